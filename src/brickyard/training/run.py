"""``Run``: one process's run as its trainer keeps it; ``RunView``: what a callback sees of it (read-only but
``lr_scale``); a training step sees it through its ``StepContext`` (``training.step``); ``Meter``: what the loop
measures.

``Run``'s fields are the public contract (documented in ``docs/extending.md`` and kept stable). The parts
of a run are the trainer's (``training.trainer.Trainer``), and so are the fields: the trainer sets them
(``train_loss`` and ``train_accuracy`` at log steps, ``metrics`` at evaluations, ``last_checkpoint``, ...). What a
callback may ask of the trainer goes through ``Run``'s methods (``stop``, ``use_eval_weights``), and what callbacks
hand to each other goes through the logs or a documented field (``train_loss``, ``lr_scale``, ``metrics``).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from brickyard.config import Config
from brickyard.data.bundle import DataBundle
from brickyard.distributed.process import Stop
from brickyard.errors import BrickyardError


@dataclass(frozen=True, eq=False)
class StepResult:
    """What one optimiser step returns to the loop (``training.step.optimizer_step``)."""
    loss: torch.Tensor                # the step's mean loss (of its last micro-batch), 0-dim, on the device
    batch: tuple                      # (x, y) of its last micro-batch: what the NaN guard searches
    images: int                       # samples it trained on, all ranks
    data_wait: float                  # seconds it waited for batches


class Meter:
    """What the loop measures as it trains, read by the reports (``training.report``, the summary). The loop
    owns it: it adds every step's result and runs the clock during the steps only (validation, the test
    and the stop agreement stay out of ``train_seconds``). Callbacks read it; ``read()`` is a sync point."""

    def __init__(self, totals):
        self.totals = totals              # loss and accuracy sums on the device (``training.step.Totals``)
        self.images = 0                   # samples trained on since this process started, all ranks
        self.data_wait = 0.0              # seconds waiting for batches, likewise
        self.epoch_seconds: list[float] = []  # each epoch's wall time: training, validation and the stop agreement
        self.last_batch: tuple = ()       # (x, y) of the latest micro-batch
        self._done, self._since, self._epoch_start = 0.0, None, 0.0

    def start_epoch(self) -> None:
        self._epoch_start = self._since = time.perf_counter()

    def add(self, result: StepResult) -> None:
        self.images += result.images
        self.data_wait += result.data_wait
        self.last_batch = result.batch

    def pause(self) -> None:
        if self._since is not None:
            self._done += time.perf_counter() - self._since
            self._since = None

    def end_epoch(self) -> None:
        self.pause()
        self.epoch_seconds.append(round(time.perf_counter() - self._epoch_start, 3))

    @property
    def train_seconds(self) -> float:
        return self._done + (time.perf_counter() - self._since if self._since is not None else 0.0)

    @property
    def classifies(self) -> bool:
        """Whether the outputs are class scores (the accuracy means something)."""
        return bool(self.totals.classify)

    def read(self) -> list[float]:
        """(loss sum, correct, samples) since the start, summed over the ranks: one all-reduce, a host sync."""
        return self.totals.read()


class Control:
    """What a run's callbacks may ask of the trainer that owns it, through ``Run``'s methods: a stop (the
    trainer reads ``request`` after every step and sets ``agreed`` once the ranks agree), the loss and the
    update's note. The trainer makes it; ``Run`` holds it privately."""

    def __init__(self, loss_sum: Callable, describe: Callable[[], str], stops_early: bool = True,
                 recompute_bn: Callable[[], bool] = lambda: False):
        self.loss_sum, self.describe, self.stops_early = loss_sum, describe, stops_early
        self.recompute_bn = recompute_bn
        self.request: Stop | None = None  # this process's stop, until the ranks agree on one
        self.agreed: Stop | None = None   # the agreed ``Stop`` (its reason is ``Run.stopped``)


