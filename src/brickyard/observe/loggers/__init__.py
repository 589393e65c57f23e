"""Loggers: the one door metrics leave a run by.

Every metric brickyard reports is one **row**, a dict with ``kind`` (``start``, ``train``, ``val``, ``test``,
``epoch``, ``watch``, ``dim_reduce``, ``summary``), ``step``, ``time`` and the values; ``metrics.jsonl`` holds
each row as one line. ``Loggers`` (``fanout``) hands every row to every logger of the run, at the same moments:
the run's start, every ``train.log_every`` steps, each validation's end, each epoch's end, each test, the end of
training and the summary. The numbers of a log step's ``train`` row (the window's loss, accuracy, images/s, wait
for data) are the trainer's, computed once (``training.report``). Built in, by the name ``train.loggers`` takes:
``jsonl`` (``metrics.jsonl``) and ``console`` (the progress lines in the run's log and, as ``train.progress``
says, on the terminal: ``observe.loggers.console``), both always on, ``csv`` (``metrics.csv``), ``tensorboard``,
``mlflow``, ``wandb``.

A user's logger is a ``Logger`` subclass, added either way:
- an instance passed to ``brickyard.fit(..., loggers=[MyLogger()])``;
- a class in the user's own installed package, under the entry-point group ``brickyard.loggers``
  (``[project.entry-points."brickyard.loggers"] mine = "mypkg.logs:MyLogger"``), then ``--set
  train.loggers=[mine]`` from the CLI, with no change to brickyard. ``names()`` lists the built-ins and these.

Loggers run on rank 0 only, as Lightning's do (``rank_zero_only``); ``console`` runs on every rank, each writing
its own ``logs/workerlog.N``.

The interface follows Lightning's ``Logger`` ABC (``src/lightning/fabric/loggers/logger.py`` at 0a6ba10, lines
28-100: ``log_hyperparams`` 69-78, ``log_metrics`` 58-67, ``finalize`` 93-100) and Keras's single ``logs`` dict
that its loop hands every callback, TensorBoard and CSV alike (``keras/src/callbacks/callback.py`` at 045cebd,
lines 42-66). Where it differs: one ``log(row)`` takes the whole row, kind included, instead of a flat
name-to-number dict per call, so ``metrics.jsonl`` is itself a logger and every logger sees exactly what it
writes; hyperparameters come with ``start``, once, beside the run directory and the step a resume picks up from;
and a logger that talks to a server declares a time bound (``timeout_s``) that the fan-out holds it to, on a
thread of its own, where Lightning's loggers run inline and a stalled server stalls training.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from brickyard.errors import ConfigError, reason

# the class scores a validation's and a test's rows carry besides loss and accuracy (``observe.metrics.class_scores``;
# higher is better): what TensorBoard and the trackers plot of them
SCORES = ("precision_macro", "recall_macro", "f1_macro", "f1_weighted", "balanced_accuracy")
# and how far their probabilities can be trusted (``observe.calibration``; lower ECE is better): the expected
# calibration error, and with temperature scaling (``train.calibrate``) the temperature and the raw logits' ECE
CALIBRATION = ("ece", "ece_uncalibrated", "temperature")
# several labels an image (``observe.multilabel``): mean average precision, micro scores at the chosen threshold
MULTILABEL = ("map", "map_micro", "f1_micro", "precision_micro", "recall_micro", "threshold")
QUOTED = SCORES + CALIBRATION + MULTILABEL  # every number a validation or test row adds to loss, accuracy and top-5

__all__ = ["Logger", "RunInfo", "names", "choices", "check", "create", "GROUP"]

GROUP = "brickyard.loggers"  # the entry-point group a user's package registers its loggers under

# the built-ins: name -> (module, class, the package it needs or None); imported when a run asks for one, so
# that listing them (the config's check) imports neither torch nor a tracker's client
_BUILTIN = {
    "jsonl": ("brickyard.observe.loggers.files", "JSONL", None),
    "console": ("brickyard.observe.loggers.console", "Console", None),
    "tensorboard": ("brickyard.observe.tensorboard", "TensorBoard", None),  # missing package: a warning, no files
    "csv": ("brickyard.observe.loggers.files", "CSV", None),
    "mlflow": ("brickyard.observe.loggers.trackers", "MLflow", "mlflow"),
    "wandb": ("brickyard.observe.loggers.trackers", "Wandb", "wandb"),
}
# on in every run: metrics.jsonl marks a directory as a run's, and a resume reads it back; the console's lines are
# the run's log (train.progress decides what of them the terminal shows)
ALWAYS = ("jsonl", "console")


@dataclass(frozen=True)
class RunInfo:
    """What a logger is started with, once, before the run's first row."""
    run_dir: Path                 # the run directory (its files: config.yaml, metrics.jsonl, checkpoints/, ...)
    config: dict                  # the resolved config as plain nested values (``Config.to_dict()``)
    step: int = 0                 # the step training starts from: 0, or where a resume picks up (rows past it are gone)
    world_size: int = 1
    warn: Callable[[str], None] = field(default=print, repr=False)  # the run's log: one line, at warning level
    rank: int = 0                 # this process's (loggers run on rank 0; ``console`` on every rank)

    @property
    def hyperparameters(self) -> dict:
        """The config flattened to dotted keys (``optim.lr``); lists as JSON text, as trackers take them."""
        return flatten(self.config)


