"""``MaxTime``: stop after a wall-clock budget."""
from __future__ import annotations

import time

from brickyard.callbacks.base import Callback
from brickyard.errors import ConfigError


class MaxTime(Callback):
    """Stop once the training loop has run ``seconds`` (wall clock from the first step, evaluation included)."""

    def __init__(self, seconds: float):
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < float("inf"):
            raise ConfigError(f"MaxTime: seconds {seconds!r} must be a positive number.")
        self.seconds, self.start = float(seconds), None

    def on_train_start(self, run):
        self.start = time.perf_counter()

    def on_step_end(self, run, loss):
        if time.perf_counter() - self.start >= self.seconds:
            run.stop(f"MaxTime {self.seconds:g}s")
