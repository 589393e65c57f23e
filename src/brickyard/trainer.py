"""The training loop, for one process of a job of any size.

``train(cfg, model, data, run_dir)`` does everything a run needs: device and precision, the
process group, loaders, the optimiser, checkpoints and resume, evaluation and the summary.

Position in training is one integer, the optimiser ``step``: epoch = step // steps_per_epoch and
the batch inside the epoch follow from it, the learning rate is a pure function of it, and the
batch plan and augmentation are seeded from it. A checkpoint therefore needs only the weights,
optimiser/scaler state, RNG state and ``step`` to resume exactly.

Host syncs: the loop accumulates loss and accuracy sums on the device and reads them back
(``.item()`` after an all-reduce) only every ``train.log_every`` steps and at evaluations.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from brickyard import checkpoint as ckpt
from brickyard import device as dev
from brickyard import boost, dist, ps
from brickyard.config import Config, save_config
from brickyard.data import DataBundle, Split
from brickyard.data.augment import DevicePrep
from brickyard.data.loaders import BatchPlan, eval_batches, make_train_loader
from brickyard.errors import BrickyardError, CheckpointError
from brickyard.finetune import find_head
from brickyard.inspection import Watcher, first_nonfinite
from brickyard.metrics import EvalAccumulator, fit_hint
from brickyard.optim import Schedule, build_optimizer, describe_groups, l1_penalty, param_groups, set_lr
from brickyard.tboard import TBWriter
from brickyard.runlog import Logger, MetricsWriter, env_record, refuse_reuse, write_json


INPUT_BOUND = 0.2  # a log window spending more than this fraction waiting for batches is reported as input-bound


class Interrupted(BrickyardError):
    exit_code = 130


class _StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it between steps and saves before leaving."""

    def __init__(self):
        self.name = None  # "SIGTERM" once caught
        self._old = {}

    def __enter__(self):
        import threading
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.name is not None:  # a second Ctrl-C leaves at once
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def evaluate(model: nn.Module, split: Split, prep: DevicePrep, device: torch.device, precision: str,
             batch_size: int, num_classes: int, world: int = 1, rank: int = 0, group=None, keep_errors: int = 0,
             num_workers: int = 0) -> dict:
    """Loss, top-1/top-5 accuracy, per-class accuracy and confusion over every sample of ``split``
    exactly once, summed across ranks. ``keep_errors``: also return up to that many of this
    rank's misclassified raw images with true and predicted labels (host syncs; test time only)."""
    was_training = model.training
    model.eval()
    acc = EvalAccumulator(num_classes, device)
    errors, kept = [], 0
    with torch.no_grad(), dev.autocast(device, precision):
        for x, y in eval_batches(split, batch_size, device, world, rank, num_workers):
            pred = acc.update(model(prep(x)), y)
            if kept < keep_errors:
                wrong = (pred != y).nonzero().flatten()[:keep_errors - kept]
                errors.append((x[wrong].cpu(), y[wrong].cpu(), pred[wrong].cpu()))
                kept += len(wrong)
    model.train(was_training)
    result = acc.result(group)
    if keep_errors and errors:
        result["errors"] = tuple(torch.cat(parts) for parts in zip(*errors))
    return result


def _oom_error(cfg, model, data, device, info) -> BrickyardError:
    from brickyard import memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        est = memory.estimate(cfg, model.cpu(), data, device, info.world_size)
        tips = memory.oom_tips(est, cfg)
        need = f" (estimated {memory.fmt(est['total'])} per device)"
    except Exception:  # noqa: BLE001  the advice must not hide the out-of-memory error itself
        tips, need = "a smaller data.batch_size, train.grad_accum, train.precision=bf16", ""
    return BrickyardError(f"out of memory on {device}{need}; try: {tips}.")


