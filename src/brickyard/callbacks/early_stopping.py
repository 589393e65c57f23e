"""``EarlyStopping``: stop when a validation metric stops improving."""
from __future__ import annotations

import math

from brickyard.callbacks.base import Callback, monitored
from brickyard.errors import ConfigError


class EarlyStopping(Callback):
    """Stop when ``monitor`` (``val_loss``, ``val_accuracy``, ``val_top5``) has not improved by more than
    ``min_delta`` for ``patience`` validations; with ``restore_best`` the weights of the best validation
    are put back when it stops (kept on the CPU, one copy of the model)."""

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, restore_best: bool = True):
        if not monitor.startswith("val_"):
            raise ConfigError(f"EarlyStopping: monitor {monitor!r} must be a validation metric such as val_loss or val_accuracy.")
        if patience < 1:
            raise ConfigError(f"EarlyStopping: patience {patience} must be at least 1.")
        self.monitor, self.patience, self.min_delta, self.restore_best = monitor, patience, abs(min_delta), restore_best
        self.sign = -1.0 if monitor.endswith("loss") else 1.0  # larger is better after multiplying
        self.best, self.wait, self.best_step, self.best_weights = None, 0, None, None

    state_key_fields = ("monitor", "min_delta")

    def on_validation_end(self, run, metrics):
        value = monitored(metrics, self.monitor, f"EarlyStopping: monitor {self.monitor!r}")
        if self.best is None or self.sign * (value - self.best) > self.min_delta:
            self.best, self.wait, self.best_step = value, 0, run.step
            if self.restore_best:
                self.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in run.model.state_dict().items()}
            return
        self.wait += 1
        if self.wait >= self.patience:
            if self.restore_best and self.best_weights is not None:
                run.model.load_state_dict(self.best_weights)
            run.log.info(f"early stopping: {self.monitor} has not improved for {self.wait} validation(s); best "
                         f"{self.best:.4f} at step {self.best_step}" + ("; its weights restored" if self.restore_best else ""))
            run.stop(f"EarlyStopping on {self.monitor}")

    def state_dict(self):
        return {"best": self.best, "wait": self.wait, "best_step": self.best_step}

    def load_state_dict(self, state):
        best, wait, step = state["best"], state["wait"], state["best_step"]
        whole = [v for v in (wait, step) if v is not None]
        if not ((best is None or isinstance(best, float) and math.isfinite(best)) and isinstance(wait, int)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in whole)):
            raise ValueError(f"EarlyStopping: {str(state)[:120]} is not its state")
        self.best, self.wait, self.best_step = best, wait, step
