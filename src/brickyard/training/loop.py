"""The training loop, for one process of a job of any size.

``train(cfg, model, data, run_dir)`` does everything a run needs: device and precision, the
process group, loaders, the optimiser, checkpoints and resume, evaluation and the summary. The
loop itself (``_loop``) is one screen: every behaviour is a callback (``brickyard.callbacks.own``,
``brickyard.callbacks``) and the step is ``brickyard.training.step.optimizer_step`` around the
user's (or brickyard's) ``train_step``.

Position in training is one integer, the optimiser ``step``: epoch = step // steps_per_epoch and
the batch inside the epoch follow from it, the learning rate is a pure function of it, and the
batch plan and augmentation are seeded from it. A checkpoint therefore needs only the weights,
optimiser/scaler state, RNG state, callback state and ``step`` to resume exactly.

Host syncs: the loop accumulates loss and accuracy sums on the device and reads them back
(``.item()`` after an all-reduce) only every ``train.log_every`` steps and at evaluations.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch
from torch import nn

from brickyard.callbacks import from_config, reduce_lr
from brickyard.callbacks.checkpointing import check_monitor
from brickyard.config import Config
from brickyard.data import DataBundle, balance
from brickyard.data.loaders import check_readers
from brickyard.distributed import parameter_server as ps
from brickyard.distributed import process as dist
from brickyard.distributed import env as dist_env
from brickyard.errors import BrickyardError, DataError, UserCodeError, reason
from brickyard.models import find_blocks
from brickyard.observe.logs import Logger
from brickyard.files import os_error, write_json
from brickyard.observe.runlog import MetricsWriter, env_record
from brickyard.callbacks.trackers import Trackers, check_installed, check_reachable
from brickyard.config.schema import loggers
from brickyard.observe.tensorboard import TBWriter
from brickyard.training import activation_checkpointing
from brickyard.training import checkpoint as ckpt
from brickyard.training import device as dev
from brickyard.training import failures, precision, setup
from brickyard.training.evaluation import evaluate, evaluate_split, finish
from brickyard.training.run import Request, Run
from brickyard.training.rundir import RunDir, default_path
from brickyard.training.step import check_class_weights, optimizer_step

__all__ = ["train", "evaluate", "Interrupted"]


class Interrupted(BrickyardError):
    exit_code = 130


def _loop(run: Run, cbs) -> None:
    """Train until ``total_steps`` or an agreed stop; the behaviours happen in the callbacks. The loop
    owns the measurements (``run.meter``): each step's result, and the clock, which runs during steps only."""
    accum, e, meter = run.config.train.grad_accum, run._engine, run.meter
    cbs.on_train_start(run)
    while run.step < run.total_steps and run.stopped is None:
        run.epoch, pos = divmod(run.step, run.steps_per_epoch)
        meter.start_epoch()
        cbs.on_epoch_start(run)
        batches = e.loader.epoch(run.epoch, pos * accum)
        for _ in range(pos, run.steps_per_epoch):
            cbs.on_step_start(run)
            result = optimizer_step(run, batches, meter.totals)
            meter.add(result)
            run.step += 1
            cbs.on_step_end(run, result.loss)
            if stop := e.vote.should_stop(run.step, e.stop_request):  # polled once per step
                e.stop, run.stopped = stop, stop.reason
            if run.stopped or run.step >= run.total_steps:
                break
        meter.pause()
        if run.interrupted:
            break
        if run.step % run.steps_per_epoch == 0 or run.step >= run.total_steps or run.stopped:  # an epoch ends
            _agree_on_stop(run)  # a request made during the epoch (a time limit on one rank)
            if _validation_due(run):
                _validate(run, cbs)
                _agree_on_stop(run)  # a decision on the validation metrics (early stopping)
            meter.end_epoch()
            cbs.on_epoch_end(run)
    cbs.on_loop_end(run)


def _validation_due(run: Run) -> bool:
    """Every ``train.eval_every`` epochs and at the end; decided on what all ranks agree on only."""
    every = run.config.train.eval_every
    ended = run.step >= run.total_steps or run.stopped is not None
    return run.data.val is not None and ((every and math.ceil(run.step / run.steps_per_epoch) % every == 0) or ended)


def _validate(run: Run, cbs) -> None:
    cbs.on_validation_start(run)
    try:
        r = evaluate_split(run, run.data.val)
    except DataError as err:  # a bad validation file: keep the epoch just trained before saying so
        kept = None if run._engine.sharded else run._engine.checkpoints.save(run)  # FSDP: saving needs every rank
        if kept is None:
            raise
        raise DataError(f"{err} The epoch trained before it is kept in {kept}: resume with `--resume auto` once the "
                        f"file is fixed.") from None
    run.metrics, run.validated_at = r, run.step
    cbs.on_validation_end(run, r)


