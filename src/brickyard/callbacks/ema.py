"""``EMA``: an exponential moving average of the weights for evaluation and the final model."""
from __future__ import annotations

import contextlib

import torch

from brickyard.callbacks.base import Callback
from brickyard.distributed.fsdp import full, like
from brickyard.errors import CheckpointError, ConfigError
from brickyard.optim.optimizers import by_type


class EMA(Callback):
    """An exponential moving average of the weights, ``avg = decay * avg + (1 - decay) * w`` after every
    step. Validation, the test evaluation, ``best.pt`` and the final weights use the average; the
    training steps use the raw weights, which every step checkpoint keeps for an exact resume."""

    def __init__(self, decay: float = 0.999):
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0.0 < decay < 1.0:
            raise ConfigError(f"EMA: decay {decay} must be between 0 and 1, e.g. 0.999.")
        self.decay, self.avg = decay, None

    state_key_fields = ("decay",)
    before_checkpoints = True

    def on_train_start(self, run):
        self.live = list(run.model.parameters()) + list(run.model.buffers())  # updated in place, so kept once
        if self.avg is not None and (len(self.avg) != len(self.live) or any(
                tuple(a.shape) != tuple(w.shape) for a, w in zip(self.avg, self.live))):
            raise CheckpointError("EMA: the averaged weights saved in the checkpoint do not fit this model.")
        self.avg = ([t.detach().clone() for t in self.live] if self.avg is None
                    else [like(a, t) for a, t in zip(self.avg, self.live)])
        # (average, weight) pairs by the type of tensor, one foreach op each: tensor parallel trains DTensors beside plain tensors
        self.floats = by_type([(a, w) for a, w in zip(self.avg, self.live) if a.is_floating_point()], key=lambda aw: aw[0])
        self.counters = [(a, w) for a, w in zip(self.avg, self.live) if not a.is_floating_point()]  # num_batches_tracked
        run.use_eval_weights(self.applied)

    def on_step_end(self, run, loss):
        with torch.no_grad():
            for pairs in self.floats:
                torch._foreach_lerp_([a for a, _ in pairs], [w for _, w in pairs], 1.0 - self.decay)
            _copy([a for a, _ in self.counters], [w for _, w in self.counters])

    def on_train_end(self, run, summary):
        with torch.no_grad():  # the run ends with the averaged weights (the test evaluated them swapped in)
            _copy(self.live, self.avg)
        run.use_eval_weights(None)

    @contextlib.contextmanager
    def applied(self):
        """Swap the averaged weights in (for an evaluation or a save) and the raw ones back after."""
        raw = [w.detach().clone() for w in self.live]
        with torch.no_grad():
            _copy(self.live, self.avg)
        try:
            yield
        finally:
            with torch.no_grad():
                _copy(self.live, raw)

    def state_dict(self):
        return {"decay": self.decay, "avg": [full(a) for a in self.avg]} if self.avg is not None else {}  # FSDP: gathered

    def load_state_dict(self, state):
        avg = state.get("avg")
        if avg is not None and not (isinstance(avg, (list, tuple)) and all(isinstance(a, torch.Tensor) for a in avg)):
            raise ValueError(f"EMA: {str(state)[:120]} is not its state")
        self.avg = list(avg) if avg is not None else None


def _copy(dst, src) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)
