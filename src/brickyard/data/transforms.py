"""Image transforms written with torch ops, configured as short strings.

A pipeline is a list like ``["resize:36", "random_resized_crop:32", "hflip"]``. Each transform
takes and returns a uint8 tensor C x H x W (uint8 keeps worker-to-trainer transfers small);
normalisation happens later on the device. The random transforms draw from ``rng``: a ``random.Random``
seeded per image by the training loader, else Python's ``random`` module (which the DataLoader seeds
per worker). Python's generator, not torch's: a few scalar draws an image, each a hundred times cheaper.

- ``resize:S`` shorter side to S (``resize:HxW`` exact size), bilinear with antialiasing
- ``center_crop:S`` / ``center_crop:HxW``
- ``random_resized_crop:S`` area 8-100%, aspect 3/4-4/3, then resize to S
- ``random_crop:S`` / ``random_crop:S:P`` a crop of size S at a random place, after P pixels of black
  on every border (torchvision's ``RandomCrop(S, padding=P)``, the CIFAR recipe's ``random_crop:32:4``);
  an image smaller than S is padded to it first (torchvision's ``pad_if_needed=True``)
- ``hflip`` horizontal flip with probability 0.5
- ``grayscale`` / ``rgb`` convert channels (the model's channels are matched automatically)
"""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from brickyard.errors import ConfigError

NAMED_STATS = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "mnist": ((0.1307,) * 3, (0.3081,) * 3),
    "none": ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),
}


def _size(arg: str, name: str) -> tuple[int, int] | int:
    try:
        if "x" in arg:
            h, w = arg.split("x")
            return int(h), int(w)
        return int(arg)
    except ValueError:
        raise ConfigError(f"transform {name}:{arg}: the size must be a number or HxW, e.g. {name}:224.") from None


def _resize(img: torch.Tensor, size) -> torch.Tensor:
    h, w = img.shape[-2:]
    if isinstance(size, int):
        scale = size / min(h, w)
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
    if tuple(size) == (h, w):
        return img
    out = F.interpolate(img[None].float(), size=size, mode="bilinear", align_corners=False, antialias=True)[0]
    return out.round().clamp(0, 255).to(torch.uint8)


def _center_crop(img: torch.Tensor, size) -> torch.Tensor:
    th, tw = (size, size) if isinstance(size, int) else size
    h, w = img.shape[-2:]
    if th > h or tw > w:
        img = _resize(img, max(th, tw))
        h, w = img.shape[-2:]
    top, left = (h - th) // 2, (w - tw) // 2
    return img[:, top:top + th, left:left + tw]


def _crop_box(h: int, w: int, rng) -> tuple[int, int, int, int] | None:
    """The random-resized-crop region (top, left, height, width) of an h x w image: area 8-100%, aspect
    3/4-4/3, ten tries (torchvision's rule); None: fall back to the centre square. Draws from ``rng``."""
    area = h * w
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, h - ch), rng.randint(0, w - cw), ch, cw
    return None


def _random_resized_crop(img: torch.Tensor, size, rng) -> torch.Tensor:
    size = (size, size) if isinstance(size, int) else size
    h, w = img.shape[-2:]
    box = _crop_box(h, w, rng)
    if box is None:
        return _resize(_center_crop(img, min(h, w)), size)
    top, left, ch, cw = box
    return _resize(img[:, top:top + ch, left:left + cw], size)


def random_crop_arg(arg: str) -> tuple[tuple[int, int], int]:
    """``((height, width), padding)`` of a ``random_crop`` argument: ``32``, ``32x28``, ``32:4``."""
    size, _, pad = arg.partition(":")
    size = _size(size, "random_crop")
    try:
        padding = int(pad) if pad else 0
    except ValueError:
        raise ConfigError(f"transform random_crop:{arg}: the padding must be a whole number of pixels, e.g. "
                          f"random_crop:32:4.") from None
    return ((size, size) if isinstance(size, int) else size), padding


def _random_crop(img: torch.Tensor, arg, rng) -> torch.Tensor:
    """torchvision's ``RandomCrop(size, padding, pad_if_needed=True)`` with black (0) padding
    (pytorch/vision ``torchvision/transforms/transforms.py`` at 6247d96, class ``RandomCrop``: ``forward`` pads every
    border by ``padding``, then the width and the height by what they lack on both sides, and ``get_params``
    draws the top in 0..h - th, then the left in 0..w - tw). The draws come from ``rng``, top first."""
    (th, tw), padding = arg
    h, w = img.shape[-2:]
    short_w, short_h = max(0, tw - w - 2 * padding), max(0, th - h - 2 * padding)
    if padding or short_w or short_h:
        img = F.pad(img, (padding + short_w, padding + short_w, padding + short_h, padding + short_h))
        h, w = img.shape[-2:]
    top, left = rng.randint(0, h - th), rng.randint(0, w - tw)
    return img[:, top:top + th, left:left + tw]


def _hflip(img: torch.Tensor, rng) -> torch.Tensor:
    return img.flip(-1) if rng.random() < 0.5 else img


