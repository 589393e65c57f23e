"""One optimiser step: the user's (or brickyard's) ``train_step`` on each micro-batch, then everything around it.

The contract of a step (``fit(..., train_step=...)``)::

    def train_step(run, batch):          # batch: (inputs, targets), on the device, normalised and augmented
        inputs, targets = batch
        outputs = run.forward(inputs)    # the model as trained (DDP-wrapped, compiled)
        return run.compute_loss(outputs, targets), outputs   # the mean loss; outputs are optional

``run`` there is the step's ``StepContext``: the run's fields read through (``run.step``, ``run.config``,
``run.model``, ...) and what the step needs of its trainer: ``forward``, ``compute_loss`` and ``backward``.

The step runs under autocast for ``train.precision``. brickyard then calls the backward pass (unless
the step called ``run.backward(loss)`` itself), weighing the mean so that the gradient is the exact
mean over the global batch and the accumulation micro-batches, also for a short last batch and for
ranks with uneven shares. Around the micro-batches brickyard does the rest, the same for every step:
gradient sync across ranks (DDP or the flat all-reduce), the NaN guard, training loss and accuracy
totals, the learning rate, ``on_before_update``, gradient clipping, the update (optimiser with the
fp16 loss scaler, parameter server, P-BFGS) and zeroing the gradients.

Host syncs: none on GPUs. The loss and accuracy sums stay on the device (``Totals``); on CPUs, where
reading the loss is not a device sync, the NaN guard reads it every step.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from brickyard.data.augment import DROP_PATH, draw_seed
from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError, ConfigError, DataError, reason, user_code_error
from brickyard.models import droppath
from brickyard.observe.inspection import first_nonfinite
from brickyard.observe.metrics import class_targets, cross_entropy_targets, is_classification
from brickyard.observe.multilabel import bce_sum
from brickyard.optim import l1_penalty, set_lr
from brickyard.training import device as dev
from brickyard.training.run import Run, StepResult


def make_loss_sum(loss_fn, label_smoothing: float = 0.0, class_weights: torch.Tensor | None = None):
    """``(outputs, targets) -> summed loss``: cross-entropy by default, else ``loss_fn``'s mean times the batch.
    ``class_weights`` (``optim.class_weights`` on the run's device, one a class) multiply each sample's cross-entropy, label smoothing
    included, by its class's weight, as Keras's ``class_weight`` does: ``class_weight_to_sample_weights`` in
    keras/src/trainers/data_adapters/data_adapter_utils.py (commit 0349fba) gives a sample the weight of its class,
    the argmax of a row of probabilities, and its "sum_over_batch_size" reduction divides the weighted sum by the
    batch (``reduce_values`` in keras/src/losses/loss.py), as the step divides this sum. (torch's own ``weight=``
    weighs the smoothing term class by class and its mean divides by the weights' sum: not Keras's loss.)"""
    if loss_fn is None:
        def cross_entropy_sum(out, y):
            t = cross_entropy_targets(out, y)
            try:
                if class_weights is not None:
                    each = F.cross_entropy(out.float(), t, reduction="none", label_smoothing=label_smoothing)
                    return (each * class_weights[t if t.dim() == 1 else t.argmax(1)]).sum()
                return F.cross_entropy(out.float(), t, reduction="sum", label_smoothing=label_smoothing)
            except IndexError as e:  # "Target -1 is out of bounds." (CPUs; CUDA stops at a device assert instead)
                raise DataError(outside_classes(out, y)) from e
            except RuntimeError as e:  # targets of another shape or type than cross-entropy takes
                if isinstance(e, torch.OutOfMemoryError) or (t.shape == out.shape and t.is_floating_point()) or (
                        t.dim() == 1 and len(t) == len(out) and not t.is_floating_point()):
                    raise  # targets of a form it takes: the error is another's
                raise DataError(f"the default cross-entropy takes class indices (N) or rows of class probabilities "
                                f"(N x C) for outputs N x C; a batch has outputs {tuple(out.shape)} and targets "
                                f"{tuple(y.shape)} of {str(y.dtype).replace('torch.', '')} ({reason(e)}); fix the labels "
                                f"or pass loss_fn.") from e
        return cross_entropy_sum
    name = getattr(loss_fn, "__name__", type(loss_fn).__name__)

    def loss_sum(out, y):
        try:
            loss = loss_fn(out, y)
        except (BrickyardError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # noqa: BLE001  the user's code keeps its traceback
            raise user_code_error(f"loss_fn {name}", e) from e
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise BrickyardError(f"loss_fn {name} must return the mean loss as a 0-dim tensor; it returned {shape}.")
        return loss.float() * len(y)
    return loss_sum


class Losses:
    """The run's two loss sums: ``train`` (label smoothing and class weights) and ``eval`` (neither, so
    validation and test read as `brickyard eval` reads a checkpoint; as timm does: train.py at 004fb5f,
    main(), the "setup loss function" block: LabelSmoothingCrossEntropy to train when --smoothing,
    validate_loss_fn = nn.CrossEntropyLoss()). Several labels an image (``data.task: multilabel``): binary
    cross-entropy (``observe.multilabel.bce_sum``) for both."""

    def __init__(self, loss_fn, optim, device: torch.device, multilabel: bool = False):
        weights = torch.tensor(optim.class_weights, dtype=torch.float32, device=device) if optim.class_weights else None
        if multilabel and loss_fn is None:  # binary cross-entropy, class weights weigh each tag's positives
            self.train, self.eval = partial(bce_sum, pos_weight=weights), bce_sum
            return
        self.train = make_loss_sum(loss_fn, optim.label_smoothing, weights)
        self.eval = make_loss_sum(loss_fn)


def check_class_weights(weights, num_classes: int, own_loss: str | None) -> None:
    """``optim.class_weights`` that cannot weigh this run's loss: one sentence, before anything is written (each
    weight is a finite number of 0 or more by then: ``config.checks.cross_check``)."""
    if not weights:
        return
    if own_loss:
        raise ConfigError(f"optim.class_weights weigh the default cross-entropy and this run has its own {own_loss}; "
                          f"weigh the classes inside it.")
    if len(weights) != num_classes:
        raise ConfigError(f"optim.class_weights has {len(weights)} weights and the data has {num_classes} classes; "
                          f"give one a class.")


def outside_classes(out: torch.Tensor, y: torch.Tensor) -> str:
    """The sentence for a batch whose class labels the model's outputs do not cover."""
    classes = out.shape[1] if out.dim() >= 2 else 1
    bad = y[(y < 0) | (y >= classes)]
    label = int(bad[0]) if bad.numel() else "?"
    return (f"a batch holds label {label}, outside the model's {classes} classes 0..{classes - 1}: fix the "
            "labels (Hugging Face marks unlabelled items -1) or widen the model's output.")


