"""TensorBoard event files in the run directory (``tensorboard --logdir runs/``), rank 0 only.

Without the ``tensorboard`` package the writer is a no-op and says so once. The event file is made at
the first value written, so a run refused before it starts adds nothing to its directory.
"""
from __future__ import annotations

from pathlib import Path


class TBWriter:
    def __init__(self, run_dir: Path | None, enabled: bool, warn):
        self.w, self.make = None, None
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
            self.w, self.make = self.make(), None
        return self.w is not None

    def scalars(self, step: int, prefix: str, values: dict) -> None:
        if not self._open():
            return
        for k, v in values.items():
            if isinstance(v, (int, float)) and v is not None:
                self.w.add_scalar(f"{prefix}/{k}", v, step)

    def histograms(self, step: int, model) -> None:
        if not self._open():
            return
        for name, p in model.named_parameters():
            self.w.add_histogram(f"weights/{name}", p.detach().float().cpu(), step)
            if p.grad is not None:
                self.w.add_histogram(f"grads/{name}", p.grad.detach().float().cpu(), step)

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
            self.w = None