class _Totals:
    """Training loss and correct predictions summed on the device since the process started; the
    sample count is a host integer. ``read()`` is the sync point: one all-reduce of a copy."""

    def __init__(self, device: torch.device, group=None):
        self.loss = torch.zeros((), device=device, dtype=torch.float64)
        self.correct = torch.zeros((), device=device, dtype=torch.float64)
        self.count, self.group = 0, group

    def add(self, loss_sum: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        self.loss.add_(loss_sum.detach())
        self.correct.add_((logits.detach().argmax(1) == y).sum())
        self.count += len(y)

    def read(self) -> list[float]:
        both = torch.stack([self.loss, self.correct, torch.tensor(float(self.count), dtype=torch.float64, device=self.loss.device)])
        return dist.all_reduce_sum(both, self.group).tolist()


class _Progress:
    """The log windows: throughput, time spent waiting for data, and the training loss and accuracy
    read back from the device on log steps only; validation lines with the train/val fit hint."""

    def __init__(self, totals: _Totals, data_world: int, per_epoch: int, log: Logger, metrics: MetricsWriter, tb, bar, plain: bool):
        self.totals, self.data_world, self.per_epoch = totals, data_world, per_epoch
        self.logger, self.metrics, self.tb, self.bar, self.plain = log, metrics, tb, bar, plain
        self.at_log, self.at_eval = [0.0, 0.0, 0], [0.0, 0.0, 0]  # rank-summed totals at the last log line / evaluation
        self.train_seconds, self.images = 0.0, 0
        self.start_window()

    def start_window(self) -> None:
        self.window_start, self.window_count, self.data_wait = time.perf_counter(), self.totals.count, 0.0

    def end_window(self) -> tuple[float, int]:
        """Close the window (at a log step or the end of an epoch); return its seconds and images (all ranks)."""
        now = time.perf_counter()
        elapsed, n = now - self.window_start, (self.totals.count - self.window_count) * self.data_world
        self.train_seconds += elapsed
        self.images += n
        self.window_start, self.window_count = now, self.totals.count
        return elapsed, n

    def log(self, step: int, epoch: int, lr: float, extra: str = "") -> None:
        now = self.totals.read()  # the sync point
        loss_sum, correct, count = (a - b for a, b in zip(now, self.at_log))
        self.at_log[:] = now
        wait, (elapsed, n) = self.data_wait, self.end_window()
        self.data_wait = 0.0
        ips, wait_frac = n / max(elapsed, 1e-9), wait / max(elapsed, 1e-9)
        loss, acc = loss_sum / max(count, 1), correct / max(count, 1)
        line = (f"epoch {epoch} step {step - epoch * self.per_epoch}/{self.per_epoch} loss {loss:.4f} "
                f"acc {acc:.4f} lr {lr:.4f} {ips:,.0f} img/s{extra}")
        if wait_frac > INPUT_BOUND:
            line += f", input-bound: {100 * wait_frac:.0f}% of the time waiting for data (try more data.num_workers)"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f} acc {acc:.4f}")
        self.logger.info(line, console=self.plain)
        self.metrics.write(kind="train", step=step, epoch=round(step / self.per_epoch, 4), loss=loss, accuracy=acc, lr=lr,
                           images_per_second=round(ips, 1), data_wait_fraction=round(wait_frac, 4))
        self.tb.scalars(step, "train", {"loss": loss, "accuracy": acc, "lr": lr, "images_per_second": ips})

    def validation(self, step: int, epoch: float, r: dict) -> None:
        now = self.totals.read()
        train_acc = (now[1] - self.at_eval[1]) / max(now[2] - self.at_eval[2], 1)
        self.at_eval[:] = now
        hint = fit_hint(train_acc, r["accuracy"])
        self.logger.info(f"epoch {epoch:g} step {step} val loss {r['loss']:.4f} acc {r['accuracy']:.4f} top5 {r['top5']:.4f}; "
                         f"train acc {train_acc:.4f}; {hint}")
        self.metrics.write(kind="val", step=step, epoch=epoch, loss=r["loss"], accuracy=r["accuracy"], top5=r["top5"],
                           train_accuracy=train_acc, hint=hint)
        self.tb.scalars(step, "val", {"loss": r["loss"], "accuracy": r["accuracy"], "top5": r["top5"]})