class Totals:
    """Training loss and correct predictions summed on the device since the process started; the
    sample count is a host integer. ``read()`` is the sync point: one all-reduce of a copy."""

    def __init__(self, device: torch.device, group=None, classify: bool | None = None):
        self.loss = torch.zeros((), device=device, dtype=torch.float64)
        self.correct = torch.zeros((), device=device, dtype=torch.float64)
        self.count, self.group, self.classify = 0, group, classify  # None: decided by the first batch

    def add(self, loss_sum: torch.Tensor, out: torch.Tensor | None, y: torch.Tensor) -> None:
        self.add_on_device(loss_sum, out, y)
        self.count += len(y)

    def add_on_device(self, loss_sum: torch.Tensor, out: torch.Tensor | None, y: torch.Tensor) -> None:
        """The sums alone, without the host's count (what a captured step replays: ``training.graphs``)."""
        self.loss.add_(loss_sum.detach())
        if self.classify is None:
            self.classify = out is not None and is_classification(out, y)
        if self.classify and out is not None:  # one-hot rows, mixed targets: against the largest share
            self.correct.add_((out.detach().argmax(1) == class_targets(y)).sum())

    def read(self) -> list[float]:
        both = torch.stack([self.loss, self.correct, torch.tensor(float(self.count), dtype=torch.float64, device=self.loss.device)])
        return dist.all_reduce_sum(both, self.group).tolist()


