"""``EMA``: an exponential moving average of the weights for evaluation and the final model."""
from __future__ import annotations

import torch

from brickyard.callbacks import averaging
from brickyard.callbacks.base import Callback
from brickyard.errors import ConfigError


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
        self.avg = ([t.detach().clone() for t in self.live] if self.avg is None
                    else averaging.laid_out(self.avg, self.live, "EMA"))
        self.floats, self.counters = averaging.paired(self.avg, self.live)
        run.use_eval_weights(self.applied)

    def on_step_end(self, run, loss):
        with torch.no_grad():
            for pairs in self.floats:
                torch._foreach_lerp_([a for a, _ in pairs], [w for _, w in pairs], 1.0 - self.decay)
            averaging.copy([a for a, _ in self.counters], [w for _, w in self.counters])

    def on_train_end(self, run, summary):
        with torch.no_grad():  # the run ends with the averaged weights (the test evaluated them swapped in)
            averaging.copy(self.live, self.avg)
        run.use_eval_weights(None)

    def applied(self):
        """Swap the averaged weights in (for an evaluation or a save) and the raw ones back after."""
        return averaging.swapped(self.live, lambda: averaging.copy(self.live, self.avg))

    def state_dict(self):
        return {"decay": self.decay, "avg": averaging.saved(self.avg)} if self.avg is not None else {}

    def load_state_dict(self, state):
        self.avg = averaging.loaded(state, "EMA")