def _agree_on_stop(run: Run) -> None:
    """At an epoch end every rank is at the same step: one all-reduce of the callbacks' stop requests (a
    decision on the shared validation metrics, or a time limit reached on one rank only). A signal is
    agreed through the engine's vote instead, so that every rank names it."""
    e = run._engine
    request = e.stop_request.reason if e.stop_request and e.stop_request.kind == "request" else None
    if run.stopped is not None:
        return
    if e.data_world > 1:
        flag = torch.tensor([float(request is not None)], device=run.device)
        if dist.all_reduce_sum(flag, e.group).item() > 0:
            e.stop = dist.Stop("request", request or "a stop asked for on another rank")
    elif request is not None:
        e.stop = dist.Stop("request", request)
    if e.stop is not None:
        run.stopped = e.stop.reason


class _StopFlag:
    """SIGINT/SIGTERM become a stop request (``"SIGTERM"``); a second Ctrl-C leaves at once."""

    def __init__(self, run: Run):
        self.run, self._old = run, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        e = self.run._engine
        if e.stop_request is not None and e.stop_request.kind == "signal":
            raise KeyboardInterrupt
        e.stop_request = dist.Stop("signal", signal.Signals(signum).name)  # a signal outranks a callback's request

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def train(cfg: Config, model: nn.Module, data: DataBundle, run_dir: Path | None = None, resume: str | None = None,
          model_meta: dict | None = None, info: dist.DistInfo | None = None, log_dir: Path | None = None,
          callbacks=(), loss_fn=None, train_step=None) -> dict:
    """Train ``model`` on ``data`` as this process's share of the job; return the summary dict."""
    req = Request(cfg, model, data, run_dir, resume, model_meta or {}, info or dist.from_env(), log_dir, list(callbacks),
                  loss_fn, train_step, started=time.perf_counter(), rss_at_start_mb=dev.rss_mib())
    check_readers(cfg, req.info.world_size, len(data.train))  # before anything is written
    balance(data, cfg.data.balance)  # likewise
    check_class_weights(cfg.optim.class_weights, data.num_classes,  # likewise
                        "loss_fn" if loss_fn is not None else "train_step" if train_step is not None else None)
    reduce_lr.check(cfg, req.callbacks, data)  # likewise
    check_monitor(cfg, data)  # likewise
    check_installed(loggers(cfg.train))  # likewise
    if req.info.rank == 0:
        check_reachable(loggers(cfg.train))  # likewise: a tracking server that takes no connection
    activation_checkpointing.choose(model, cfg.train.activation_checkpointing)  # likewise
    if cfg.dist.strategy == "fsdp":
        find_blocks(model, cfg.dist.fsdp.blocks, "dist.fsdp.blocks")  # likewise
    with _torch_flags():
        host = dev.setup(cfg.train, req.info.local_rank, req.info.local_world_size, cfg.data.num_workers,
                         streams=not data.in_memory)
        if cfg.data.num_workers == "auto":  # planned with the threads
            cfg = req.config = cfg.replace(**{"data.num_workers": host.workers})
        setup.check_placement(cfg, model, host.device, req.info.distributed)
        if host.device.type == "cuda":
            torch.cuda.set_device(host.device)
        try:
            created = dist.init(req.info, cfg.dist.backend, host.device, cfg.dist.timeout_s)
        except RuntimeError as e:
            raise BrickyardError(f"rank {req.info.rank}: could not join the process group within dist.timeout_s="
                                 f"{cfg.dist.timeout_s}s ({reason(e)}).") from None
        try:
            req.run_dir = Path(run_dir) if run_dir else Path(dist.broadcast_object(str(default_path(cfg.preset))))
            return _run_in(req, host)
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
        if torch.are_deterministic_algorithms_enabled() != saved[0]:  # the setter imports torch._inductor (1 s)
            torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.benchmark = saved[1]
        torch.set_num_threads(saved[2])


def _run_in(req: Request, host: dev.Host) -> dict:
    """The run inside its directory: logs and metrics opened, failures turned into one sentence."""
    info, run_dir = req.info, req.run_dir
    rundir = RunDir(run_dir, info.is_main)
    rundir.lock(req.resume, info.restart_count > 0)  # until this process ends the run: one writer per directory
    try:
        return _logged(req, host, rundir)
    finally:
        rundir.unlock()


