"""``Watching`` / ``Histograms``: activation and gradient statistics of chosen layers, weight and
gradient histograms, into ``metrics.jsonl`` and TensorBoard."""
from __future__ import annotations

from brickyard.callbacks.base import Callback


class Watching(Callback):
    def __init__(self, watcher, every: int, metrics, tb):
        self.watcher, self.every, self.metrics, self.tb, self.on = watcher, every, metrics, tb, False

    def on_step_start(self, run):
        self.on = run.step % self.every == 0
        if self.on:
            self.watcher.attach()

    def on_before_update(self, run):
        if self.on:
            found = self.watcher.collect()
            self.metrics.write(kind="watch", step=run.step, layers=found)
            for name, row in found.items():
                self.tb.scalars(run.step, f"watch/{name}", row)


class Histograms(Callback):
    def __init__(self, every: int, tb):
        self.every, self.tb = every, tb

    def on_before_update(self, run):
        if run.step % self.every == 0:
            self.tb.histograms(run.step, run.model)
