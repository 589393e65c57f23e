"""``EarlyStopping``: stop when a validation metric stops improving."""
from __future__ import annotations

import math

import torch

from brickyard.callbacks.base import Callback, argument, monitored
from brickyard.errors import CheckpointError, ConfigError


class EarlyStopping(Callback):
    """Stop when ``monitor`` (``val_loss``, ``val_accuracy``, ``val_top5``) has not improved by more than
    ``min_delta`` for ``patience`` validations; with ``restore_best`` the weights of the best validation
    are put back when it stops (kept on the CPU, one copy of the model, and in every checkpoint, so that a
    resumed run restores them as an uninterrupted one does)."""

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, restore_best: bool = True):
        if not isinstance(monitor, str) or not monitor.startswith("val_"):
            raise ConfigError(f"EarlyStopping: monitor {monitor!r} must be a validation metric such as val_loss or val_accuracy.")
        if isinstance(patience, (int, float)) and not isinstance(patience, bool) and patience < 1:
            raise ConfigError(f"EarlyStopping: patience {patience} must be at least 1.")
        patience = argument("EarlyStopping", "patience", patience, whole=True, least=1)
        min_delta = argument("EarlyStopping", "min_delta", min_delta)
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
            restored = self.restore_best and self.best_weights is not None
            if restored:
                run.model.load_state_dict(self.best_weights)
            note = "; its weights restored" if restored else \
                "; its weights were not in the checkpoint resumed from, so the last weights stay" if self.restore_best else ""
            run.log.info(f"early stopping: {self.monitor} has not improved for {self.wait} validation(s); best "
                         f"{self.best:.4f} at step {self.best_step}{note}")
            run.stop(f"EarlyStopping on {self.monitor}")

    def on_train_start(self, run):
        """Weights a checkpoint handed back that do not fit this model are one sentence, before any step."""
        if self.best_weights is None:
            return
        own = run.model.state_dict()
        if set(own) != set(self.best_weights) or any(tuple(own[k].shape) != tuple(v.shape) for k, v in self.best_weights.items()):
            raise CheckpointError("EarlyStopping: the best weights saved in the checkpoint do not fit this model.")

    def state_dict(self):
        state = {"best": self.best, "wait": self.wait, "best_step": self.best_step}
        if self.best_weights is not None and all(type(v) is torch.Tensor for v in self.best_weights.values()):
            state["best_weights"] = self.best_weights  # not under FSDP: its shards are not one model's weights
        return state

    def load_state_dict(self, state):
        weights = state.get("best_weights")
        if weights is not None and not (isinstance(weights, dict) and all(
                isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items())):
            raise ValueError(f"EarlyStopping: {str(state)[:120]} is not its state")
        self.best_weights = weights if self.restore_best else None
        best, wait, step = state["best"], state["wait"], state["best_step"]
        whole = [v for v in (wait, step) if v is not None]
        if not ((best is None or isinstance(best, float) and math.isfinite(best)) and isinstance(wait, int)
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in whole)):
            raise ValueError(f"EarlyStopping: {str(state)[:120]} is not its state")
        self.best, self.wait, self.best_step = best, wait, step
