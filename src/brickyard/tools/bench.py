"""``brickyard bench``: where the time of a training step goes, and how it scales.

One process (or one torchrun job) runs ``warmup`` untimed steps, then ``steps`` timed steps in two
passes over the same loop, synchronising the device at phase boundaries (bench only; training
never does this):

- pass A, gradients *not* synchronised in the backward pass: data wait, forward+backward, optimiser,
  and, with several processes, the wait for the slower rank (a barrier) and the gradient
  all-reduce alone, timed apart;
- pass B, the real step (throughput is measured on it), with the gradient sync a training run uses
  (``dist.grad_sync``: DDP, or one flat all-reduce after the backward pass, the default on CPUs);
  with DDP its difference from the sum of pass A's parts is DDP's own work (hooks, bucket copies)
  less the all-reduce it overlaps with the backward.

Throughput is the median (min, max) over windows of pass B; the parts are means over the timed steps
(the tail of the waits is part of the cost); warm-up is excluded. Several device
specs run as separate jobs, and speed-up and scaling efficiency are computed against the first.
"""
from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from brickyard import models
from brickyard.data import augment, balance, build_data
from brickyard.data.loaders import device_batches, make_train_loader, step_batch
from brickyard.distributed import gradsync
from brickyard.distributed import process as dist
from brickyard.distributed.flat import flatten
from brickyard.errors import BrickyardError
from brickyard.observe.plots import scaling
from brickyard.observe.profiling import StepProfiler
from brickyard.optim import build_optimizer, param_groups
from brickyard.training import device as dev
from brickyard.training import precision
from brickyard.training.ways import choose, name_of
from brickyard.training.ways.collective import grad_sync

INPUT_BOUND = 0.20  # the fraction of a step spent waiting for data above which we call a run input-bound
COMM_BOUND = 0.20
SUPERLINEAR = 1.15  # scaling efficiency above this is a measurement problem, and said so


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg, steps: int, warmup: int, run_dir: Path, train) -> dict:
    """This process's share of the bench of ``cfg``: bench's own step taken apart (``run_local``), or for a way of
    ``TRAINED`` the trainer's step (``run_trained``: ``train`` is ``api.train_config``, with its run directory in
    ``run_dir``)."""
    if name_of(cfg) in TRAINED:
        return run_trained(cfg, steps, warmup, run_dir, train)
    return run_local(cfg, steps, warmup)