@dataclass(frozen=True)
class _Job:
    """What the end of a run needs to know about the job and this process's place in it."""
    cfg: Config
    info: dist.DistInfo
    data: DataBundle
    run_dir: Path
    host: dev.Host
    data_world: int
    group: object
    model_meta: dict


def _finish(job: _Job, model: nn.Module, prep: DevicePrep, log: Logger, metrics: MetricsWriter, tb, step: int,
            per_epoch: int, last_val: dict | None, progress: _Progress, wall_start: float) -> dict:
    """Test evaluation, the summary (``summary.json``) and the plots; returns the summary."""
    cfg, info, data, run_dir = job.cfg, job.info, job.data, job.run_dir
    summary = {"epochs": round(step / per_epoch, 4), "steps": step, "val_accuracy": None, "val_loss": None,
               "test_accuracy": None, "test_loss": None}
    if last_val is not None:
        summary.update(val_accuracy=last_val["accuracy"], val_loss=last_val["loss"])
    if data.test is not None:
        r = evaluate(model, data.test, prep, job.host.device, job.host.precision, cfg.data.eval_batch_size, data.num_classes,
                     job.data_world, info.rank, job.group, keep_errors=36 if info.is_main and cfg.train.plots else 0,
                     num_workers=cfg.data.num_workers)
        summary.update(test_accuracy=r["accuracy"], test_loss=r["loss"], test_top5=r["top5"])
        metrics.write(kind="test", step=step, loss=r["loss"], accuracy=r["accuracy"], top5=r["top5"],
                      per_class_accuracy=r["per_class_accuracy"], confusion=r["confusion"])
        tb.scalars(step, "test", {"loss": r["loss"], "accuracy": r["accuracy"], "top5": r["top5"]})
        log.info(f"test loss {r['loss']:.4f} acc {r['accuracy']:.4f} top5 {r['top5']:.4f}")
        if info.is_main and "errors" in r:
            wrong_images, true, pred = r["errors"]
            torch.save({"images": wrong_images, "true": true, "pred": pred, "classes": list(data.classes),
                        "mean": list(data.mean), "std": list(data.std)}, run_dir / "test_errors.pt")
    summary.update(
        train_seconds=round(progress.train_seconds, 3), wall_seconds=round(time.perf_counter() - wall_start, 3),
        images_per_second=round(progress.images / max(progress.train_seconds, 1e-9), 1), device=str(job.host.device),
        world_size=info.world_size, mode=cfg.dist.mode, trainers=job.data_world, precision=job.host.precision,
        channels_last=job.host.channels_last, model=job.model_meta.get("name"), data=data.name, run_dir=str(run_dir),
    )
    tb.close()
    if info.is_main:
        write_json(run_dir / "summary.json", summary)
        if cfg.train.plots:  # after summary.json is safely written; their time is added to it
            from brickyard.plots import plot_runs
            start = time.perf_counter()
            try:
                plot_runs([run_dir])
            except BrickyardError as e:
                log.warning(f"no plots: {e}")
            summary["plot_seconds"] = round(time.perf_counter() - start, 3)
            write_json(run_dir / "summary.json", summary)
    return summary


def _determinism_error(e: RuntimeError, device: torch.device) -> str | None:
    """The sentence for PyTorch's refusals under ``torch.use_deterministic_algorithms(True)``."""
    text = str(e)
    if "does not have a deterministic implementation" in text:
        op = text.split(" does not have", 1)[0].strip().split()[-1]
        return (f"train.deterministic: {op} has no deterministic implementation on {device}; "
                f"set train.deterministic=false or use a model without that layer.")
    if "CUBLAS_WORKSPACE_CONFIG" in text:
        return (f"train.deterministic on {device} needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before the "
                f"process starts (`brickyard train` sets it; set it yourself when calling brickyard from Python).")
    return None


