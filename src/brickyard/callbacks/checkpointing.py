"""``Checkpointing``: ``step-N.pt`` every ``checkpoint.every_steps`` and at epoch ends, ``best.pt`` by
validation accuracy (else loss), and a last save when the loop ends (a stop, ``max_steps``)."""
from __future__ import annotations

from brickyard.callbacks.base import Callback
from brickyard.distributed import process as dist


class Checkpointing(Callback):
    """Saves through a ``CheckpointManager`` (rank 0 only; the NaN guard runs on every rank first). Under
    FSDP every rank gathers the state with rank 0, which writes it."""

    def __init__(self, manager, every_steps: int, every_epoch: bool, state_fn, guard):
        self.guard = guard  # the NaN guard (``training.step.guard``): no non-finite weights are saved
        self.manager, self.every_steps, self.every_epoch, self.state_fn = manager, every_steps, every_epoch, state_fn
        self.saved_at = None

    def save(self, run, metric: float | None = None) -> None:
        self.guard(run)
        self.saved_at = run.step
        sharded = run._engine.sharded
        if self.manager is None and not sharded:
            return
        best = None
        improves = metric is not None and self.manager is not None and self.manager.improves(metric)
        if sharded:  # rank 0 keeps the best metric; the others gather what it will write
            improves = dist.broadcast_object(improves)
        if improves:
            if self.manager is not None:
                self.manager.best_metric = metric  # recorded in the state, so a resumed run compares with it
            if run.swaps_eval_weights:
                with run.eval_weights():  # EMA: best.pt holds the averaged weights that were evaluated
                    best = self.state_fn(run)
                    best["model"] = {k: v.detach().clone() for k, v in best["model"].items()}
        else:
            metric = None
        state = self.state_fn(run)
        if self.manager is None:
            return
        run.last_checkpoint = self.manager.save(state, run.step, metric, best)
        run._engine.callbacks.on_checkpoint(run, run.last_checkpoint)

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
