"""The start of a run in words and files: the lines that say how it was put together (hardware and
settings, model and data, batch and schedule, parameter groups) and ``env.json``."""
from __future__ import annotations

import os

from brickyard.data.loaders import device_batches
from brickyard.files import write_json
from brickyard.models import whitening
from brickyard.observe.runlog import env_record
from brickyard.optim import describe_groups
from brickyard.training import device as dev
from brickyard.training import precision


def write_env(trainer, measured: dict | None) -> None:
    """``env.json``: what produced the run (rank 0)."""
    job, run = trainer.job, trainer.run
    host, info = job.host, job.info
    write_json(run.run_dir / "env.json", env_record(host.device, job.config.train.seed, info.world_size, {
        "precision": run.precision, "channels_last": trainer.channels_last, "threads": host.threads,
        "pinned_cpus": list(host.pinned) if host.pinned else None, "grad_sync": trainer.grad_sync.name,
        "allocator": host.allocator, "model": trainer.meta, "restart_count": info.restart_count,
        "cpu_model": precision.cpu_model(), "precision_measured": measured}))


def announce(trainer, measured: dict | None = None) -> None:
    """The start-of-run lines: hardware and settings (with how ``precision: auto`` chose, where it
    measured), model and data, batch and schedule, groups."""
    run, host, info = trainer.run, trainer.job.host, trainer.job.info
    cfg, data, log = run.config, run.data, run.log
    how = f" (auto: {measured['how']})" if measured else ""
    whole = trainer.way.whole_model(run.model)  # a pipeline's stage: the model it is a stage of
    n_params = sum(p.numel() for p in whole.parameters())
    pinned = f" on CPU {','.join(map(str, host.pinned))}" if host.pinned else ""
    log.info(f"device {dev.describe(host.device)}, precision {host.precision}{how}, channels_last {trainer.channels_last}, "
             f"{host.threads} threads{pinned}" + (f", {host.workers} loader workers" if not data.in_memory else "")
             + f", allocator {host.allocator}, world size {info.world_size}"
             + (f", gradient sync {trainer.grad_sync.name}" if info.world_size > 1 else "")
             + (", compiled" if trainer.compiled else "") + f", pid {os.getpid()}")
    if trainer.graphs_note:
        log.info(trainer.graphs_note)
    log.info(f"model {trainer.meta.get('name', type(whole).__name__)} ({n_params:,} parameters), "
             f"data {data.name}: {len(data.train):,} train / {len(data.val) if data.val else 0:,} val / "
             f"{len(data.test) if data.test else 0:,} test")
    if cfg.data.eval_limit and any(s is not None and len(s) > cfg.data.eval_limit for s in (data.val, data.test)):
        log.info(f"data.eval_limit: validation and test read the first {cfg.data.eval_limit:,} images of each split only")
    for note in data.notes:
        log.info(note)
    if cfg.model.whiten:
        log.info(whitening.describe(whole, whitening.images_used(data)))
    _batch_lines(trainer)


def _batch_lines(trainer) -> None:
    run, readers = trainer.run, trainer.way.readers
    cfg, log = run.config, run.log
    accum, peak = cfg.train.grad_accum, trainer.plan.peak_lr
    parts = device_batches(cfg.data, accum, readers)
    shown = str(parts[0]) if len(set(parts)) == 1 else "-".join(map(str, sorted(set(parts), reverse=True)))
    log.info(f"global batch {sum(parts) * accum} ({shown} per device x {readers} x {accum} accumulation), "
             f"{run.steps_per_epoch} steps/epoch, {run.total_steps} steps, peak lr {peak:g} ({cfg.schedule.name})")
    if not cfg.data.global_batch_size and readers > 1:  # the user fixed the per-device batch: say what moved
        base = cfg.schedule.lr_max or cfg.optim.lr
        rate = (f"dist.scale_lr: linear raised the peak rate {base:g} -> {peak:g}" if peak != base else
                f"the peak rate stays {base:g} (dist.scale_lr: linear would make it {base * readers:g})")
        log.info(f"data.batch_size {cfg.data.batch_size} per device: the global batch grows with the world size "
                 f"({cfg.data.batch_size * accum} on one device, {sum(parts) * accum} on {readers}); {rate}")
    for line in describe_groups(trainer.param_groups, peak):
        log.info(line)