def _is_comm_failure(e: RuntimeError) -> bool:
    text = str(e).lower()
    return any(k in text for k in ("timed out", "timeout", "connection closed", "connection reset", "nccl", "gloo"))


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def train(cfg: Config, model: nn.Module, data: DataBundle, run_dir: Path, resume: str | None = None,
          model_meta: dict | None = None, info: dist.DistInfo | None = None, log_dir: Path | None = None) -> dict:
    """Train ``model`` on ``data`` as this process's share of the job; return the summary dict."""
    wall_start = time.perf_counter()
    info = info or dist.from_env()
    run_dir = Path(run_dir)
    t = cfg.train

    host = dev.setup(t, info.local_rank, info.local_world_size)
    device = host.device
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if info.is_main and not resume and info.restart_count == 0:
        refuse_reuse(run_dir)  # before anything in it is opened
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(log_dir) if log_dir else run_dir / "logs"
    log_files = [log_dir / f"workerlog.{info.rank}"] + ([run_dir / "train.log"] if info.is_main else [])
    log = Logger(info.rank, tuple(log_files))
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if info.is_main else None)
    heartbeat = None
    try:
        dist.init(info, cfg.dist.backend, device, cfg.dist.timeout_s)
        heartbeat = dist.Heartbeat(info)
        return _train(cfg, model, data, run_dir, resume, model_meta or {}, info, host, log, metrics, wall_start)
    except BrickyardError as e:
        log.error(str(e))
        raise
    except torch.OutOfMemoryError:
        raise _oom_error(cfg, model, data, device, info) from None
    except RuntimeError as e:
        if "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
            raise _oom_error(cfg, model, data, device, info) from None
        refusal = _determinism_error(e, device) if t.deterministic else None
        if refusal:
            log.error(refusal)
            raise BrickyardError(refusal) from None
        if not info.distributed or not _is_comm_failure(e):
            raise
        silent = heartbeat.silent_ranks() if heartbeat else []
        who = f"rank {', '.join(map(str, silent))} stopped answering" if silent else "a peer rank stopped answering or died"
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        msg = (f"rank {info.rank}: a collective did not complete within dist.timeout_s={cfg.dist.timeout_s}s; {who} "
               f"(see the workerlogs in {log_dir}; {reason}).")
        log.error(msg)
        raise BrickyardError(msg) from None
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        metrics.close()
        log.close()
        dist.shutdown()


