"""``Run``: what a callback, the step and the loop see of one process's run.

The attributes above the line in ``Run`` are the public contract (documented in the README and
kept stable); those below are the parts the loop is built from, open to read, free to change.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from brickyard.errors import BrickyardError


@dataclass(eq=False)
class Run:
    config: Any                       # the resolved, frozen Config
    model: nn.Module                  # the model being trained (never the DDP wrapper)
    optimizer: Any                    # brickyard.optim.Optimizer (or a torch.optim one): param_groups, step, state_dict
    rank: int
    world_size: int
    device: torch.device
    precision: str
    run_dir: Path
    log: Any                          # the rank-aware Logger: run.log.info("...")
    steps_per_epoch: int
    total_steps: int
    step: int = 0                     # optimiser steps taken
    epoch: int = 0                    # the epoch being trained (step // steps_per_epoch)
    lr: float = 0.0                   # the learning rate of the latest step
    train_loss: float | None = None   # the training loss of the latest log window
    metrics: dict = field(default_factory=dict)   # the latest evaluation: loss, accuracy, top5, ...
    last_checkpoint: Path | None = None
    eval_weights: Callable = contextlib.nullcontext  # EMA swaps its averaged weights in here
    # ---- the parts the loop is built from ----------------------------------------------------
    forward: nn.Module | None = None  # the model as trained (DDP-wrapped, compiled)
    grad_sync: Any = None             # how the ranks' gradients meet (``gradsync.GradSync``): skip(), (), zero_grad()
    data: Any = None
    data_world: int = 1               # processes that read data (trainers in parameter-server mode)
    group: Any = None                 # their process group (None: all ranks)
    prep: Any = None                  # raw batch -> device tensor (normalise, augment, layout)
    loss_sum: Callable | None = None  # (outputs, targets) -> summed loss, a 0-dim float tensor
    scaler: Any = None
    schedule: Any = None
    update: Any = None                # the update strategy: optimiser, parameter server or P-BFGS
    train_step: Callable | None = None
    loader: Any = None
    vote: Any = None                  # the ranks' agreement on a stop step (``dist.StopVote``)
    totals: Any = None
    callbacks: Any = None
    stop_request: str | None = None   # a reason, until the ranks agree on it
    stopped: str | None = None        # the agreed cause once the loop is ending
    data_wait: float = 0.0            # seconds waiting for batches in the current log window
    batch: tuple = ()                 # (x, y, n_global) of the latest micro-batch
    check_each_step: bool = False     # the NaN guard reads the loss every step (CPUs: no device sync)
    extras: dict = field(default_factory=dict)

    def stop(self, reason: str = "a callback") -> None:
        """End training after this step on every rank, with a checkpoint, the test evaluation and the summary."""
        if self.config.dist.mode == "ps" and self.config.dist.ps.sync:
            raise BrickyardError(f"{reason} asked to stop early, but a synchronous parameter-server run cannot stop "
                                 f"before its last step yet; use dist.mode: collective.")
        if self.stop_request is None:
            self.stop_request = reason

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def interrupted(self) -> bool:
        """Stopped by a signal (SIGINT, SIGTERM): the command ends with exit code 130."""
        return bool(self.stopped) and self.stopped.startswith("SIG")
