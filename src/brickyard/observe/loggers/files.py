"""The loggers that write files into the run directory: ``jsonl`` (``metrics.jsonl``) and ``csv``
(``metrics.csv``). Both are ``essential``: a write that fails (a full disk) ends the run, naming the file."""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from brickyard.files import naming, write_atomic
from brickyard.observe.loggers import Logger, RunInfo


class JSONL(Logger):
    """Appends every row to ``metrics.jsonl`` (rank 0) as one JSON object a line, flushed line by line, so a crash
    loses at most the line being written. A ``start`` row waits for the first row of the run's own (a logged step,
    an evaluation), and the file is opened then: a run that fails before it has anything to say leaves no
    ``metrics.jsonl``, which marks a directory as holding a run and would block the next start."""

    essential = True

    def __init__(self, path: Path | None = None):
        self.path, self.f, self.pending = path, None, []

    def start(self, run: RunInfo) -> None:
        self.path = self.path or Path(run.run_dir) / "metrics.jsonl"

    def log(self, row: dict) -> None:
        if self.path is None:
            return
        if row.get("kind") == "start":
            self.pending.append(row)
            return
        with naming(self.path):
            if self.f is None:
                self.f = open(self.path, "a", buffering=1)
            for r in self.pending + [row]:
                self.f.write(json.dumps(r) + "\n")
        self.pending = []

    def finish(self, ok: bool) -> None:
        if self.f:
            f, self.f = self.f, None
            with naming(self.path):
                f.close()



def open_csv(path: Path, step: int, columns) -> tuple:
    """``path`` opened to append rows (line-buffered), after the rows past ``step`` of a resumed run are dropped;
    the header written where the file is new. Returns (file, ``csv.writer``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if step and path.is_file():
        drop_rows_after(path, step)  # a resumed run trains those steps again
    new = not path.exists() or path.stat().st_size == 0
    f = open(path, "a", newline="", buffering=1)
    writer = csv.writer(f)
    if new:
        writer.writerow(columns)
    return f, writer

class CSV(Logger):
    """One CSV row per validation: step, epoch, learning rate and training loss of the latest log step (empty
    before the first), the validation metrics and the seconds since the run's first row (its ``start``). Flushed
    after each row; a resumed run appends, after dropping the rows past the step it resumes from (and a line cut by
    a crash). A relative ``path`` is taken in the run directory."""

    essential = True
    COLUMNS = ("step", "epoch", "lr", "train_loss", "val_loss", "val_accuracy", "val_top5", "seconds")

    def __init__(self, path: str | Path = "metrics.csv"):
        self.path, self.f, self.writer = Path(path), None, None
        self.lr = self.train_loss = None

    def start(self, run: RunInfo) -> None:
        self.path = self.path if self.path.is_absolute() else Path(run.run_dir) / self.path
        self.step = run.step

    def _open(self) -> None:
        """At the run's first row (its ``start``): a start refused before then leaves no file."""
        self.f, self.writer = open_csv(self.path, self.step, self.COLUMNS)
        self.started = time.perf_counter()

    def log(self, row: dict) -> None:
        if self.f is None:
            with naming(self.path):
                self._open()
        if row.get("kind") == "train":
            self.lr, self.train_loss = row.get("lr"), row.get("loss")
        elif row.get("kind") == "val":
            with naming(self.path):
                self.writer.writerow([row["step"], row.get("epoch"), self.lr, self.train_loss, row.get("loss"),
                                      row.get("accuracy"), row.get("top5"), round(time.perf_counter() - self.started, 3)])

    def finish(self, ok: bool) -> None:
        if self.f is not None:
            f, self.f, self.writer = self.f, None, None
            f.close()


def drop_rows_after(path: Path, step: int) -> None:
    """Keep the header and the rows of ``step`` or before (a resume trains the later ones again)."""
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    keep = lines[:1] + [x for x in lines[1:] if x.endswith("\n") and _step(x) is not None and _step(x) <= step]
    if keep != lines:
        write_atomic(path, "".join(keep))


def _step(line: str) -> int | None:
    try:
        return int(line.split(",", 1)[0])
    except ValueError:
        return None
