"""Device-side preparation of a raw batch: scale, normalise, augment, mix, memory format.

Runs on the training device on whole batches. Every random draw is made for the whole *global*
batch (all ranks together) from generators seeded per step, and each rank uses its slice: N
processes augment exactly as one does, and a resumed run draws what an uninterrupted one drew.

The order is timm's (``timm/data/transforms_factory.py``, ``train.py``): per-image augmentation
(RandAugment on the [0, 1] image; shift and flip), normalisation, random erasing on the normalised
image, then mixup or cutmix over the batch, which turns the targets into class probabilities.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.distributed
import torch.nn.functional as F

from brickyard.data.randaugment import RandAugment
from brickyard.errors import DataError

# what each augmentation's generator is seeded with, apart from the run's seed and the step
SHIFT, RAND_AUGMENT, ERASING, MIXING, DROP_PATH = 0, 1, 2, 3, 4


def draw_seed(seed: int, step: int, stream: int) -> int:
    """The seed of augmentation ``stream``'s draws at ``step`` (shift and flip keep their original one)."""
    if stream == SHIFT:
        return seed * 7_919 + step
    return ((seed * 1_000_003 + step) * 8 + stream) % (1 << 62)


@dataclass
class Strong:
    """The strong augmentations of ``data.*`` (timm's ``--aa``, ``--reprob``, ``--mixup``, ``--cutmix``)."""
    rand_augment: object = None          # a randaugment.RandAugment
    erasing: float = 0.0                 # probability per image
    mixup: float = 0.0                   # Beta alpha (0: off)
    cutmix: float = 0.0                  # Beta alpha (0: off)
    num_classes: int = 0
    world: int = 1                       # the processes that read data, among which a global batch is split
    group: object = None                 # their process group (None: all)

    @property
    def mixing(self) -> bool:
        return self.mixup > 0 or self.cutmix > 0


