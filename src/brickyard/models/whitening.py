"""``model.whiten``: the first convolution's filters set from the training images and frozen.

The filters are the principal directions of the image patches the convolution reads, each divided by the
root of its variance (plus ``EPS``) and paired with its negative, as airbench's whitening layer
(KellerJordan/cifar10-airbench, ``airbench94.py`` at commit 01a2367: ``get_patches``,
``get_whitening_parameters`` and ``init_whitening_conv``, lines 250-265, eps 5e-4; the layer is frozen by
``net[0].weight.requires_grad = False`` in ``make_net``, line 238, and set from the first 5,000 normalised
training images in ``main``). Its ablations
(``cifar10-zoo``, ``airbench_ablations/README.md``) credit the layer with reaching 94% on CIFAR-10 in 22
epochs instead of 35.

Differences from airbench: there the whitening convolution is a layer of its own (2x2, 24 filters for 3
channels, a bias trained for 3 epochs) inserted before the network; here it is the model's own first
convolution, so the architecture and its cost stay as they are. Where that convolution has fewer than two
filters for each patch dimension (``fashion_fast``: 16 filters, 3x3 grey patches of 9 dimensions) the
directions of least variance are left out; where it has more, the filters past the ``2 x dimensions``
whitening ones keep their initial values (frozen with the rest). A bias, if the layer has one, trains.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from brickyard.data.augment import DevicePrep
from brickyard.errors import ConfigError, DataError

IMAGES = 5_000    # airbench94's count, from images held in memory
FROM_FILES = 512  # from an image folder: each is decoded and transformed (a 224 px JPEG: several ms)
EPS = 5e-4        # airbench94's init_whitening_conv default, for images normalised to unit variance
_CHUNK = 256      # images whose patches are gathered at once
_WORK = 2e9       # multiply-adds the covariance may take (a second or two; 5,000 28 px images at 3x3: 0.3e9)
_VALUES = 5e7     # image values read from memory at once (200 MB as float32: 5,000 CIFAR images, 330 at 224 px)


def first_conv(model: nn.Module) -> tuple[str, nn.Conv2d] | None:
    """The first ``nn.Conv2d`` in module order, with its name; None if the model has none."""
    return next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)


def images_used(data, count: int = IMAGES) -> int:
    """How many training images ``whiten`` reads from ``data`` (a ``DataBundle``): ``count`` held in memory
    (no more than ``_VALUES`` values in all), ``FROM_FILES`` read from files."""
    images = data.train.images
    if images is None:
        count = min(count, FROM_FILES)
    elif len(images):
        count = min(count, max(1, int(_VALUES // max(images[0].numel(), 1))))
    return min(count, len(data.train))


def _images(data, count: int) -> torch.Tensor:
    """The first training inputs as the model reads them, ``count`` held in memory or ``FROM_FILES`` read
    from files (an image folder's, each through its training transforms with the same draws on every rank):
    bytes scaled and normalised as the device preparation does, floats as they are."""
    split = data.train
    if split.images is not None:
        x = split.images[:images_used(data, count)]
    else:
        ds = split.as_dataset()
        seeded = getattr(ds, "seeded", False)
        read = [ds[(i, i) if seeded else i] for i in range(images_used(data, count))]
        first = list(split.collate(read)[0]) if split.collate else [torch.as_tensor(item[0]) for item in read]
        if len({tuple(t.shape) for t in first}) > 1:
            raise ConfigError(f"model.whiten reads the first {len(first)} training images together and they differ in size "
                              f"({', '.join(sorted({'x'.join(map(str, t.shape)) for t in first})[:3])}); make the training "
                              f"transforms end at one size, or turn it off.")
        x = torch.stack(first)
    return DevicePrep(data.mean, data.std)(x).float()


def patch_covariance(images: torch.Tensor, kernel: tuple[int, int]) -> torch.Tensor:
    """The second moment of the ``kernel``-sized patches of N x C x H x W ``images``, over patches: a
    (C*kh*kw)-square float64 matrix. Patches start every pixel (airbench's ``get_patches``) unless that is
    more than ``_WORK`` multiply-adds, then every ``stride`` pixels in both directions."""
    kh, kw = kernel
    n, c, h, w = images.shape
    d = c * kh * kw
    stride = max(1, math.ceil(math.sqrt(n * (h - kh + 1) * (w - kw + 1) * d * d / _WORK)))
    total, count = torch.zeros(d, d, dtype=torch.float64), 0
    for chunk in images.split(_CHUNK):
        p = chunk.unfold(2, kh, stride).unfold(3, kw, stride)        # N, C, H', W', kh, kw
        p = p.permute(0, 2, 3, 1, 4, 5).reshape(-1, d).double()      # one row a patch, in the weight's C, kh, kw order
        total += p.T @ p
        count += len(p)
    return total / max(count, 1)


def whitening_filters(cov: torch.Tensor, out_channels: int, eps: float = EPS) -> torch.Tensor:
    """Up to ``out_channels`` filters (flattened): the principal directions of ``cov``, largest variance
    first, each divided by sqrt(variance + eps), then the same negated."""
    values, vectors = torch.linalg.eigh(cov)                         # ascending
    k = min(out_channels // 2, len(values))
    values, vectors = values.flip(0)[:k], vectors.flip(1)[:, :k].T   # k x d, largest first
    scaled = vectors / torch.sqrt(values.clamp(min=0) + eps).unsqueeze(1)
    return torch.cat((scaled, -scaled)).float()


def whiten(model: nn.Module, data, name: str, count: int = IMAGES) -> None:
    """Set and freeze ``model``'s first convolution as the module docstring says, from ``data``'s first
    ``count`` training images (``describe`` says it for the run's log). ``name``: the model's, for errors."""
    found = first_conv(model)
    if found is None:
        raise ConfigError(f"model.whiten sets a model's first convolution from the data, and {name} has none; turn it off.")
    layer_name, conv = found
    if conv.groups != 1:
        raise ConfigError(f"model.whiten: {name}'s first convolution ({layer_name}) is grouped ({conv.groups} groups); "
                          f"whitening needs one that reads every channel; turn it off.")
    if len(data.train) == 0:
        raise ConfigError("model.whiten needs training images to set the first convolution from; the training set is empty.")
    x = _images(data, count)
    if x.dim() != 4 or x.shape[1] != conv.in_channels:
        raise ConfigError(f"model.whiten: {name}'s first convolution ({layer_name}) reads {conv.in_channels}-channel images "
                          f"and the training inputs are {tuple(x.shape[1:])}; turn it off.")
    kh, kw = conv.kernel_size
    if x.shape[2] < kh or x.shape[3] < kw:
        raise ConfigError(f"model.whiten: the training images ({x.shape[2]}x{x.shape[3]}) are smaller than {layer_name}'s "
                          f"{kh}x{kw} filters.")
    cov = patch_covariance(x, (kh, kw))
    if not torch.isfinite(cov).all():
        raise DataError(f"model.whiten: the first {len(x):,} training images hold NaN or infinite values; clean them or "
                        f"turn it off.")
    filters = whitening_filters(cov, conv.out_channels)
    with torch.no_grad():
        conv.weight[: len(filters)] = filters.view(len(filters), conv.in_channels, kh, kw).to(conv.weight.dtype)
    conv.weight.requires_grad_(False)


def describe(model: nn.Module, images: int) -> str:
    """What ``whiten`` made of ``model`` from ``images`` training images, in a sentence for the run's log."""
    layer_name, conv = first_conv(model)
    kh, kw = conv.kernel_size
    pairs = min(conv.out_channels // 2, conv.in_channels * kh * kw)
    kept = conv.out_channels - 2 * pairs
    return (f"model.whiten: {layer_name}'s {2 * pairs} filters whiten its {conv.in_channels}x{kh}x{kw} patches "
            f"({pairs} principal directions of {images:,} training images, and their negatives), frozen"
            + (f"; its other {kept} keep their initial values, frozen too" if kept else ""))