def run_local(cfg, steps: int, warmup: int, window: int = 10) -> dict:
    """Benchmark this process's share of the job described by ``cfg``; rank 0's result is complete."""
    info = dist.from_env()
    t = cfg.train
    host = dev.setup(t, info.local_rank, info.local_world_size)
    dist.init(info, cfg.dist.backend, host.device, cfg.dist.timeout_s)
    try:
        job, data = _job(cfg, info, host)
        one_step = functools.partial(_timed_step, job)
        for s in range(warmup):
            one_step(s, True)
        # pass A skips the gradient sync in the backward pass, then times the wait for the slower rank
        # and the sync apart; pass B is the real step. One process runs pass B alone.
        a = [one_step(warmup + s, False) for s in range(steps)] if info.distributed else None
        profiler = None
        if t.profile_steps:  # `--profile DIR`: pass B's first steps, traced
            profiler = StepProfiler(*t.profile_steps, Path(t.profile_dir or "profile"), info.rank, host.device)
        b = []
        for s in range(steps):
            if profiler is not None:
                profiler.step_start(warmup + s)
            b.append(one_step(warmup + s, True))
            if profiler is not None:
                profiler.step_end(warmup + s)
        if profiler is not None:
            profiler.close()
        job.loader.close()
        # means, as throughput is: the tail of the waits is part of the cost
        mean = lambda rows, i: statistics.fmean(r[i] for r in rows)  # noqa: E731
        data_wait, opt_step = mean(b, 0), mean(b, 2)
        compute = mean(a, 1) if a is not None else mean(b, 1)
        wait, sync = (mean(a, 4), mean(a, 5)) if a is not None else (0.0, 0.0)
        # the parts are timed apart, so they add up to `total`; `real_step` is pass B's step, whose
        # difference from `total` is DDP's own work (hooks, bucket copies) less what its all-reduce
        # overlapped with the backward pass; with the flat all-reduce its sync (`real_sync`) is timed apart
        step_time = data_wait + compute + wait + sync + opt_step
        real_sync = mean(b, 6)
        real_step = data_wait + mean(b, 1) + real_sync + opt_step
        windows = [b[i:i + window] for i in range(0, len(b) - window + 1, window)] or [b]
        ips = [sum(r[3] for r in w) * info.world_size / sum(r[0] + r[1] + r[2] + r[6] for r in w) for w in windows]
        result = {
            "images_per_second": statistics.median(ips), "images_per_second_min": min(ips), "images_per_second_max": max(ips),
            "seconds_per_epoch": len(data.train) / statistics.median(ips),
            # grad_sync is the whole synchronisation, in two parts measured apart: the wait and the all-reduce
            "step_ms": {"data_wait": 1e3 * data_wait, "forward_backward": 1e3 * compute, "grad_sync": 1e3 * (wait + sync),
                        "rank_wait": 1e3 * wait, "allreduce": 1e3 * sync, "optimizer": 1e3 * opt_step, "total": 1e3 * step_time,
                        "real_step": 1e3 * real_step, "real_sync": 1e3 * real_sync},
            "world_size": info.world_size, "per_device_batch": max(device_batches(cfg.data, t.grad_accum, info.world_size)),
            "global_batch": step_batch(cfg.data, t.grad_accum, info.world_size), "device": dev.describe(host.device),
            "precision": job.precision, "precision_measured": job.measured, "channels_last": host.channels_last,
            "threads_per_process": host.threads,
            "pinned_cpus": list(host.pinned) if host.pinned else None, "grad_sync": job.sync.name,
            "loader": type(job.loader).__name__, "model": cfg.model.name, "data": cfg.data.name, "steps": steps,
            "warmup": warmup, **dev.peak_memory(host.device),
        }
        result["verdict"] = verdict(result)
        return result
    finally:
        dist.shutdown()


def _job(cfg, info, host):
    """Model, optimiser, gradient sync and an endless batch stream, built as ``brickyard train`` builds them."""

    t, device = cfg.train, host.device
    data = build_data(cfg.data)
    balance(data, cfg.data.balance)  # the epochs `brickyard train` draws
    torch.manual_seed(t.seed)
    model = models.build(cfg, data).to(device, memory_format=torch.channels_last if host.channels_last else torch.preserve_format)
    optimizer = build_optimizer(cfg.optim, param_groups(model, cfg.optim))
    fwd, sync = grad_sync(cfg.dist, model, device, own_cores=host.own_cores) if info.distributed else (model, gradsync.GradSync())
    loader = make_train_loader(data.train, cfg.data, device, info.world_size, info.rank, t.seed, t.grad_accum)
    prep = augment.build(cfg, data, device, host.channels_last, t.seed, info.world_size, floats=augment.float_dtype(model))
    n_params = sum(p.numel() for p in model.parameters())  # auto as for a run long enough to pay for compiling
    compiled = dev.resolve_compile(t.compile, device, n_params, dev.COMPILE_MIN_STEPS)
    chosen, measured = precision.decide(t.precision, model, data, max(device_batches(cfg.data, t.grad_accum, info.world_size)),
                                        host, info.rank)  # as a training run chooses
    job = SimpleNamespace(batches=_endless(loader), loader=loader, prep=prep, device=device, precision=chosen,
                          measured=measured,
                          fwd=torch.compile(fwd) if compiled else fwd, sync=sync, model=model, optimizer=optimizer,
                          distributed=info.distributed)
    return job, data


