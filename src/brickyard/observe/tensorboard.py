"""``tensorboard``: the logger that writes TensorBoard event files into the run directory
(``tensorboard --logdir runs/``), rank 0 only."""
from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from brickyard.files import naming
from brickyard.observe.loggers import QUOTED, Logger, RunInfo

# the scalars each kind of row puts into TensorBoard, under which prefix (a test during training, which carries
# its epoch, is ``test_during``; the final test ``test``)
_SCALARS = {"train": ("train", ("loss", "accuracy", "lr", "images_per_second")),
            "val": ("val", ("loss", "accuracy", "top5", *QUOTED)), "test": ("test", ("loss", "accuracy", "top5", *QUOTED)),
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
    learning rate and images/s at the log steps, validation and test metrics (the test's reliability diagram as an
    image, ``test/reliability``), ``train.watch`` statistics under
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
            from torch.utils.tensorboard.summary import histogram, image, scalar
        except ImportError:
            run.warn("train.tensorboard is on but the tensorboard package is not installed (pip install tensorboard); "
                     "no event files.")
            return
        self.folder, self.proto = Path(run.run_dir), (Event, RecordWriter, scalar, histogram, image)

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
        if kind == "test" and "reliability" in row and self._open():  # the final test's reliability diagram, as a picture
            import numpy as np

            from brickyard.observe.plots import reliability_image
            picture = reliability_image(row)
            if picture is not None:
                self._summaries(row["step"], [self.proto[4]("test/reliability", np.asarray(picture), dataformats="HWC")])

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
