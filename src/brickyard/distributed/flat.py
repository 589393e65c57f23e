"""Parameters and gradients as one flat vector (parameter-server chunks, the dimension-reduction subspace)."""
from __future__ import annotations

import torch


def flatten(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def flat_grads(params) -> torch.Tensor:
    return flatten(p.grad if p.grad is not None else torch.zeros_like(p) for p in params)


def load_flat(params, flat: torch.Tensor) -> None:
    """Copy ``flat`` back into ``params`` (in order)."""
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
