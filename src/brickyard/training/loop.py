"""``train``: one process's share of a job, from a config, a model and data to the summary.

It resolves what the run decides once (``training.resolve``), joins the process group, takes the run
directory, opens the logs, and hands the parts to the ``Trainer`` (``training.trainer``), which owns the
loop; every failure on the way becomes one sentence in the logs and for the CLI. From ``train`` to a
user's ``train_step`` is four frames: ``train``, ``Trainer.fit``, ``step.optimizer_step`` and ``_call_step``
(the run directory, the logs and the reporting of failures are context managers around them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed import ProcessGroup

from brickyard.config import Config
from brickyard.config.schema import loggers as train_loggers
from brickyard.data import DataBundle
from brickyard.distributed import env as dist_env
from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError, UserCodeError, reason
from brickyard.files import os_error
from brickyard.observe.loggers import RunInfo
from brickyard.observe.loggers.fanout import Loggers, for_run
from brickyard.observe.logs import Logger
from brickyard.training import checkpoint as ckpt
from brickyard.training import device as dev
from brickyard.training import failures, precision, ways
from brickyard.training.announce import announce, write_env
from brickyard.training.evaluation import evaluate
from brickyard.training.resolve import auto_batch, check_before_writing, check_placement, log_every, plan, run_dir_of
from brickyard.training.rundir import RunDir
from brickyard.training.trainer import Interrupted, Job, Trainer, UserParts, serve

__all__ = ["train", "evaluate", "Interrupted"]


@dataclasses.dataclass(frozen=True, eq=False)
class _Start:
    """What ``train`` was given and found before the run directory is opened."""
    config: Config
    model: nn.Module
    data: DataBundle
    user: UserParts
    info: dist.DistInfo
    way: ways.Way    # as chosen from the config given: asked only the job's shape (check, groups, serves, readers)
    host: dev.Host
    run_dir: Path
    resume: str | None
    log_dir: Path
    started: float
    rss_at_start_mb: float


def train(cfg: Config, model: nn.Module, data: DataBundle, run_dir: Path | None = None, resume: str | None = None,
          model_meta: dict | None = None, info: dist.DistInfo | None = None, log_dir: Path | None = None,
          callbacks=(), loss_fn=None, train_step=None, loggers=()) -> dict:
    """Train ``model`` on ``data`` as this process's share of the job; return the summary dict. ``loggers``:
    ``observe.loggers.Logger`` instances that get every row besides those ``train.loggers`` names (rank 0)."""
    started, rss = time.perf_counter(), dev.rss_mib()
    info = info or dist.from_env()
    if cfg.data.task == "auto":  # one label an image, or several (multi-hot rows): decided once, from the data
        cfg = cfg.replace(**{"data.task": "multilabel" if data.multilabel else "single"})
        if data.multilabel:
            data.notes.append("several labels an image (multi-hot rows): data.task multilabel, binary cross-entropy, "
                              "mean average precision and a threshold chosen on validation")
    user = UserParts(tuple(callbacks), loss_fn, train_step, model_meta or {}, tuple(loggers))
    way = ways.choose(cfg, info)
    check_before_writing(cfg, model, data, user, info, way, resume)
    with _torch_flags():
        host = dev.setup(cfg.train, info.local_rank, info.local_world_size, cfg.data.num_workers,
                         streams=not data.in_memory)
        if cfg.data.num_workers == "auto":  # planned with the threads
            cfg = cfg.replace(**{"data.num_workers": host.workers})
        check_placement(cfg, model, host.device, info.distributed)
        if host.device.type == "cuda":
            torch.cuda.set_device(host.device)
        try:
            created = dist.init(info, cfg.dist.backend, host.device, cfg.dist.timeout_s)
        except RuntimeError as e:
            raise BrickyardError(f"rank {info.rank}: could not join the process group within dist.timeout_s="
                                 f"{cfg.dist.timeout_s}s ({reason(e)}).") from None
        try:
            where = run_dir_of(run_dir, cfg.preset)
            start = _Start(cfg, model, data, user, info, way, host, where, resume,
                           Path(log_dir) if log_dir else where / "logs", started, rss)
            with _locked(where, resume, info) as rundir, _reported(start) as opened:
                trainer = _build(start, rundir, opened)
                if trainer is None:  # a parameter server: it served until the trainers were done
                    return {}
                summary = trainer.fit(started)
                dist.barrier()
                return summary
        finally:
            if created:  # a process group the caller made is theirs to end
                dist.shutdown()


@contextlib.contextmanager
def _locked(where: Path, resume: str | None, info):
    """The run directory, held until this process ends the run: one writer per directory."""
    rundir = RunDir(where, info.is_main)
    rundir.lock(resume, info.restart_count > 0)
    try:
        yield rundir
    finally:
        rundir.unlock()


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


@dataclasses.dataclass(eq=False)
class _Opened:
    """What a run's logs and its agreement with the other ranks are: open while the run is."""
    log: Logger
    metrics: Loggers                      # where every row goes (on ranks other than 0 the console alone)
    group: ProcessGroup | None = None     # the readers' process group (None: every rank)
    messages: ProcessGroup | None = None  # the way's own group (the parameter server's messages)
    vote: dist.StopVote | None = None  # None on a serving rank: it takes no part in the trainers' stops
    config: Config | None = None          # the job's resolved config once there is one (what a failure is said with)


