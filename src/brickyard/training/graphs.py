"""The training step as one CUDA graph (``train.cuda_graphs``): forward, backward, gradient clipping and the
optimiser's update captured once and replayed, so that a small network on a big GPU stops waiting for
the host to launch each of its kernels.

How, after PyTorch's "whole network capture" recipe (docs/source/notes/cuda.rst, "CUDA Graphs", in
pytorch/pytorch): the first ``WARMUP`` steps run eagerly on a side stream (cuDNN picks its kernels, the
optimiser makes its state); the next full batch is captured with the gradients unset, so that the
backward pass allocates them in the graph's own memory; from then on each full batch is copied into the
graph's input buffers and the graph replayed. Unlike the recipe's, the warm-up steps are real steps of
the run on its own batches, and capturing runs nothing, so the run's steps and data are those of an eager
run. The learning rate lives in a one-element tensor a group (torch's fused Adam, AdamW and SGD read it on
the device), filled before each replay from the schedule, which stays a pure function of the step.

What stays outside the graph: the batch's preparation (augmentation on the device), the learning rate,
the callbacks, the sample count, the NaN guard (it reads the device-side loss sums at log steps, as an
eager GPU run does). A batch of another shape (the last, short one) runs eagerly into the same gradient
buffers. ``decide`` says when the step cannot be captured, in words, before the first step; a capture
that fails anyway leaves the run eager and says why.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from brickyard.callbacks import Callback
from brickyard.models.droppath import DropPath
from brickyard.optim import l1_penalty, set_lr
from brickyard.training.run import StepResult
from brickyard.training.step import StepContext, _call_step, default_step, optimizer_step

WARMUP = 3  # eager steps before the capture (the recipe's side-stream warm-up)
AUTO_MAX_PARAMS = 5_000_000  # auto: the MNIST nets (30k-430k) and LeNet, not ResNet-18 (11.7M) and larger
CAPTURABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # with fused=True: a tensor lr, no host read


@dataclass(frozen=True)
class Decision:
    on: bool
    reason: str = ""  # why the step stays eager ("" when it is captured)


def decide(setting, *, device: torch.device, precision: str, way_refusal: str | None, grad_accum: int,
           own_step: bool, compiled: bool, schedule: str, optimizer, callbacks, model: nn.Module) -> Decision:
    """Whether the step is captured, and if not, why: ``setting`` is ``train.cuda_graphs`` (True, False, "auto");
    ``auto`` captures where nothing forbids it and the model is small (under ``AUTO_MAX_PARAMS``: a step that
    waits on the host's kernel launches); ``true`` also a larger model and a ``train_step`` or ``loss_fn`` of
    the user's."""
    if setting is False:
        return Decision(False, "train.cuda_graphs is false")
    why = _refusal(device, precision, way_refusal, grad_accum, compiled, schedule, optimizer, callbacks, model)
    if why is None and setting == "auto":
        n_params = sum(p.numel() for p in model.parameters())
        if own_step:
            why = ("the run has a train_step or loss_fn of its own, which may read values on the host or change shapes "
                   "(set train.cuda_graphs: true to capture it anyway)")
        elif n_params >= AUTO_MAX_PARAMS:
            why = (f"auto captures models under {AUTO_MAX_PARAMS / 1e6:g}M parameters, whose steps wait on kernel "
                   f"launches; this one has {n_params / 1e6:.1f}M (set train.cuda_graphs: true to capture it: its "
                   f"graph then keeps the step's memory apart from evaluation's)")
    return Decision(why is None, why or "")


def _refusal(device, precision, way_refusal, grad_accum, compiled, schedule, optimizer, callbacks, model) -> str | None:
    if device.type != "cuda":
        return f"the device is {device.type}; CUDA graphs are CUDA's"
    if way_refusal:
        return way_refusal
    if precision == "fp16":
        return "fp16's loss scaler reads on the host whether the gradients are finite, every step (bf16 needs no scaler)"
    if grad_accum > 1:
        return f"train.grad_accum is {grad_accum}: only one micro-batch a step is captured"
    if compiled:
        return "train.compile is on, and the compiled model is not captured again"
    if schedule == "none":
        return "schedule.name is none: a scheduler of your own sets the rate on the host"
    if type(optimizer) not in CAPTURABLE or not optimizer.defaults.get("fused"):
        return f"the optimiser {type(optimizer).__name__} has no fused update that reads its rate on the device"
    hooked = [type(c).__name__ for c in callbacks if type(c).on_before_update is not Callback.on_before_update]
    if hooked:
        return f"{', '.join(hooked)} acts between the backward pass and the update (on_before_update)"
    if any(isinstance(m, DropPath) and m.p > 0 for m in model.modules()):
        return "model.drop_path draws its masks from a seed a batch, on the host"
    return None


def choose(trainer, own_step: bool, log) -> tuple:
    """(the trainer's step, a line for the start of the run or ''): a ``GraphedStep`` where ``decide`` captures
    it, else ``optimizer_step``; the line says which where it matters (a GPU, or ``train.cuda_graphs: true``)."""
    cfg, run = trainer.config, trainer.run
    setting, own = cfg.train.cuda_graphs, trainer.way.step_function()
    d = decide(setting, device=run.device, precision=run.precision, way_refusal=trainer.way.capture_refusal(),
               grad_accum=cfg.train.grad_accum, own_step=own_step, compiled=trainer.job.compiled,
               schedule=cfg.schedule.name, optimizer=run.optimizer, callbacks=trainer.callbacks.callbacks,
               model=run.model)
    if d.on:
        return GraphedStep(log), (f"cuda graphs: the training step is captured after {WARMUP} eager steps and "
                                  f"replayed (train.cuda_graphs: {str(setting).lower()})")
    if setting is True or (setting == "auto" and run.device.type == "cuda"):
        return own or optimizer_step, f"train.cuda_graphs: the training step runs eagerly: {d.reason}"
    return own or optimizer_step, ""


class GraphedStep:
    """``training.step.optimizer_step``'s work for one micro-batch a step, replayed from a CUDA graph once
    captured (see the module docstring). Called as ``step(trainer, batches)``; ``captured`` says whether a
    graph replays, ``refused`` why capturing failed."""

    def __init__(self, log):
        self.log, self.done = log, 0
        self.graph: Graph | None = None
        self.static: tuple = ()      # the graph's input buffers (x, y) and its loss sum
        self.key: tuple = ()         # the shapes and global batch the graph was captured for
        self.refused = ""
        self.params: list[torch.Tensor] = []

    def _start(self, run) -> None:
        """The rate of each group in a tensor on the device, read there by the fused update (after a resume
        loaded the optimiser's saved groups)."""
        self.params = [p for g in run.optimizer.param_groups for p in g["params"]]
        for g in run.optimizer.param_groups:
            g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=run.device)
            if "capturable" in g:
                g["capturable"] = True

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, trainer, batches) -> StepResult:
        if self.refused:  # a capture failed: the eager step from now on (which expects no gradients left)
            trainer.run.optimizer.zero_grad(set_to_none=True)
            return optimizer_step(trainer, batches)
        run = trainer.run
        if not self.params:
            self._start(run)
        wait = time.perf_counter()
        x, y, n_global, offset = next(batches)
        data_wait = time.perf_counter() - wait
        x, y = trainer.prep.train(x, y, run.step, n_global, offset)
        run.lr = trainer.plan.schedule(run.step) * run.lr_scale if run.lr_override is None else run.lr_override
        set_lr(run.optimizer, run.lr)
        weight = len(y) * trainer.way.readers / n_global
        key = (tuple(x.shape), tuple(y.shape), x.dtype, y.dtype, n_global)
        full = n_global == trainer.plan.batches.global_batch  # a short last batch is not worth a graph
        if self.graph is None and not self.refused and self.done >= WARMUP and full:
            self._capture(trainer, x, y, weight, key)
        if self.graph is not None and key == self.key:
            sx, sy, loss_sum = self.static
            sx.copy_(x)
            sy.copy_(y)
            self.graph.replay()
        else:
            loss_sum = self._eager(trainer, x, y, weight)
        trainer.meter.totals.count += len(y)
        self.done += 1
        return StepResult(loss_sum / len(y), (x, y), len(y) * trainer.way.readers, data_wait)

    def _eager(self, trainer, x, y, weight) -> torch.Tensor:
        """One step without the graph: on a side stream while warming up (the recipe's), else into the
        graph's gradient buffers, zeroed in place."""
        if self.graph is None:
            trainer.run.optimizer.zero_grad(set_to_none=True)
            with side_stream():
                return _body(trainer, x, y, weight)
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        return _body(trainer, x, y, weight)

    def _capture(self, trainer, x, y, weight, key) -> None:
        started = time.perf_counter()
        sx, sy = x.clone(), y.clone()
        graph = Graph()
        trainer.run.optimizer.zero_grad(set_to_none=True)
        try:
            loss_sum = graph.capture(lambda: _body(trainer, sx, sy, weight))
        except Exception as err:  # noqa: BLE001  whatever forbids the capture: the run goes on eagerly
            while err.__context__ is not None and isinstance(err.__context__, Exception):
                err = err.__context__  # the first error, not the capture's end that it broke
            self.refused = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            trainer.run.optimizer.zero_grad(set_to_none=True)
            self.log.warning(f"train.cuda_graphs: capturing the step failed ({self.refused}); the run's steps stay eager")
            return
        self.graph, self.static, self.key = graph, (sx, sy, loss_sum), key
        self.log.info(f"cuda graphs: the training step is captured at step {trainer.run.step} and replayed "
                      f"(batches of {tuple(x.shape)}; {time.perf_counter() - started:.2f} s to capture)")


