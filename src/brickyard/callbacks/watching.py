"""``Watching`` / ``Histograms``: activation and gradient statistics of chosen layers (``watch`` rows: into
``metrics.jsonl`` and TensorBoard), weight and gradient histograms (the loggers that take them: TensorBoard)."""
from __future__ import annotations

from brickyard.callbacks.base import Callback


class Watching(Callback):
    def __init__(self, watcher, every: int, loggers):
        self.watcher, self.every, self.loggers, self.on = watcher, every, loggers, False

    def on_step_start(self, run):
        self.on = run.step % self.every == 0
        if self.on:
            self.watcher.attach()

    def on_before_update(self, run):
        if self.on:
            self.loggers.write(kind="watch", step=run.step, layers=self.watcher.collect())


class Histograms(Callback):
    def __init__(self, every: int, loggers):
        self.every, self.loggers = every, loggers

    def on_before_update(self, run):
        if run.step % self.every == 0:
            self.loggers.histograms(run.step, run.model)
