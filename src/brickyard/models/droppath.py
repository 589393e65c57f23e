"""Stochastic depth (drop path): a residual branch is dropped for whole samples, the rest scaled up.

timm's ``drop_path`` and ``DropPath`` (``timm/layers/drop.py``): in training, each sample's branch is
kept with probability ``1 - p`` and divided by it (``scale_by_keep``); in evaluation, the identity.
The rate rises linearly over a network's blocks from 0 to ``model.drop_path`` (timm's ResNet:
``drop_path_rate * net_block_idx / (net_num_blocks - 1)`` in ``timm/models/resnet.py``
``make_blocks``; its ViT: ``torch.linspace(0, drop_path_rate, depth)``).

Where brickyard differs: timm draws from the global RNG for the local batch. Here, inside a
training step, the draws are made for the whole global batch from a generator seeded with the step
and the module's place in the network, and each rank uses its slice (``batch``), so N processes
drop the same samples' branches as one process does, a resumed run what an uninterrupted one did,
and activation checkpointing's recomputation what the forward pass drew. Outside a step (a user's
own loop) it draws as timm does.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

_current: tuple[int, int, int] | None = None  # (seed of this step, samples in the global batch, this rank's offset)


@contextlib.contextmanager
def batch(seed: int, n_global: int, offset: int):
    """Draws inside this block are for the global batch of ``n_global`` samples, of which this rank's
    inputs start at ``offset``."""
    global _current
    saved, _current = _current, (seed, n_global, offset)
    try:
        yield
    finally:
        _current = saved


class DropPath(nn.Module):
    def __init__(self, p: float, index: int = 0):
        super().__init__()
        self.p, self.index = float(p), index
        self._gen: torch.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        if _current is None:
            mask = x.new_empty(x.shape[0]).bernoulli_(keep)
        else:
            seed, n_global, offset = _current
            if self._gen is None or self._gen.device != x.device:
                self._gen = torch.Generator(device=x.device)
            self._gen.manual_seed((seed * 1_009 + self.index) % (1 << 62))
            draws = torch.rand(n_global, generator=self._gen, device=x.device)[offset:offset + x.shape[0]]
            mask = (draws < keep).to(x.dtype)
        return x * mask.div_(keep).view(-1, *([1] * (x.dim() - 1)))

    def extra_repr(self) -> str:
        return f"p={self.p:.3f}"


def rates(top: float, blocks: int) -> list[float]:
    """Each of ``blocks`` blocks' rate, 0 to ``top`` linearly (timm's rule)."""
    if blocks <= 1:
        return [top] * blocks
    return [top * i / (blocks - 1) for i in range(blocks)]


def branch(p: float, index: int) -> nn.Module:
    """A ``DropPath`` where ``p`` > 0, else an identity (so models without it are unchanged)."""
    return DropPath(p, index) if p > 0 else nn.Identity()
