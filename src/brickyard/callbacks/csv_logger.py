"""``CSVLogger``: one CSV row per validation, as a callback (``CSVLogger("val.csv")``); ``train.loggers: [csv]``
is the ``csv`` logger (``brickyard.observe.loggers.files.CSV``), which writes the same columns from the rows."""
from __future__ import annotations

import time
from pathlib import Path

from brickyard.callbacks.base import Callback
from brickyard.files import naming
from brickyard.observe.loggers.files import open_csv


class CSVLogger(Callback):
    """One CSV row per validation: step, epoch, learning rate, training loss and the validation metrics.
    Written by rank 0, flushed after each row; a resumed run appends, after dropping the rows past the step it
    resumes from (and a line cut by a crash). A relative
    ``path`` is taken in the run directory."""

    COLUMNS = ("step", "epoch", "lr", "train_loss", "val_loss", "val_accuracy", "val_top5", "seconds")

    def __init__(self, path="metrics.csv"):
        self.path, self.f, self.writer = Path(path), None, None

    def on_train_start(self, run):
        if run.rank != 0:
            return
        self.path = self.path if self.path.is_absolute() else Path(run.run_dir) / self.path
        self.f, self.writer = open_csv(self.path, run.step, self.COLUMNS)
        self.start = time.perf_counter()

    def on_validation_end(self, run, metrics):
        if self.writer is None:
            return
        with naming(self.path):
            self.writer.writerow([run.step, round(run.step / run.steps_per_epoch, 4), run.lr, run.train_loss,
                                  metrics.get("loss"), metrics.get("accuracy"), metrics.get("top5"),
                                  round(time.perf_counter() - self.start, 3)])

    def on_train_end(self, run, summary):
        if self.f is not None:
            self.f.close()
            self.f = None