@dataclass(eq=False)
class Run:
    """One process's run, as a callback or a ``train_step`` sees it. Every field is documented and kept
    stable; brickyard's own parts are the trainer's."""
    config: Config                    # the resolved, frozen config
    model: nn.Module                  # the model being trained (never the DDP wrapper)
    optimizer: torch.optim.Optimizer
    data: DataBundle                  #: train/val/test splits, classes, num_classes
    rank: int
    world_size: int
    device: torch.device
    precision: str                    # fp32, bf16 or fp16
    run_dir: Path
    log: logging.LoggerAdapter        # rank-aware: ``run.log.info("...")`` ("brickyard.run" logger)
    steps_per_epoch: int
    total_steps: int
    forward: nn.Module | None = None  # the model as trained (DDP-wrapped, compiled): call this in a step
    planned_steps: int = 0            # the steps the schedule spans (train.epochs); total_steps is where this run stops
    step: int = 0                     # optimiser steps taken
    epoch: int = 0                    # the epoch being trained (step // steps_per_epoch)
    lr: float = 0.0                   # the learning rate of the latest step
    lr_scale: float = 1.0             # multiplies the schedule's rate from the next step on (``ReduceLROnPlateau``)
    lr_override: float | None = None  # the rate of the next steps instead of the schedule's (``SWA``'s); None: the schedule's
    train_loss: float | None = None   # the training loss of the latest log window
    train_accuracy: float | None = None  # its accuracy (class logits only)
    metrics: dict = field(default_factory=dict)   # the latest evaluation: loss, accuracy, top5, ...
    validated_at: int | None = None   # the step of the latest validation (``metrics``)
    last_checkpoint: Path | None = None
    stopped: str | None = None        # the agreed cause once the loop is ending (``stop``, a signal)
    meter: Meter | None = None        # what the loop measured: images, time, data wait, the loss totals
    _control: Control | None = field(default=None, repr=False)
    _eval_weights: Callable[[], ContextManager] | None = field(default=None, repr=False)

    def stop(self, reason: str = "a callback") -> None:
        """End training after this step on every rank, with a checkpoint, the test evaluation and the summary."""
        if not self._control.stops_early:
            raise BrickyardError(f"{reason} asked to stop early, but a synchronous parameter-server run cannot stop "
                                 f"before its last step yet; use dist.mode: collective.")
        if self._control.request is None:
            self._control.request = Stop("request", reason)

    def compute_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The run's loss (``loss_fn``, else cross-entropy with ``optim.label_smoothing``): the mean over the batch."""
        return self._control.loss_sum(outputs, targets) / len(targets)

    def use_eval_weights(self, swap: Callable[[], ContextManager] | None) -> None:
        """Evaluate (validation, test, ``best.pt``) inside ``swap()``, e.g. EMA's averaged weights; None: the raw weights."""
        self._eval_weights = swap

    def eval_weights(self) -> ContextManager:
        """The weights evaluations use, swapped in for the ``with`` block."""
        return self._eval_weights() if self._eval_weights is not None else contextlib.nullcontext()

    @property
    def swaps_eval_weights(self) -> bool:
        return self._eval_weights is not None

    def recompute_bn(self) -> bool:
        """Recompute batch norm's running statistics for the weights the model holds now, with one pass over the
        training data (``torch.optim.swa_utils.update_bn``; every rank calls it). False: the model has none."""
        return self._control.recompute_bn()

    def update_note(self) -> str:
        """What the update strategy adds to a log line (a parameter server's wait, P-BFGS's steps); '' for an optimiser."""
        return self._control.describe()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def interrupted(self) -> bool:
        """Stopped by a signal (SIGINT, SIGTERM): the command ends with exit code 130."""
        return self._control.agreed is not None and self._control.agreed.kind == "signal"


WRITABLE = ("lr_scale", "lr_override")  # the fields a callback may set (``ReduceLROnPlateau``, ``SWA``)
_INSTEAD = {"lr": "set run.lr_scale, which multiplies the schedule's rate from the next step on, or run.lr_override",
            "stopped": "call run.stop(reason)", "forward": "wrap the model before fit", "model": "wrap the model before fit",
            "optimizer": "use schedule.name: none and a scheduler of your own on run.optimizer"}


class RunView:
    """A callback's view of the ``Run``: every field, property and method reads as on the run, and a name a step or
    callback kept on the run reads through too. Setting one of the run's own fields (or methods) raises
    ``AttributeError`` naming it and what to do instead: the trainer owns them. ``lr_scale`` is the one field a
    callback sets; ``stop()`` and ``use_eval_weights()`` are how it asks for the rest. A name the run does not have
    (a value of the user's own, as a ``train_step`` keeps one) is set on the run, as before; a callback's own state
    belongs on the callback (``self.x``), where ``state_dict`` can save it."""

    __slots__ = ("_run",)

    def __init__(self, run: Run):
        object.__setattr__(self, "_run", run)

    def __getattr__(self, name):
        if name.startswith("__") or name in RunView.__slots__:  # copy and pickle ask before __init__ ran
            raise AttributeError(name)
        return getattr(self._run, name)

    def __setattr__(self, name, value):
        if name in RunView.__slots__:
            object.__setattr__(self, name, value)
            return
        _check_writable(name)
        setattr(self._run, name, value)

    def __delattr__(self, name):
        _check_writable(name)
        delattr(self._run, name)

    def __repr__(self) -> str:
        return f"RunView({self._run!r})"


def _check_writable(name: str) -> None:
    """Nothing for ``WRITABLE`` and for names that are none of ``Run``'s; else the sentence."""
    if name in WRITABLE or not (hasattr(Run, name) or name in Run.__dataclass_fields__):
        return
    instead = _INSTEAD.get(name, f"keep a value of your own on the callback (self.{name.lstrip('_')})")
    raise AttributeError(f"run.{name} is read-only in a callback (the trainer sets it); {instead}")
