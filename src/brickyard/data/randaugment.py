"""RandAugment on whole batches on the training device, with timm's operations and magnitudes.

Follows ``timm/data/auto_augment.py`` (huggingface/pytorch-image-models, commit 066e490):
``_RAND_TRANSFORMS`` (the 15 operations below, Cutout left to random erasing as there),
``rand_augment_ops`` (each operation applied with probability 0.5), ``RandAugment.__call__`` (``n``
operations per image, chosen uniformly with replacement), ``AugmentOp.__call__`` (a magnitude
``m`` out of ``_LEVEL_DENOM`` = 10, with Gaussian noise of ``mstd`` when set, clipped to 0-10) and the
``_*_level_to_arg`` functions (rotate +-30 degrees, shear +-0.3, translate +-0.45 of the side, enhance
factors 0.1-1.9, posterize ``int(m / 10 * 4)`` bits kept, solarize threshold ``int(m / 10 * 256)``,
solarize-add ``int(m / 10 * 110)``; signed operations negated with probability 0.5). Geometric
operations fill with the data set's mean, as timm's ``create_transform`` sets ``img_mean``.

Where brickyard differs, and why: timm works on one PIL image at a time in a data-loader worker and
rounds to bytes after each operation; here a batch of float images in [0, 1] is transformed on the
device (no rounding between operations), geometric operations sample bilinearly (timm picks bilinear
or bicubic at random), and the draws are made for the whole global batch from a generator seeded per
step, so N processes augment exactly as one does and a resumed run as an uninterrupted one.

Policy strings: timm's (``rand-m9-n2-mstd0.5``) or without the prefix (``n2-m9``): ``n`` operations
per image (default 2), magnitude ``m`` (default 10), ``mstd`` the magnitude's noise (above 100:
uniform in 0-m, as timm).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from brickyard.config.checks import rand_augment_policy

OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color", "Contrast",
       "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
LEVEL_DENOM = 10.0


def _gray(x: torch.Tensor) -> torch.Tensor:
    """PIL's ``convert("L")`` (ITU-R 601-2 luma) as one channel; grey images are their own."""
    if x.shape[1] < 3:
        return x[:, :1]
    w = torch.tensor([0.299, 0.587, 0.114], device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x[:, :3] * w).sum(1, keepdim=True)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ``ImageEnhance``: ``degenerate + factor * (image - degenerate)``, clipped."""
    return (degenerate + factor.view(-1, 1, 1, 1) * (x - degenerate)).clamp_(0, 1)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return (x * 255).round_()


def _auto_contrast(x, level, sign, fill):
    """PIL's ``ImageOps.autocontrast`` per channel: the darkest level to 0, the brightest to 255, truncated
    as PIL's table is (computed in double precision, as there)."""
    b = _bytes(x).double()
    lo = b.amin((2, 3), keepdim=True)
    hi = b.amax((2, 3), keepdim=True)
    scale = 255.0 / (hi - lo).clamp_min(1)
    out = (b * scale - lo * scale).floor_().clamp_(0, 255)
    return torch.where(hi > lo, out, b).to(x.dtype) / 255


