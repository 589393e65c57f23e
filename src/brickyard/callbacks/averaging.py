"""What ``EMA`` and ``SWA`` share: a copy of the model's weights (parameters, then buffers) kept beside the live ones,
updated in place by foreach ops, swapped in for an evaluation or a save, and kept in checkpoints."""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from brickyard.distributed.fsdp import full, like
from brickyard.errors import CheckpointError
from brickyard.optim.optimizers import by_type


def laid_out(avg: list, live: list, who: str) -> list:
    """A checkpoint's averaged weights laid out as this run's (``like``: sharded as they are), one sentence where
    they do not fit its model."""
    if len(avg) != len(live) or any(tuple(a.shape) != tuple(w.shape) for a, w in zip(avg, live)):
        raise CheckpointError(f"{who}: the averaged weights saved in the checkpoint do not fit this model.")
    return [like(a, w) for a, w in zip(avg, live)]


def paired(avg: list, live: list) -> tuple[list, list]:
    """``(floats, counters)``: the float (average, weight) pairs grouped by the type of tensor, one foreach op each
    (tensor parallel trains DTensors beside plain tensors), and the others (``num_batches_tracked``: copied)."""
    pairs = list(zip(avg, live))
    return (by_type([p for p in pairs if p[0].is_floating_point()], key=lambda aw: aw[0]),
            [p for p in pairs if not p[0].is_floating_point()])


@contextlib.contextmanager
def swapped(live: list, put_in: Callable[[], None]):
    """``put_in`` the average (for an evaluation or a save) and the raw weights back after."""
    raw = [w.detach().clone() for w in live]
    with torch.no_grad():
        put_in()
    try:
        yield
    finally:
        with torch.no_grad():
            copy(live, raw)


def copy(dst, src) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


def saved(avg: list) -> list:
    """The average as a checkpoint keeps it: whole tensors (gathered under FSDP)."""
    return [full(a) for a in avg]


def loaded(state: dict, who: str) -> list | None:
    """The average a checkpoint's state holds (None: none yet); a foreign one is a ValueError naming ``who``."""
    avg = state.get("avg")
    if avg is not None and not (isinstance(avg, (list, tuple)) and all(isinstance(a, torch.Tensor) for a in avg)):
        raise ValueError(f"{who}: {str(state)[:120]} is not its state")
    return list(avg) if avg is not None else None
