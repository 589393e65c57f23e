"""One training step, and the three ways a step updates the weights.

``train_step(run, batches)`` runs ``train.grad_accum`` micro-batches forward and backward, syncs the
gradients across ranks (``run.grad_sync``: DDP did it inside the last backward; the flat all-reduce
runs here), and then ``run.update``: ``OptimizerUpdate`` (the optimiser, with the fp16 loss scaler), ``ParameterServerUpdate``
(push gradients, pull parameters) or ``DimReduceUpdate`` (P-BFGS in a subspace). Pass your own
``train_step`` to ``brickyard.fit`` to change the step; it gets the ``Run`` and the batch iterator and
returns the step's mean loss as a tensor.

Host syncs: none on GPUs. The loss and accuracy sums stay on the device (``Totals``); on CPUs, where
reading the loss is not a device sync, the NaN guard reads it every step.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch import nn

from brickyard.training import device as dev
from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError
from brickyard.observe.metrics import is_classification
from brickyard.optim import l1_penalty, set_lr


def make_loss_sum(loss_fn, label_smoothing: float = 0.0):
    """``(outputs, targets) -> summed loss``: cross-entropy by default, else ``loss_fn``'s mean times the batch."""
    if loss_fn is None:
        return lambda out, y: F.cross_entropy(out.float(), y, reduction="sum", label_smoothing=label_smoothing)
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)

    def loss_sum(out, y):
        loss = loss_fn(out, y)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise BrickyardError(f"loss_fn {name} must return the mean loss as a 0-dim tensor; it returned {shape}.")
        return loss.float() * len(y)
    return loss_sum


class Totals:
    """Training loss and correct predictions summed on the device since the process started; the
    sample count is a host integer. ``read()`` is the sync point: one all-reduce of a copy."""

    def __init__(self, device: torch.device, group=None):
        self.loss = torch.zeros((), device=device, dtype=torch.float64)
        self.correct = torch.zeros((), device=device, dtype=torch.float64)
        self.count, self.group, self.classify = 0, group, None

    def add(self, loss_sum: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        self.loss.add_(loss_sum.detach())
        if self.classify is None:
            self.classify = is_classification(out, y)
        if self.classify:
            self.correct.add_((out.detach().argmax(1) == y).sum())
        self.count += len(y)

    def read(self) -> list[float]:
        both = torch.stack([self.loss, self.correct, torch.tensor(float(self.count), dtype=torch.float64, device=self.loss.device)])
        return dist.all_reduce_sum(both, self.group).tolist()


def train_step(run, batches) -> torch.Tensor:
    """Forward and backward over ``train.grad_accum`` micro-batches, then the update; the mean loss of the last."""
    t = run.config.train
    for micro in range(t.grad_accum):
        wait = time.perf_counter()
        x, y, n_global, offset = next(batches)
        run.data_wait += time.perf_counter() - wait
        x = run.prep(x, run.step * t.grad_accum + micro, n_global, offset)
        last = micro == t.grad_accum - 1
        with contextlib.nullcontext() if last else run.grad_sync.skip():
            with dev.autocast(run.device, run.precision):
                out = run.forward(x)
                loss_sum = run.loss_sum(out, y)
            if run.check_each_step and not torch.isfinite(loss_sum):
                raise_nonfinite(run, x, y)
            # sum / global batch, times the world size because DDP averages over ranks:
            # the gradient is the exact mean over all samples, also for a short last batch
            loss = loss_sum * (run.data_world / (n_global * t.grad_accum))
            if run.config.optim.l1:
                loss = loss + run.config.optim.l1 / t.grad_accum * l1_penalty(run.optimizer.param_groups)
            run.scaler.scale(loss).backward()
        run.totals.add(loss_sum, out, y)
    run.grad_sync()
    run.batch = (x, y, n_global)
    run.callbacks.on_before_update(run)
    run.lr = run.schedule(run.step)
    set_lr(run.optimizer, run.lr)
    if t.grad_clip:
        run.scaler.unscale_(run.optimizer)
        nn.utils.clip_grad_norm_([p for g in run.optimizer.param_groups for p in g["params"]], t.grad_clip)
    run.update(run, loss_sum)
    run.grad_sync.zero_grad(run.optimizer)
    return loss_sum.detach() / len(y)


def raise_nonfinite(run, x, y):
    from brickyard.observe.inspection import first_nonfinite
    where = first_nonfinite(run.model, x, y, run.loss_sum)
    kept = (f"the newest checkpoint ({run.last_checkpoint}) holds the last good weights" if run.last_checkpoint
            else "no checkpoint was written yet")
    raise BrickyardError(f"training loss became non-finite at step {run.step}; first non-finite: {where}; "
                         f"{kept} (lower optim.lr or set train.grad_clip).")


def guard(run) -> None:
    """Stop on a non-finite loss before anything is saved (a host sync; log and save steps only)."""
    if run.config.train.nan_guard and run.batch and not torch.isfinite(run.totals.loss).item():
        raise_nonfinite(run, *run.batch[:2])


class Update:
    """An update strategy: ``__call__(run, loss_sum)`` changes the weights from the gradients in them.
    The rest have defaults: no state to checkpoint, nothing to add to the log line, nothing to end."""

    def __call__(self, run, loss_sum) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> str:
        return ""

    def finish(self) -> None:
        pass


class OptimizerUpdate(Update):
    """The optimiser's step, through the loss scaler (a no-op unless fp16)."""

    def __call__(self, run, loss_sum) -> None:
        run.scaler.step(run.optimizer)
        run.scaler.update()


class ParameterServerUpdate(Update):
    """Push this trainer's gradient to the servers and pull the new parameters (``brickyard.distributed.parameter_server``)."""

    def __init__(self, client):
        self.client = client

    def __call__(self, run, loss_sum) -> None:
        self.client.step(run.lr, run.step)

    def finish(self) -> None:
        self.client.finish()


class DimReduceUpdate(Update):
    """Stage 2 of dimension-reduction training: P-BFGS in the subspace (``brickyard.boost.dim_reduce.DimReduce``)."""

    def __init__(self, booster):
        self.booster = booster

    def __call__(self, run, loss_sum) -> None:
        from brickyard.boost import dim_reduce as boost
        x, y, n_global = run.batch
        # the method needs the loss on the host every step: one scalar all-reduce
        loss0 = float(dist.all_reduce_sum(loss_sum.detach().double().reshape(1), run.group)) / n_global
        trial = boost.make_trial_loss(run.model, x, y, n_global, run.loss_sum,
                                      lambda: dev.autocast(run.device, run.precision), run.group)
        self.booster.step(loss0, trial)

    def describe(self) -> str:
        return f", subspace steps that passed the Armijo test {self.booster.accepted}/{self.booster.steps}"

    def state_dict(self) -> dict | None:
        return self.booster.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.booster.load_state_dict(state)
