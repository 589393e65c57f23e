"""Ray Train: ``brickyard.fit`` inside a ``TorchTrainer``'s training function.

Ray makes the process group (``ray/train/torch/config.py`` ``_setup_torch_process_group`` calls
``init_process_group`` and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``), and ``fit`` uses it as it
uses any group a user made, and leaves it alone. What Ray needs besides is what this module gives:

- ``RayReport``: a callback that calls ``ray.train.report`` at each epoch's end (and where the loop ends between
  them): the latest validation's numbers (``val_loss``, ``val_accuracy``, ...), ``train_loss``, ``lr``, ``step`` and
  ``epoch``, with the checkpoint brickyard wrote at that step as a Ray ``Checkpoint`` of one file,
  ``checkpoint.pt``. Every rank reports at the same steps (``report`` is a barrier in Ray Train 2: "All workers must
  call ``ray.train.report`` the same number of times", ``ray/train/v2/api/train_fn_utils.py``); rank 0 attaches the
  file, as Ray's own ``RayTrainReportCallback`` for Lightning does (``ray/train/lightning/_lightning_utils.py``,
  which reports at every training epoch's end).
- ``ray_resume()``: the checkpoint to resume from, ``ray.train.get_checkpoint()``'s ``checkpoint.pt``, for
  ``fit(resume=)``: None on a first start, the latest reported one after Ray restarts the workers
  (``FailureConfig(max_failures=...)``) or when a trainer is given ``resume_from_checkpoint``.

Ray is imported only when these are used: ``pip install 'brickyard[ray]'``. docs/distributed.md has the example.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from brickyard.callbacks.base import Callback
from brickyard.errors import BrickyardError

FILE = "checkpoint.pt"  # the brickyard checkpoint inside a Ray checkpoint's directory


def _ray_train():
    """``ray.train``, in a Ray Train worker; one sentence anywhere else."""
    try:
        import ray.train  # here, not at the top: only runs that report to Ray load it
    except ImportError:
        raise BrickyardError("RayReport and ray_resume need Ray Train: pip install 'brickyard[ray]'.") from None
    try:
        ray.train.get_context().get_world_rank()
    except RuntimeError:
        raise BrickyardError("RayReport and ray_resume work inside a Ray Train training function (the function a "
                             "TorchTrainer runs on each worker), not in the script that starts it.") from None
    return ray.train


class RayReport(Callback):
    """Reports to Ray Train at each epoch's end and where the loop ends (see the module docstring). Checkpoints are
    brickyard's (``checkpoint.every_epoch``, ``every_steps``): a report carries the one written at its step, if any."""

    def __init__(self):
        self.train = _ray_train()
        self.reported_at: int | None = None

    def on_epoch_end(self, run):
        self.report(run)

    def on_loop_end(self, run):
        if self.reported_at != run.step:  # the run stopped or reached max_steps between epoch ends
            self.report(run)

    def report(self, run) -> None:
        self.reported_at = run.step
        metrics = {"step": run.step, "epoch": run.step / max(run.steps_per_epoch, 1), "lr": run.lr}
        if run.train_loss is not None:
            metrics["train_loss"] = run.train_loss
        if run.validated_at is not None:
            metrics.update({f"val_{k}": v for k, v in run.metrics.items() if _number(v)})
            metrics["validated_at"] = run.validated_at
        written = run.last_checkpoint
        if not (run.is_main and written is not None and _step_of(written) == run.step):
            self.train.report(metrics)
            return
        folder = Path(tempfile.mkdtemp(prefix=f"brickyard-ray-{run.step}-"))
        try:
            _link_or_copy(written, folder / FILE)
            self.train.report(metrics, checkpoint=self.train.Checkpoint.from_directory(folder),
                              checkpoint_dir_name=f"step-{run.step:07d}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def ray_resume(run_dir=None) -> Iterator[str | None]:
    """``with ray_resume(run_dir) as resume: brickyard.fit(..., run_dir=run_dir, resume=resume)``: where to continue
    from, readable for the ``with`` block. None when Ray has no checkpoint (a first start); else the run's own
    ``step-N.pt`` for the step Ray's latest checkpoint holds when ``run_dir`` still has it (the workers restarted on
    the same machine: the run goes on in its directory), else the copy in Ray's checkpoint (a new machine, a new
    ``run_dir``)."""
    train = _ray_train()
    restored = train.get_checkpoint()
    if restored is None:
        yield None
        return
    with restored.as_directory() as folder:
        path = Path(folder) / FILE
        if not path.is_file():
            raise BrickyardError(f"the Ray checkpoint {restored.path} holds no {FILE}: it was not reported by RayReport.")
        own = Path(run_dir) / "checkpoints" / f"{Path(restored.path).name}.pt" if run_dir else None
        yield str(own) if own is not None and own.is_file() and _same_file(own, path) else str(path)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _step_of(path: Path) -> int | None:
    stem = Path(path).stem
    return int(stem[len("step-"):]) if stem.startswith("step-") and stem[len("step-"):].isdigit() else None


def _same_file(a: Path, b: Path) -> bool:
    """One file (linked), or two of the same size and bytes: the run's own checkpoint and Ray's copy of it."""
    try:
        if os.path.samefile(a, b):
            return True
        if a.stat().st_size != b.stat().st_size:
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    except OSError:
        return False


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)  # the checkpoint as written, without a copy where both sit on one file system
    except OSError:
        shutil.copy2(source, target)