class Logger(ABC):
    """Where a run's rows go. Subclass it and implement ``log``; ``start`` and ``finish`` are optional.

    Contract:
    - ``start(run)`` once, before any row; an exception there ends the run in one sentence before anything is
      written to the run directory (a wrong address or id is a setting to fix, not a metric to lose).
    - ``log(row)`` for every row, in order, at the moments the module docstring lists. The row is shared: read it,
      do not change it. Rows from a resumed run continue at ``run.step + 1``.
    - ``log_histograms(step, tensors)``: weight and gradient histograms (``train.histograms_every``), CPU tensors
      named ``weights/NAME`` and ``grads/NAME``; built only when some logger overrides it.
    - ``progress(step, ended)``: after every optimiser step, and once with ``ended`` when the loop ends (before the
      test evaluation): a display's cue (``console``'s bar), no row; called only where a logger overrides it.
    - ``finish(ok)`` once at the end: ``ok`` False after a failure or a stop by a signal.
    - ``essential``: an exception out of ``log`` ends the run (brickyard's own files: a full disk must not go
      unsaid). Otherwise the logger is dropped with one warning and training goes on.
    - ``timeout_s``: None runs the logger inline, in the training thread. A number runs it on a thread of its own:
      ``log`` never waits for it, and a call that takes longer than that many seconds drops it with one warning.
      ``start`` and a finished run's ``finish`` (uploads) get ``start_timeout_s`` (default: the same); ``finish``
      after a failure or a signal gets 2 s, so a stop is never held up. ``BRICKYARD_LOGGER_TIMEOUT_S`` overrides
      both for every such logger.
    """

    name: str = ""                  # the name it was chosen by (``train.loggers``); else its class's name
    essential: bool = False
    timeout_s: float | None = None
    start_timeout_s: float | None = None

    def start(self, run: RunInfo) -> None:  # noqa: B027  optional, unlike log
        """Called once before the first row."""

    @abstractmethod
    def log(self, row: dict) -> None:
        """One row: ``{"kind": ..., "step": ..., "time": ..., values}``."""

    def log_histograms(self, step: int, tensors: dict) -> None:  # noqa: B027  optional, unlike log
        """Weight and gradient histograms at ``step`` (``train.histograms_every``); most loggers ignore them."""

    def progress(self, step: int, ended: bool = False) -> None:  # noqa: B027  optional, unlike log
        """After every optimiser step (``step``: the steps taken), and with ``ended`` once the loop is over."""

    def finish(self, ok: bool) -> None:  # noqa: B027  optional, unlike log
        """Called once at the end; ``ok`` False after a failure or a stop by a signal."""


def flatten(d: dict, prefix: str = "") -> dict:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim.lr": 0.1}``; lists and tuples as JSON text."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


def _entry_points() -> dict:
    """The ``brickyard.loggers`` entry points of the installed packages, by name (the first of a name wins)."""
    found: dict = {}
    for ep in importlib.metadata.entry_points(group=GROUP):
        found.setdefault(ep.name, ep)
    return found


def names() -> list[str]:
    """Every name ``train.loggers`` takes: the built-ins, then the installed packages' entry points (a built-in's
    name is the built-in's)."""
    return list(_BUILTIN) + sorted(set(_entry_points()) - set(_BUILTIN))


def choices() -> list[str]:
    """The names an unknown name's sentence lists: ``names()`` but those always on."""
    return [n for n in names() if n not in ALWAYS]


def check(chosen: Iterable[str]) -> None:
    """One sentence for a name no built-in or installed package has, or a built-in whose package is missing;
    imports nothing of the loggers themselves. ``jsonl`` is always on and may be named or not."""
    chosen = list(chosen)
    known = set(names()) if any(n not in _BUILTIN for n in chosen) else set(_BUILTIN)  # entry points: only when asked
    for name in chosen:
        if name not in known:
            raise ConfigError(f"train.loggers: {name!r} is not one of {', '.join(choices())}.")
    for name in chosen:
        needs = _BUILTIN.get(name, (None, None, None))[2]
        if needs and importlib.util.find_spec(needs) is None:
            raise ConfigError(f"train.loggers: {name} needs the {needs} package: pip install 'brickyard[{name}]'.")


def create(name: str) -> Logger:
    """A new logger of that name: a built-in, else the entry point's class (called with no arguments)."""
    if name in _BUILTIN:
        module, cls, _ = _BUILTIN[name]
        made = getattr(importlib.import_module(module), cls)()
    else:
        ep = _entry_points().get(name)
        if ep is None:
            check([name])  # the sentence for an unknown name
        try:
            made = ep.load()()
        except Exception as e:  # noqa: BLE001  the user's package: its own reason, in one sentence
            raise ConfigError(f"train.loggers: {name} (entry point {ep.value} of group {GROUP}) could not be "
                              f"made: {reason(e, 240, joined=True)}") from None
        if not callable(getattr(made, "log", None)):
            raise ConfigError(f"train.loggers: {name} (entry point {ep.value}) made a {type(made).__name__}, which "
                              f"has no log(row) method; subclass brickyard.observe.loggers.Logger.")
    made.name = name
    return made
