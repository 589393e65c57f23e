"""``ProgressLog``: the log windows (throughput, data wait, training loss and accuracy read back on log
steps only), the validation lines, the progress bar, and the ``train``, ``val`` and ``epoch`` rows every logger
gets (``brickyard.observe.loggers``: ``metrics.jsonl``, TensorBoard, the trackers)."""
from __future__ import annotations

import sys

from tqdm import tqdm

from brickyard.callbacks.base import Callback
from brickyard.observe.metrics import fit_hint

INPUT_BOUND = 0.2  # a log window spending more than this fraction waiting for batches is reported as input-bound
MIN_HINT_IMAGES = 500  # fewer recent training images than this say too little to hint at over- or under-fitting


class ProgressLog(Callback):
    """Reads the training totals back every ``train.log_every`` steps (the loop's only host sync) and
    sets ``run.train_loss`` / ``run.train_accuracy``, which callbacks after it read (``NotLearning``).
    Its windows are differences of what the loop measured (``run.meter``): images, training time, data wait."""

    def __init__(self, run, loggers, input_bound_hint: str | None, guard):
        self.guard = guard  # the NaN guard (``training.step.guard``): before a loss is read back
        t = run.config.train
        self.loggers, self.hint = loggers, input_bound_hint  # loggers: ``observe.loggers.fanout.Loggers``
        self.every = t.log_every
        use_bar = run.is_main and (t.progress == "bar" or (t.progress == "auto" and sys.stderr.isatty()))
        self.plain = run.is_main and not use_bar and t.progress != "none"
        self.use_bar, self.bar = use_bar, None
        self.at_log, self.last_window = [0.0, 0.0, 0], (0.0, 0)  # rank-summed totals at the last log line; its window
        self.window = (0.0, 0, 0.0)  # the meter's (train seconds, images, data wait) when the window opened

    def on_train_start(self, run):
        if self.use_bar:
            self.bar = tqdm(total=run.total_steps, initial=run.step, unit="step", dynamic_ncols=True, leave=False)

    def on_epoch_start(self, run):
        m = run.meter
        self.window = (m.train_seconds, m.images, m.data_wait)

    def _end_window(self, run) -> tuple[float, int, float]:
        """Close the window at a log step; its training seconds, images (all ranks) and data wait."""
        m = run.meter
        now = (m.train_seconds, m.images, m.data_wait)
        elapsed, n, wait = (a - b for a, b in zip(now, self.window))
        self.window = now
        return elapsed, n, wait

    def on_step_end(self, run, loss):
        if self.bar is not None:
            self.bar.update(1)
        if run.step % self.every == 0 or run.step == run.total_steps:
            self.guard(run)  # the loss read-back below is this loop's only host sync
            self._log(run)

    def _log(self, run) -> None:
        now = run.meter.read()  # the sync point
        loss_sum, correct, count = (a - b for a, b in zip(now, self.at_log))
        self.at_log[:] = now
        self.last_window = (correct, count)
        elapsed, n, wait = self._end_window(run)
        ips, wait_frac = n / max(elapsed, 1e-9), wait / max(elapsed, 1e-9)
        loss = loss_sum / max(count, 1)
        acc = correct / max(count, 1) if run.meter.classifies else None
        run.train_loss, run.train_accuracy = loss, acc
        shown_acc = f" acc {acc:.4f}" if acc is not None else ""
        extra = run.update_note()
        line = (f"epoch {run.epoch + 1} step {run.step - run.epoch * run.steps_per_epoch}/{run.steps_per_epoch} "
                f"loss {loss:.4f}{shown_acc} lr {run.lr:.4g} {ips:,.0f} img/s{extra}")
        if wait_frac > INPUT_BOUND and self.hint:
            line += f", input-bound: {100 * wait_frac:.0f}% of the time waiting for data ({self.hint})"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}{shown_acc}")
        run.log.info(line, console=self.plain)
        self.loggers.write(kind="train", step=run.step, epoch=round(run.step / run.steps_per_epoch, 4), loss=loss,
                           accuracy=acc, lr=run.lr, images_per_second=round(ips, 1), data_wait_fraction=round(wait_frac, 4))

    def on_validation_end(self, run, r):
        # like with like: the training accuracy of the latest steps (since the last log line, else that
        # line's window), not the epoch's mean, which its first steps drag down
        now = run.meter.read()
        since = [a - b for a, b in zip(now, self.at_log)]
        correct, count = (since[1], since[2]) if since[2] > 0 else self.last_window
        train_acc = correct / max(count, 1) if run.meter.classifies and count else None
        epoch = round(run.step / run.steps_per_epoch, 4)
        hint = None
        if r["accuracy"] is not None and train_acc is not None:
            mixed = run.config.data.mixup > 0 or run.config.data.cutmix > 0  # accuracy on mixed images says little
            hint = fit_hint(train_acc, r["accuracy"]) if count >= MIN_HINT_IMAGES and not mixed else None
            run.log.info(f"epoch {epoch:g} step {run.step} val loss {r['loss']:.4f} acc {r['accuracy']:.4f} "
                         f"top5 {r['top5']:.4f}; train acc {train_acc:.4f} (last {int(count):,} training images"
                         f"{', mixed: against the larger share' if mixed else ''})"
                         + (f"; {hint}" if hint else ""))
        else:
            run.log.info(f"epoch {epoch:g} step {run.step} val loss {r['loss']:.4f}")
        self.loggers.write(kind="val", step=run.step, epoch=epoch, loss=r["loss"], accuracy=r["accuracy"], top5=r["top5"],
                           train_accuracy=train_acc, hint=hint)

    def on_epoch_end(self, run):
        seconds = run.meter.epoch_seconds[-1]  # training, validation and the stop agreement
        epoch = round(run.step / run.steps_per_epoch, 4)
        self.loggers.write(kind="epoch", step=run.step, epoch=epoch, seconds=seconds)
        run.log.info(f"epoch {epoch:g} took {seconds:.1f} s", console=self.plain)

    def on_loop_end(self, run):
        if self.bar is not None:
            self.bar.close()
