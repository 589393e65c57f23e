"""``Run``: what a callback and a training step see of one process's run; ``Engine``: the parts the
loop is built from.

``Run``'s fields are the public contract (documented in ``docs/extending.md`` and kept stable). The
engine (``run._engine``) is brickyard's own: open to read, free to change between versions; what one
of brickyard's behaviours hands to another is a typed field there, never an untyped dict.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from brickyard.distributed.process import Stop
from brickyard.errors import BrickyardError


@dataclass(eq=False)
class Request:
    """What ``training.loop.train`` was asked to do: the config, model and data, where, and the user's code."""
    config: Any
    model: nn.Module
    data: Any
    run_dir: Path | None = None
    resume: str | None = None
    meta: dict = field(default_factory=dict)   # the model's name and registry flag, saved in checkpoints
    info: Any = None                           # this process's place in the job (``DistInfo``)
    log_dir: Path | None = None
    callbacks: list = field(default_factory=list)
    loss_fn: Callable | None = None
    train_step: Callable | None = None
    started: float = 0.0                       # time.perf_counter() when train() began (the summary's wall time)
    rss_at_start_mb: float = 0.0               # resident memory then (the summary's peak is above it)
    vote: Any = None                           # the run's ``StopVote`` once built: where an error one rank met is left


@dataclass(frozen=True, eq=False)
class StepResult:
    """What one optimiser step returns to the loop (``training.step.optimizer_step``)."""
    loss: torch.Tensor                # the step's mean loss (of its last micro-batch), 0-dim, on the device
    batch: tuple                      # (x, y) of its last micro-batch: what the NaN guard searches
    images: int                       # samples it trained on, all ranks
    data_wait: float                  # seconds it waited for batches


