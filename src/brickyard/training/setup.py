"""How a run is put together: the model on its device, the optimiser, the batch plan, the schedule,
the update strategy, brickyard's behaviours as callbacks, DDP, and the lines that announce it all.

Everything here runs once, before the loop; ``training.loop`` calls ``plan`` (the frozen ``Plan``), then
``serve`` on a parameter server, else ``build_run``, ``callbacks_for``, ``wrap`` and ``announce`` in that order.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from brickyard.boost import dim_reduce as boost
from brickyard.boost.callbacks import Snapshotting, Stage2Log
from brickyard.callbacks import CallbackList
from brickyard.callbacks.checkpointing import Checkpointing
from brickyard.callbacks.not_learning import NotLearning
from brickyard.callbacks.progress import ProgressLog
from brickyard.callbacks.test_every import TestEvery
from brickyard.config import Config
from brickyard.callbacks.watching import Histograms, Watching
from brickyard.callbacks.profiling import Profiling
from brickyard.data import augment
from brickyard.data.loaders import BatchPlan, device_batches, make_train_loader, step_batch
from brickyard.distributed import fsdp, gradsync
from brickyard.distributed import parameter_server as ps
from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError, ConfigError
from brickyard.models import whitening
from brickyard.models.finetune import find_head
from brickyard.observe.inspection import Watcher
from brickyard.optim import OptimizerUpdate, Schedule, build_optimizer, describe_groups, param_groups
from brickyard.training import memory
from brickyard.training import activation_checkpointing
from brickyard.training import checkpoint as ckpt
from brickyard.training import device as dev
from brickyard.training.evaluation import evaluate_split
from brickyard.training.run import Engine, Meter, Request, Run
from brickyard.training.step import Totals, default_step, guard, make_loss_sum


@dataclass(frozen=True, eq=False)
class Plan:
    """What a run will do, resolved once from the config, the data and the job before any part is built:
    the run directory, who reads data, the batch plan, the step counts and the learning-rate schedule.
    Everything built after it reads it; nothing decides these again."""
    config: Config                    # resolved: data.num_workers and data.batch_size "auto" are numbers here
    run_dir: Path
    layout: ps.Layout | None          # dist.mode: ps: which ranks train and which serve; else None
    data_world: int                   # processes that read data (the trainers in parameter-server mode)
    batches: BatchPlan                # which samples each rank reads at each step (any world size, any resume)
    steps_per_epoch: int
    total_steps: int
    peak_lr: float
    schedule: Schedule                # step -> learning rate

    def serves(self, rank: int) -> bool:
        return self.layout is not None and self.layout.is_server(rank)


def plan(cfg: Config, data, info, run_dir: Path) -> Plan:
    t = cfg.train
    layout = ps.check_layout(cfg, info.world_size) if cfg.dist.mode == "ps" else None
    data_world = layout.trainers if layout is not None else info.world_size
    g = step_batch(cfg.data, t.grad_accum, data_world)
    batches = BatchPlan(len(data.train), max(1, g // data_world), data_world, min(info.rank, data_world - 1), t.seed,
                        global_batch=g, draw=data.train.draw, drop_last=cfg.data.drop_last)
    per_epoch = batches.steps_per_epoch // t.grad_accum
    if per_epoch == 0:
        raise BrickyardError(f"train.grad_accum: {t.grad_accum} is more than the {batches.steps_per_epoch} batches in an epoch.")
    planned = math.ceil(t.epochs * per_epoch) if t.epochs else t.max_steps  # what the schedule spans
    total = planned  # where the run stops: max_steps and stop_epoch end it early, never reshape the schedule
    if t.max_steps:
        total = min(total, t.max_steps)
    if t.stop_epoch:
        total = min(total, math.ceil(t.stop_epoch * per_epoch))
    peak, schedule = _schedule(cfg, data_world, planned, per_epoch)
    return Plan(cfg, Path(run_dir), layout, data_world, batches, per_epoch, total, peak, schedule)


def check_placement(cfg: Config, model: nn.Module, device: torch.device, distributed: bool) -> None:
    """``dist.*`` settings this device cannot honour, as config errors before the process group forms
    (torch would fail later, inside ``init_process_group`` or DDP's wrap, with a message about itself)."""
    if not distributed:
        return
    if cfg.dist.backend == "nccl" and (device.type != "cuda" or not torch.distributed.is_nccl_available()):
        where = f"this run's device is {device.type}" if device.type != "cuda" else "this torch was built without it"
        raise ConfigError(f"dist.backend: nccl runs on CUDA GPUs only and {where}; use gloo or auto.")
    if cfg.dist.sync_bn and device.type != "cuda" and any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError(f"dist.sync_bn: torch's SyncBatchNorm runs on GPUs only and this run's device is {device.type}; "
                          f"turn it off (each process then normalises over its own share of the batch).")


def _place(req: Request, host, log):
    """The model on its device (layout, SyncBatchNorm, activation checkpointing, FSDP) and the optimiser's
    parameter groups: (model, channels_last, groups)."""
    cfg, model, data, info = req.config, req.model, req.data, req.info
    t, device = cfg.train, host.device
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    sharding = cfg.dist.strategy == "fsdp" and info.distributed
    channels_last = host.channels_last and data.is_images and not sharding  # FSDP shards contiguous parameters only
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    if cfg.dist.sync_bn and info.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    checkpointed = activation_checkpointing.apply(model, t.activation_checkpointing)
    if checkpointed:
        log.info(f"activation checkpointing: {len(checkpointed)} blocks ({_some(checkpointed)}) recompute their "
                 f"activations in the backward pass")
    if cfg.dist.strategy == "fsdp":
        _shard(model, cfg.dist, host, info, log)
    head = find_head(model) if cfg.finetune.head_lr_mult != 1.0 else None
    return model, channels_last, param_groups(model, cfg.optim, head, cfg.finetune.head_lr_mult)


def _ps_groups(the_plan: Plan, info):
    """Parameter-server mode: the trainers' process group and the messages' group (every rank makes both,
    in this order: ``new_group`` is collective); (None, None) otherwise."""
    if the_plan.layout is None or not info.distributed:
        return None, None
    return torch.distributed.new_group(list(range(the_plan.layout.trainers))), ps.message_group()


def serve(req: Request, host, the_plan: Plan, log) -> None:
    """A parameter server's whole part in the job: hold its share of the parameters and apply the
    trainers' pushes until they are done. No training run is built on this rank."""
    _, _, groups = _place(req, host, log)
    _, ps_group = _ps_groups(the_plan, req.info)
    ps.serve([p.detach() for g in groups for p in g["params"]], the_plan.layout, req.info.rank, the_plan.config,
             the_plan.total_steps, the_plan.schedule, log, ps_group)
    dist.barrier()


def build_run(req: Request, host, log, the_plan: Plan) -> Run:
    """The parts of a training run, built once from the plan: the model on its device, optimiser, update
    strategy, loader, loss and scaler; nothing wrapped yet (``wrap``)."""
    cfg, data, run_dir, meta, info = the_plan.config, req.data, the_plan.run_dir, req.meta, req.info
    t, device = cfg.train, host.device
    model, channels_last, groups = _place(req, host, log)
    group, ps_group = _ps_groups(the_plan, info)
    engine = Engine(data_world=the_plan.data_world, group=group, info=info, host=host, meta=meta,
                    channels_last=channels_last, peak_lr=the_plan.peak_lr, groups=groups, schedule=the_plan.schedule,
                    loss_sum=make_loss_sum(req.loss_fn, cfg.optim.label_smoothing, torch.tensor(
                        cfg.optim.class_weights, dtype=torch.float32, device=device) if cfg.optim.class_weights else None),
                    eval_loss_sum=make_loss_sum(req.loss_fn),
                    step_fn=req.train_step or default_step, scaler=torch.amp.GradScaler("cuda", enabled=host.precision == "fp16"),
                    check_each_step=t.nan_guard and device.type == "cpu", sharded=fsdp.is_sharded(model))
    run = Run(cfg, model, build_optimizer(cfg.optim, groups), data, info.rank, info.world_size, device, host.precision,
              run_dir, log, the_plan.steps_per_epoch, the_plan.total_steps, meter=Meter(Totals(device, group)),
              _engine=engine)
    engine.update = _update_strategy(run, the_plan.layout, groups, ps_group)
    engine.loader = make_train_loader(data.train, cfg.data, device, the_plan.data_world, info.rank, t.seed, t.grad_accum)
    _check_image_features(cfg, data)
    engine.prep = augment.build(cfg, data, device, channels_last, t.seed, the_plan.data_world, group,
                                augment.float_dtype(model))
    return run


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _shard(model, d, host, info, log) -> None:
    """``dist.strategy: fsdp``: shard the parameters across the ranks before the optimiser sees them."""
    if not info.distributed:
        log.info("dist.strategy: fsdp on one process: nothing to shard, the model trains whole")
        return
    blocks = fsdp.shard(model, d, host.precision, host.device)
    where = f"{len(blocks)} blocks ({_some(blocks)}) and the root" if blocks else "the whole model as one unit"
    offload = ""
    if d.fsdp.offload:
        offload = (", shards offloaded to host memory" if host.device.type == "cuda" else
                   "; dist.fsdp.offload has nothing to do on a CPU run (the shards are in host memory already)")
    log.info(f"FSDP: {where} sharded across {info.world_size} ranks{offload}")


def _schedule(cfg, data_world: int, total: int, per_epoch: int):
    peak, sched_cfg = cfg.schedule.lr_max or cfg.optim.lr, cfg.schedule
    if cfg.dist.scale_lr == "linear" and data_world > 1:
        peak *= data_world
        if sched_cfg.name != "onecycle" and sched_cfg.warmup_epochs < cfg.dist.scale_warmup_epochs:
            sched_cfg = dataclasses.replace(sched_cfg, warmup_epochs=cfg.dist.scale_warmup_epochs)
    return peak, Schedule(sched_cfg, peak, total, per_epoch)


def _update_strategy(run: Run, layout, groups, ps_group):
    """The optimiser, the parameter server (``dist.mode: ps``) or P-BFGS (``boost.dim_reduce``), behind one interface."""
    cfg, e = run.config, run._engine
    if layout is not None:
        params = [p for g in groups for p in g["params"]]
        return ps.ParameterServerUpdate(ps.Client(params, layout, cfg.dist.ps.sync, ps_group))
    if cfg.boost.dim_reduce.enabled:
        named = _trainable(run.model)
        P = boost.resolve_subspace(cfg, run.run_dir, [n for n, _ in named], sum(p.numel() for _, p in named), run.log)
        how = boost.method_settings(cfg.boost.dim_reduce)
        run.log.info(f"dimension-reduction stage 2 ({how.method}: rho {how.rho:g}, up to {how.max_search} step sizes, "
                     f"alpha {how.alpha:g}): {boost.p_memory(P.shape)}; the optimiser is replaced by P-BFGS")
        return boost.DimReduceUpdate(boost.DimReduce([p for _, p in named], P, boost.method_settings(cfg.boost.dim_reduce)), e.loss_sum,
                                     lambda: dev.autocast(run.device, run.precision), e.group)
    return OptimizerUpdate(e.scaler)


def _trainable(model) -> list:
    """(name, parameter) of what the optimiser trains: the order of boost's snapshots and subspace."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _check_image_features(cfg, data) -> None:
    if data.is_images:
        return
    shape = "x".join(str(s) for s in data.sample_shape) or "a scalar"
    d = cfg.data
    for key, on in (("augment", d.augment != "none"), ("rand_augment", bool(d.rand_augment)),
                    ("random_erasing", d.random_erasing > 0), ("cutmix", d.cutmix > 0), ("tta", d.tta != "none")):
        if on:
            raise BrickyardError(f"data.{key}: {getattr(d, key)!r} works on images (N x C x H x W); these inputs are N x {shape}.")


def callbacks_for(run: Run, metrics, tb, extra) -> CallbackList:
    """brickyard's behaviours, then the config's built-ins and the user's callbacks, in one list. The
    order is part of the contract: ``ProgressLog`` sets ``run.train_loss`` before ``NotLearning`` reads
    it, and checkpoints are written before a user's ``on_epoch_end`` sees ``run.last_checkpoint``."""
    t, c, e = run.config.train, run.config.checkpoint, run._engine
    e.checkpoints = ckpt.Checkpoints(run.run_dir / "checkpoints", c.keep_last, c.keep_best, run.is_main, guard)
    hint = None if run.data.in_memory else "try more data.num_workers"
    own = [ProgressLog(run, metrics, tb, hint, guard), NotLearning(stop=t.stop_if_not_learning),
           Checkpointing(e.checkpoints, c.every_steps, c.every_epoch, c.monitor)]
    if t.watch:
        own.append(Watching(Watcher(run.model, t.watch), t.watch_every, metrics, tb))
    if t.test_every:
        own.append(TestEvery(t.test_every, metrics, tb, evaluate_split))
    if t.histograms_every:
        own.append(Histograms(t.histograms_every, tb))
    if t.profile_steps:
        where = Path(t.profile_dir).expanduser() if t.profile_dir else run.run_dir / "profile"
        own.append(Profiling(*t.profile_steps, where, run.rank, run.device))
    b = run.config.boost
    if b.snapshots.enabled:
        named = _trainable(run.model)
        snaps = boost.Snapshots(boost.snapshot_dir(run.config, run.run_dir), b.snapshots.keep, [n for n, _ in named],
                                b.snapshots.include_init) \
            if run.is_main else None
        own.append(Snapshotting(snaps, b.snapshots, b.dim_reduce.n_components, [p for _, p in named]))
    if isinstance(e.update, boost.DimReduceUpdate):
        own.append(Stage2Log(e.update.booster.stats, metrics))
    e.callbacks = CallbackList(own + list(extra))
    return e.callbacks


def wrap(run: Run) -> None:
    """The gradient sync of collective runs of several processes (DDP, one flat all-reduce, or FSDP's
    inside the backward pass), then ``torch.compile`` when asked."""
    e = run._engine
    model, e.grad_sync = run.model, gradsync.GradSync()
    if e.sharded:  # FSDP reduce-scatters inside the backward pass
        e.grad_sync = fsdp.FSDPSync(run.model)
    elif run.world_size > 1 and not isinstance(e.update, ps.ParameterServerUpdate):  # the servers sync the rest
        model, e.grad_sync = grad_sync(run.config.dist, run.model, run.device, e.group, e.host.own_cores)
    n_params = sum(p.numel() for p in run.model.parameters())
    e.compiled = dev.resolve_compile(run.config.train.compile, run.device, n_params, run.total_steps)
    run.forward = torch.compile(model) if e.compiled else model
    e.vote = dist.StopVote(e.info, warn=run.log.warning, group=e.group)


def grad_sync(d, model: nn.Module, device: torch.device, group=None, own_cores: bool = True):
    """(the model to call, its ``gradsync.GradSync``) for ``dist.grad_sync`` (``d`` is the config's ``dist``).
    ``auto`` takes flat on CPUs (measured faster there: no idle core to overlap with; a user's step is
    synced by brickyard after its backward too) and DDP on GPUs, with SyncBatchNorm, and for parameters
    of several dtypes. Why a rule and not a measurement: timing both would take collective steps on every
    rank before training (DDP's buckets settle after a few), and the ordering held on every machine
    measured (``benchmarks/cpu_scaling.py``, ``brickyard bench --devices cpu:2`` reports each part)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    fits = bool(trainable) and len({(p.dtype, p.device) for p in trainable}) == 1
    if d.grad_sync == "flat" and not fits:  # sync_bn is refused with the config
        raise BrickyardError("dist.grad_sync: flat needs trainable parameters of one dtype on one device; use dist.grad_sync: ddp.")
    how = d.grad_sync
    if how == "auto":
        how = "flat" if device.type == "cpu" and fits and not d.sync_bn else "ddp"
    if how == "flat":
        return model, gradsync.FlatGrads(model, group, spin=own_cores)
    ddp = nn.parallel.DistributedDataParallel(model, **({"device_ids": [device.index]} if device.type == "cuda" else {}))
    return ddp, gradsync.GradSync(ddp)


def announce(run: Run, host: dev.Host, info, measured: dict | None = None) -> None:
    """The start-of-run lines: hardware and settings (with how ``precision: auto`` chose, where it
    measured), model and data, batch and schedule, groups."""
    cfg, data, log = run.config, run.data, run.log
    how = f" (auto: {measured['how']})" if measured else ""
    n_params = sum(p.numel() for p in run.model.parameters())
    pinned = f" on CPU {','.join(map(str, host.pinned))}" if host.pinned else ""
    log.info(f"device {dev.describe(host.device)}, precision {host.precision}{how}, channels_last {run._engine.channels_last}, "
             f"{host.threads} threads{pinned}" + (f", {host.workers} loader workers" if not data.in_memory else "")
             + f", allocator {host.allocator}, world size {info.world_size}"
             + (f", gradient sync {run._engine.grad_sync.name}" if info.world_size > 1 else "")
             + (", compiled" if run._engine.compiled else "") + f", pid {os.getpid()}")
    log.info(f"model {run._engine.meta.get('name', type(run.model).__name__)} ({n_params:,} parameters), "
             f"data {data.name}: {len(data.train):,} train / {len(data.val) if data.val else 0:,} val / "
             f"{len(data.test) if data.test else 0:,} test")
    if cfg.data.eval_limit and any(s is not None and len(s) > cfg.data.eval_limit for s in (data.val, data.test)):
        log.info(f"data.eval_limit: validation and test read the first {cfg.data.eval_limit:,} images of each split only")
    for note in data.notes:
        log.info(note)
    if cfg.model.whiten:
        log.info(whitening.describe(run.model, whitening.images_used(data)))
    accum, peak = cfg.train.grad_accum, run._engine.peak_lr
    parts = device_batches(cfg.data, accum, run._engine.data_world)
    shown = str(parts[0]) if len(set(parts)) == 1 else "-".join(map(str, sorted(set(parts), reverse=True)))
    log.info(f"global batch {sum(parts) * accum} ({shown} per device x {run._engine.data_world} x {accum} accumulation), "
             f"{run.steps_per_epoch} steps/epoch, {run.total_steps} steps, peak lr {peak:g} ({cfg.schedule.name})")
    if not cfg.data.global_batch_size and run._engine.data_world > 1:  # the user fixed the per-device batch: say what moved
        base = cfg.schedule.lr_max or cfg.optim.lr
        rate = (f"dist.scale_lr: linear raised the peak rate {base:g} -> {peak:g}" if peak != base else
                f"the peak rate stays {base:g} (dist.scale_lr: linear would make it {base * run._engine.data_world:g})")
        log.info(f"data.batch_size {cfg.data.batch_size} per device: the global batch grows with the world size "
                 f"({cfg.data.batch_size * accum} on one device, {sum(parts) * accum} on {run._engine.data_world}); {rate}")
    for line in describe_groups(run._engine.groups, peak):
        log.info(line)


def resolve_auto_batch(cfg, model, data, device, info, log):
    """``data.batch_size: auto``: probe this device, then take the smallest choice over all ranks."""
    batch, how = memory.auto_batch(cfg, model, data, device, info.world_size, len(data.train))
    agreed = torch.tensor([batch], dtype=torch.float64, device=device)
    if info.distributed:
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    batch = int(agreed.item())
    log.info(f"data.batch_size: auto chose {batch} per device ({how}, agreed by all {info.world_size} rank(s))")
    return cfg.replace(**{"data.batch_size": batch})
