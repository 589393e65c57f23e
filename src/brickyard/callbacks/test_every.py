"""``TestEvery``: the test split evaluated every N epochs during training."""
from __future__ import annotations

from brickyard.callbacks.base import Callback


class TestEvery(Callback):
    """``train.test_every``: the test split evaluated every N epochs during training (the final test
    pass happens anyway), as the classic notebooks plot test accuracy per epoch."""

    def __init__(self, every: int, loggers, evaluate):
        self.every, self.loggers = every, loggers  # a ``test`` row with its epoch (TensorBoard: ``test_during/``)
        self.evaluate = evaluate  # (run, split) -> metrics: ``training.evaluation.evaluate_split``

    def on_epoch_end(self, run):
        done = run.step // run.steps_per_epoch
        if run.data.test is None or run.step >= run.total_steps or run.stopped or run.step % run.steps_per_epoch:
            return
        if done % self.every == 0:
            r = self.evaluate(run, run.data.test)
            shown = f" acc {r['accuracy']:.4f}" if r["accuracy"] is not None else ""
            run.log.info(f"epoch {done} step {run.step} test loss {r['loss']:.4f}{shown}")
            self.loggers.write(kind="test", step=run.step, epoch=done, loss=r["loss"], accuracy=r["accuracy"],
                               top5=r["top5"])