@contextlib.contextmanager
def _reported(s: _Start):
    """The run with its logs open: every failure said once, in the logs and for the CLI, and left in the job's
    store for the ranks whose collectives its leaving fails."""
    info = s.info
    log = Logger(info.rank, tuple([s.log_dir / f"workerlog.{info.rank}"] + ([s.run_dir / "train.log"] if info.is_main else [])))
    opened = _Opened(log, Loggers())
    heartbeat, done = None, False
    try:
        # rank 0: every logger; the others: the console alone, their own log file's progress lines
        opened.metrics = for_run(train_loggers(s.config.train), s.user.loggers, log.warning, info.rank)
        # brickyard's own command ends itself once its node has lost the job's store for a while (a user's Python is
        # left alone): it may wait on something with no timeout of its own
        lost = failures.cut_off(info.rank, s.log_dir, dist.LOST_GRACE_S) if dist_env.OWN_PROCESS else None
        heartbeat = dist.Heartbeat(info, on_lost=lost)
        opened.group, opened.messages = s.way.groups()  # collective: every rank, in this order
        if not s.way.serves(info.rank):
            opened.vote = dist.StopVote(info, warn=log.warning, group=s.way.vote_group(opened.group))
        yield opened
        done = True
    except BrickyardError as e:
        log.error(str(e), exc_info=isinstance(e, UserCodeError))  # the user's traceback, in the run's logs too
        _leave_cause(opened.vote, e)
        raise
    except OSError as e:  # a full disk, a size limit, permissions: the CLI names the file and the reason
        log.error(os_error(e))
        _leave_cause(opened.vote, e)
        raise
    except Exception as e:  # noqa: BLE001  said in one sentence where it means something; else a crash, logged whole
        explained = failures.explain(e, opened.config or s.config, s.model, s.data, s.host.device, info, log, heartbeat, s.log_dir,
                                     opened.vote) if isinstance(e, (torch.OutOfMemoryError, RuntimeError)) else e
        if explained is not e:
            _leave_cause(opened.vote, explained)  # out of memory on this rank's device
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
                opened.metrics.finish(done)
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


def _build(s: _Start, rundir: RunDir, opened: _Opened) -> Trainer | None:
    """Resolve the rest (batch size, plan, precision), then build the way of training from the resolved config and
    the trainer, restore it and write the run's record; None on a serving rank, once it has served."""
    cfg, info, log, metrics = s.config, s.info, opened.log, opened.metrics
    torch.manual_seed(cfg.train.seed)
    if cfg.data.batch_size == "auto":
        cfg = cfg.replace(**{"data.batch_size": auto_batch(cfg, s.model, s.data, s.host.device, info, log)})
    way = ways.choose(cfg, info, (opened.group, opened.messages))  # from the final config (workers and batch resolved): no part holds the one given
    found = ckpt.find(s.resume, s.run_dir / "checkpoints", log.warning, log.info) if s.resume else None
    if s.resume and s.resume != "auto":
        rundir.check_resume_file(s.resume)  # once the file is known to be a checkpoint
    the_plan = plan(cfg, s.data, info, way.readers)  # batches, steps and schedule: decided once, here
    if cfg.train.log_every == "auto":  # from the plan's steps; the way is made again from the final config
        cfg = cfg.replace(**{"train.log_every": log_every("auto", the_plan.total_steps, s.host.device)})
        way = ways.choose(cfg, info, (opened.group, opened.messages))
    chosen, measured = precision.decide(cfg.train.precision, s.model, s.data, the_plan.batches.batch_size, s.host, info.rank)
    compiled = dev.resolve_compile(cfg.train.compile, s.host.device, sum(p.numel() for p in s.model.parameters()),
                                   the_plan.total_steps)
    job = Job(cfg, dataclasses.replace(s.host, precision=chosen), info, s.run_dir, the_plan, way, opened.group,
              opened.messages, opened.vote, s.rss_at_start_mb, compiled)
    opened.config = cfg  # an out-of-memory error names the batch size auto chose
    if way.serves(info.rank):
        serve(job, s.model, s.data, log)
        return None
    trainer = Trainer(job, s.model, s.data, s.user, log, metrics)
    if found:
        trainer.load_state_dict(*found)
    if s.resume or info.restart_count:
        for line in rundir.repair(trainer.run.step):  # after a crash: nothing past the resumed step, no temporaries
            log.info(line)
    trainer.wrap()
    # before config.yaml and env.json: a logger that cannot start is one sentence that leaves nothing behind
    metrics.start(RunInfo(s.run_dir, cfg.to_dict(), trainer.run.step, info.world_size, log.warning, info.rank))
    if info.is_main:
        rundir.claim()
        rundir.save_config(cfg)
        write_env(trainer, measured)
    announce(trainer, measured)
    metrics.write(kind="start", step=trainer.run.step, world_size=info.world_size, total_steps=trainer.run.total_steps,
                  steps_per_epoch=trainer.run.steps_per_epoch)
    return trainer