def _logged(req: Request, host: dev.Host, rundir: RunDir) -> dict:
    info, run_dir = req.info, req.run_dir
    log_dir = Path(req.log_dir) if req.log_dir else run_dir / "logs"
    log = Logger(info.rank, tuple([log_dir / f"workerlog.{info.rank}"] + ([run_dir / "train.log"] if info.is_main else [])))
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if info.is_main else None)
    heartbeat, done = None, False
    try:
        # brickyard's own command ends itself once its node has lost the job's store for a while (a user's Python is
        # left alone): it may wait on something with no timeout of its own
        lost = failures.cut_off(info.rank, log_dir, dist.LOST_GRACE_S) if dist_env.OWN_PROCESS else None
        heartbeat = dist.Heartbeat(info, on_lost=lost)
        summary = _train(req, host, log, metrics, rundir)
        done = True
        return summary
    except BrickyardError as e:
        log.error(str(e), exc_info=isinstance(e, UserCodeError))  # the user's traceback, in the run's logs too
        _leave_cause(req.vote, e)
        raise
    except OSError as e:  # a full disk, a size limit, permissions: the CLI names the file and the reason
        log.error(os_error(e))
        _leave_cause(req.vote, e)
        raise
    except Exception as e:  # noqa: BLE001  said in one sentence where it means something; else a crash, logged whole
        explained = failures.explain(e, req.config, req.model, req.data, host.device, info, log, heartbeat, log_dir,
                                     req.vote) \
            if isinstance(e, (torch.OutOfMemoryError, RuntimeError)) else e
        if explained is not e:
            _leave_cause(req.vote, explained)  # out of memory on this rank's device
            raise explained from None
        log.error(f"crashed: {type(e).__name__}: {e}", exc_info=e)
        e.logged_in = [str(h.baseFilename) for h in log.handlers if hasattr(h, "baseFilename")]  # what the CLI names
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        try:
            # after a failure, that failure is the one to say (a full disk fails a cut row's flush again here)
            with contextlib.nullcontext() if done else contextlib.suppress(OSError):
                metrics.close()
        finally:
            log.close()


def _leave_cause(vote, e: BaseException) -> None:
    """Leave the sentence of an error this rank met in the job's store, for the ranks whose collectives its
    leaving fails (``StopVote.leave_cause``); not one that itself followed another rank's, nor an interruption."""
    if vote is None or getattr(e, "follows", False):
        return
    if isinstance(e, OSError):
        vote.leave_cause(os_error(e), 1)
    elif isinstance(e, BrickyardError) and e.exit_code != 130:
        vote.leave_cause(str(e), e.exit_code)


def _train(req: Request, host: dev.Host, log: Logger, metrics: MetricsWriter, rundir: RunDir) -> dict:
    cfg, info, run_dir, meta = req.config, req.info, req.run_dir, req.meta
    if req.resume and cfg.dist.mode == "ps":
        raise BrickyardError(ps.NO_RESUME)
    torch.manual_seed(cfg.train.seed)
    if cfg.data.batch_size == "auto":
        cfg = req.config = setup.resolve_auto_batch(cfg, req.model, req.data, host.device, info, log)
    found = ckpt.find(req.resume, run_dir / "checkpoints", log.warning, log.info) if req.resume else None
    if req.resume and req.resume != "auto":
        rundir.check_resume_file(req.resume)  # once the file is known to be a checkpoint
    plan = setup.plan(cfg, req.data, info, run_dir)  # batches, steps and schedule: decided once, here
    chosen, measured = precision.decide(cfg.train.precision, req.model, req.data, plan.batches.batch_size, host, info.rank)
    host = dataclasses.replace(host, precision=chosen)
    if plan.serves(info.rank):  # a parameter server: it serves until the trainers are done
        setup.serve(req, host, plan, log)
        return {}
    run = setup.build_run(req, host, log, plan)
    e = run._engine
    e.rss_at_start_mb = req.rss_at_start_mb
    tb = TBWriter(run_dir if info.is_main else None, "tensorboard" in loggers(cfg.train), log.warning)
    trackers = Trackers(sorted(loggers(cfg.train)), metrics)
    cbs = setup.callbacks_for(run, metrics, tb, [trackers] + from_config(cfg) + req.callbacks)
    if found:
        e.checkpoints.restore(run, *found)
    if req.resume or info.restart_count:
        for line in rundir.repair(run.step):  # after a crash: nothing past the resumed step, no temporaries
            log.info(line)
    setup.wrap(run)
    req.vote = e.vote
    if info.is_main:
        rundir.claim()
        rundir.save_config(cfg)
        write_json(run_dir / "env.json", env_record(host.device, cfg.train.seed, info.world_size, {
            "precision": run.precision, "channels_last": e.channels_last, "threads": host.threads,
            "pinned_cpus": list(host.pinned) if host.pinned else None, "grad_sync": e.grad_sync.name,
            "allocator": host.allocator, "model": meta, "restart_count": info.restart_count,
            "cpu_model": precision.cpu_model(), "precision_measured": measured}))
    setup.announce(run, host, info, measured)
    metrics.write(kind="start", step=run.step, world_size=info.world_size, total_steps=run.total_steps)
    run.model.train()
    with _StopFlag(run):
        _loop(run, cbs)
    e.loader.close()  # the streaming loader's persistent workers
    e.update.finish()
    if run.interrupted:
        where = f" to {run.last_checkpoint}" if run.last_checkpoint else ""
        restarting = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0  # e.g. a node joined an elastic job
        then = " (a group torchrun restarts resumes there by itself)" if restarting else ""
        raise Interrupted(f"{run.stopped} at step {run.step}: saved a checkpoint{where}; resume with "
                          f"`brickyard train --run-dir {run_dir} --resume auto`{then}.")
    summary = finish(run, metrics, tb, req.started)
    cbs.on_train_end(run, summary)
    metrics.write(kind="summary", **{k: v for k, v in summary.items() if k != "run_dir"})
    dist.barrier()
    return summary