def _equalize(x, level, sign, fill):
    """PIL's ``ImageOps.equalize`` per channel: a lookup table from the histogram of each image."""
    n, c, h, w = x.shape
    q = _bytes(x).long().flatten(2)                                              # n x c x hw
    hist = torch.zeros(n, c, 256, device=x.device).scatter_add_(2, q, torch.ones_like(q, dtype=torch.float))
    last = torch.where(hist > 0, torch.arange(256, device=x.device), -1).amax(2, keepdim=True)
    step = ((h * w - hist.gather(2, last.clamp_min(0))) // 255)                   # n x c x 1
    before = hist.cumsum(2) - hist                                                # pixels below each level
    lut = ((step // 2 + before) // step.clamp_min(1)).clamp_(0, 255)
    out = lut.gather(2, q).view(n, c, h, w) / 255
    return torch.where(step.view(n, c, 1, 1) > 0, out, x)


def _invert(x, level, sign, fill):
    return 1 - x


def _posterize(x, level, sign, fill):
    bits = (level / LEVEL_DENOM * 4).floor().long()                              # bits kept, 0-4
    mask = (256 - (1 << (8 - bits))).view(-1, 1, 1, 1)
    return (_bytes(x).long() & mask).float() / 255


def _solarize(x, level, sign, fill):
    thresh = (level / LEVEL_DENOM * 256).floor().view(-1, 1, 1, 1)
    b = _bytes(x)
    return torch.where(b < thresh, b, 255 - b) / 255


def _solarize_add(x, level, sign, fill):
    add = (level / LEVEL_DENOM * 110).floor().view(-1, 1, 1, 1)
    b = _bytes(x)
    return torch.where(b < 128, (b + add).clamp_(max=255), b) / 255


def _factor(level):
    return level / LEVEL_DENOM * 1.8 + 0.1


def _color(x, level, sign, fill):
    return _blend(_gray(x).expand_as(x), x, _factor(level)) if x.shape[1] >= 3 else x


def _contrast(x, level, sign, fill):
    mean = (_bytes(_gray(x)).mean((1, 2, 3), keepdim=True)).add_(0.5).floor_() / 255  # PIL: int(mean + 0.5)
    return _blend(mean.expand_as(x), x, _factor(level))


def _brightness(x, level, sign, fill):
    return _blend(torch.zeros_like(x), x, _factor(level))


def _sharpness(x, level, sign, fill):
    """PIL's SMOOTH filter (3x3, centre 5, the rest 1, over 13) as the degenerate image; the border kept."""
    c = x.shape[1]
    k = torch.ones(3, 3, device=x.device, dtype=x.dtype)
    k[1, 1] = 5
    smooth = F.conv2d(x, (k / 13).expand(c, 1, 3, 3), padding=1, groups=c)
    degenerate = x.clone()
    degenerate[:, :, 1:-1, 1:-1] = smooth[:, :, 1:-1, 1:-1]
    return _blend(degenerate, x, _factor(level))


def _warp(x, matrix, fill):
    """Sample ``x`` where the per-image 2 x 3 ``matrix`` maps each output pixel centre (in pixels, from
    the top-left corner, PIL's convention) to its input point; outside the image: ``fill``."""
    n, c, h, w = x.shape
    ys, xs = torch.meshgrid(torch.arange(h, device=x.device, dtype=x.dtype) + 0.5,
                            torch.arange(w, device=x.device, dtype=x.dtype) + 0.5, indexing="ij")
    points = torch.stack([xs, ys, torch.ones_like(xs)], -1).view(1, h * w, 3)
    src = points @ matrix.transpose(1, 2)                                        # n x hw x 2
    grid = torch.stack([src[..., 0] * 2 / w - 1, src[..., 1] * 2 / h - 1], -1).view(n, h, w, 2)
    f = fill.view(1, -1, 1, 1)
    return F.grid_sample(x - f, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + f


def _affine(a, b, c, d, e, f_):
    return torch.stack([torch.stack([a, b, c], -1), torch.stack([d, e, f_], -1)], -2)


def _rotate(x, level, sign, fill):
    theta = torch.deg2rad(sign * level / LEVEL_DENOM * 30)     # counter-clockwise, about the centre (PIL rotate)
    h, w = x.shape[-2:]
    cx, cy = w / 2, h / 2
    cos, sin = theta.cos(), theta.sin()
    return _warp(x, _affine(cos, -sin, cx - cos * cx + sin * cy, sin, cos, cy - sin * cx - cos * cy), fill)


def _shear(axis):
    def op(x, level, sign, fill):
        s = sign * level / LEVEL_DENOM * 0.3
        one, zero = torch.ones_like(s), torch.zeros_like(s)
        m = _affine(one, s, zero, zero, one, zero) if axis == "x" else _affine(one, zero, zero, s, one, zero)
        return _warp(x, m, fill)
    return op


def _translate(axis):
    def op(x, level, sign, fill):
        pct = sign * level / LEVEL_DENOM * 0.45
        one, zero = torch.ones_like(pct), torch.zeros_like(pct)
        h, w = x.shape[-2:]
        m = _affine(one, zero, pct * w, zero, one, zero) if axis == "x" else _affine(one, zero, zero, zero, one, pct * h)
        return _warp(x, m, fill)
    return op


FUNCTIONS = {"AutoContrast": _auto_contrast, "Equalize": _equalize, "Invert": _invert, "Rotate": _rotate,
             "Posterize": _posterize, "Solarize": _solarize, "SolarizeAdd": _solarize_add, "Color": _color,
             "Contrast": _contrast, "Brightness": _brightness, "Sharpness": _sharpness, "ShearX": _shear("x"),
             "ShearY": _shear("y"), "TranslateXRel": _translate("x"), "TranslateYRel": _translate("y")}


class RandAugment:
    def __init__(self, policy: str, fill):
        self.policy = policy
        self.n, self.m, self.mstd = rand_augment_policy(policy)
        self.fill = torch.as_tensor(fill, dtype=torch.float32)

    def __call__(self, x: torch.Tensor, gen: torch.Generator, n_global: int, span: slice) -> torch.Tensor:
        """Augment ``x`` (N x C x H x W, floats in [0, 1]) in place of a copy; the draws are made for
        the ``n_global`` images of the global batch and ``span`` of them used."""
        dev = gen.device
        fill = self.fill.to(x.device)[: x.shape[1]]
        for _ in range(self.n):
            op = torch.randint(0, len(OPS), (n_global,), generator=gen, device=dev)[span].to(x.device)
            apply = (torch.rand(n_global, generator=gen, device=dev)[span] < 0.5).to(x.device)
            sign = torch.where(torch.rand(n_global, generator=gen, device=dev)[span] > 0.5, -1.0, 1.0).to(x.device)
            if self.mstd == math.inf:
                level = torch.rand(n_global, generator=gen, device=dev)[span] * self.m
            elif self.mstd > 0:
                level = self.m + self.mstd * torch.randn(n_global, generator=gen, device=dev)[span]
            else:
                level = torch.full((n_global,), self.m, device=dev)[span]
            level = level.clamp(0, LEVEL_DENOM).to(x.device, x.dtype)
            for k, name in enumerate(OPS):
                chosen = ((op == k) & apply).nonzero().squeeze(1)
                if len(chosen):
                    x[chosen] = FUNCTIONS[name](x[chosen], level[chosen], sign[chosen].to(x.dtype), fill).to(x.dtype)
        return x