class StepContext:
    """What a ``train_step`` gets as ``run``, made for one micro-batch: the run's fields, read through, and
    ``forward``, ``compute_loss`` and ``backward``. ``batch_weight`` turns the batch's mean loss into its share
    of the gradient (local batch / global batch x ranks / accumulation)."""

    __slots__ = ("run", "batch_weight", "backward_done", "_loss_sum", "_scaler")

    def __init__(self, run: Run, loss_sum, scaler, batch_weight: float):
        self.run, self.batch_weight, self.backward_done = run, batch_weight, False
        self._loss_sum, self._scaler = loss_sum, scaler

    def __getattr__(self, name):  # the run's fields and methods: step, config, model, device, log, ...
        if name.startswith("__") or name in StepContext.__slots__:  # copy and pickle ask before __init__ ran
            raise AttributeError(name)
        return getattr(self.run, name)

    def __setattr__(self, name, value):  # what a step keeps on ``run`` outlives the step, as it did on the Run
        if name in StepContext.__slots__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.run, name, value)

    @property
    def forward(self) -> nn.Module:
        return self.run.forward

    def compute_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The run's loss (``loss_fn``, else cross-entropy with ``optim.label_smoothing``): the mean over the batch."""
        return self._loss_sum(outputs, targets) / len(targets)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward through the loss scaler, for a step that calls it itself (several losses, several
        backward passes). ``loss`` is the mean over this process's batch; brickyard weighs it so that the
        gradient is the exact mean over the global batch and the accumulation steps. A step that does
        not call it returns its loss and brickyard calls it."""
        self.backward_done = True
        self._scaler.scale(loss * self.batch_weight).backward()


def default_step(run, batch):
    """brickyard's own step: the forward pass and the run's loss (written to the contract above)."""
    x, y = batch
    out = run.forward(x)
    return run.compute_loss(out, y), out


def optimizer_step(trainer, batches) -> StepResult:
    """Micro-batches through the step, then sync, guard, learning rate, hooks, clipping and the update;
    returns what the step measured: its mean loss (of the last micro-batch, a 0-dim tensor on the device),
    that batch, the samples trained on and the time spent waiting for data. The loss sums go to the
    meter's totals. ``trainer``: the ``training.trainer.Trainer`` whose parts the step uses."""
    run, t = trainer.run, trainer.config.train
    data_wait, images, readers = 0.0, 0, trainer.way.readers
    for micro in range(t.grad_accum):
        wait = time.perf_counter()
        x, y, n_global, offset = next(batches)
        data_wait += time.perf_counter() - wait
        draw = run.step * t.grad_accum + micro
        x, y = trainer.prep.train(x, y, draw, n_global, offset)
        batch = (x, y, n_global)
        ctx = StepContext(run, trainer.losses.train, trainer.scaler, len(y) * readers / (n_global * t.grad_accum))
        last = micro == t.grad_accum - 1
        with contextlib.nullcontext() if last else trainer.grad_sync.skip(), \
                droppath.batch(draw_seed(t.seed, draw, DROP_PATH), n_global, offset):
            loss, out = _call_step(ctx, trainer.step_fn, x, y)
            loss_sum = loss.detach().float() * len(y)
            if trainer.check_each_step and not torch.isfinite(loss_sum):
                trainer.guard.raise_for(run, x, y)
            if not ctx.backward_done:
                # the mean times (local / global batch) times the world size, because DDP averages over ranks:
                # the gradient is the exact mean over all samples, also for a short last batch
                weighted = loss.float() * ctx.batch_weight
                if run.config.optim.l1:
                    weighted = weighted + run.config.optim.l1 / t.grad_accum * l1_penalty(run.optimizer.param_groups)
                trainer.scaler.scale(weighted).backward()
        trainer.meter.totals.add(loss_sum, out, y)
        images += len(y) * readers
    trainer.grad_sync()
    apply_update(trainer, loss_sum, batch)
    return StepResult(loss_sum / len(y), (x, y), images, data_wait)