class DevicePrep:
    """A batch on its way to the model: bytes (uint8) scaled to [0, 1] and normalised, other floats and booleans
    (a user's float64 ``x / 255.0``, float16, a mask) cast to ``float_dtype``, the model's (Keras casts float
    inputs to ``floatx`` too: ``convert_to_sliceable``, "Step 2. Normalize floats to floatx", in
    keras/src/trainers/data_adapters/array_slicing.py; other integer inputs, token ids say, are left as they
    are); then the training augmentations."""

    def __init__(self, mean, std, augment: str = "none", shift: int = 2, channels_last: bool = False,
                 device: torch.device = torch.device("cpu"), seed: int = 0, strong: Strong | None = None,
                 float_dtype: torch.dtype = torch.float32):
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.augment, self.shift, self.channels_last = augment, shift, channels_last
        self.seed = seed
        self.float_dtype = float_dtype
        self.strong = strong or Strong()
        self.gen = torch.Generator(device=device)

    def __call__(self, x: torch.Tensor, step: int | None = None, n_global: int | None = None, offset: int = 0) -> torch.Tensor:
        """Prepare a batch; with ``step``, augment it with draws made for the whole global batch
        of ``n_global`` samples, of which ``x`` is the slice starting at ``offset``."""
        train = step is not None
        n_all, span = (n_global or x.shape[0]), slice(offset, offset + x.shape[0])
        ra = self.strong.rand_augment if train else None
        if ra is not None and x.dtype != torch.uint8:
            raise DataError(f"data.rand_augment works on images held as bytes (0-255, as every built-in data set and image "
                            f"folder); these are {x.dtype}: augment them in your own code or store them as uint8.")
        if x.dtype == torch.uint8:
            if self.channels_last and x.dim() == 4:  # reorder the bytes, a quarter of reordering the floats
                x = x.contiguous(memory_format=torch.channels_last)
            if ra is not None:
                self.gen.manual_seed(draw_seed(self.seed, step, RAND_AUGMENT))
                x = self._normalise(ra(x.float().div_(255.0), self.gen, n_all, span))
            else:
                x = self._normalise(x.float().div_(255.0))  # (x / 255 - mean) / std in place: 3.5x faster
        if (x.is_floating_point() or x.dtype == torch.bool) and x.dtype != self.float_dtype:
            x = x.to(self.float_dtype)  # after the bytes' scaling in float32, for a float64 model too
        if train and self.augment != "none" and self.shift > 0:
            self.gen.manual_seed(draw_seed(self.seed, step, SHIFT))
            x = random_shift(x, self.shift, self.gen, n_all, span)
            if self.augment == "crop-flip":
                flip = torch.rand(n_all, device=x.device, generator=self.gen)[span] < 0.5
                x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
        if train and self.strong.erasing > 0:
            seed = draw_seed(self.seed, step, ERASING)
            self.gen.manual_seed(seed)
            x = random_erasing(x, self.strong.erasing, self.gen, n_all, offset, seed)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / std`` in place, over the channels of N x C x H x W images; a one-value mean and std (a
        user's data: 0 and 1) over inputs of any other shape, such as N x F bytes, which the images' 1 x C x 1 x 1
        broadcast turned into a RuntimeError ("output with shape [64, 4] doesn't match the broadcast shape")."""
        if x.dim() == 4 or self.mean.numel() > 1:
            return x.sub_(self.mean).div_(self.std)
        return x.sub_(self.mean.view(())).div_(self.std.view(()))

    def train(self, x: torch.Tensor, y: torch.Tensor, step: int, n_global: int, offset: int = 0):
        """A training batch: ``(inputs, targets)`` prepared and augmented; with mixup or cutmix the
        targets are class probabilities (N x classes)."""
        x = self(x, step, n_global, offset)
        if self.strong.mixing:
            x, y = mix(x, y, self.strong, random.Random(draw_seed(self.seed, step, MIXING)), n_global, offset)
        return x, y


def random_shift(x: torch.Tensor, pad: int, gen: torch.Generator, n_draw: int | None = None,
                 span: slice = slice(None)) -> torch.Tensor:
    """Translate each image by up to ``pad`` pixels in each direction, filling with zeros.

    Offsets are drawn for ``n_draw`` images and ``span`` of them applied to ``x``."""
    n, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n_draw or n, 1, 1, 1), device=x.device, generator=gen)[span]
    dx = torch.randint(0, 2 * pad + 1, (n_draw or n, 1, 1, 1), device=x.device, generator=gen)[span]
    rows = (torch.arange(h, device=x.device).view(1, 1, h, 1) + dy).expand(n, c, h, w + 2 * pad)
    cols = (torch.arange(w, device=x.device).view(1, 1, 1, w) + dx).expand(n, c, h, w)
    return padded.gather(2, rows).gather(3, cols)


def random_erasing(x: torch.Tensor, p: float, gen: torch.Generator, n_global: int, offset: int, noise_seed: int,
                   attempts: int = 10) -> torch.Tensor:
    """timm's ``RandomErasing`` (``timm/data/random_erasing.py``, ``RandomErasing._erase``, commit 066e490) in
    the mode its ``train.py`` uses (``--remode pixel``): with probability ``p`` an image gets one rectangle of
    2-33% of its area, aspect ratio 0.3-3.3 (log-uniform), the first of ``attempts`` draws that fits strictly
    inside (``w < W and h < H``), placed uniformly, filled with per-pixel standard normal noise (the image is
    normalised). Every draw is made for the global batch: the rectangles, and the noise of all of them at
    once from ``noise_seed`` (in image order, each rectangle's channels, rows and columns in turn), of which
    a rank takes its images' part; one ``masked_scatter`` writes it, no loop over the images."""
    n, c, h, w = x.shape
    dev = gen.device
    erase = torch.rand(n_global, generator=gen, device=dev) < p
    area = torch.empty(n_global, attempts, device=dev).uniform_(0.02, 1 / 3, generator=gen) * (h * w)
    aspect = torch.empty(n_global, attempts, device=dev).uniform_(math.log(0.3), math.log(1 / 0.3), generator=gen).exp()
    top_u = torch.rand(n_global, attempts, generator=gen, device=dev)
    left_u = torch.rand(n_global, attempts, generator=gen, device=dev)
    bh = (area * aspect).sqrt().round().long()
    bw = (area / aspect).sqrt().round().long()
    fits = (bw < w) & (bh < h)
    first = fits.int().argmax(1, keepdim=True)                     # the first attempt that fits
    erase &= fits.any(1)
    bh, bw = bh.gather(1, first).squeeze(1) * erase, bw.gather(1, first).squeeze(1) * erase
    top = (top_u.gather(1, first).squeeze(1) * (h - bh + 1)).floor().long()   # randint(0, H - h), inclusive
    left = (left_u.gather(1, first).squeeze(1) * (w - bw + 1)).floor().long()
    starts = F.pad((bh * bw * c).cumsum(0), (1, 0))  # where each image's noise starts, and the total
    total, lo, hi = starts[[n_global, offset, offset + n]].tolist()  # one read from the device
    if total == 0:
        return x
    noise = torch.randn(total, generator=torch.Generator(device=dev).manual_seed(noise_seed % (1 << 62)),
                        device=dev, dtype=x.dtype)
    span = slice(offset, offset + n)
    top, left, bh, bw = (t[span].to(x.device).view(n, 1, 1, 1) for t in (top, left, bh, bw))
    rows = torch.arange(h, device=x.device).view(1, 1, h, 1)
    cols = torch.arange(w, device=x.device).view(1, 1, 1, w)
    box = (rows >= top) & (rows < top + bh) & (cols >= left) & (cols < left + bw)
    return x.masked_scatter(box.expand(n, c, h, w), noise[lo:hi].to(x.device))


def mix(x: torch.Tensor, y: torch.Tensor, strong: Strong, rng: random.Random, n_global: int, offset: int):
    """timm's ``Mixup`` in its default batch mode (``timm/data/mixup.py``, ``Mixup._params_per_batch``,
    ``_mix_batch``, ``cutmix_bbox_and_lam``, ``rand_bbox``, ``mixup_target``; commit 066e490; train.py's
    defaults ``--mixup-prob 1.0``, ``--mixup-switch-prob 0.5``): one ``lam`` ~ Beta(alpha, alpha) per batch;
    with both on, cutmix with probability 0.5; image ``i`` is mixed with image ``n - 1 - i`` (``x.flip(0)``)
    of the **global** batch, so with several processes each gathers the others' images (one all-gather
    of the prepared batch a step); cutmix pastes one box of side ``sqrt(1 - lam)`` at a uniform centre,
    clipped to the image, and ``lam`` becomes the share left unpasted. The targets become
    ``lam * onehot(y) + (1 - lam) * onehot(partner)``; label smoothing applies to these probabilities in
    the loss (``F.cross_entropy(label_smoothing=...)``), which equals timm's smoothed one-hots mixed."""
    n = x.shape[0]
    if y.dim() == 2 and y.shape[1] == 1:
        y = y[:, 0]  # a Dataset's labels as 1-element tensors
    onehot = y.float() if y.dim() == 2 else F.one_hot(y.long(), strong.num_classes).to(torch.float32)  # rows: as given
    if strong.mixup > 0 and strong.cutmix > 0:
        use_cutmix = rng.random() < 0.5
        lam = rng.betavariate(strong.cutmix, strong.cutmix) if use_cutmix else rng.betavariate(strong.mixup, strong.mixup)
    elif strong.mixup > 0:
        use_cutmix, lam = False, rng.betavariate(strong.mixup, strong.mixup)
    else:
        use_cutmix, lam = True, rng.betavariate(strong.cutmix, strong.cutmix)
    if use_cutmix:  # the box's draws come first, so every rank draws the same
        h, w = x.shape[-2:]
        ratio = math.sqrt(1 - lam)
        cut_h, cut_w = int(h * ratio), int(w * ratio)
        cy, cx = rng.randrange(h), rng.randrange(w)
        yl, yh = min(max(cy - cut_h // 2, 0), h), min(max(cy + cut_h // 2, 0), h)
        xl, xh = min(max(cx - cut_w // 2, 0), w), min(max(cx + cut_w // 2, 0), w)
        lam = 1 - (yh - yl) * (xh - xl) / float(h * w)
    if lam == 1.0:
        return x, onehot
    all_x, all_y = _global_batch(x, onehot, strong, n_global)
    px = all_x.flip(0)[offset:offset + n]
    py = all_y.flip(0)[offset:offset + n]
    if use_cutmix:
        x = x.clone()
        x[:, :, yl:yh, xl:xh] = px[:, :, yl:yh, xl:xh]
    else:
        x = x * lam + px * (1 - lam)
    return x, onehot * lam + py * (1 - lam)


def _global_batch(x: torch.Tensor, y: torch.Tensor, strong: Strong, n_global: int):
    """The whole global batch of prepared images and one-hot targets, on every rank (itself with one)."""
    if strong.world <= 1:
        return x, y
    sizes = [n_global // strong.world + (1 if r < n_global % strong.world else 0) for r in range(strong.world)]
    longest = max(sizes)
    flat = torch.cat([x.reshape(len(x), -1), y], 1).contiguous()
    padded = torch.zeros(longest, flat.shape[1], device=x.device, dtype=flat.dtype)
    padded[:len(flat)] = flat
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded, group=strong.group)
    full = torch.cat([p[:s] for p, s in zip(parts, sizes)])
    per_image = x[0].numel()
    images = full[:, :per_image].view(-1, *x.shape[1:])
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        images = images.contiguous(memory_format=torch.channels_last)
    return images, full[:, per_image:]


def float_dtype(model) -> torch.dtype:
    """The dtype of ``model``'s first floating-point parameter (float32 for a model without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def build(cfg, data, device, channels_last: bool, seed: int, world: int = 1, group=None,
          floats: torch.dtype = torch.float32) -> DevicePrep:
    """The training batches' preparation for ``cfg`` (a ``Config``) and ``data`` (a ``DataBundle``); ``floats``:
    the model's float dtype (``float_dtype``)."""
    d = cfg.data
    strong = Strong(erasing=d.random_erasing, mixup=d.mixup, cutmix=d.cutmix,
                    num_classes=cfg.model.num_classes or data.num_classes, world=world, group=group)
    if d.rand_augment:
        strong.rand_augment = RandAugment(d.rand_augment, data.mean)
    return DevicePrep(data.mean, data.std, d.augment, d.shift, channels_last, device, seed, strong, floats)
