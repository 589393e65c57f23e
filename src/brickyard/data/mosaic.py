"""``mnist-mosaic`` and ``fashion-mnist-mosaic``: several labels an image, built offline from MNIST or Fashion-MNIST.

Each image is 56 x 56, a 2 x 2 grid of 28-pixel cells; 1 to 4 of the cells (as many as drawn, uniformly) hold a
digit (or garment) drawn at random, the others stay black, and the image's tags are the classes present (a class
drawn twice is one tag): multi-hot rows of 10. The training and validation mosaics are made from the data set's
training images (its first 50,000 and last 10,000, as the single-label sets split them; with ``data.train_on_all``
the training mosaics from all 60,000 and no validation), the test mosaics from its test images; each split's draws are seeded, so every run and every rank builds the same images.
"""
from __future__ import annotations

import torch

from brickyard.data.bundle import DataBundle, Split

SIZES = {"train": 20000, "val": 2000, "test": 4000}  # mosaics a split
CELL = 28


def mosaics(images: torch.Tensor, labels: torch.Tensor, count: int, seed: int, classes: int = 10):
    """``count`` mosaics (N x 1 x 56 x 56 uint8) of ``images`` (M x 1 x 28 x 28) and their multi-hot tags (N x classes,
    float)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(count, 1, 2 * CELL, 2 * CELL, dtype=torch.uint8)
    tags = torch.zeros(count, classes)
    many = torch.randint(1, 5, (count,), generator=g)  # digits an image
    for i in range(count):
        cells = torch.randperm(4, generator=g)[:int(many[i])]
        picks = torch.randint(0, len(images), (len(cells),), generator=g)
        for cell, k in zip(cells.tolist(), picks.tolist()):
            r, c = divmod(cell, 2)
            out[i, :, r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = images[k]
            tags[i, int(labels[k])] = 1.0
    return out, tags


def mosaic_bundle(name: str, base: DataBundle) -> DataBundle:
    """The mosaic data set ``name`` made from ``base``, the single-label bundle of its source (train, val and test)."""
    parts: dict = {}
    for i, split in enumerate(("train", "val", "test")):
        src = getattr(base, split)  # no validation split with data.train_on_all
        parts[split] = Split(*mosaics(src.images, src.labels, SIZES[split], seed=4321 + i)) if src is not None else None
    pixels = parts["train"].images.float() / 255  # the mosaics' own statistics: a quarter to all of each is black
    return DataBundle(name, parts["train"], parts["val"], parts["test"], base.num_classes, 1, (2 * CELL, 2 * CELL),
                      (pixels.mean().item(),), (pixels.std().item(),), list(base.classes), multilabel=True)