def _body(trainer, x, y, weight: float) -> torch.Tensor:
    """The captured work: the step (under autocast), the weighted backward pass, the loss and accuracy
    sums, clipping and the update; returns the batch's loss sum (a device tensor)."""
    run, t = trainer.run, trainer.config.train
    ctx = StepContext(run, trainer.losses.train, trainer.scaler, weight)
    loss, out = _call_step(ctx, trainer.step_fn, x, y, cache=False)  # no autocast cache in a graph (torch's notes)
    loss_sum = loss.detach().float() * len(y)
    if not ctx.backward_done:
        weighted = loss.float() * weight
        if run.config.optim.l1:
            weighted = weighted + run.config.optim.l1 * l1_penalty(run.optimizer.param_groups)
        weighted.backward()
    trainer.meter.totals.add_on_device(loss_sum, out, y)
    if t.grad_clip:
        nn.utils.clip_grad_norm_([p for g in run.optimizer.param_groups for p in g["params"]], t.grad_clip)
    trainer.update(run, loss_sum, (x, y, len(y)))
    return loss_sum


class Graph:
    """One CUDA graph: ``capture(fn)`` records ``fn``'s kernels without running them and returns its outputs
    (filled by each ``replay()``)."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn):
        # the outer stream context puts the current stream back even where a failed capture leaves torch's
        # ``graph`` context on its capture stream (its ``__exit__`` raises in ``capture_end`` before leaving it)
        with torch.cuda.stream(torch.cuda.current_stream()), torch.cuda.graph(self.graph):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


@contextlib.contextmanager
def side_stream():
    """Run the block on a stream of its own, ordered after and before the current one (the warm-up of
    torch's recipe: lazy initialisations happen off the stream the graph is captured from)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


def plain_lr(optimizer_state: dict) -> dict:
    """An optimiser's ``state_dict`` as an eager run writes it: each group's rate a number (a captured step
    keeps it in a tensor), ``capturable`` off. The state dict's groups are its own copies."""
    for g in optimizer_state.get("param_groups", []):
        if isinstance(g.get("lr"), torch.Tensor):
            g["lr"] = float(g["lr"])
            if "capturable" in g:
                g["capturable"] = False
    return optimizer_state


__all__ = ["Decision", "GraphedStep", "WARMUP", "choose", "decide", "default_step", "plain_lr"]
