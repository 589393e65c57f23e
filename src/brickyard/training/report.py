"""``Report``: the rows the trainer writes at its moments, from what the loop measured (``training.run.Meter``).

- ``train`` at each log step (every ``train.log_every`` steps and the last): the window since the previous one,
  its mean loss and accuracy (read back from the device: the loop's only host sync), its images a second (all
  ranks) and the share of its time spent waiting for batches, with a ``hint`` where that share is above
  ``INPUT_BOUND`` and more loader workers would help, and the update's ``note`` where it has one;
- ``val`` at each validation: its metrics, the training accuracy of the steps since the last log step (else that
  log step's window) over ``train_images`` images, and a ``hint`` at over- or under-fitting where there is reason;
- ``epoch`` at each epoch's end: its wall time.

Every logger gets the same row (``observe.loggers``): the console's lines, ``metrics.jsonl``, TensorBoard and the
trackers read the same numbers.
"""
from __future__ import annotations

from brickyard.observe.loggers import QUOTED
from brickyard.observe.metrics import fit_hint

INPUT_BOUND = 0.2  # a log window spending more than this fraction waiting for batches is reported as input-bound
MIN_HINT_IMAGES = 500  # fewer recent training images than this say too little to hint at over- or under-fitting


class Report:
    """Windows over the meter: ``open_window`` at each epoch's start, then one row per moment. ``input_bound_hint``:
    what to try when a window is input-bound (None: nothing to try, e.g. the data already sits in memory)."""

    def __init__(self, meter, input_bound_hint: str | None):
        self.meter, self.hint = meter, input_bound_hint
        self.at_log, self.last_window = [0.0, 0.0, 0.0], (0.0, 0.0)  # rank-summed totals at the last log step; its window
        self.window = (0.0, 0, 0.0)  # the meter's (train seconds, images, data wait) when the window opened

    def open_window(self) -> None:
        m = self.meter
        self.window = (m.train_seconds, m.images, m.data_wait)

    def _end_window(self) -> tuple[float, int, float]:
        """Close the window; its training seconds, images (all ranks) and data wait."""
        m = self.meter
        now = (m.train_seconds, m.images, m.data_wait)
        elapsed, n, wait = (a - b for a, b in zip(now, self.window))
        self.window = now
        return elapsed, n, wait

    def train(self, run) -> dict:
        """The ``train`` row of a log step (a host sync: one all-reduce, every rank)."""
        now = self.meter.read()
        loss_sum, correct, count = (a - b for a, b in zip(now, self.at_log))
        self.at_log[:] = now
        self.last_window = (correct, count)
        elapsed, n, wait = self._end_window()
        ips, wait_frac = n / max(elapsed, 1e-9), wait / max(elapsed, 1e-9)
        loss = loss_sum / max(count, 1)
        acc = correct / max(count, 1) if self.meter.classifies else None
        row = dict(kind="train", step=run.step, epoch=round(run.step / run.steps_per_epoch, 4), loss=loss, accuracy=acc,
                   lr=run.lr, images_per_second=round(ips, 1), data_wait_fraction=round(wait_frac, 4))
        note = run.update_note()
        if note:
            row["note"] = note
        if wait_frac > INPUT_BOUND and self.hint:
            row["hint"] = f"input-bound: {100 * wait_frac:.0f}% of the time waiting for data ({self.hint})"
        return row

    def val(self, run, r: dict) -> dict:
        """The ``val`` row of a validation whose metrics are ``r`` (a host sync: one all-reduce, every rank)."""
        # like with like: the training accuracy of the latest steps (since the last log step, else that step's
        # window), not the epoch's mean, which its first steps drag down
        now = self.meter.read()
        since = [a - b for a, b in zip(now, self.at_log)]
        correct, count = (since[1], since[2]) if since[2] > 0 else self.last_window
        train_acc = correct / max(count, 1) if self.meter.classifies and count else None
        hint = None
        if r["accuracy"] is not None and train_acc is not None:
            mixed = run.config.data.mixup > 0 or run.config.data.cutmix > 0  # accuracy on mixed images says little
            hint = fit_hint(train_acc, r["accuracy"]) if count >= MIN_HINT_IMAGES and not mixed else None
        return dict(kind="val", step=run.step, epoch=round(run.step / run.steps_per_epoch, 4), loss=r["loss"],
                    accuracy=r["accuracy"], top5=r["top5"], **{k: r[k] for k in QUOTED if k in r},
                    train_accuracy=train_acc, hint=hint, train_images=int(count))

    def epoch(self, run) -> dict:
        """The ``epoch`` row of an epoch's end: its wall time (training, validation and the stop agreement)."""
        return dict(kind="epoch", step=run.step, epoch=round(run.step / run.steps_per_epoch, 4),
                    seconds=self.meter.epoch_seconds[-1])
