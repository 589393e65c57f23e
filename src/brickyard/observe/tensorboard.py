"""TensorBoard event files in the run directory (``tensorboard --logdir runs/``), rank 0 only.

Without the ``tensorboard`` package the writer is a no-op and says so once. The event file is made at
the first value written, so a run refused before it starts adds nothing to its directory.
"""
from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from pathlib import Path

from brickyard.files import naming
from brickyard.observe.loggers import Logger, RunInfo


class TBWriter:
    def __init__(self, run_dir: Path | None, enabled: bool, warn):
        self.w, self.make, self.path, self._hook = None, None, run_dir, None
        if not (enabled and run_dir is not None):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency (brickyard[viz])
        except ImportError:
            warn("train.tensorboard is on but the tensorboard package is not installed (pip install tensorboard); no event files.")
            return
        self.make = lambda: SummaryWriter(log_dir=str(run_dir))

    def _open(self) -> bool:
        if self.w is None and self.make is not None:
            with naming(self.path):
                self.w, self.make = self.make(), None
            self.path = Path(getattr(getattr(self.w.file_writer, "event_writer", None), "_file_name", self.path))
            self._quiet_writer_thread()
        return self.w is not None

    def _quiet_writer_thread(self) -> None:
        """TensorBoard writes from a thread of its own; a failed write (a full disk) ends that thread with a
        traceback on stderr, then the next value written raises the same error here, where the run says it
        in one line. Until ``close``, that thread's ``OSError`` is left to that one line."""
        previous = threading.excepthook

        def hook(args):
            if not (isinstance(args.exc_value, OSError) and "tensorboard" in type(args.thread).__module__):
                previous(args)
        threading.excepthook, self._hook = hook, previous

    def scalars(self, step: int, prefix: str, values: dict) -> None:
        if not self._open():
            return
        with naming(self.path):
            for k, v in values.items():
                if isinstance(v, (int, float)) and v is not None:
                    self.w.add_scalar(f"{prefix}/{k}", v, step)

    def histograms(self, step: int, model) -> None:
        if not self._open():
            return
        with naming(self.path):
            for name, p in model.named_parameters():
                self.w.add_histogram(f"weights/{name}", p.detach().float().cpu(), step)
                if p.grad is not None:
                    self.w.add_histogram(f"grads/{name}", p.grad.detach().float().cpu(), step)

    def close(self) -> None:
        try:
            if self.w is not None:
                w, self.w = self.w, None
                with naming(self.path):
                    w.close()
        finally:
            if self._hook is not None:
                threading.excepthook, self._hook = self._hook, None


# the scalars each kind of row puts into TensorBoard, under which prefix (a test during training, which carries
# its epoch, is ``test_during``; the final test ``test``)
_SCALARS = {"train": ("train", ("loss", "accuracy", "lr", "images_per_second")),
            "val": ("val", ("loss", "accuracy", "top5")), "test": ("test", ("loss", "accuracy", "top5")),
            "test_during": ("test_during", ("loss", "accuracy"))}
_files = itertools.count()


def _tensorflow_bins() -> list[float]:
    """The bucket edges ``SummaryWriter.add_histogram``'s default ``bins="tensorflow"`` stands for (its
    ``default_bins``: 1e-12 up to 1e20 by factors of 1.1, mirrored below zero)."""
    v, buckets = 1e-12, []
    while v < 1e20:
        buckets.append(v)
        v *= 1.1
    return [-b for b in reversed(buckets)] + [0] + buckets


class TensorBoard(Logger):
    """``tensorboard``: an event file in the run directory (``tensorboard --logdir runs/``): train loss, accuracy,
    learning rate and images/s at the log steps, validation and test metrics, ``train.watch`` statistics under
    ``watch/LAYER``, and weight and gradient histograms (``train.histograms_every``).

    The events are written by this thread, as rows come, into a file flushed after each row: a failed write (a
    full disk) is raised here, naming the file, where ``SummaryWriter``'s writer thread printed a traceback of its
    own first (brickyard quieted it by replacing ``threading.excepthook`` for the whole process). The records are
    the ones ``SummaryWriter.add_scalar`` and ``add_histogram`` write: torch's summary protos in tensorboard's
    record framing, file name and first event. Without the ``tensorboard`` package it writes nothing and says so
    once. The file is made at the first value written, so a run refused before it starts adds nothing."""

    essential = True

    def __init__(self):
        self.folder, self.path, self.f, self.records, self.proto = None, None, None, None, None

    def start(self, run: RunInfo) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event  # optional dependency (brickyard[viz])
            from tensorboard.summary.writer.record_writer import RecordWriter
            from torch.utils.tensorboard.summary import histogram, scalar
        except ImportError:
            run.warn("train.tensorboard is on but the tensorboard package is not installed (pip install tensorboard); "
                     "no event files.")
            return
        self.folder, self.proto = Path(run.run_dir), (Event, RecordWriter, scalar, histogram)

    def _open(self) -> bool:
        if self.records is None and self.folder is not None:
            Event, RecordWriter = self.proto[:2]
            self.path = self.folder / (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                                       f"{os.getpid()}.{next(_files)}")
            with naming(self.path):
                self.folder.mkdir(parents=True, exist_ok=True)
                self.f = open(self.path, "wb")
                self.records = RecordWriter(self.f)
                self._event(Event(wall_time=time.time(), file_version="brain.Event:2"))
        return self.records is not None

    def _event(self, event) -> None:
        self.records.write(event.SerializeToString())

    def _summaries(self, step: int, summaries) -> None:
        Event = self.proto[0]
        with naming(self.path):
            for s in summaries:
                self._event(Event(wall_time=time.time(), step=int(step), summary=s))
            self.f.flush()

    def log(self, row: dict) -> None:
        kind = "test_during" if row.get("kind") == "test" and "epoch" in row else row.get("kind")
        if kind == "watch":
            scalars = [(f"watch/{name}/{k}", v) for name, found in row.get("layers", {}).items() for k, v in found.items()]
        elif kind in _SCALARS:
            prefix, keys = _SCALARS[kind]
            scalars = [(f"{prefix}/{k}", row.get(k)) for k in keys]
        else:
            return
        scalars = [(tag, v) for tag, v in scalars if isinstance(v, (int, float))]
        if scalars and self._open():
            scalar = self.proto[2]
            self._summaries(row["step"], [scalar(tag, v) for tag, v in scalars])

    def log_histograms(self, step: int, tensors: dict) -> None:
        if tensors and self._open():
            histogram = self.proto[3]
            bins = _tensorflow_bins()
            self._summaries(step, [histogram(tag, t, bins) for tag, t in tensors.items()])

    def finish(self, ok: bool) -> None:
        if self.f is not None:
            f, self.f, self.records = self.f, None, None
            with naming(self.path):
                f.close()