def _train(cfg, model, data, run_dir, resume, model_meta, info, host: dev.Host, log: Logger, metrics: MetricsWriter,
           wall_start):
    t, c = cfg.train, cfg.checkpoint
    device, precision, channels_last = host.device, host.precision, host.channels_last
    torch.manual_seed(t.seed)
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True

    if cfg.data.batch_size == "auto":
        cfg = _resolve_auto_batch(cfg, model, data, device, info, log)
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    if cfg.dist.sync_bn and info.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    raw_model = model
    head = find_head(model) if cfg.finetune.head_lr_mult != 1.0 else None
    groups = param_groups(model, cfg.optim, head, cfg.finetune.head_lr_mult)
    params = [p for g in groups for p in g["params"]]
    optimizer = build_optimizer(cfg.optim, groups)

    # in parameter-server mode only the trainers read data; the servers hold the parameters
    layout = ps.check_layout(cfg, info.world_size) if cfg.dist.mode == "ps" else None
    group, ps_group, data_world = None, None, info.world_size
    if layout is not None:
        if resume:
            raise BrickyardError(ps.NO_RESUME)
        if info.distributed:
            group = torch.distributed.new_group(list(range(layout.trainers)))
            ps_group = ps.message_group()
        data_world = layout.trainers
    plan = BatchPlan(len(data.train), cfg.data.batch_size, data_world, min(info.rank, data_world - 1), t.seed)
    per_epoch = plan.steps_per_epoch // t.grad_accum
    if per_epoch == 0:
        raise BrickyardError(f"train.grad_accum: {t.grad_accum} is more than the {plan.steps_per_epoch} batches in an epoch.")
    total_steps = math.ceil(t.epochs * per_epoch)
    if t.max_steps:
        total_steps = min(total_steps, t.max_steps) if t.epochs else t.max_steps
    peak = cfg.schedule.lr_max or cfg.optim.lr
    sched_cfg = cfg.schedule
    if cfg.dist.scale_lr == "linear" and data_world > 1:
        peak *= data_world
        if sched_cfg.name != "onecycle" and sched_cfg.warmup_epochs < cfg.dist.scale_warmup_epochs:
            import dataclasses
            sched_cfg = dataclasses.replace(sched_cfg, warmup_epochs=cfg.dist.scale_warmup_epochs)
    schedule = Schedule(sched_cfg, peak, total_steps, per_epoch)
    if layout is not None and layout.is_server(info.rank):
        ps.serve([p.detach() for p in params], layout, info.rank, cfg, total_steps, schedule, log, ps_group)
        dist.barrier()
        return {}
    loader = make_train_loader(data.train, cfg.data, device, data_world, info.rank, t.seed)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    manager = _checkpoint_manager(run_dir, c) if info.is_main else None
    step = 0
    boost.check_config(cfg)
    state = _resume_state(resume, run_dir, log)
    if state is not None:
        path, state = state
        step = _restore(state, path, raw_model, optimizer, scaler, device)
        if manager is not None:
            manager.best_metric = state.get("best_metric")
        log.info(f"resumed from {path} at step {step} (epoch {step // per_epoch})")

    named = [(n, p) for n, p in raw_model.named_parameters() if p.requires_grad]
    snaps = None
    if cfg.boost.snapshots.enabled and info.is_main:
        snaps = boost.Snapshots(boost.snapshot_dir(cfg, run_dir), cfg.boost.snapshots.keep, [n for n, _ in named])
    booster = None
    if cfg.boost.dim_reduce.enabled:
        P = boost.resolve_subspace(cfg, run_dir, [n for n, _ in named], sum(p.numel() for _, p in named), log)
        booster = boost.DimReduce([p for _, p in named], P, cfg.boost.dim_reduce)
        log.info(f"dimension-reduction stage 2: {boost.p_memory(P.shape)}; the optimiser is replaced by P-BFGS")
        if state is not None and state.get("boost"):
            booster.load_state_dict(state["boost"])
    client = ps.Client(params, layout, cfg.dist.ps.sync, ps_group) if layout is not None else None
    if info.distributed and client is None:
        ddp_kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
        model = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    fwd_model = torch.compile(model) if t.compile else model

    prep = DevicePrep(data.mean, data.std, cfg.data.augment, cfg.data.shift, channels_last, device, t.seed)
    if info.is_main:
        save_config(cfg, run_dir / "config.yaml")
        write_json(run_dir / "env.json", env_record(device, t.seed, info.world_size, {
            "precision": precision, "channels_last": channels_last, "threads": host.threads, "allocator": host.allocator,
            "model": model_meta, "restart_count": info.restart_count}))
    _announce(log, cfg, raw_model, model_meta, data, host, info, data_world,
              per_epoch, total_steps, peak, groups)
    metrics.write(kind="start", step=step, world_size=info.world_size, total_steps=total_steps)
    tb = TBWriter(run_dir if info.is_main else None, t.tensorboard, log.warning)
    watcher = Watcher(raw_model, t.watch) if t.watch else None

    def snapshot(step: int) -> dict:
        return {
            "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
            "rng": _rng_state(device), "step": step, "epoch": step // per_epoch,
            "best_metric": manager.best_metric if manager else None, "config": cfg.to_dict(),
            "boost": booster.state_dict() if booster is not None else None,
            "meta": {**model_meta, "classes": list(data.classes), "mean": list(data.mean), "std": list(data.std),
                     "image_size": list(data.image_size), "in_channels": data.in_channels,
                     "num_classes": data.num_classes, "data": data.name},
        }

    def save(step: int, metric: float | None = None) -> Path | None:
        if manager is None:
            return None
        return manager.save(snapshot(step), step, metric)

    def val_eval(step: int, epoch: float) -> dict | None:
        if data.val is None:
            return None
        r = evaluate(fwd_model, data.val, prep, device, precision, cfg.data.eval_batch_size, data.num_classes,
                     data_world, info.rank, group, num_workers=cfg.data.num_workers)
        progress.validation(step, epoch, r)
        return r

    # On a CPU reading the loss is not a device sync, so every step is checked before the update and
    # the layer is named on good weights; on GPUs the check rides on the log and save steps.
    check_each_step = t.nan_guard and device.type == "cpu"

    def raise_nonfinite(step: int, x, y):
        where = first_nonfinite(raw_model, x, y)
        raise BrickyardError(f"training loss became non-finite at step {step}; first non-finite: {where}; "
                             f"the newest checkpoint holds the last good weights (lower optim.lr or set train.grad_clip).")

    def guard(step: int, x, y) -> None:
        """Stop on a non-finite loss before anything is saved (a host sync; log and save steps only)."""
        if t.nan_guard and not torch.isfinite(totals.loss).item():
            raise_nonfinite(step, x, y)

    if snaps is not None and step == 0 and cfg.boost.snapshots.start_epoch == 0:
        snaps.save(0, [p for _, p in named])  # the initial weights start the trajectory

    use_bar = info.is_main and (t.progress == "bar" or (t.progress == "auto" and sys.stderr.isatty()))
    plain = info.is_main and not use_bar and t.progress != "none"
    bar = None
    if use_bar:
        from tqdm import tqdm
        bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, leave=False)

    totals = _Totals(device, group)
    progress = _Progress(totals, data_world, per_epoch, log, metrics, tb, bar, plain)
    last_val = None
    model.train()
    vote = dist.StopVote(info)
    stopping = False
    with _StopFlag() as stop:
        while step < total_steps:
            epoch, pos = divmod(step, per_epoch)
            batches = loader.epoch(epoch, pos * t.grad_accum)
            progress.start_window()
            for _ in range(pos, per_epoch):
                watching = watcher is not None and step % t.watch_every == 0
                if watching:
                    watcher.attach()
                for micro in range(t.grad_accum):
                    wait_start = time.perf_counter()
                    x, y, n_global, offset = next(batches)
                    progress.data_wait += time.perf_counter() - wait_start
                    x = prep(x, step * t.grad_accum + micro, n_global, offset)
                    sync = model.no_sync() if model is not raw_model and micro < t.grad_accum - 1 else contextlib.nullcontext()
                    with sync:
                        with dev.autocast(device, precision):
                            out = fwd_model(x)
                            loss_sum = F.cross_entropy(out.float(), y, reduction="sum", label_smoothing=cfg.optim.label_smoothing)
                        # sum / global batch, times world size because DDP averages over ranks:
                        # the gradient is the exact mean over all samples, also for a short last batch
                        if check_each_step and not torch.isfinite(loss_sum):
                            raise_nonfinite(step, x, y)
                        loss = loss_sum * (data_world / (n_global * t.grad_accum))
                        if cfg.optim.l1:
                            loss = loss + cfg.optim.l1 / t.grad_accum * l1_penalty(groups)
                        scaler.scale(loss).backward()
                    totals.add(loss_sum, out, y)
                if watching:
                    found = watcher.collect()
                    metrics.write(kind="watch", step=step, layers=found)
                    for name, row in found.items():
                        tb.scalars(step, f"watch/{name}", row)
                if t.histograms_every and step % t.histograms_every == 0:
                    tb.histograms(step, raw_model)
                lr = schedule(step)
                set_lr(optimizer, lr)
                if t.grad_clip:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(params, t.grad_clip)
                if booster is not None:
                    # the method needs the loss on the host every step: one scalar all-reduce
                    loss0 = float(dist.all_reduce_sum(loss_sum.detach().double().reshape(1), group)) / n_global
                    trial = boost.make_trial_loss(raw_model, x, y, n_global, cfg.optim.label_smoothing,
                                                  lambda: dev.autocast(device, precision), group)
                    booster.step(loss0, trial)
                elif client is not None:
                    client.step(lr, step)
                else:
                    scaler.step(optimizer)
                    scaler.update()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if snaps is not None and step / per_epoch >= cfg.boost.snapshots.start_epoch and (
                        (cfg.boost.snapshots.every_steps and step % cfg.boost.snapshots.every_steps == 0)
                        or (not cfg.boost.snapshots.every_steps and step % per_epoch == 0)):
                    snaps.save(step, [p for _, p in named])
                if bar is not None:
                    bar.update(1)
                if step % t.log_every == 0 or step == total_steps:
                    guard(step, x, y)  # the loss read-back below is this loop's only host sync
                    extra = f", subspace steps accepted {booster.accepted}/{booster.steps}" if booster is not None else ""
                    progress.log(step, epoch, lr, extra)
                if c.every_steps and step % c.every_steps == 0:
                    guard(step, x, y)
                    save(step)
                stopping = vote.should_stop(step, stop.name)
                if stopping or step >= total_steps:
                    break
            progress.end_window()
            if stopping:
                guard(step, x, y)
                path = save(step)
                if bar is not None:
                    bar.close()
                where = f" to {path}" if path else ""
                raise Interrupted(f"{vote.cause} at step {step}: saved a checkpoint{where}; resume with "
                                  f"`brickyard train {cfg.preset} --run-dir {run_dir} --resume auto`.")
            epoch_done = step % per_epoch == 0 or step >= total_steps
            if epoch_done:
                ep = round(step / per_epoch, 4)
                evaluate_now = t.eval_every and (math.ceil(ep) % t.eval_every == 0) or step >= total_steps
                last_val = val_eval(step, ep) if evaluate_now else last_val
                if c.every_epoch or step >= total_steps:
                    guard(step, x, y)
                    save(step, last_val["accuracy"] if last_val and evaluate_now else None)
    if bar is not None:
        bar.close()
    loader.close()  # the streaming loader's persistent workers
    if client is not None:
        client.finish()

    job = _Job(cfg, info, data, run_dir, host, data_world, group, model_meta)
    summary = _finish(job, fwd_model, prep, log, metrics, tb, step, per_epoch, last_val, progress, wall_start)
    metrics.write(kind="summary", **{k: v for k, v in summary.items() if k != "run_dir"})
    dist.barrier()
    return summary


