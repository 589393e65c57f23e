"""Images handed over channels-last (N x H x W x C, the layout Keras and NumPy keep them in:
``keras.datasets.cifar10`` gives 50000 x 32 x 32 x 3) read as the N x C x H x W that torch's layers take.

The layout is never guessed from the shape alone, which cannot tell 16 x 16 x 3 images from 16 channels of
16 x 3: with a model at hand (``fit``, ``predict`` on a module) one sample goes through it as given, and only
where that fails and the channels-first view goes through are the arrays read that way (a model that
permutes its input itself keeps what it was given); with a checkpoint's recorded C x H x W, the shapes say it.
"""
from __future__ import annotations

import torch


def could_be_channels_last(x: torch.Tensor) -> bool:
    """A 4-D batch whose last size could be a channel count (1 to 4) and whose second is not that."""
    return x.dim() == 4 and 1 <= x.shape[3] <= 4 and x.shape[1] != x.shape[3]


def channels_first(x: torch.Tensor) -> torch.Tensor:
    """The N x C x H x W view of an N x H x W x C batch (no copy: channels-last strides)."""
    return x.permute(0, 3, 1, 2)


def model_reads_channels_last(model: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether ``model`` fails on the first of ``x`` as given and takes it channels-first: one sample
    forward, no gradient, in eval mode, on the model's device (the mode is put back)."""
    if not could_be_channels_last(x) or not len(x):
        return False
    p = next(model.parameters(), None)
    sample = x[:1].float().to(p.device if p is not None else "cpu")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                model(sample)
                return False
            except Exception:  # noqa: BLE001  the model's own refusal of this layout; the other is tried
                pass
            try:
                model(channels_first(sample))
                return True
            except Exception:  # noqa: BLE001  neither layout: the run meets the model's error as it is
                return False
    finally:
        model.train(was_training)


def as_checkpoint_reads(x: torch.Tensor, channels: int | None, size) -> torch.Tensor:
    """``x`` channels-first where it is ``N x H x W x C`` for a checkpoint that reads C x H x W images."""
    if channels and size and x.dim() == 4 and tuple(x.shape[1:]) == (*size, channels) != (channels, *size):
        return channels_first(x)
    return x
