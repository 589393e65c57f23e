"""Checkpoints: one owner of what a checkpoint holds, how it is written, verified and restored.

``Checkpoints`` is that owner of the files: ``save(run, metric)`` writes ``step-N.pt`` (and ``best.pt``
when the metric is the best so far) and rotates old steps away; what a checkpoint holds is its trainer's
``state_dict()`` (weights, optimiser, scaler, RNG, callbacks' state, the best metric, the step, the config
and the model's metadata), which the trainer's ``load_state_dict`` puts back; the module's
``find(resume, ...)`` picks the checkpoint a run continues from. The ``Checkpointing`` callback only
decides when.

A checkpoint is a dict of tensors and plain Python values in ``torch.save``'s zip format, written
through ``brickyard.files.write_atomic`` (a temporary beside the target, fsync, rename), so a crash in
the middle of a save never leaves a broken ``step-*.pt``. Reading verifies every member against the
CRC-32 the zip format stores (``torch.load`` does not), so a flipped byte on a disk or in a copy is
refused by name instead of loading as slightly different weights; ``torch.load(weights_only=True)``
refuses any pickled object other than tensors and plain containers, so a checkpoint cannot run code.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

from brickyard import models
from brickyard.config import Config, build, check_resumable
from brickyard.distributed import process as dist
from brickyard.errors import CheckpointError
from brickyard.files import copy_atomic, read_torch, write_torch

_STEP = re.compile(r"^step-(\d+)\.pt$")


def load(path: str | Path, resume: bool = False) -> dict:
    """A brickyard checkpoint, its shape checked (a file from elsewhere is one sentence, never a KeyError
    later); ``resume``: also what continuing a run needs (step, optimiser, RNG state)."""
    state = read_torch(path)
    if isinstance(state, dict) and "model" not in state and isinstance(state.get("state_dict"), dict):
        raise CheckpointError(f"checkpoint {path} holds a 'state_dict' (as Lightning's do), not a brickyard run's; "
                              f"to train from its weights, set finetune.init_from={path}.")
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not a brickyard checkpoint (no 'model' entry).")
    if not isinstance(state["model"], dict) or not all(isinstance(v, torch.Tensor) for v in state["model"].values()):
        raise CheckpointError(f"checkpoint {path} is not a brickyard checkpoint ('model' is not a dict of tensors).")
    for key, kind in (("meta", dict), ("config", dict)):
        if key in state and not isinstance(state[key], kind):
            raise CheckpointError(f"checkpoint {path} has a damaged '{key}' entry ({type(state[key]).__name__}, not a mapping).")
    if resume:
        missing = [k for k in ("step", "optimizer", "rng") if k not in state]
        step = state.get("step")
        if missing or not isinstance(step, int) or isinstance(step, bool) or step < 0:
            what = f"no {', '.join(repr(k) for k in missing)} entry" if missing else f"step {step!r}"
            raise CheckpointError(f"checkpoint {path} cannot be resumed from ({what}); it holds weights only: start a "
                                  f"new run from them with finetune.init_from.")
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
            return path, load(path, resume=True)
        except CheckpointError as e:
            warn(f"{e} Falling back to the previous checkpoint.")
    return None


def check_model(state: dict, model: torch.nn.Module, path: Path, what: str = "checkpoint ") -> None:
    """Raise a ``CheckpointError`` naming the first key or shape that does not fit ``model``; ``what``
    precedes the path (``""`` for an exported file)."""
    own = model.state_dict()
    theirs = state["model"]
    missing = [k for k in own if k not in theirs]
    unexpected = [k for k in theirs if k not in own]
    if missing or unexpected:
        saved = state.get("meta", {}).get("model", "another model")
        raise CheckpointError(
            f"{what}{path} holds {saved}, which does not fit this model: "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}."
        )
    for k, v in own.items():
        if tuple(theirs[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{what}{path}: {k} has shape {tuple(theirs[k].shape)}, the model expects {tuple(v.shape)}.")


class Checkpoints:
    """The one owner of a run's checkpoint files (see the module docstring). Every rank has one; only the
    one with ``write`` (rank 0) touches files. ``state_of()`` is what a checkpoint holds (the trainer's
    ``state_dict``); ``sharded``: every rank gathers it (FSDP), rank 0 writes it; ``saved(path)`` is called
    after each file is written (the trainer records it as ``run.last_checkpoint`` and calls ``on_checkpoint``)."""

    def __init__(self, folder: Path, keep_last: int, keep_best: bool, write: bool, guard=None,
                 state_of: Callable[[], dict] | None = None, sharded: bool = False,
                 saved: Callable[[Path], None] | None = None):
        self.folder, self.keep_last, self.keep_best, self.write = Path(folder), keep_last, keep_best, write
        self.guard = guard            # run -> None, raises on non-finite weights (``training.step.NanGuard``)
        self.state_of, self.sharded, self.saved = state_of, sharded, saved
        self.best_metric: float | None = None
        self.best_step: int | None = None   # the step whose weights best.pt holds

    def restore_check(self, model, config, path: Path, state: dict) -> None:
        """Refuse a ``model`` (the whole model, as a checkpoint holds it) that does not fit, or a ``config`` that
        would change the run (``config.check_resumable``, what ``--resume auto`` checks against ``config.yaml``),
        before anything is put back."""
        check_model(state, model, path)
        if isinstance(state.get("config"), dict):
            check_resumable(state["config"], config, f"the checkpoint {path}")

    # writing

    def improves(self, metric: float) -> bool:
        return self.keep_best and (self.best_metric is None or metric > self.best_metric)

    def save(self, run, metric: float | None = None) -> Path | None:
        """Write ``step-N.pt`` for ``run.step``; when ``metric`` (higher is better) is the best so far, also
        ``best.pt``, with the evaluated weights (EMA's averages where a callback swaps them in). Collective
        under FSDP: every rank calls it. Returns the path written (rank 0), else None."""
        if self.guard is not None:
            self.guard(run)  # no non-finite weights are saved
        sharded = self.sharded
        if not self.write and not sharded:
            return None
        improves = metric is not None and self.write and self.improves(metric)
        if sharded:  # rank 0 keeps the best metric; the others gather what it will write
            improves = dist.broadcast_object(improves)
        best = None
        if improves:
            self.best_metric, self.best_step = metric, run.step  # in the state: a resumed run compares with them
            if run.swaps_eval_weights:
                with run.eval_weights():  # EMA: best.pt holds the averaged weights that were evaluated
                    best = self.state_of()
                    best["model"] = {k: v.detach().clone() for k, v in best["model"].items()}
        state = self.state_of()
        if not self.write:
            return None
        path = self.folder / f"step-{run.step:07d}.pt"
        write_torch(state, path)
        if improves:
            if best is not None:
                write_torch(best, self.folder / "best.pt")
            else:
                copy_atomic(path, self.folder / "best.pt")
        for old in step_checkpoints(self.folder)[:-self.keep_last]:
            old.unlink(missing_ok=True)
        if self.saved is not None:  # the trainer records it as run.last_checkpoint
            self.saved(path)
        return path


def find(resume: str, folder: Path, warn, info) -> tuple[Path, dict] | None:
    """The checkpoint a run continues from: the file ``resume`` names, or for ``auto`` the newest one in
    ``folder`` that verifies, a damaged one named through ``warn`` and skipped."""
    if resume != "auto":
        return Path(resume), load(resume, resume=True)
    found = newest_valid(folder, warn)
    if found is None:
        info(f"no checkpoint in {folder}; starting from scratch")
    return found


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


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
    if "config" not in state:
        raise CheckpointError(f"checkpoint {path} has no 'config' entry: it was not written by brickyard train.")
    cfg = build(state["config"])
    try:
        model = models.create(meta["name"], int(meta["num_classes"]), int(meta["in_channels"]),
                              tuple(int(s) for s in meta["image_size"]),
                              **dict(meta.get("options") or {}))  # the model.* options the run built it with (patch_size)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} has a damaged 'meta' entry ({type(e).__name__}: {e}).") from None
    check_model(state, model, Path(path))
    model.load_state_dict(state["model"])
    return model, state, cfg


def _meta_number(state: dict, path, key: str, default: float, ok, what: str) -> float:
    """``meta[key]`` of a checkpoint (``default`` where none is kept), checked: a stranger's value that is not a
    number ``ok`` takes is one sentence."""
    meta = state.get("meta")
    v = meta.get(key, default) if isinstance(meta, dict) else default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
        raise CheckpointError(f"checkpoint {path}: its {key} {str(v)[:40]} is not {what}.")
    return float(v)


def temperature(state: dict, path) -> float:
    """The temperature ``train.calibrate`` kept in a checkpoint's ``meta`` (1: none kept), checked."""
    return _meta_number(state, path, "temperature", 1.0, lambda t: t > 0, "a positive number")


def threshold(state: dict, path) -> float:
    """The threshold several labels an image are scored at, kept in a checkpoint's ``meta`` (0.5: none kept), checked."""
    return _meta_number(state, path, "threshold", 0.5, lambda t: 0 < t < 1, "a number between 0 and 1")