def _timed_step(job, step: int, comm: bool) -> tuple[float, ...]:
    """One step timed in phases: data, forward+backward, the gradient sync after it (the flat
    all-reduce; DDP's is inside the backward pass), optimiser. ``comm=False`` skips the sync and, with
    several processes, times apart the wait for the slower rank (a barrier that waits as the sync
    does) and the all-reduce alone (the flat sync itself; for DDP one flat buffer, as its buckets)."""
    t0 = time.perf_counter()
    x, y, n_global, offset = next(job.batches)
    x, y = job.prep.train(x, y, step, n_global, offset)
    _sync(job.device)
    t1 = time.perf_counter()
    with (nullcontext() if comm else job.sync.skip()):
        with dev.autocast(job.device, job.precision):
            loss = F.cross_entropy(job.fwd(x).float(), y)
        loss.backward()
    _sync(job.device)
    t2 = time.perf_counter()
    if comm:
        job.sync()
        _sync(job.device)
    t3 = time.perf_counter()
    wait = allreduce = 0.0
    if not comm and job.distributed:
        _barrier(job)
        t_wait = time.perf_counter()
        if job.sync.name == "flat":
            job.sync()
        else:
            tdist.all_reduce(flatten(p.grad for p in job.model.parameters() if p.grad is not None))
        _sync(job.device)
        wait, allreduce = t_wait - t3, time.perf_counter() - t_wait
    t4 = time.perf_counter()
    job.optimizer.step()
    job.sync.zero_grad(job.optimizer)
    _sync(job.device)
    return t1 - t0, t2 - t1, time.perf_counter() - t4, len(y), wait, allreduce, t3 - t2


def _barrier(job) -> None:
    """All ranks here; a CPU process of the flat sync waits awake, as its sync does (a sleeping wait
    would make the all-reduce after it pay for waking the core)."""
    spin = getattr(job.sync, "spin_s", 0.0)
    if spin and job.device.type == "cpu":
        gradsync.spin_wait(tdist.all_reduce(torch.zeros(1), async_op=True), spin)
    else:
        tdist.barrier()


def _endless(loader):
    epoch = 0
    while True:
        yield from loader.epoch(epoch)
        epoch += 1


TRAINED = ("pipeline", "tensor_parallel", "fsdp")  # ways whose step is the trainer's own, not bench's pass A and B


def run_trained(cfg, steps: int, warmup: int, run_dir: Path, train, window: int = 10) -> dict:
    """A layout whose step bench does not take apart (pipeline stages, tensor parallel, FSDP): ``warmup + steps``
    steps of a real training run (the trainer, as ``brickyard train`` runs it, nothing evaluated but a batch of the
    test split at the end), images/s the median over windows of ``window`` steps after the warm-up, read from its
    per-step rows (``train.log_every: 1``: a host sync a step, as bench's own passes have), and for a pipeline each rank's stage compute against its step (summary.json's ``pipeline``,
    timed by ``distributed.pipeline.StageClock`` after the trainer's first 2 steps)."""
    run_cfg = cfg.replace(**{"train.max_steps": warmup + steps, "train.epochs": 0, "train.log_every": 1,
                             "train.eval_every": 0, "data.eval_limit": cfg.data.eval_batch_size, "train.plots": False,
                             "train.loggers": [], "train.tensorboard": False, "train.progress": "none",
                             "checkpoint.every_epoch": False, "checkpoint.keep_best": False})
    info = dist.from_env()
    summary = train(run_cfg, run_dir)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    ips = [r["images_per_second"] for r in rows if r.get("kind") == "train" and r["step"] > warmup]
    windows = [statistics.fmean(ips[i:i + window]) for i in range(0, len(ips) - window + 1, window)] or ips or [0.0]
    p = cfg.dist.pipeline
    result = {"way": name_of(cfg), "images_per_second": statistics.median(windows), "images_per_second_min": min(windows),
              "images_per_second_max": max(windows), "world_size": info.world_size, "steps": steps, "warmup": warmup,
              "global_batch": step_batch(cfg.data, cfg.train.grad_accum, choose(cfg, info).readers),
              "model": cfg.model.name, "data": cfg.data.name, "device": summary.get("device", ""),
              "precision": summary.get("precision", cfg.train.precision), "pipeline": summary.get("pipeline")}
    result.update({k: v for k, v in summary.items() if k.startswith("peak_") or k == "held_per_rank"})
    if result["pipeline"]:
        idle = [r["idle"] for r in result["pipeline"]["ranks"] if r and r["idle"] is not None]
        m, s = result["pipeline"]["microbatches"], p.stages
        result["pipeline"]["textbook_bubble"] = (s - 1) / (m + s - 1)
        result["verdict"] = (f"pipeline idle {100 * statistics.fmean(idle):.0f}% of a step (mean over ranks; the "
                             f"schedule's own bubble {100 * (s - 1) / (m + s - 1):.0f}%)") if idle else "pipeline"
    else:
        result["verdict"] = f"{result['way']}: throughput of the trainer's own step"
    return result


