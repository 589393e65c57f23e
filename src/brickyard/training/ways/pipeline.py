"""Pipeline stages (``dist.pipeline.stages: N``): the model cut at block boundaries into N stages, each
process holding one stage's parameters and optimiser state only; torch's ``PipelineStage`` and
``ScheduleGPipe`` / ``Schedule1F1B`` run the microbatches (``distributed.pipeline`` says how the model is cut
and cites torch's and torchtitan's sources).

Layout: a job of ``world`` processes is ``world / N`` pipelines (replicas) of N stages, the pipeline dimension
outermost as torchtitan builds its mesh (``torchtitan/distributed/parallel_dims.py``,
``ParallelDims._build_mesh_without_ep``: dims in the order pp, dp_replicate, dp_shard, cp, tp): rank r runs stage
``r // replicas`` of replica ``r % replicas``, so the stages of a pipeline sit on different machines of a
multi-node job and a stage's replicas, which all-reduce its gradients each step, side by side. Each replica reads its share of the recipe's global batch, as data-parallel
processes do, so the learning rate, schedule and data order are those of one process; the first stage takes the
inputs, the last the targets and the loss, each microbatch's loss weighted so that the gradient, averaged over
the replicas of a stage (one flat all-reduce in the stage's replica group), is the global batch's mean. The
logits are broadcast from the last stage through the pipeline, so every rank counts loss and accuracy (and the
NaN guard reads them) as a data-parallel process does, summed over its stage's replicas. Gradient clipping
takes the global norm over the stages (one all-reduce in the pipeline). Evaluation runs the forward passes
through the same stages, one microbatch a batch, each replica its share. Every rank takes part in the stop vote.

Checkpoints hold the whole model and the optimiser state as one process writes them (gathered through each
pipeline, parameters keyed by name and numbered as one process's groups number them), so a run saved on N stages
resumes on one process, on other stages or replicas, or under FSDP, and the reverse (``distributed.pipeline``:
``gather_state``, ``stage_optimizer_state``). Batch norm sees microbatch statistics.

With ``dist.strategy: fsdp`` each stage is sharded over its replicas, as torchtitan composes them
(``torchtitan/distributed/pipeline_parallel.py``, ``pipeline_llm``: the model split into stage parts first, then
``parallelize_fn``, its FSDP among them, applied to each part and the stage given the result): torch's
``fully_shard`` on the stage's blocks and the stage, over a mesh of the stage's replica group, and
``PipelineStage`` runs it (``torch/distributed/pipelining/stage.py``: ``backward_maybe_with_nosync`` turns the
gradient sync off for each microbatch's backward, ``perform_reduce_grad`` reduce-scatters after the last), in
place of the flat all-reduce; checkpoints gather the shards before the stages.

With ``dist.tensor_parallel: T`` each stage's layers are split across T ranks as ``training.ways.tensor_parallel``
splits a whole model (the classifier's rows on the last stage only), the third dimension of torchtitan's mesh,
innermost: rank ``(stage x replicas + replica) x T + shard``. Each of a stage's T ranks sends to and receives from
the rank of the same shard in the next and previous stages (one pipeline per shard, carrying the same activations,
as torchtitan's pp dimension has one group per place in the other dimensions), the replicas average the local
parts of their gradients (``distributed.tensor_parallel.ReplicaGrads``), and clipping sums the shards' squares over
the group before the pipeline. FSDP and tensor parallel together inside a stage are not built.

Not built yet: fp16's loss scaler, a ``train_step`` of the user's.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from brickyard.callbacks import Callback
from brickyard.data.loaders import device_batches
from brickyard.distributed import fsdp
from brickyard.distributed import pipeline as pp
from brickyard.distributed import tensor_parallel as tp
from brickyard.distributed.gradsync import FlatGrads, GradSync
from brickyard.errors import ConfigError
from brickyard.optim import STATE_COPIES
from brickyard.training import device as dev
from brickyard.training.run import StepResult
from brickyard.training.step import apply_update
from brickyard.training.ways.base import Way
from brickyard.training.ways.tensor_parallel import same_random_state


def stage_shards(cfg, world: int) -> int:
    """The FSDP shards of each stage of ``cfg``'s pipeline on ``world`` processes: its replicas under
    ``dist.strategy: fsdp``, else 1 (each stage whole on each of its replicas)."""
    replicas = max(1, world // (cfg.dist.pipeline.stages * cfg.dist.tensor_parallel))
    return replicas if cfg.dist.strategy == "fsdp" else 1


@dataclass(frozen=True)
class Lines:
    """A pipeline rank's own process groups besides its stage's replicas: its pipeline (the stages it sends to and
    receives from) and its stage's tensor-parallel group (None: the stage is whole on each rank)."""
    pipe: object
    tp: object = None


