"""The training loop, for one process of a job of any size.

``train(cfg, model, data, run_dir)`` does everything a run needs: device and precision, the
process group, loaders, the optimiser, checkpoints and resume, evaluation and the summary. The
loop itself (``_loop``) is one screen: every behaviour is a callback (``brickyard.behaviours``,
``brickyard.callbacks``) and the step is ``brickyard.steps.train_step``.

Position in training is one integer, the optimiser ``step``: epoch = step // steps_per_epoch and
the batch inside the epoch follow from it, the learning rate is a pure function of it, and the
batch plan and augmentation are seeded from it. A checkpoint therefore needs only the weights,
optimiser/scaler state, RNG state, callback state and ``step`` to resume exactly.

Host syncs: the loop accumulates loss and accuracy sums on the device and reads them back
(``.item()`` after an all-reduce) only every ``train.log_every`` steps and at evaluations.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from brickyard import behaviours as bh
from brickyard import checkpoint as ckpt
from brickyard import device as dev
from brickyard import dist, failures, ps, steps
from brickyard.callbacks import CallbackList, from_config
from brickyard.config import Config, save_config
from brickyard.data import DataBundle
from brickyard.data.augment import DevicePrep
from brickyard.data.loaders import BatchPlan, make_train_loader
from brickyard.errors import BrickyardError, CheckpointError
from brickyard.evaluation import evaluate, evaluate_split, finish
from brickyard.finetune import find_head
from brickyard.optim import Schedule, build_optimizer, describe_groups, param_groups
from brickyard.runlog import Logger, MetricsWriter, default_run_dir, env_record, refuse_reuse, write_json
from brickyard.state import Run
from brickyard.tboard import TBWriter

__all__ = ["train", "evaluate", "Interrupted"]


class Interrupted(BrickyardError):
    exit_code = 130


def _loop(run: Run, cbs) -> None:
    """Train until ``total_steps`` or an agreed stop; the behaviours happen in the callbacks."""
    accum = run.config.train.grad_accum
    cbs.on_train_start(run)
    while run.step < run.total_steps and run.stopped is None:
        run.epoch, pos = divmod(run.step, run.steps_per_epoch)
        cbs.on_epoch_start(run)
        batches = run.loader.epoch(run.epoch, pos * accum)
        for _ in range(pos, run.steps_per_epoch):
            cbs.on_step_start(run)
            loss = run.train_step(run, batches)
            run.step += 1
            cbs.on_step_end(run, loss)
            if run.vote.should_stop(run.step, run.stop_request):
                run.stopped = run.vote.cause
            if run.stopped or run.step >= run.total_steps:
                break
        if run.interrupted:
            break
        if run.step % run.steps_per_epoch == 0 or run.step >= run.total_steps or run.stopped:  # an epoch ends
            if _validation_due(run):
                _validate(run, cbs)
            _agree_on_stop(run)
            cbs.on_epoch_end(run)
    cbs.on_loop_end(run)


def _validation_due(run: Run) -> bool:
    every = run.config.train.eval_every
    ended = run.step >= run.total_steps or run.stop_request is not None or run.stopped is not None
    return run.data.val is not None and ((every and math.ceil(run.step / run.steps_per_epoch) % every == 0) or ended)


def _validate(run: Run, cbs) -> None:
    cbs.on_validation_start(run)
    r = evaluate_split(run, run.data.val)
    run.metrics = r
    run.extras.update(last_val=r, validated_at=run.step)
    cbs.on_validation_end(run, r)


def _agree_on_stop(run: Run) -> None:
    """At an epoch end every rank is at the same step: one all-reduce of the callbacks' stop requests (a
    decision on the shared validation metrics, or a time limit reached on one rank only). A signal is
    agreed through ``run.vote`` instead, so that every rank names it."""
    request = run.stop_request if run.stop_request and not run.stop_request.startswith("SIG") else None
    if run.stopped is not None:
        return
    if run.data_world > 1:
        flag = torch.tensor([float(request is not None)], device=run.device)
        if dist.all_reduce_sum(flag, run.group).item() > 0:
            run.stopped = request or "a stop asked for on another rank"
    elif request is not None:
        run.stopped = request


class _StopFlag:
    """SIGINT/SIGTERM become a stop request (``run.stop_request = "SIGTERM"``); a second Ctrl-C leaves at once."""

    def __init__(self, run: Run):
        self.run, self._old = run, {}

    def __enter__(self):
        import threading
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.run.stop_request is not None and self.run.stop_request.startswith("SIG"):
            raise KeyboardInterrupt
        self.run.stop_request = signal.Signals(signum).name  # a signal outranks a callback's request

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def train(cfg: Config, model: nn.Module, data: DataBundle, run_dir: Path | None = None, resume: str | None = None,
          model_meta: dict | None = None, info: dist.DistInfo | None = None, log_dir: Path | None = None,
          callbacks=(), loss_fn=None, train_step=None) -> dict:
    """Train ``model`` on ``data`` as this process's share of the job; return the summary dict."""
    wall_start = time.perf_counter()
    info = info or dist.from_env()
    with _torch_flags():
        host = dev.setup(cfg.train, info.local_rank, info.local_world_size)
        if host.device.type == "cuda":
            torch.cuda.set_device(host.device)
        try:
            created = dist.init(info, cfg.dist.backend, host.device, cfg.dist.timeout_s)
        except RuntimeError as e:
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise BrickyardError(f"rank {info.rank}: could not join the process group within dist.timeout_s="
                                 f"{cfg.dist.timeout_s}s ({reason}).") from None
        try:
            run_dir = Path(run_dir) if run_dir else Path(dist.broadcast_object(str(default_run_dir(cfg.preset))))
            return _run_in(run_dir, log_dir, cfg, model, data, resume, model_meta or {}, info, host, wall_start,
                           (list(callbacks), loss_fn, train_step))
        finally:
            if created:  # a process group the caller made is theirs to end
                dist.shutdown()