def format_trained(r: dict) -> str:
    """``run_trained``'s result: throughput, and each pipeline stage's compute and idle time."""
    lines = [f"{r['model']} on {r['data']}, {r['device']}, precision {r['precision']}, world size {r['world_size']}, "
             f"global batch {r['global_batch']}, {r['way']} (the trainer's step: {r['warmup']} warm-up + {r['steps']} timed steps)",
             f"images/s {r['images_per_second']:,.0f} (min {r['images_per_second_min']:,.0f}, max "
             f"{r['images_per_second_max']:,.0f}); rank 0 held {_mib(r.get('held_per_rank'))}, "
             + ", ".join(f"{k} {v:,.0f}" for k, v in r.items() if k.startswith("peak_"))]
    pipe = r.get("pipeline")
    if pipe:
        lines.append(f"schedule {pipe['schedule']}, {pipe['microbatches']} microbatches: the schedule's own bubble "
                     f"(S - 1) / (M + S - 1) is {100 * pipe['textbook_bubble']:.1f}% of a step")
        for row in pipe["ranks"]:
            if row and row["idle"] is not None:
                shard = f", tensor-parallel rank {row['shard']}" if row.get("shard") is not None else ""
                lines.append(f"  stage {row['stage']}, replica {row['replica']}{shard}: computes {row['busy_ms']:.1f} ms of each "
                             f"{row['step_ms']:.1f} ms step, idle {100 * row['idle']:.1f}%")
    return "\n".join(lines + [f"verdict: {r['verdict']}"])


def _mib(held: dict | None) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.1f} MiB" for k, v in (held or {}).items()) or "?"


def verdict(r: dict) -> str:
    ms = r["step_ms"]
    total = max(ms["total"], 1e-9)
    if ms["data_wait"] / total > INPUT_BOUND:
        return f"input-bound: {100 * ms['data_wait'] / total:.0f}% of each step waits for data (> {100 * INPUT_BOUND:.0f}%)"
    if ms.get("rank_wait", 0.0) / total > COMM_BOUND:
        return f"imbalance-bound: {100 * ms['rank_wait'] / total:.0f}% of each step waits for the slower rank"
    if ms.get("allreduce", ms["grad_sync"]) / total > COMM_BOUND:
        return f"communication-bound: the gradient all-reduce is {100 * ms.get('allreduce', ms['grad_sync']) / total:.0f}% of a step"
    return f"compute-bound: forward+backward is {100 * ms['forward_backward'] / total:.0f}% of each step"


def format_result(r: dict) -> str:
    if "way" in r:
        return format_trained(r)
    ms = r["step_ms"]
    mem = ", ".join(f"{k} {v:,.0f}" for k, v in r.items() if k.startswith("peak_"))
    return "\n".join([
        f"{r['model']} on {r['data']}, {r['device']}, precision {r['precision']}, channels_last {r['channels_last']}, "
        f"{r['threads_per_process']} threads/process, world size {r['world_size']}, global batch {r['global_batch']}, {r['loader']}",
        f"images/s {r['images_per_second']:,.0f} (min {r['images_per_second_min']:,.0f}, max {r['images_per_second_max']:,.0f}), "
        f"{r['seconds_per_epoch']:.1f} s/epoch, {mem}",
        f"step {ms['total']:.1f} ms = data wait {ms['data_wait']:.1f} + forward/backward {ms['forward_backward']:.1f} "
        f"+ gradient sync {ms['grad_sync']:.1f} (waiting for the slower rank {ms.get('rank_wait', 0.0):.1f}, the all-reduce "
        f"{ms.get('allreduce', 0.0):.1f}) "
        f"+ optimiser {ms['optimizer']:.1f}, each timed apart (means)" + _real_step(r),
        f"verdict: {r['verdict']}",
    ] + ([f"precision auto: {r['precision_measured']['how']}"] if r.get("precision_measured") else []))


