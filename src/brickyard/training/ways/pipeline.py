"""Pipeline stages (``dist.pipeline.stages: N``): the model cut at block boundaries into N stages, one a
process, each holding its stage's parameters and optimiser state only; torch's ``PipelineStage`` and
``ScheduleGPipe`` / ``Schedule1F1B`` run the microbatches (``distributed.pipeline`` says how the model is cut
and cites torch's and torchtitan's sources).

One pipeline (N processes, N stages): every rank reads the recipe's whole global batch, so the learning rate,
schedule and data order are those of one process; the first stage takes the inputs, the last the targets and
the run's training loss, each microbatch's loss divided by the global batch so that the gradient is its mean.
The logits are broadcast from the last stage, so every rank counts loss and accuracy (and the NaN guard reads
them) as one process does, each rank in a process group of its own (``groups``). Gradient clipping takes the
global norm over the stages (one all-reduce). Evaluation runs the forward passes through the same stages, one
microbatch a batch. A checkpoint holds the whole model under its own names (gathered on every rank) and each
stage's optimiser state; ``load_state`` would read it back on the same number of stages, but resuming is
refused in ``check`` for now (the checkpoint's check compares the whole model with the stage), as is
``train.max_time_s`` (each rank's own clock, and the stages do not agree on a stop yet: the stop vote runs in each
rank's own group). Batch norm sees microbatch statistics.

Not built yet: replicas of a pipeline (data parallel across pipelines), tensor parallel, resharding a
checkpoint onto another number of stages, resuming, a ``train_step`` of the user's.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from brickyard.distributed import pipeline as pp
from brickyard.distributed.gradsync import GradSync
from brickyard.errors import CheckpointError, ConfigError
from brickyard.training.run import StepResult
from brickyard.training.step import apply_update
from brickyard.training.ways.base import Way


class PipelineWay(Way):
    name = "pipeline"
    sharded = True       # saving gathers the stages and evaluating runs through them: every rank takes part
    keeps_layout = False

    def __init__(self, cfg, info):
        super().__init__(cfg, info)
        self.p = cfg.dist.pipeline
        self.stage = None  # this rank's stage module, once cut
        self.names: dict[str, str] = {}
        self.order: list[str] = []
        self.schedules: dict[tuple[int, bool], object] = {}
        self.n_global = 1
        self.loss_sum = None
        self.device = torch.device("cpu")

    @property
    def readers(self) -> int:
        return 1  # one pipeline reads the whole global batch

    def check(self, model, resume):
        pp.cuts(model, self.p.stages, self.p.split)
        if self.info.world_size != self.p.stages:
            raise ConfigError(f"dist.pipeline.stages: {self.p.stages} runs one process a stage and this job has "
                              f"{self.info.world_size}; replicas of a pipeline are not built yet.")
        if resume:
            raise ConfigError("dist.pipeline.stages: resuming a pipeline run is not built yet; start it afresh in a "
                              "new run directory.")
        if self.cfg.train.precision == "fp16":
            raise ConfigError("train.precision: fp16 needs the loss scaler, which the pipeline's schedule does not "
                              "apply to its microbatches yet; use bf16 or fp32 with dist.pipeline.stages.")
        if self.cfg.train.max_time_s:
            raise ConfigError("train.max_time_s stops each pipeline stage by its own clock, and the stages do not "
                              "agree on a stop yet; leave it 0 with dist.pipeline.stages.")

    def groups(self):
        """Each rank in a group of its own: every rank counts the same logits, so nothing is summed across them."""
        if not self.info.distributed:
            return None, None
        own = [tdist.new_group([r]) for r in range(self.info.world_size)]  # collective: every rank, in order
        return own[self.info.rank], None

    def shard(self, model, host, log):
        """This rank's stage of ``model``: the module the optimiser and the run see."""
        starts = pp.cuts(model, self.p.stages, self.p.split)
        parts = pp.pieces(model)
        i = self.info.rank
        self.stage = pp.stage_module(model, starts, i)
        self.names, self.order = pp.own_names(model, self.stage), list(model.state_dict())
        self.device = host.device
        held, total = sum(p.numel() for p in self.stage.parameters()), sum(p.numel() for p in model.parameters())
        end = starts[i + 1] if i + 1 < len(starts) else len(parts)
        how = "at dist.pipeline.split" if self.p.split else "balanced by parameter count"
        log.info(f"pipeline: stage {i} of {self.p.stages} ({how}) holds {parts[starts[i]][0]}..{parts[end - 1][0]}: "
                 f"{held} of {total} parameters; {self.p.microbatch_count()} microbatches a step, schedule "
                 f"{self.p.schedule}; batch norm, if any, sees microbatch statistics")
        return self.stage

    def _schedule(self, n: int, train: bool):
        """A stage and schedule for batches of ``n`` (torch's stages fix their shapes at the first step)."""
        key = (n, train)
        if key not in self.schedules:
            m = self.p.microbatch_count() if train else 1
            while n % m:
                m -= 1  # a short last batch: the largest divisor (the gradient is a sum either way)
            # imported here: torch.distributed.pipelining loads torch._dynamo and FSDP, which other runs never import
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
            stage = PipelineStage(self.stage, self.info.rank, self.p.stages, self.device)
            kind = Schedule1F1B if self.p.schedule == "1f1b" and m >= self.p.stages else ScheduleGPipe
            self.schedules[key] = kind(stage, m, loss_fn=self._loss if train else None, scale_grads=False)
        return self.schedules[key]

    def _loss(self, out, y):
        return self.loss_sum(out, y) / self.n_global

    def forward_all(self, x: torch.Tensor | None, n: int, train: bool, y=None, losses=None):
        """Through the stages (inputs on the first, targets on the last); the logits on every rank."""
        sched = self._schedule(n, train)
        first, last = self.info.rank == 0, self.info.rank == self.p.stages - 1
        out = sched.step(*((x,) if first else ()), target=y if last and train else None, losses=losses)
        return pp.broadcast_from_last(out if last else None, n, self.device)

    def step_function(self):
        return self.step

    def step(self, trainer, batches) -> StepResult:
        """One optimiser step of the pipeline (the ``training.step.optimizer_step`` contract)."""
        run = trainer.run
        wait = time.perf_counter()
        x, y, n_global, offset = next(batches)
        data_wait = time.perf_counter() - wait
        x, y = trainer.prep.train(x, y, run.step, n_global, offset)
        self.loss_sum, self.n_global = trainer.losses.train, n_global
        losses: list = []
        out = self.forward_all(x, len(y), True, y, losses)
        part = torch.stack([torch.stack(losses).sum() * n_global] if losses else [torch.zeros((), device=run.device)])
        loss_sum = pp.broadcast_from_last(part if self.info.rank == self.p.stages - 1 else None, 1, run.device)[0]
        if trainer.check_each_step and not torch.isfinite(loss_sum):
            trainer.guard.raise_for(run, x, y)
        trainer.meter.totals.add(loss_sum, out, y)
        apply_update(trainer, loss_sum, (x, y, n_global), self._clip)
        return StepResult(loss_sum / len(y), (x, y), len(y), data_wait)

    def _clip(self, optimizer, max_norm: float) -> None:
        """``clip_grad_norm_`` over the global norm of every stage's gradients (one all-reduce)."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros((), device=self.device)
        tdist.all_reduce(sq)
        coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))

    def grad_sync(self, model, device, group, own_cores):
        return _Forward(self, model), GradSync()

    def full_state(self, model, optimizer):
        return pp.gather_state(model, self.names, self.order, optimizer)

    def load_state(self, model, optimizer, state) -> None:
        own = {k: v for k, v in state["model"].items()}
        model.load_state_dict({k: own[v] for k, v in self.names.items()})
        stages = state["optimizer"].get("stages")
        if not isinstance(stages, list) or len(stages) != self.p.stages:
            raise CheckpointError(f"the checkpoint's optimiser state is not that of {self.p.stages} pipeline stages "
                                  f"(resharding onto another number of stages is not built yet).")
        optimizer.load_state_dict(stages[self.info.rank])

    def capture_refusal(self):
        return "dist.pipeline.stages sends activations between the stages, which is not captured"

    def summary_name(self, world):
        return "pipeline"


class _Forward(torch.nn.Module):
    """The run's ``forward`` for evaluation: a batch through every stage, the logits on every rank."""

    def __init__(self, way: PipelineWay, stage: torch.nn.Module):
        super().__init__()
        self.way, self.stage = way, stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.way.forward_all(x, len(x), False)