class PipelineWay(Way):
    name = "pipeline"
    sharded = True       # saving gathers the stages and evaluating runs through them: every rank takes part
    keeps_layout = False

    def __init__(self, cfg, info, groups=None):
        super().__init__(cfg, info, groups)
        self.p = cfg.dist.pipeline
        self.tp = cfg.dist.tensor_parallel  # ranks each stage's layers are split across
        self.replicas = max(1, info.world_size // (self.p.stages * self.tp))
        self.stage_index, rest = divmod(info.rank, self.replicas * self.tp)
        self.replica, self.tp_index = divmod(rest, self.tp)
        self.fsdp = stage_shards(cfg, info.world_size) > 1  # each stage sharded over its replicas
        self.stage = None  # this rank's stage module, once cut
        self.whole: torch.nn.Module | None = None  # the other stages' pieces on the meta device: nothing held
        self.io: pp.Io | None = None  # what this stage receives and sends, a sample's
        self.names: dict[str, str] = {}
        self.order: list[str] = []
        self.opt_groups: pp.Groups | None = None
        self.schedules: dict[tuple[int, bool], object] = {}
        self.peers, lines = groups or (None, Lines(None))  # its stage's replicas, and this rank's pipeline
        self.pipe, self.tp_group = lines.pipe, lines.tp
        self.n_global = 1
        self.loss_sum = None
        self.device = torch.device("cpu")
        self.clock = pp.StageClock()
        self.starts: list[int] = []  # the piece each stage begins at

    @property
    def readers(self) -> int:
        return self.replicas  # each pipeline reads its share of the global batch

    @property
    def reader_index(self) -> int:
        return self.replica

    def check(self, model, resume):
        pp.cuts(model, self.p.stages, self.p.split)
        self.check_layout()
        if self.tp > 1:
            tp.require_plan(model, self.tp)

    def check_layout(self):
        world, per = self.info.world_size, self.p.stages * self.tp
        if world % per:
            split = f" x dist.tensor_parallel: {self.tp}" if self.tp > 1 else ""
            raise ConfigError(f"dist.pipeline.stages: {self.p.stages}{split} does not divide the job's {world} "
                              f"processes; a job runs whole pipelines (processes = stages x "
                              f"{'tensor-parallel ranks x ' if self.tp > 1 else ''}replicas).")
        if self.cfg.train.precision == "fp16":
            raise ConfigError("train.precision: fp16 needs the loss scaler, which the pipeline's schedule does not "
                              "apply to its microbatches yet; use bf16 or fp32 with dist.pipeline.stages.")
        if self.cfg.data.global_batch_size and self.p.microbatches != "auto":  # shared by the pipelines
            self.check_microbatches(self.cfg.data)  # (data.batch_size: the config checks it; auto takes a divisor)

    def microbatches(self, replica: int) -> int:
        """The microbatches of a full step of ``replica``'s pipeline (its device batch: ``microbatch_count``)."""
        return self.p.microbatch_count(device_batches(self.cfg.data, 1, self.replicas)[replica])

    def check_microbatches(self, d) -> None:
        m = self.p.microbatch_count()
        bad = sorted({b for b in device_batches(d, self.cfg.train.grad_accum, self.replicas) if b % m})
        if bad:
            over = f" over {self.replicas} pipelines" if self.replicas > 1 else ""
            raise ConfigError(f"dist.pipeline.microbatches: {m} does not divide a device's batch of {bad[0]} "
                              f"(data.global_batch_size: {d.global_batch_size}{over}); choose a divisor of it.")

    def groups(self):
        """(the stage's replicas that hold what this rank holds, over which metrics are summed and gradients averaged;
        ``Lines``: this rank's pipeline and tensor-parallel group). Rank ``(stage x replicas + replica) x tp + shard``:
        the pipeline outermost, tensor parallel innermost (the module docstring). Every rank makes every group, in
        the same order (``new_group`` is collective)."""
        if not self.info.distributed:
            return None, Lines(None)
        s, r, t = self.p.stages, self.replicas, self.tp

        def rank(i, k, j):
            return (i * r + k) * t + j
        pipes = {(k, j): tdist.new_group([rank(i, k, j) for i in range(s)]) for k in range(r) for j in range(t)}
        peers = {(i, j): tdist.new_group([rank(i, k, j) for k in range(r)]) for i in range(s) for j in range(t)}
        splits = {(i, k): tdist.new_group([rank(i, k, j) for j in range(t)]) for i in range(s) for k in range(r)} if t > 1 else {}
        i, k, j = self.stage_index, self.replica, self.tp_index
        return peers[(i, j)], Lines(pipes[(k, j)], splits.get((i, k)))

    def vote_group(self, readers_group):
        return None  # every rank: the stages of a pipeline stop at the same step

    def shard(self, model, host, log, sample=()):
        """This rank's stage of ``model``: the module the optimiser and the run see."""
        self.starts = starts = self._starts(model, host, sample)
        parts = pp.pieces(model)
        i = self.stage_index
        self.whole, self.stage = model, pp.stage_module(model, starts, i)
        self.names, self.order = pp.own_names(model, self.stage), list(model.state_dict())
        self.device = host.device
        held, total = sum(p.numel() for p in self.stage.parameters()), sum(p.numel() for p in model.parameters())
        if sample:  # images: what the stage receives and sends known now, the other stages' weights are freed
            with dev.autocast(host.device, host.precision):  # the dtypes the run's forward passes make
                self.io = pp.io(model, starts, i, torch.zeros(2, *sample, device=host.device))
            pp.release_others(model, self.stage)
        shards = ""
        if self.tp > 1:  # the stage's layers split across its tensor-parallel group, as on its own
            shards = self._split(host)
        elif self.fsdp:  # torch's PipelineStage runs an FSDP stage: gradients reduce-scattered after the last microbatch
            blocks = fsdp.shard(model, self.cfg.dist, host.precision, host.device, fsdp.group_mesh(self.peers, host.device),
                                root=self.stage)
            shards = (f"; FSDP: shard {self.replica} of {self.replicas} of the stage ({len(blocks)} blocks and the "
                      f"stage sharded), about {held // self.replicas:,} parameters held")
        elif self.cfg.dist.strategy == "fsdp":
            shards = "; dist.strategy: fsdp has one replica a stage to shard over: each stage trains whole"
        end = starts[i + 1] if i + 1 < len(starts) else len(parts)
        how = ("at dist.pipeline.split" if self.p.split else "balanced by parameter count" if self.p.balance == "params"
               else f"balanced by each block's measured {self.p.balance}")
        place = f"stage {i} of {self.p.stages}" + (f", replica {self.replica} of {self.replicas}" if self.replicas > 1 else "")
        place += f", tensor-parallel rank {self.tp_index} of {self.tp}" if self.tp > 1 else ""
        m = self.microbatches(self.replica)
        log.info(f"pipeline: rank {self.info.rank} is {place} ({how}): {parts[starts[i]][0]}..{parts[end - 1][0]}, "
                 f"{held:,} of {total:,} parameters; {m} microbatch{'' if m == 1 else 'es'} a step, schedule "
                 f"{self.p.schedule}; batch norm, if any, sees microbatch statistics{shards}")
        return self.stage

    def _split(self, host) -> str:
        """Split this rank's stage across its tensor-parallel group (the classifier's rows on the last stage only),
        and say what it holds."""
        assert self.stage is not None
        last = self.stage_index == self.p.stages - 1
        plan = tp.plan(self.stage, self.tp, head=last)
        tp.apply(self.stage, plan, fsdp.group_mesh(self.tp_group, host.device))
        same_random_state(host.device)  # dropout outside the split layers must draw alike on a group's ranks
        held, _ = tp.held(self.stage)
        own = {id(m): name for name, m in self.whole_model(self.stage).named_modules()}  # the model's names, for the log
        head = own.get(id(dict(self.stage.named_modules()).get(plan.head)), plan.head) if plan.head else None
        what = dataclasses.replace(plan, head=head).describe(self.tp) if plan else "nothing to split: the stage whole on each"
        return f"; tensor parallel: rank {self.tp_index} of {self.tp} of the stage holds {held:,} ({what})"

    def _starts(self, model, host, sample: tuple) -> list[int]:
        """Where the stages begin: at the split points, by parameter count, or by the pieces' time or memory,
        measured on rank 0 (a microbatch of the data's shape) and shared, so that every rank cuts the model in the
        same place."""
        if self.p.split or self.p.balance == "params" or not self.info.distributed or not sample:
            return pp.cuts(model, self.p.stages, self.p.split)
        starts: list[int] = []
        if self.info.rank == 0:
            batch = max(device_batches(self.cfg.data, 1, self.replicas))
            m = self.p.microbatch_count(batch)
            x = torch.randn(max(1, batch // m), *sample, device=host.device)
            with dev.autocast(host.device, host.precision):
                starts = pp.planned_cuts(model, self.p, x, STATE_COPIES[self.cfg.optim.name],
                                         self.replicas if self.fsdp else 1, m)
        box = [starts]
        tdist.broadcast_object_list(box, src=0)
        return list(box[0])

    def held_groups(self, groups, module):
        cut, self.opt_groups = pp.held_groups(groups, module, self.names)
        return cut

    def whole_model(self, model):
        return self.whole if self.whole is not None else model

    def _schedule(self, n: int, train: bool, x: torch.Tensor):
        """A stage and schedule for batches of ``n`` (torch's stages fix their shapes: given here, from ``x``)."""
        key = (n, train)
        if key not in self.schedules:
            m = self.p.microbatch_count(n) if train else 1
            while n % m:
                m -= 1  # a short last batch: the largest divisor of it (the gradient is a sum either way)
            # imported here: torch.distributed.pipelining loads torch._dynamo and FSDP, which other runs never import
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
            received, sent = (self.io.batch(n // m, self.device) if self.io is not None else  # else the whole model's
                              pp.examples(self.whole_model(self.stage), self.starts, self.stage_index, x[:n // m]))
            if train:  # what carries a gradient between the stages (the metadata says so: gradients are sent back)
                received = received.requires_grad_(self.stage_index > 0 and received.is_floating_point())
                sent = sent.requires_grad_(sent.is_floating_point())
            stage = PipelineStage(self.stage, self.stage_index, self.p.stages, self.device, input_args=received,
                                  output_args=sent, group=self.pipe)
            for name in ("forward_one_chunk", "backward_one_chunk") if train else ():
                if hasattr(stage, name):  # torch's names for a microbatch's compute (distributed.pipeline.StageClock)
                    setattr(stage, name, self.clock.timed(getattr(stage, name)))
            kind = Schedule1F1B if self.p.schedule == "1f1b" and m >= self.p.stages else ScheduleGPipe
            self.schedules[key] = kind(stage, m, loss_fn=self._loss if train else None, scale_grads=False)
        return self.schedules[key]

    def _loss(self, out, y):
        return self.loss_sum(out, y) * self.replicas / self.n_global  # averaged over the replicas: the global mean

    def forward_all(self, x: torch.Tensor, n: int, train: bool, y=None, losses=None):
        """Through the stages (inputs on the first, targets on the last); the logits on every rank."""
        sched = self._schedule(n, train, x)
        first, last = self.stage_index == 0, self.stage_index == self.p.stages - 1
        out = sched.step(*((x,) if first else ()), target=y if last and train else None, losses=losses)
        return pp.broadcast_from_last(out if last else None, n, self.device, self.pipe)

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
        start = time.perf_counter()
        with dev.autocast(run.device, run.precision):  # the microbatches' forward passes, as a step's (evaluation has its own)
            out = self.forward_all(x, len(y), True, y, losses)
        self.clock.step(time.perf_counter() - start)
        last = self.stage_index == self.p.stages - 1
        part = torch.stack([torch.stack(losses).sum() * n_global / self.replicas] if losses
                           else [torch.zeros((), device=run.device)])
        loss_sum = pp.broadcast_from_last(part if last else None, 1, run.device, self.pipe)[0]
        if trainer.check_each_step and not torch.isfinite(loss_sum):
            trainer.guard.raise_for(run, x, y)
        trainer.meter.totals.add(loss_sum, out, y)
        trainer.grad_sync()  # the stage's replicas: their gradients averaged
        apply_update(trainer, loss_sum, (x, y, n_global))
        return StepResult(loss_sum / len(y), (x, y), len(y) * self.replicas, data_wait)

    def clip(self, optimizer, max_norm: float) -> None:
        """``clip_grad_norm_`` over the global norm of every stage's gradients (one all-reduce in the pipeline; with
        FSDP, the squares of a stage's shards summed over its replicas first)."""
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        split, whole = tp.local_parts(grads)  # FSDP's and tensor parallel's shards; the tensors every rank holds whole
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in split:
            sq += g.detach().float().pow(2).sum()
        if self.fsdp or self.tp > 1:
            tdist.all_reduce(sq, group=self.peers if self.fsdp else self.tp_group)
        for g in whole:
            sq += g.detach().float().pow(2).sum()
        tdist.all_reduce(sq, group=self.pipe)
        coef = torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0)
        for g in split + whole:
            g.detach().mul_(coef.to(g.dtype))

    def grad_sync(self, model, device, group, own_cores):
        sync: GradSync = GradSync()
        if self.replicas > 1 and self.tp > 1:  # DTensors' gradients: their local parts averaged
            sync = tp.ReplicaGrads(model, self.peers, spin=own_cores)
        elif self.replicas > 1 and not self.fsdp:
            sync = FlatGrads(model, self.peers, spin=own_cores)
        return _Forward(self, model), sync

    def full_state(self, model, optimizer):
        assert self.opt_groups is not None  # set with the trainer's optimiser groups
        return pp.gather_state(model, self.names, self.order, optimizer, self.opt_groups, self.pipe)

    def load_state(self, model, optimizer, state) -> None:
        assert self.opt_groups is not None
        own = state["model"]
        fsdp.load_model_state(model, {k: own[v] for k, v in self.names.items()})  # FSDP: this rank's shards
        fsdp.load_optimizer_state(optimizer, pp.stage_optimizer_state(state["optimizer"], self.opt_groups))

    def callbacks(self, run, update, writer):
        return [_StageTimes(self)]

    def capture_refusal(self):
        return "dist.pipeline.stages sends activations between the stages, which is not captured"

    def summary_name(self, world):
        return "pipeline+fsdp" if self.fsdp else "pipeline+tensor_parallel" if self.tp > 1 else "pipeline"


class _Forward(torch.nn.Module):
    """The run's ``forward`` for evaluation: a batch through every stage, the logits on every rank."""

    def __init__(self, way: PipelineWay, stage: torch.nn.Module):
        super().__init__()
        self.way, self.stage = way, stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.way.forward_all(x, len(x), False)



class _StageTimes(Callback):
    """Each rank's stage time against its step time, in its log and (gathered) in the summary's ``pipeline``."""

    def __init__(self, way: PipelineWay):
        self.way = way

    def summary(self, run) -> dict:
        w = self.way
        row = {"stage": w.stage_index, "replica": w.replica, "shard": w.tp_index if w.tp > 1 else None, **w.clock.row()}
        if row["idle"] is not None:
            run.log.info(f"pipeline: stage {w.stage_index} computed {row['busy_ms']:.1f} ms of each {row['step_ms']:.1f} ms "
                         f"step ({row['steps']} steps timed): idle {100 * row['idle']:.1f}% (waiting for the other "
                         f"stages: fill and drain, the sends)")
        rows: list = [None] * w.info.world_size
        tdist.all_gather_object(rows, row)  # collective: every rank's summary is made together
        return {"pipeline": {"schedule": w.p.schedule, "microbatches": w.microbatches(0), "ranks": rows}}