def _real_step(r: dict) -> str:
    """The real step of several processes beside the sum of the parts timed apart, and why they differ."""
    ms = r["step_ms"]
    if r["world_size"] == 1:
        return ""
    why = ("its hooks and bucket copies, less the all-reduce it overlaps with the backward pass" if r["grad_sync"] == "ddp"
           else f"its sync, the wait and the all-reduce together, {ms['real_sync']:.1f} ms")
    pinned = "; each process on its own CPUs" if r.get("pinned_cpus") else ""
    return f"; the real step ({r['grad_sync']}) {ms['real_step']:.1f} ms ({ms['real_step'] - ms['total']:+.1f}: {why}){pinned}"


def paired(rounds: list[dict], specs: list[str]) -> list[tuple[str, dict]]:
    """Each spec's result from several rounds of all specs run in turn: the round of the median
    throughput, with ``speedup``, the median over rounds of its ratio to the first spec's (a pair is
    two runs minutes apart at most, so the host's drift moves it less than the runs themselves)."""
    out = []
    for spec in specs:
        runs = sorted((r[spec] for r in rounds), key=lambda r: r["images_per_second"])
        mid = dict(runs[(len(runs) - 1) // 2], rounds=len(rounds))
        mid["speedup"] = statistics.median(r[spec]["images_per_second"] / r[specs[0]]["images_per_second"] for r in rounds)
        out.append((spec, mid))
    return out


def scaling_table(results: list[tuple[str, dict]]) -> tuple[str, list[dict]]:
    base = results[0][1]
    w = max(12, *(len(spec) for spec, _ in results))
    rows, lines = [], [f"{'devices':<{w}} {'world':>5} {'images/s':>10} {'speed-up':>9} {'efficiency':>10}  verdict"]
    for spec, r in results:
        speedup = r.get("speedup", r["images_per_second"] / base["images_per_second"])
        eff = speedup * base["world_size"] / r["world_size"]
        rows.append({"devices": spec, "world_size": r["world_size"], "images_per_second": r["images_per_second"],
                     "speedup": speedup, "efficiency": eff, "verdict": r["verdict"]})
        lines.append(f"{spec:<{w}} {r['world_size']:>5} {r['images_per_second']:>10,.0f} {speedup:>8.2f}x {100 * eff:>9.0f}%  {r['verdict']}")
    odd = [row["devices"] for row in rows if row["efficiency"] > SUPERLINEAR]
    if odd:
        lines.append(f"warning: {', '.join(odd)} scaled above {100 * SUPERLINEAR:.0f}% of linear, which N processes on "
                     f"shared hardware do not do: the first spec's figure is probably too low (still warming up, or the "
                     f"machine was busy); measure again with more --warmup and --steps.")
    return "\n".join(lines), rows


def plot_scaling(rows: list[dict], path: Path) -> None:
    scaling([r["world_size"] for r in rows], [r["images_per_second"] for r in rows],
            [100 * r["efficiency"] for r in rows], path)


def run_job(args, cfg, spec: str, nodes=None, extra=()) -> dict:
    """Run one device spec as its own process(es) and return rank 0's result; with ``nodes`` (a
    ``launch.Job`` of several machines) as one torchrun job across them."""
    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "result.json"
        argv = [sys.executable, "-m", "brickyard", "bench"] + ([args.config] if args.config else [])
        for item in [*args.overrides, *extra]:
            argv += ["--set", item]
        argv += ["--devices", spec, "--steps", str(args.steps), "--warmup", str(args.warmup), "--result", str(result)]
        if nodes is not None:
            argv += ["--nnodes", str(nodes.nnodes), "--master", nodes.master]
            argv += ["--node-rank", str(nodes.node_rank)] if nodes.node_rank is not None else []
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0 or not result.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("error: ")
            raise BrickyardError(f"bench --devices {spec} failed: {last}")
        return json.loads(result.read_text())