@contextlib.contextmanager
def _torch_flags():
    """Put back the process-wide torch settings a run changes (``fit`` leaves the process as it found it)."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark, torch.get_num_threads())
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.benchmark = saved[1]
        torch.set_num_threads(saved[2])


def _run_in(run_dir: Path, log_dir, cfg, model, data, resume, meta, info, host, wall_start, user) -> dict:
    """The run inside its directory: logs and metrics opened, failures turned into one sentence."""
    if info.is_main and not resume and info.restart_count == 0:
        refuse_reuse(run_dir)  # before anything in it is opened
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(log_dir) if log_dir else run_dir / "logs"
    log = Logger(info.rank, tuple([log_dir / f"workerlog.{info.rank}"] + ([run_dir / "train.log"] if info.is_main else [])))
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if info.is_main else None)
    heartbeat = None
    try:
        heartbeat = dist.Heartbeat(info)
        return _train(cfg, model, data, run_dir, resume, meta, info, host, log, metrics, wall_start, user)
    except BrickyardError as e:
        log.error(str(e))
        raise
    except (torch.OutOfMemoryError, RuntimeError) as e:
        raise failures.explain(e, cfg, model, data, host.device, info, log, heartbeat, log_dir) from None
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        metrics.close()
        log.close()


def _train(cfg, model, data, run_dir, resume, meta, info, host: dev.Host, log: Logger, metrics: MetricsWriter,
           wall_start, user) -> dict:
    user_callbacks, loss_fn, user_step = user
    if resume and cfg.dist.mode == "ps":
        raise BrickyardError(ps.NO_RESUME)
    torch.manual_seed(cfg.train.seed)
    if cfg.data.batch_size == "auto":
        cfg = _resolve_auto_batch(cfg, model, data, host.device, info, log)
    run = _build_run(cfg, model, data, run_dir, meta, info, host, log, loss_fn, user_step)
    if run.update is None:  # a parameter server: it serves until the trainers are done
        return {}
    tb = TBWriter(run_dir if info.is_main else None, cfg.train.tensorboard, log.warning)
    progress = bh.ProgressLog(run, metrics, tb, None if run.data.in_memory else "try more data.num_workers")
    cbs = _callbacks(run, progress, metrics, tb, from_config(cfg) + user_callbacks)
    _restore(run, cbs, resume)
    _wrap(run)
    if info.is_main:
        save_config(cfg, run_dir / "config.yaml")
        write_json(run_dir / "env.json", env_record(host.device, cfg.train.seed, info.world_size, {
            "precision": run.precision, "channels_last": run.extras["channels_last"], "threads": host.threads,
            "allocator": host.allocator, "model": meta, "restart_count": info.restart_count}))
    _announce(run, host, info)
    metrics.write(kind="start", step=run.step, world_size=info.world_size, total_steps=run.total_steps)
    run.model.train()
    with _StopFlag(run):
        _loop(run, cbs)
    run.loader.close()  # the streaming loader's persistent workers
    if hasattr(run.update, "finish"):
        run.update.finish()
    if run.interrupted:
        where = f" to {run.last_checkpoint}" if run.last_checkpoint else ""
        raise Interrupted(f"{run.stopped} at step {run.step}: saved a checkpoint{where}; resume with "
                          f"`brickyard train {cfg.preset} --run-dir {run_dir} --resume auto`.")
    summary = finish(run, progress, wall_start)
    cbs.on_train_end(run, summary)
    metrics.write(kind="summary", **{k: v for k, v in summary.items() if k != "run_dir"})
    dist.barrier()
    return summary


def _build_run(cfg, model, data, run_dir, meta, info, host, log, loss_fn, user_step) -> Run:
    """Model on its device, optimiser, batch plan, schedule and update strategy; nothing wrapped yet."""
    t, device = cfg.train, host.device
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    channels_last = host.channels_last and data.is_images
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    if cfg.dist.sync_bn and info.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    head = find_head(model) if cfg.finetune.head_lr_mult != 1.0 else None
    groups = param_groups(model, cfg.optim, head, cfg.finetune.head_lr_mult)
    layout = ps.check_layout(cfg, info.world_size) if cfg.dist.mode == "ps" else None
    group, ps_group, data_world = None, None, info.world_size
    if layout is not None:  # only the trainers read data; the servers hold the parameters
        if info.distributed:
            group = torch.distributed.new_group(list(range(layout.trainers)))
            ps_group = ps.message_group()
        data_world = layout.trainers
    plan = BatchPlan(len(data.train), cfg.data.batch_size, data_world, min(info.rank, data_world - 1), t.seed)
    per_epoch = plan.steps_per_epoch // t.grad_accum
    if per_epoch == 0:
        raise BrickyardError(f"train.grad_accum: {t.grad_accum} is more than the {plan.steps_per_epoch} batches in an epoch.")
    total = math.ceil(t.epochs * per_epoch)
    if t.max_steps:
        total = min(total, t.max_steps) if t.epochs else t.max_steps
    peak, schedule = _schedule(cfg, data_world, total, per_epoch)
    run = Run(cfg, model, build_optimizer(cfg.optim, groups), info.rank, info.world_size, device, host.precision,
              run_dir, log, per_epoch, total, data=data, data_world=data_world, group=group, schedule=schedule,
              loss_sum=steps.make_loss_sum(loss_fn, cfg.optim.label_smoothing), train_step=user_step or steps.train_step,
              scaler=torch.amp.GradScaler("cuda", enabled=host.precision == "fp16"), totals=steps.Totals(device, group),
              check_each_step=t.nan_guard and device.type == "cpu")
    run.extras.update(channels_last=channels_last, model_name=meta.get("name"), meta=meta, peak=peak, groups=groups, info=info)
    if layout is not None and layout.is_server(info.rank):
        ps.serve([p.detach() for g in groups for p in g["params"]], layout, info.rank, cfg, total, schedule, log, ps_group)
        dist.barrier()
        return run  # run.update stays None: this process served and is done
    run.update = _update_strategy(run, layout, groups, ps_group)
    run.loader = make_train_loader(data.train, cfg.data, device, data_world, info.rank, t.seed)
    _check_image_features(cfg, data)
    run.prep = DevicePrep(data.mean, data.std, cfg.data.augment, cfg.data.shift, channels_last, device, t.seed)
    return run


def _schedule(cfg, data_world: int, total: int, per_epoch: int):
    import dataclasses
    peak, sched_cfg = cfg.schedule.lr_max or cfg.optim.lr, cfg.schedule
    if cfg.dist.scale_lr == "linear" and data_world > 1:
        peak *= data_world
        if sched_cfg.name != "onecycle" and sched_cfg.warmup_epochs < cfg.dist.scale_warmup_epochs:
            sched_cfg = dataclasses.replace(sched_cfg, warmup_epochs=cfg.dist.scale_warmup_epochs)
    return peak, Schedule(sched_cfg, peak, total, per_epoch)


def _update_strategy(run: Run, layout, groups, ps_group):
    from brickyard import boost
    cfg = run.config
    if layout is not None:
        params = [p for g in groups for p in g["params"]]
        return steps.ParameterServerUpdate(ps.Client(params, layout, cfg.dist.ps.sync, ps_group))
    if cfg.boost.dim_reduce.enabled:
        named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
        P = boost.resolve_subspace(cfg, run.run_dir, [n for n, _ in named], sum(p.numel() for _, p in named), run.log)
        run.log.info(f"dimension-reduction stage 2: {boost.p_memory(P.shape)}; the optimiser is replaced by P-BFGS")
        return steps.DimReduceUpdate(boost.DimReduce([p for _, p in named], P, cfg.boost.dim_reduce))
    return steps.OptimizerUpdate()


def _check_image_features(cfg, data) -> None:
    if data.is_images:
        return
    shape = "x".join(str(s) for s in data.sample_shape) or "a scalar"
    if cfg.data.augment != "none":
        raise BrickyardError(f"data.augment: {cfg.data.augment!r} works on images (N x C x H x W); these inputs are N x {shape}.")


def _callbacks(run: Run, progress, metrics, tb, extra) -> CallbackList:
    """brickyard's behaviours, then the config's built-ins and the user's callbacks, in one list."""
    from brickyard import boost
    from brickyard.inspection import Watcher
    t, c = run.config.train, run.config.checkpoint
    manager = ckpt.CheckpointManager(run.run_dir / "checkpoints", c.keep_last, c.keep_best) if run.is_main else None
    own = [progress, bh.Checkpointing(manager, c.every_steps, c.every_epoch, _checkpoint_state)]
    if t.watch:
        own.append(bh.Watching(Watcher(run.model, t.watch), t.watch_every, metrics, tb))
    if t.histograms_every:
        own.append(bh.Histograms(t.histograms_every, tb))
    if run.config.boost.snapshots.enabled and run.is_main:
        named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
        snaps = boost.Snapshots(boost.snapshot_dir(run.config, run.run_dir), run.config.boost.snapshots.keep, [n for n, _ in named])
        own.append(bh.Snapshotting(snaps, run.config.boost.snapshots, [p for _, p in named]))
    run.callbacks = CallbackList(own + list(extra))
    run.extras["manager"] = manager
    return run.callbacks


