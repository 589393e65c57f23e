"""``Checkpointing``: when to save. ``step-N.pt`` every ``checkpoint.every_steps`` and at epoch ends,
``best.pt`` by ``checkpoint.monitor`` (``auto``: validation accuracy, else loss), and a last save when the loop
ends (a stop, ``max_steps``). What is saved, where and how is ``training.checkpoint.Checkpoints``'."""
from __future__ import annotations

import math

from brickyard.callbacks.base import Callback, monitored
from brickyard.errors import ConfigError


class Checkpointing(Callback):
    """Decides when the run's ``Checkpoints`` save (every rank calls it: under FSDP saving is collective)."""

    def __init__(self, checkpoints, every_steps: int, every_epoch: bool, monitor: str = "auto"):
        self.checkpoints, self.every_steps, self.every_epoch, self.monitor = checkpoints, every_steps, every_epoch, monitor
        self.saved_at = None

    def metric(self, val: dict) -> float:
        """The validation's score for ``best.pt``, higher better: an accuracy as it is, a loss negated."""
        return score(val, self.monitor)

    def save(self, run, metric: float | None = None) -> None:
        self.saved_at = run.step
        self.checkpoints.save(run, metric)  # the trainer sets run.last_checkpoint, calls on_checkpoint (rank 0)

    def on_step_end(self, run, loss):
        if self.every_steps and run.step % self.every_steps == 0:
            self.save(run)

    def on_epoch_end(self, run):
        if self.every_epoch or run.step >= run.total_steps:
            val = run.metrics if run.validated_at == run.step else None
            self.save(run, self.metric(val) if val is not None else None)

    def on_loop_end(self, run):
        if self.saved_at != run.step:
            self.save(run)


def score(val: dict, monitor: str) -> float:
    """A validation's score under ``checkpoint.monitor``, higher better: an accuracy or score as it is, a loss negated
    (``auto``: the accuracy where there is one, the mean average precision of several labels an image, else the loss)."""
    if monitor == "auto":  # several labels an image have no accuracy: their mean average precision
        best = val.get("accuracy") if val.get("accuracy") is not None else val.get("map")
        return best if best is not None else -val["loss"]
    value = monitored(val, monitor, f"checkpoint.monitor: {monitor}", "; pick one of them or auto")
    return -value if monitor == "val_loss" else value


def held_validation(rows, step, best: float, monitor: str) -> dict | None:
    """Of the logged validation rows, the one whose weights ``best.pt`` holds: the row at ``step`` (saved with the
    best since 0.3.0), else the row whose score under the ``monitor`` it was saved with is ``best``."""
    for row in rows:
        if isinstance(step, int) and row.get("step") == step:
            return row
    for row in rows:
        if step is None and rescored(row, monitor) == best:
            return row
    return None


def rescored(row: dict | None, monitor: str) -> float | None:
    """A logged validation row's score under ``monitor`` (``score``), or None where it has no such value."""
    if row is None:
        return None
    try:
        value = score(row, monitor)
    except (ConfigError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def check_monitor(cfg, data) -> None:
    """Before anything is written: ``checkpoint.monitor`` names a metric this run's validations will have."""
    c = cfg.checkpoint
    if c.monitor == "auto" or not c.keep_best:
        return
    if data.val is None:
        raise ConfigError(f"checkpoint.monitor: {c.monitor} picks best.pt from the validations, and this run has no "
                          f"validation data: hold some out (data.train_on_all false, data.val_fraction, fit's val_data), "
                          f"or set it to auto.")
    if c.monitor != "val_loss" and not data.num_classes:
        raise ConfigError(f"checkpoint.monitor: {c.monitor} scores classes, and this run's labels are not classes; use "
                          f"val_loss or auto.")
