"""Checkpoints: written atomically, loaded without executing code, validated against the model.

A checkpoint is a dict of tensors and plain Python values, saved with ``torch.save`` to a
temporary file in the same folder, fsync'd and renamed over the target, so a crash in the middle
of a save never leaves a broken ``step-*.pt``. ``torch.load(weights_only=True)`` refuses any
pickled object other than tensors and plain containers, so a checkpoint cannot run code.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch

from brickyard import models
from brickyard.config import Config, build
from brickyard.errors import CheckpointError

_STEP = re.compile(r"^step-(\d+)\.pt$")


def save_atomic(state: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read(path: str | Path, what: str = "checkpoint"):
    """A file written by ``torch.save`` (weights only, on the CPU); a missing, foreign or damaged
    file is a ``CheckpointError`` sentence that calls it ``what``."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist.")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{what} {path} cannot be read: it is not a file written by torch.save "
                              f"(another format, or cut short).")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  any unpickling failure means a bad file
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()] or [type(e).__name__]
        # torch's weights-only refusal says what it met on a line of its own
        reason = next((x for x in lines if "unsupported" in x.lower()), lines[0])
        raise CheckpointError(f"{what} {path} cannot be read ({reason[:160]}).") from None


def load(path: str | Path) -> dict:
    state = read(path)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not a brickyard checkpoint (no 'model' entry).")
    return state


def step_checkpoints(folder: Path) -> list[Path]:
    """``step-*.pt`` files in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name))]
    return [p for _, p in sorted(found)]


def newest_valid(folder: Path, warn) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; a broken one is reported through ``warn`` and skipped."""
    for path in reversed(step_checkpoints(folder)):
        try:
            return path, load(path)
        except CheckpointError as e:
            warn(f"{e} Falling back to the previous checkpoint.")
    return None


def check_model(state: dict, model: torch.nn.Module, path: Path) -> None:
    """Raise a ``CheckpointError`` naming the first key or shape that does not fit ``model``."""
    own = model.state_dict()
    theirs = state["model"]
    missing = [k for k in own if k not in theirs]
    unexpected = [k for k in theirs if k not in own]
    if missing or unexpected:
        saved = state.get("meta", {}).get("model", "another model")
        raise CheckpointError(
            f"checkpoint {path} holds {saved}, which does not fit this model: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}."
        )
    for k, v in own.items():
        if tuple(theirs[k].shape) != tuple(v.shape):
            raise CheckpointError(f"checkpoint {path}: {k} has shape {tuple(theirs[k].shape)}, the model expects {tuple(v.shape)}.")


class CheckpointManager:
    """Saves ``step-N.pt`` files, keeps the last ``keep_last`` and a copy of the best as ``best.pt``."""

    def __init__(self, folder: Path, keep_last: int, keep_best: bool):
        self.folder, self.keep_last, self.keep_best = folder, keep_last, keep_best
        self.best_metric: float | None = None

    def improves(self, metric: float) -> bool:
        return self.keep_best and (self.best_metric is None or metric > self.best_metric)

    def save(self, state: dict, step: int, metric: float | None = None, best_state: dict | None = None) -> Path:
        """Write ``step-N.pt``; when ``metric`` is the best so far, also ``best.pt`` (``best_state`` if
        given, e.g. averaged weights, else a copy of the step's file). Call ``improves`` and record the
        metric in ``state`` first, so the saved ``best_metric`` includes this one."""
        path = self.folder / f"step-{step:07d}.pt"
        save_atomic(state, path)
        if metric is not None and self.keep_best and (self.best_metric is None or metric >= self.best_metric):
            self.best_metric = metric
            if best_state is not None:
                save_atomic(best_state, self.folder / "best.pt")
            else:
                tmp = self.folder / ".best.pt.tmp"
                shutil.copyfile(path, tmp)
                os.replace(tmp, self.folder / "best.pt")
        for old in step_checkpoints(self.folder)[:-self.keep_last]:
            old.unlink(missing_ok=True)
        return path


def pick(path: Path) -> Path:
    """A run directory (or its ``checkpoints/``) stands for its ``best.pt``, else its newest step."""
    path = Path(path)
    if not path.is_dir():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if (folder / "best.pt").is_file():
        return folder / "best.pt"
    steps = step_checkpoints(folder)
    if not steps:
        raise CheckpointError(f"{path} is a folder with no checkpoint (best.pt or step-N.pt) in it.")
    return steps[-1]


def load_model(path) -> tuple[torch.nn.Module, dict, Config]:
    """Rebuild a registry model from a brickyard checkpoint (a file or a run directory); returns
    (model, state, config)."""
    path = pick(Path(path))
    state = load(path)
    meta = state.get("meta", {})
    if not meta.get("registry"):
        raise CheckpointError(f"checkpoint {path} holds a user model ({meta.get('name')}); rebuild it in Python and load state['model'].")
    cfg = build(state["config"])
    model = models.create(meta["name"], meta["num_classes"], meta["in_channels"], tuple(meta["image_size"]),
                          **meta.get("options", {}))  # the model.* options the run built it with (patch_size)
    check_model(state, model, Path(path))
    model.load_state_dict(state["model"])
    return model, state, cfg