def _wrap(run: Run) -> None:
    """DDP for collective runs of several processes, then ``torch.compile`` when asked."""
    model = run.model
    if run.world_size > 1 and isinstance(run.update, (steps.OptimizerUpdate, steps.DimReduceUpdate)):
        kwargs = {"device_ids": [run.device.index]} if run.device.type == "cuda" else {}
        model = nn.parallel.DistributedDataParallel(model, **kwargs)
    run.forward = torch.compile(model) if run.config.train.compile else model
    run.vote = dist.StopVote(run.extras["info"])


def _checkpoint_state(run: Run) -> dict:
    data, meta = run.data, run.extras["meta"]
    manager = run.extras.get("manager")
    return {
        "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict(),
        "rng": failures.rng_state(run.device), "step": run.step, "epoch": run.step // run.steps_per_epoch,
        "best_metric": manager.best_metric if manager else None, "config": run.config.to_dict(),
        "boost": run.update.state_dict(), "callbacks": run.callbacks.state_dict(),
        "meta": {**meta, "classes": list(data.classes), "mean": list(data.mean), "std": list(data.std),
                 "image_size": list(data.image_size), "in_channels": data.in_channels,
                 "num_classes": data.num_classes, "data": data.name},
    }


def _restore(run: Run, cbs, resume: str | None) -> None:
    """Continue from a checkpoint: weights, optimiser, scaler, RNG, callbacks' state and the step."""
    if not resume:
        return
    found = _resume_state(resume, run.run_dir, run.log)
    if found is None:
        return
    path, state = found
    ckpt.check_model(state, run.model, path)
    run.model.load_state_dict(state["model"])
    try:
        run.optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: optimiser state does not fit ({e}).") from None
    if state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    if state.get("boost") and isinstance(run.update, steps.DimReduceUpdate):
        run.update.booster.load_state_dict(state["boost"])
    cbs.load_state_dict(state.get("callbacks") or {})
    failures.set_rng_state(state["rng"], run.device)
    run.step = int(state["step"])
    if run.extras.get("manager") is not None:
        run.extras["manager"].best_metric = state.get("best_metric")
    run.log.info(f"resumed from {path} at step {run.step} (epoch {run.step // run.steps_per_epoch})")