def to_channels(img: torch.Tensor, channels: int) -> torch.Tensor:
    if img.shape[0] == channels:
        return img
    if channels == 1:  # ITU-R 601 luma
        w = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
        return (img[:3].float() * w).sum(0, keepdim=True).round().clamp(0, 255).to(torch.uint8)
    return img[:1].expand(channels, -1, -1).contiguous()


RANDOM = {"random_resized_crop", "random_crop", "hflip"}


class Pipeline:
    """The transforms of one split. ``prefix`` (up to the first random transform, plus the channel
    conversion) is deterministic and can be cached; ``suffix`` is applied on every read.

    ``plan(h, w)`` is the same pipeline as geometry: the region of the original image that ends up in
    the output, the output size and the flip, with the same random draws in the same order. A decoder
    that knows it can read just that region at reduced scale and resize once (``imagefolder.read``)."""

    def __init__(self, specs, channels: int):
        self.specs = [str(s).partition(":") for s in specs]
        self.padded = any(name == "random_crop" and random_crop_arg(arg)[1] for name, _, arg in self.specs)
        self.prefix, self.suffix = [], []
        self.channels = channels
        self.fixed_size = None  # (H, W) after the prefix, when it ends in a fixed size
        for spec in specs:
            name, _, arg = str(spec).partition(":")
            target = self.suffix if (self.suffix or name in RANDOM) else self.prefix
            if name == "resize":
                size = _size(arg, name)
                target.append((lambda img, s, _: _resize(img, s), size))
            elif name == "center_crop":
                size = _size(arg, name)
                target.append((lambda img, s, _: _center_crop(img, s), size))
            elif name == "random_resized_crop":
                target.append((_random_resized_crop, _size(arg, name)))
            elif name == "random_crop":
                target.append((_random_crop, random_crop_arg(arg)))
            elif name == "hflip":
                target.append((lambda img, _, rng: _hflip(img, rng), None))
            elif name in ("grayscale", "rgb"):
                target.append((lambda img, c, _: to_channels(img, c), 1 if name == "grayscale" else 3))
            else:
                raise ConfigError(f"transform {spec!r} is not one of resize:S, center_crop:S, random_resized_crop:S, "
                                  f"random_crop:S[:P], hflip, grayscale, rgb.")
            if target is self.prefix and name in ("resize", "center_crop"):
                fixed = name == "center_crop" or isinstance(size, tuple)
                self.fixed_size = ((size, size) if isinstance(size, int) else size) if fixed else None

    def plan(self, h: int, w: int, rng=random):
        """``(box, (out_h, out_w), flip)``: ``box`` = (left, top, right, bottom) in the h x w original's
        pixel coordinates; None when the pipeline has a step this cannot follow (a centre crop larger
        than the image). Draws from ``rng`` as the step-by-step pipeline does, in the same order."""
        left, top, bw, bh = 0.0, 0.0, float(w), float(h)  # the region of the original the virtual image shows
        vh, vw, flip = h, w, False                         # the virtual image's size
        if self.padded:
            return None  # padding: the output reaches past the image
        for name, _, arg in self.specs:
            if name == "resize":
                size = _size(arg, name)
                if isinstance(size, int):
                    scale = size / min(vh, vw)
                    vh, vw = max(1, round(vh * scale)), max(1, round(vw * scale))
                else:
                    vh, vw = size
            elif name in ("center_crop", "random_resized_crop"):
                size = _size(arg, name)
                th, tw = (size, size) if isinstance(size, int) else size
                if name == "center_crop":
                    if th > vh or tw > vw:
                        return None
                    ct, cl, ch, cw = (vh - th) // 2, (vw - tw) // 2, th, tw
                else:
                    box = _crop_box(vh, vw, rng)
                    if box is None:
                        side = min(vh, vw)
                        box = ((vh - side) // 2, (vw - side) // 2, side, side)
                    ct, cl, ch, cw = box
                sy, sx = bh / vh, bw / vw
                left, top, bw, bh = left + cl * sx, top + ct * sy, cw * sx, ch * sy
                vh, vw = th, tw
            elif name == "random_crop":
                (th, tw), _ = random_crop_arg(arg)
                if th > vh or tw > vw:
                    return None  # padded to the size: past the image
                ct, cl = rng.randint(0, vh - th), rng.randint(0, vw - tw)
                sy, sx = bh / vh, bw / vw
                left, top, bw, bh = left + cl * sx, top + ct * sy, tw * sx, th * sy
                vh, vw = th, tw
            elif name == "hflip":
                flip = rng.random() < 0.5
        return (left, top, left + bw, top + bh), (vh, vw), flip

    def first(self, img: torch.Tensor) -> torch.Tensor:
        for fn, arg in self.prefix:
            img = fn(img, arg, None)
        return to_channels(img, self.channels)

    def rest(self, img: torch.Tensor, rng=random) -> torch.Tensor:
        for fn, arg in self.suffix:
            img = fn(img, arg, rng)
        return img

    def __call__(self, img: torch.Tensor, rng=random) -> torch.Tensor:
        return self.rest(self.first(img), rng)
