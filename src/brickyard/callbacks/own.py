"""brickyard's own behaviours, as callbacks on the same interface a user's callbacks use.

- ``ProgressLog``: the log windows (throughput, data wait, training loss and accuracy read back on log
  steps only), the validation lines, ``metrics.jsonl``, TensorBoard scalars and the progress bar.
- ``Checkpointing``: ``step-N.pt`` every ``checkpoint.every_steps`` and at epoch ends, ``best.pt`` by
  validation accuracy (else loss), and a last save when the loop ends (a stop, ``max_steps``).
- ``Watching`` / ``Histograms``: activation and gradient statistics of chosen layers, weight and
  gradient histograms.
- ``Snapshotting``: stage 1 of dimension-reduction training saves flattened weights.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time

from brickyard.callbacks import Callback
from brickyard.errors import BrickyardError
from brickyard.observe.metrics import fit_hint
from brickyard.training.step import guard

INPUT_BOUND = 0.2  # a log window spending more than this fraction waiting for batches is reported as input-bound
MIN_HINT_IMAGES = 500  # fewer recent training images than this say too little to hint at over- or under-fitting


class ProgressLog(Callback):
    def __init__(self, run, metrics, tb, input_bound_hint: str | None):
        t = run.config.train
        self.metrics, self.tb, self.hint = metrics, tb, input_bound_hint
        self.every = t.log_every
        use_bar = run.is_main and (t.progress == "bar" or (t.progress == "auto" and sys.stderr.isatty()))
        self.plain = run.is_main and not use_bar and t.progress != "none"
        self.use_bar, self.bar = use_bar, None
        self.at_log, self.last_window = [0.0, 0.0, 0], (0.0, 0)  # rank-summed totals at the last log line; its window
        self.train_seconds, self.images = 0.0, 0
        self.window_start, self.window_count = time.perf_counter(), 0

    def on_train_start(self, run):
        if self.use_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=run.total_steps, initial=run.step, unit="step", dynamic_ncols=True, leave=False)

    def on_epoch_start(self, run):
        self.window_start, self.window_count, run.data_wait = time.perf_counter(), run.totals.count, 0.0
        self.epoch_start = self.window_start

    def _end_window(self, run) -> tuple[float, int]:
        """Close the window (at a log step or the end of an epoch); its seconds and images (all ranks)."""
        now = time.perf_counter()
        elapsed, n = now - self.window_start, (run.totals.count - self.window_count) * run.data_world
        self.train_seconds += elapsed
        self.images += n
        self.window_start, self.window_count = now, run.totals.count
        return elapsed, n

    def on_step_end(self, run, loss):
        if self.bar is not None:
            self.bar.update(1)
        if run.step % self.every == 0 or run.step == run.total_steps:
            guard(run)  # the loss read-back below is this loop's only host sync
            self._log(run)

    def _log(self, run) -> None:
        now = run.totals.read()  # the sync point
        loss_sum, correct, count = (a - b for a, b in zip(now, self.at_log))
        self.at_log[:] = now
        self.last_window = (correct, count)
        wait, (elapsed, n) = run.data_wait, self._end_window(run)
        run.data_wait = 0.0
        ips, wait_frac = n / max(elapsed, 1e-9), wait / max(elapsed, 1e-9)
        loss = loss_sum / max(count, 1)
        acc = correct / max(count, 1) if run.totals.classify else None
        run.train_loss, run.extras["train_accuracy"] = loss, acc
        shown_acc = f" acc {acc:.4f}" if acc is not None else ""
        extra = run.update.describe()
        line = (f"epoch {run.epoch + 1} step {run.step - run.epoch * run.steps_per_epoch}/{run.steps_per_epoch} "
                f"loss {loss:.4f}{shown_acc} lr {run.lr:.4g} {ips:,.0f} img/s{extra}")
        if wait_frac > INPUT_BOUND and self.hint:
            line += f", input-bound: {100 * wait_frac:.0f}% of the time waiting for data ({self.hint})"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}{shown_acc}")
        run.log.info(line, console=self.plain)
        self.metrics.write(kind="train", step=run.step, epoch=round(run.step / run.steps_per_epoch, 4), loss=loss,
                           accuracy=acc, lr=run.lr, images_per_second=round(ips, 1), data_wait_fraction=round(wait_frac, 4))
        self.tb.scalars(run.step, "train", {"loss": loss, "accuracy": acc, "lr": run.lr, "images_per_second": ips})

    def on_validation_start(self, run):
        self._end_window(run)  # evaluation is not training: it stays out of train_seconds and images/s

    def on_validation_end(self, run, r):
        self.window_start = time.perf_counter()
        # like with like: the training accuracy of the latest steps (since the last log line, else that
        # line's window), not the epoch's mean, which its first steps drag down
        now = run.totals.read()
        since = [a - b for a, b in zip(now, self.at_log)]
        correct, count = (since[1], since[2]) if since[2] > 0 else self.last_window
        train_acc = correct / max(count, 1) if run.totals.classify and count else None
        epoch = round(run.step / run.steps_per_epoch, 4)
        hint = None
        if r["accuracy"] is not None and train_acc is not None:
            hint = fit_hint(train_acc, r["accuracy"]) if count >= MIN_HINT_IMAGES else None
            run.log.info(f"epoch {epoch:g} step {run.step} val loss {r['loss']:.4f} acc {r['accuracy']:.4f} "
                         f"top5 {r['top5']:.4f}; train acc {train_acc:.4f} (last {int(count):,} training images)"
                         + (f"; {hint}" if hint else ""))
        else:
            run.log.info(f"epoch {epoch:g} step {run.step} val loss {r['loss']:.4f}")
        self.metrics.write(kind="val", step=run.step, epoch=epoch, loss=r["loss"], accuracy=r["accuracy"], top5=r["top5"],
                           train_accuracy=train_acc, hint=hint)
        self.tb.scalars(run.step, "val", {k: r[k] for k in ("loss", "accuracy", "top5") if r[k] is not None})

    def on_epoch_end(self, run):
        self._end_window(run)
        seconds = round(time.perf_counter() - self.epoch_start, 3)  # training, validation and the stop agreement
        run.extras.setdefault("epoch_seconds", []).append(seconds)
        epoch = round(run.step / run.steps_per_epoch, 4)
        self.metrics.write(kind="epoch", step=run.step, epoch=epoch, seconds=seconds)
        run.log.info(f"epoch {epoch:g} took {seconds:.1f} s", console=self.plain)

    def on_loop_end(self, run):
        if run.step % run.steps_per_epoch:
            self._end_window(run)  # a stop in the middle of an epoch
        if self.bar is not None:
            self.bar.close()


class NotLearningError(BrickyardError):
    exit_code = 1


class NotLearning(Callback):
    """Says so when a classifier stops learning: the training loss within 3% of ln(classes) or the
    accuracy within 1.5x of chance for ``windows`` log windows in a row, after the first tenth of
    the run. One warning, recorded in the summary; ``train.stop_if_not_learning`` ends the run
    there (exit code 1, the checkpoints already written kept). Runs after ``ProgressLog`` and reads
    what it read back, so it adds no host sync."""

    def __init__(self, windows: int = 3, stop: bool = False):
        self.windows, self.stop, self.streak, self.said = windows, stop, 0, None

    def on_step_end(self, run, loss):
        every = run.config.train.log_every
        c = run.data.num_classes
        if not (run.step % every == 0 or run.step == run.total_steps) or c < 2 or not run.totals.classify:
            return
        if run.step < run.total_steps / 10:
            return
        chance_loss = math.log(c)
        acc = run.extras.get("train_accuracy")
        stuck = abs(run.train_loss - chance_loss) < 0.03 * chance_loss or (acc is not None and acc < 1.5 / c)
        self.streak = self.streak + 1 if stuck else 0
        if self.streak < self.windows or self.said:
            return
        self.said = (f"not learning: for {self.streak} log windows up to step {run.step} the training loss is "
                     f"{run.train_loss:.3f} (chance: ln {c} = {chance_loss:.3f}) and the accuracy {acc:.3f} (chance "
                     f"{1 / c:.3f}); likely causes: a learning rate too high for this batch ({run.lr:.4g} now; try "
                     f"a lower optim.lr or a longer warm-up), ReLUs that died early, or labels that do not match the inputs")
        run.extras["not_learning"] = self.said
        if self.stop:
            raise NotLearningError(self.said + "; stopped (train.stop_if_not_learning).")
        run.log.warning(self.said + ".")


class TestEvery(Callback):
    """``train.test_every``: the test split evaluated every N epochs during training (the final test
    pass happens anyway), as the classic notebooks plot test accuracy per epoch."""

    def __init__(self, every: int, progress: ProgressLog):
        self.every, self.progress = every, progress

    def on_epoch_end(self, run):
        done = run.step // run.steps_per_epoch
        if run.data.test is None or run.step >= run.total_steps or run.stopped or run.step % run.steps_per_epoch:
            return
        if done % self.every == 0:
            from brickyard.training.evaluation import evaluate_split
            r = evaluate_split(run, run.data.test)
            shown = f" acc {r['accuracy']:.4f}" if r["accuracy"] is not None else ""
            run.log.info(f"epoch {done} step {run.step} test loss {r['loss']:.4f}{shown}")
            self.progress.metrics.write(kind="test", step=run.step, epoch=done, loss=r["loss"], accuracy=r["accuracy"],
                                        top5=r["top5"])
            self.progress.tb.scalars(run.step, "test_during", {k: r[k] for k in ("loss", "accuracy") if r[k] is not None})


class Checkpointing(Callback):
    """Saves through a ``CheckpointManager`` (rank 0 only; the NaN guard runs on every rank first)."""

    def __init__(self, manager, every_steps: int, every_epoch: bool, state_fn):
        self.manager, self.every_steps, self.every_epoch, self.state_fn = manager, every_steps, every_epoch, state_fn
        self.saved_at = None

    def save(self, run, metric: float | None = None) -> None:
        guard(run)
        self.saved_at = run.step
        if self.manager is None:
            return
        best = None
        if metric is not None and self.manager.improves(metric):
            self.manager.best_metric = metric  # recorded in the state, so a resumed run compares with it
            if run.eval_weights is not contextlib.nullcontext:
                with run.eval_weights():  # EMA: best.pt holds the averaged weights that were evaluated
                    best = self.state_fn(run)
                    best["model"] = {k: v.detach().clone() for k, v in best["model"].items()}
        else:
            metric = None
        run.last_checkpoint = self.manager.save(self.state_fn(run), run.step, metric, best)
        run.callbacks.on_checkpoint(run, run.last_checkpoint)

    def on_step_end(self, run, loss):
        if self.every_steps and run.step % self.every_steps == 0:
            self.save(run)

    def on_epoch_end(self, run):
        if self.every_epoch or run.step >= run.total_steps:
            fresh = run.extras.get("validated_at") == run.step
            val = run.extras.get("last_val") if fresh else None
            metric = None
            if val is not None:
                metric = val["accuracy"] if val["accuracy"] is not None else -val["loss"]
            self.save(run, metric)

    def on_loop_end(self, run):
        if self.saved_at != run.step:
            self.save(run)


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


class Snapshotting(Callback):
    """Stage 1 of dimension-reduction training: flattened trainable weights every ``every`` steps from
    ``start_epoch`` on (``every_steps: auto`` spreads ``keep`` snapshots over that stretch; 0: at each
    epoch end); the initial weights start the trajectory. Too few snapshots for the subspace is one
    sentence before the first step."""

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
        taken = min(self.cfg.keep, multiples + (1 if start == 0 else 0))  # with the initial weights
        if taken <= self.n_components:
            raise BrickyardError(f"boost.snapshots: {taken} snapshot(s) over steps {start}..{run.total_steps} (every "
                                 f"{self.every}) cannot give boost.dim_reduce.n_components={self.n_components} components; "
                                 f"train longer, set boost.snapshots.every_steps lower (or auto), or use fewer components.")
        if run.step == 0 and start == 0 and self.snaps is not None:
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
        run.extras["dim_reduce"] = self.stats.summary(self.stats.total)
