"""``console``: the run's progress lines, a logger like the others (always on).

From the rows it is handed it writes the lines a run has always printed: at each log step the training window
(``epoch 1 step 60/196 loss 1.0088 acc 0.8165 lr 2.436e-05 448 img/s``, with the update's note and the
input-bound hint where the row has them), at each validation its metrics against the recent training accuracy,
and at each epoch's end its time. They are records of the ``brickyard.run`` logger, so they go to the rank's
``logs/workerlog.N`` (rank 0: also ``train.log``) whatever ``train.progress`` says; ``train.progress`` decides the
terminal only: ``plain`` prints the lines, ``bar`` a tqdm bar on stderr (advanced every step through
``progress``) with the loss as its postfix, ``none`` neither, ``auto`` a bar where stderr is a terminal, else
lines. The validation line goes to the terminal in every mode, ``none`` included, as it always has.

It runs on every rank (each rank's log file has its own lines: its own wait for data), the other loggers on rank 0
only; the numbers are the trainer's (``training.report``), computed once and handed to every logger alike.
"""
from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from brickyard.observe.loggers import Logger, RunInfo

_RECORDS = logging.getLogger("brickyard.run")  # what ``run.log`` writes to (``observe.logs``)


class Console(Logger):
    """The progress lines of a run (see the module docstring)."""

    name = "console"

    def __init__(self):
        self.rank, self.bar, self.plain, self.use_bar, self.mixed = 0, None, False, False, False
        self.steps_per_epoch = 1

    def start(self, run: RunInfo) -> None:
        t, d = run.config.get("train", {}), run.config.get("data", {})
        progress = t.get("progress", "auto")
        self.rank = run.rank
        main = run.rank == 0
        self.use_bar = main and (progress == "bar" or (progress == "auto" and sys.stderr.isatty()))
        self.plain = main and not self.use_bar and progress != "none"
        self.mixed = (d.get("mixup") or 0) > 0 or (d.get("cutmix") or 0) > 0  # accuracy on mixed images says little

    def _say(self, line: str, console: bool = True) -> None:
        _RECORDS.info(line, extra={"rank": self.rank, "console": console})

    def log(self, row: dict) -> None:
        kind = row.get("kind")
        if kind == "start":
            self.steps_per_epoch = row.get("steps_per_epoch") or 1
            if self.use_bar and self.bar is None:
                self.bar = tqdm(total=row.get("total_steps"), initial=row.get("step", 0), unit="step", dynamic_ncols=True,
                                leave=False)
        elif kind == "train":
            self._train(row)
        elif kind == "val":
            self._val(row)
        elif kind == "epoch":
            self._say(f"epoch {row['epoch']:g} took {row['seconds']:.1f} s", console=self.plain)

    def _train(self, row: dict) -> None:
        step, per_epoch = row["step"], self.steps_per_epoch
        epoch = (step - 1) // per_epoch  # the epoch being trained when the window closed
        acc = row.get("accuracy")
        shown_acc = f" acc {acc:.4f}" if acc is not None else ""
        line = (f"epoch {epoch + 1} step {step - epoch * per_epoch}/{per_epoch} loss {row['loss']:.4f}{shown_acc} "
                f"lr {row['lr']:.4g} {row['images_per_second']:,.0f} img/s{row.get('note', '')}")
        if row.get("hint"):
            line += f", {row['hint']}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {row['loss']:.4f}{shown_acc}")
        self._say(line, console=self.plain)

    def _val(self, row: dict) -> None:
        head = f"epoch {row['epoch']:g} step {row['step']} val loss {row['loss']:.4f}"
        if row.get("map") is not None:  # several labels an image
            head += f" mAP {row['map']:.4f} F1 {row['f1_micro']:.4f} at {row['threshold']:g}"
        train_acc = row.get("train_accuracy")
        if row.get("accuracy") is None or train_acc is None:
            self._say(head)
            return
        hint = row.get("hint")
        self._say(f"{head} acc {row['accuracy']:.4f} top5 {row['top5']:.4f}; train acc {train_acc:.4f} (last "
                  f"{int(row['train_images']):,} training images{', mixed: against the larger share' if self.mixed else ''})"
                  + (f"; {hint}" if hint else ""))

    def progress(self, step: int, ended: bool = False) -> None:
        if self.bar is None:
            return
        if ended:
            self._close()
        else:
            self.bar.update(step - self.bar.n)

    def _close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.close()

    def finish(self, ok: bool) -> None:
        self._close()  # a run that failed mid-loop leaves no bar behind
