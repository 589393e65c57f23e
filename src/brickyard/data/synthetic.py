"""Random images of any shape and class count, for tests and benchmarks.

Each class has its own fixed random template; an image is its template plus noise, so a model
can learn the task and accuracy means something.
"""
from __future__ import annotations

import torch

from brickyard.data.bundle import DataBundle, Split


def synthetic_bundle(cfg, seed: int = 1234) -> DataBundle:
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.channels, cfg.height, cfg.width)
    templates = torch.rand((cfg.num_classes, *shape), generator=g) * 255

    def make(n: int) -> Split:
        labels = torch.randint(0, cfg.num_classes, (n,), generator=g)
        noise = torch.randn((n, *shape), generator=g) * 60
        images = (templates[labels] + noise).clamp(0, 255).to(torch.uint8)
        return Split(images, labels)

    train, val, test = make(cfg.num_train), make(cfg.num_val), make(cfg.num_test)
    return DataBundle(
        "synthetic", train, val if cfg.num_val else None, test if cfg.num_test else None,
        cfg.num_classes, cfg.channels, (cfg.height, cfg.width), (0.5,) * cfg.channels, (0.25,) * cfg.channels,
        [str(i) for i in range(cfg.num_classes)],
    )
