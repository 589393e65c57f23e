"""Dimension reduction's behaviours on the callback interface: ``Snapshotting`` (stage 1 saves
flattened weights) and ``Stage2Log`` (stage 2's per-epoch line)."""
from __future__ import annotations

import math

from brickyard.callbacks.base import Callback
from brickyard.errors import BrickyardError


class Snapshotting(Callback):
    """Stage 1 of dimension-reduction training: flattened trainable weights every ``every`` steps from
    ``start_epoch`` on (``every_steps: auto`` spreads ``keep`` snapshots over that stretch; 0: at each
    epoch end); the initial weights start the trajectory when ``start_epoch`` is 0 or ``include_init``
    is on (then they are kept whatever ``keep`` drops, as the authors' PCA includes ``0.pt``). Too few
    snapshots for the subspace is one sentence before the first step."""

    def __init__(self, snaps, cfg, n_components: int, params):  # snaps: None on ranks other than 0 (they check only)
        self.snaps, self.cfg, self.n_components, self.params = snaps, cfg, n_components, params

    def on_train_start(self, run):
        start = math.ceil(self.cfg.start_epoch * run.steps_per_epoch)
        stretch = max(0, run.total_steps - start)
        every = self.cfg.every_steps
        if every == "auto":
            every = max(1, stretch // self.cfg.keep)
        self.every = every or run.steps_per_epoch
        lo = max(start, 1)
        multiples = max(0, run.total_steps // self.every - (lo - 1) // self.every)
        init = start == 0 or self.cfg.include_init
        taken = min(self.cfg.keep + (1 if self.cfg.include_init else 0), multiples + (1 if init else 0))
        if taken <= self.n_components:
            raise BrickyardError(f"boost.snapshots: {taken} snapshot(s) over steps {start}..{run.total_steps} (every "
                                 f"{self.every}) cannot give boost.dim_reduce.n_components={self.n_components} components; "
                                 f"train longer, set boost.snapshots.every_steps lower (or auto), or use fewer components.")
        if run.step == 0 and init and self.snaps is not None:
            self.snaps.save(0, self.params)

    def on_step_end(self, run, loss):
        if self.snaps is not None and run.step / run.steps_per_epoch >= self.cfg.start_epoch and run.step % self.every == 0:
            self.snaps.save(run.step, self.params)


class Stage2Log(Callback):
    """Dimension-reduction stage 2, per epoch: subspace steps, the share that passed the Armijo test, the
    step sizes taken and the loss before and at the subspace step (log, ``metrics.jsonl`` kind
    ``dim_reduce``); the summary keeps the totals."""

    def __init__(self, stats, metrics):
        self.stats, self.metrics = stats, metrics

    def _write(self, run, d: dict) -> None:
        if not d["steps"]:
            return
        epoch = round(run.step / run.steps_per_epoch, 4)
        sizes = ", ".join(f"{k}: {v}" for k, v in sorted(d["step_sizes"].items(), key=lambda kv: -float(kv[0])))
        run.log.info(f"stage 2 epoch {epoch:g}: {d['steps']} subspace steps, {100 * d['passed_fraction']:.0f}% passed the "
                     f"Armijo test; step sizes {sizes}; loss {d['loss_before']:.4f} -> {d['loss_after']:.4f} (mean, before "
                     f"and at the subspace step)")
        self.metrics.write(kind="dim_reduce", step=run.step, epoch=epoch, **d)

    def on_epoch_end(self, run):
        self._write(run, self.stats.end_epoch())

    def on_loop_end(self, run):
        self._write(run, self.stats.end_epoch())  # a part epoch at the end

    def summary(self, run) -> dict:
        return {"dim_reduce": self.stats.summary(self.stats.total)}