def _resume_state(resume: str, run_dir: Path, log: Logger):
    if resume == "auto":
        found = ckpt.newest_valid(run_dir / "checkpoints", log.warning)
        if found is None:
            log.info(f"no checkpoint in {run_dir / 'checkpoints'}; starting from scratch")
        return found
    return Path(resume), ckpt.load(resume)


def _announce(run: Run, host: dev.Host, info) -> None:
    """The start-of-run lines: hardware and settings, model and data, batch and schedule, groups."""
    cfg, data, log = run.config, run.data, run.log
    n_params = sum(p.numel() for p in run.model.parameters())
    log.info(f"device {dev.describe(host.device)}, precision {host.precision}, channels_last {run.extras['channels_last']}, "
             f"{host.threads} threads, allocator {host.allocator}, world size {info.world_size}, pid {os.getpid()}")
    log.info(f"model {run.extras['meta'].get('name', type(run.model).__name__)} ({n_params:,} parameters), "
             f"data {data.name}: {len(data.train):,} train / {len(data.val) if data.val else 0:,} val / "
             f"{len(data.test) if data.test else 0:,} test")
    accum, peak = cfg.train.grad_accum, run.extras["peak"]
    log.info(f"global batch {cfg.data.batch_size * run.data_world * accum} "
             f"({cfg.data.batch_size} per device x {run.data_world} x {accum} accumulation), "
             f"{run.steps_per_epoch} steps/epoch, {run.total_steps} steps, peak lr {peak:g} ({cfg.schedule.name})")
    for line in describe_groups(run.extras["groups"], peak):
        log.info(line)


def _resolve_auto_batch(cfg, model, data, device, info, log):
    """``data.batch_size: auto``: probe this device, then take the smallest choice over all ranks."""
    from brickyard import memory
    batch, how = memory.auto_batch(cfg, model, data, device, info.world_size, len(data.train))
    agreed = torch.tensor([batch], dtype=torch.float64, device=device)
    if info.distributed:
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    batch = int(agreed.item())
    log.info(f"data.batch_size: auto chose {batch} per device ({how}, agreed by all {info.world_size} rank(s))")
    return cfg.replace(**{"data.batch_size": batch})