class Meter:
    """What the loop measures as it trains, read by the reports (``ProgressLog``, the summary). The loop
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


@dataclass(eq=False)
class Engine:
    """brickyard's parts of a run: set up by ``training.setup``, used by the loop, the step and brickyard's
    own callbacks. Not a user contract."""
    data_world: int = 1               # processes that read data (trainers in parameter-server mode)
    group: Any = None                 # their process group (None: all ranks)
    info: Any = None                  # this process's place in the job (``distributed.process.DistInfo``)
    host: Any = None                  # device, threads and pinning (``training.device.Host``)
    meta: dict = field(default_factory=dict)  # the model's name and registry flag, saved in checkpoints
    channels_last: bool = False
    peak_lr: float = 0.0
    groups: list = field(default_factory=list)  # the optimiser's parameter groups as built
    prep: Any = None                  # raw batch -> device tensor (normalise, augment, layout)
    loss_sum: Callable | None = None  # (outputs, targets) -> summed loss, a 0-dim float tensor
    eval_loss_sum: Callable | None = None  # the same for validation and test: no label smoothing, so they read
    # as `brickyard eval` reads a checkpoint; as timm does (train.py at 004fb5f, main(), the "setup loss function"
    # block: LabelSmoothingCrossEntropy to train when --smoothing, validate_loss_fn = nn.CrossEntropyLoss())
    scaler: Any = None                # torch.amp.GradScaler (a no-op unless fp16)
    schedule: Any = None              # step -> learning rate
    update: Any = None                # the update strategy (``training.updates.Update``)
    step_fn: Callable | None = None   # the user's ``train_step(run, batch)``, or brickyard's
    grad_sync: Any = None             # how the ranks' gradients meet (``distributed.gradsync.GradSync``)
    loader: Any = None
    vote: Any = None                  # the ranks' agreement on a stop step (``distributed.process.StopVote``)
    callbacks: Any = None             # ``callbacks.base.CallbackList``
    checkpoints: Any = None           # ``training.checkpoint.Checkpoints``: what is saved, how it is restored
    stop_request: Any = None          # this process's ``distributed.process.Stop``, until the ranks agree on one
    stop: Any = None                  # the agreed ``Stop`` (its reason is ``Run.stopped``)
    check_each_step: bool = False     # the NaN guard reads the loss every step (CPUs: no device sync)
    rss_at_start_mb: float = 0.0      # resident memory when train() began (the summary's peak is above it)
    sharded: bool = False             # FSDP: saving and evaluating are collectives every rank takes part in
    compiled: bool = False            # train.compile resolved: run.forward is torch.compile(model)
    backward_done: bool = False       # the step called ``run.backward`` itself
    batch_weight: float = 1.0         # local batch / global batch x ranks / accumulation: mean loss -> gradient weight


@dataclass(eq=False)
class Run:
    """One process's run, as a callback or a ``train_step`` sees it. Every field is documented and kept
    stable; brickyard's own parts live in ``_engine``."""
    config: Any                       # the resolved, frozen ``Config``
    model: nn.Module                  # the model being trained (never the DDP wrapper)
    optimizer: torch.optim.Optimizer
    data: Any                         # ``brickyard.data.DataBundle``: train/val/test splits, classes, num_classes
    rank: int
    world_size: int
    device: torch.device
    precision: str                    # fp32, bf16 or fp16
    run_dir: Path
    log: logging.LoggerAdapter        # rank-aware: ``run.log.info("...")`` ("brickyard.run" logger)
    steps_per_epoch: int
    total_steps: int
    forward: nn.Module | None = None  # the model as trained (DDP-wrapped, compiled): call this in a step
    step: int = 0                     # optimiser steps taken
    epoch: int = 0                    # the epoch being trained (step // steps_per_epoch)
    lr: float = 0.0                   # the learning rate of the latest step
    lr_scale: float = 1.0             # multiplies the schedule's rate from the next step on (``ReduceLROnPlateau``)
    train_loss: float | None = None   # the training loss of the latest log window
    train_accuracy: float | None = None  # its accuracy (class logits only)
    metrics: dict = field(default_factory=dict)   # the latest evaluation: loss, accuracy, top5, ...
    validated_at: int | None = None   # the step of the latest validation (``metrics``)
    last_checkpoint: Path | None = None
    stopped: str | None = None        # the agreed cause once the loop is ending (``stop``, a signal)
    meter: Meter | None = None        # what the loop measured: images, time, data wait, the loss totals
    _engine: Engine = field(default_factory=Engine, repr=False)
    _eval_weights: Callable[[], ContextManager] | None = field(default=None, repr=False)

    def stop(self, reason: str = "a callback") -> None:
        """End training after this step on every rank, with a checkpoint, the test evaluation and the summary."""
        if self.config.dist.mode == "ps" and self.config.dist.ps.sync:
            raise BrickyardError(f"{reason} asked to stop early, but a synchronous parameter-server run cannot stop "
                                 f"before its last step yet; use dist.mode: collective.")
        if self._engine.stop_request is None:
            self._engine.stop_request = Stop("request", reason)

    def compute_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The run's loss (``loss_fn``, else cross-entropy with ``optim.label_smoothing``): the mean over the batch."""
        return self._engine.loss_sum(outputs, targets) / len(targets)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the loss scaler, for a step that calls it itself (several losses, several
        backward passes). ``loss`` is the mean over this process's batch; brickyard weighs it so that the
        gradient is the exact mean over the global batch and the accumulation steps. A step that does
        not call it returns its loss and brickyard calls it."""
        e = self._engine
        e.backward_done = True
        e.scaler.scale(loss * e.batch_weight).backward()

    def use_eval_weights(self, swap: Callable[[], ContextManager] | None) -> None:
        """Evaluate (validation, test, ``best.pt``) inside ``swap()``, e.g. EMA's averaged weights; None: the raw weights."""
        self._eval_weights = swap

    def eval_weights(self) -> ContextManager:
        """The weights evaluations use, swapped in for the ``with`` block."""
        return self._eval_weights() if self._eval_weights is not None else contextlib.nullcontext()

    @property
    def swaps_eval_weights(self) -> bool:
        return self._eval_weights is not None

    def update_note(self) -> str:
        """What the update strategy adds to a log line (a parameter server's wait, P-BFGS's steps); '' for an optimiser."""
        return self._engine.update.describe()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def interrupted(self) -> bool:
        """Stopped by a signal (SIGINT, SIGTERM): the command ends with exit code 130."""
        return self._engine.stop is not None and self._engine.stop.kind == "signal"