def _restore(state: dict, path: Path, model: nn.Module, optimizer, scaler, device: torch.device) -> int:
    """Load a checkpoint's model, optimiser, scaler and RNG state; return its step."""
    ckpt.check_model(state, model, path)
    model.load_state_dict(state["model"])
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: optimiser state does not fit ({e}).") from None
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    _set_rng_state(state["rng"], device)
    return int(state["step"])


def _announce(log, cfg, model, model_meta, data, host: dev.Host, info, data_world,
              per_epoch, total_steps, peak, groups) -> None:
    """The start-of-run lines: hardware and settings, model and data, batch and schedule, groups."""
    t = cfg.train
    n_params = sum(p.numel() for p in model.parameters())
    log.info(f"device {dev.describe(host.device)}, precision {host.precision}, channels_last {host.channels_last}, "
             f"{host.threads} threads, allocator {host.allocator}, world size {info.world_size}, pid {os.getpid()}")
    log.info(f"model {model_meta.get('name', type(model).__name__)} ({n_params:,} parameters), "
             f"data {data.name}: {len(data.train):,} train / {len(data.val) if data.val else 0:,} val / "
             f"{len(data.test) if data.test else 0:,} test")
    log.info(f"global batch {cfg.data.batch_size * data_world * t.grad_accum} "
             f"({cfg.data.batch_size} per device x {data_world} x {t.grad_accum} accumulation), "
             f"{per_epoch} steps/epoch, {total_steps} steps, peak lr {peak:g} ({cfg.schedule.name})")
    for line in describe_groups(groups, peak):
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


def _checkpoint_manager(run_dir: Path, c) -> ckpt.CheckpointManager:
    return ckpt.CheckpointManager(run_dir / "checkpoints", c.keep_last, c.keep_best)


def _resume_state(resume: str | None, run_dir: Path, log: Logger):
    if not resume:
        return None
    if resume == "auto":
        found = ckpt.newest_valid(run_dir / "checkpoints", log.warning)
        if found is None:
            log.info(f"no checkpoint in {run_dir / 'checkpoints'}; starting from scratch")
        return found
    path = Path(resume)
    return path, ckpt.load(path)
