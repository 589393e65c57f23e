"""TensorBoard event files in the run directory (``tensorboard --logdir runs/``), rank 0 only.

Without the ``tensorboard`` package the writer is a no-op and says so once. The event file is made at
the first value written, so a run refused before it starts adds nothing to its directory.
"""
from __future__ import annotations

import threading
from pathlib import Path

from brickyard.files import naming


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