def apply_update(trainer, loss_sum: torch.Tensor, batch) -> None:
    """What every step does once its gradients are summed: ``on_before_update``, the learning rate, clipping
    (the way's ``clip``, when ``train.grad_clip`` is set; after the fp16 scaler's unscale), the update
    and zeroing the gradients (``optimizer_step``'s and a way's own step, e.g. a pipeline's)."""
    run, max_norm = trainer.run, trainer.config.train.grad_clip
    trainer.callbacks.on_before_update(run)
    if run.config.schedule.name == "none":  # the user's own scheduler sets the rates
        run.lr = run.optimizer.param_groups[0]["lr"]
    else:
        run.lr = trainer.plan.schedule(run.step) * run.lr_scale if run.lr_override is None else run.lr_override
        set_lr(run.optimizer, run.lr)
    if max_norm:
        trainer.scaler.unscale_(run.optimizer)
        trainer.way.clip(run.optimizer, max_norm)
    trainer.update(run, loss_sum, batch)
    trainer.grad_sync.zero_grad(run.optimizer)


def _call_step(ctx: StepContext, fn, x, y, cache: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step under autocast; its result checked: a 0-dim loss, optionally with the outputs, as a pair or a mapping
    of ``loss`` and ``outputs``. Lightning reads a ``training_step`` that returns a Mapping by its ``loss`` key and
    refuses one without it; the other keys go to its callbacks only (``ClosureResult.from_training_step_output`` in
    src/lightning/pytorch/loops/optimization/automatic.py); here they are ignored. ``cache``: autocast's cache of
    cast weights (off in a step captured as a CUDA graph)."""
    run = ctx.run
    with dev.autocast(run.device, run.precision, cache):
        try:
            result = fn(ctx, (x, y))
        except (BrickyardError, torch.OutOfMemoryError):
            raise
        except Exception as err:  # noqa: BLE001  the user's code: its own traceback stays, the CLI says one line
            if fn is default_step:
                raise
            raise user_code_error(f"train_step {_name(fn)}", err) from err
    if isinstance(result, Mapping) and "loss" in result:  # Lightning's training_step may return {"loss": ..., ...}
        result = (result["loss"], result.get("outputs"))
    loss, out = result if isinstance(result, tuple) else (result, None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        keys = f" with keys {', '.join(map(repr, list(result)[:4]))} and no 'loss'" if isinstance(result, Mapping) else ""
        raise BrickyardError(f"train_step {_name(fn)} must return the mean loss as a 0-dim tensor (or (loss, outputs), or "
                             f"{{'loss': loss, 'outputs': outputs}}); it returned {got}{keys}.")
    if not ctx.backward_done and not loss.requires_grad:
        raise BrickyardError(f"train_step {_name(fn)} returned a loss without a gradient; return the loss of "
                             f"run.forward's outputs (or call run.backward(loss) yourself).")
    return loss, out


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class NanGuard:
    """Stops on a non-finite loss, naming the first layer that made it (``observe.inspection``)."""

    def __init__(self, on: bool, sharded: str | None, loss_sum):  # sharded: the way's name where the model is split
        self.on, self.sharded, self.loss_sum = on, sharded, loss_sum

    def raise_for(self, run, x, y):
        # the search runs the model on this rank alone: under FSDP a forward pass needs every rank
        where = (f"not searched: the model is split across the processes ({self.sharded})" if self.sharded
                 else first_nonfinite(run.model, x, y, self.loss_sum))
        kept = (f"the newest checkpoint ({run.last_checkpoint}) holds the last good weights" if run.last_checkpoint
                else "no checkpoint was written yet")
        raise BrickyardError(f"training loss became non-finite at step {run.step}; first non-finite: {where}; "
                             f"{kept} (lower optim.lr or set train.grad_clip).")

    def __call__(self, run) -> None:
        """Stop on a non-finite loss before anything is saved (a host sync; log and save steps only)."""
        m = run.meter
        if self.on and m is not None and m.last_batch and not torch.isfinite(m.totals.loss).item():
            self.raise_for(run, *m.last_batch)
