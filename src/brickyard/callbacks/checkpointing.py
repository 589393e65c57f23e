"""``Checkpointing``: when to save. ``step-N.pt`` every ``checkpoint.every_steps`` and at epoch ends,
``best.pt`` by validation accuracy (else loss), and a last save when the loop ends (a stop,
``max_steps``). What is saved, where and how is ``training.checkpoint.Checkpoints``'."""
from __future__ import annotations

from brickyard.callbacks.base import Callback


class Checkpointing(Callback):
    """Decides when the run's ``Checkpoints`` save (every rank calls it: under FSDP saving is collective)."""

    def __init__(self, checkpoints, every_steps: int, every_epoch: bool):
        self.checkpoints, self.every_steps, self.every_epoch = checkpoints, every_steps, every_epoch
        self.saved_at = None

    def save(self, run, metric: float | None = None) -> None:
        self.saved_at = run.step
        self.checkpoints.save(run, metric)  # sets run.last_checkpoint and calls on_checkpoint (rank 0)

    def on_step_end(self, run, loss):
        if self.every_steps and run.step % self.every_steps == 0:
            self.save(run)

    def on_epoch_end(self, run):
        if self.every_epoch or run.step >= run.total_steps:
            val = run.metrics if run.validated_at == run.step else None
            metric = None
            if val is not None:
                metric = val["accuracy"] if val["accuracy"] is not None else -val["loss"]
            self.save(run, metric)

    def on_loop_end(self, run):
        if self.saved_at != run.step:
            self.save(run)
