"""The trainer: one object owns one process's run. It builds the parts, typed and in the order a reader
sees in ``__init__`` (the model on its device, its parameter groups, the loss, the optimiser and update, the
loader, the device-side preparation, checkpoints, the callbacks; then ``wrap``: the gradient sync), owns the loop (``fit``) and has one ``state_dict`` / ``load_state_dict``
for resume. torchtitan's ``Trainer.__init__`` (torchtitan/train.py) is the anchor; a way of training
(``training.ways``) supplies the parts that differ between data parallel, FSDP, the parameter server and
dimension reduction.

Callbacks see the run through a read-only ``RunView`` of its ``Run`` (``training.run``), a training step
through its ``StepContext`` (``training.step``); the trainer sets the run's fields. Position in training is
one integer, the optimiser ``step``: epoch = step // steps_per_epoch and the batch inside the epoch follow
from it, the learning rate is a pure function of it,
and the batch plan and augmentation are seeded from it. A checkpoint therefore needs only the weights,
optimiser/scaler state, RNG state, callback state and ``step`` to resume exactly.

Host syncs: the loop accumulates loss and accuracy sums on the device and reads them back (``.item()``
after an all-reduce) only every ``train.log_every`` steps and at evaluations, into the rows every logger gets
(``training.report``; the console's lines among them).
"""
from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed import ProcessGroup

from brickyard.callbacks import Callback, CallbackList, from_config
from brickyard.callbacks.checkpointing import Checkpointing, held_validation, rescored
from brickyard.callbacks.not_learning import NotLearning
from brickyard.callbacks.profiling import Profiling
from brickyard.callbacks.test_every import TestEvery
from brickyard.callbacks.watching import Histograms, Watching
from brickyard.config import Config
from brickyard.data import DataBundle, augment
from brickyard.data.loaders import make_train_loader
from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError, CheckpointError, DataError, reason
from brickyard.models.finetune import find_head
from brickyard.observe.inspection import Watcher
from brickyard.observe.runlog import read_metrics
from brickyard.optim import build_optimizer, param_groups
from brickyard.training import activation_checkpointing, graphs
from brickyard.training import checkpoint as ckpt
from brickyard.training import device as dev
from brickyard.training.evaluation import SplitEvaluator, finish
from brickyard.training.report import Report
from brickyard.training.resolve import Plan
from brickyard.training.run import Control, Meter, Run, RunView
from brickyard.training.step import Losses, NanGuard, Totals, default_step
from brickyard.training.ways import Way
from brickyard.training.ways.dim_reduce import snapshot_callbacks


class Interrupted(BrickyardError):
    exit_code = 130


@dataclass(frozen=True)
class UserParts:
    """What the user brings besides the model and the data (``fit``'s keywords)."""
    callbacks: tuple = ()
    loss_fn: Callable | None = None
    train_step: Callable | None = None
    meta: dict = field(default_factory=dict)  # the model's name and registry flag, saved in checkpoints
    loggers: tuple = ()  # ``observe.loggers.Logger`` instances besides those the config names (rank 0)


@dataclass(frozen=True, eq=False)
class Job:
    """Where and as what this process trains, resolved before any part is built (``training.resolve``)."""
    config: Config                    # resolved: data.num_workers and data.batch_size "auto" are numbers here
    host: dev.Host                    # device, threads, loader workers, precision
    info: dist.DistInfo               # this process's place in the job
    run_dir: Path
    plan: Plan
    way: Way
    group: ProcessGroup | None        # the readers' process group (None: every rank)
    messages: ProcessGroup | None     # the way's own process group (the parameter server's messages)
    vote: dist.StopVote | None        # the ranks' agreement on a stop step (None on a serving rank)
    rss_at_start_mb: float
    compiled: bool = False            # train.compile resolved: the model as trained is torch.compile'd


class Trainer:
    """One process's run (see the module docstring). ``metrics`` (``observe.loggers.fanout.Loggers``) is where its
    rows go."""

    def __init__(self, job: Job, model: nn.Module, data: DataBundle, user: UserParts, log, metrics):
        cfg, host, info, way = job.config, job.host, job.info, job.way
        self.job, self.config, self.plan, self.way, self.data = job, cfg, job.plan, way, data
        self.log_every = int(cfg.train.log_every)  # resolved (auto: training.resolve.log_every)
        whole, self.model, self.channels_last = place(model, job, data, log)
        self.param_groups = way.held_groups(param_groups(whole, cfg.optim, find_head(whole) if cfg.finetune.head_lr_mult
                                                         != 1.0 else None, cfg.finetune.head_lr_mult), self.model)
        self.losses = Losses(user.loss_fn, cfg.optim, host.device, cfg.data.task == "multilabel")
        self.scaler = torch.amp.GradScaler("cuda", enabled=host.precision == "fp16")
        self.step_fn = user.train_step or default_step
        self.check_each_step = cfg.train.nan_guard and host.device.type == "cpu"  # CPUs: reading the loss is no sync
        self.guard = NanGuard(cfg.train.nan_guard, way.name if way.sharded else None, self.losses.train)
        self.meter = Meter(Totals(host.device, job.group, False if cfg.data.task == "multilabel" else None))
        self.report = Report(self.meter, None if data.in_memory else "try more data.num_workers")
        self.control = Control(self.losses.train, lambda: self.update.describe(), way.stops_early,
                               lambda: self.evaluate.recompute_bn(self.run))
        self.run = Run(cfg, self.model, build_optimizer(cfg.optim, self.param_groups), data, info.rank, info.world_size,
                       host.device, host.precision, job.run_dir, log, self.plan.steps_per_epoch, self.plan.total_steps,
                       planned_steps=self.plan.planned_steps or self.plan.total_steps, meter=self.meter,
                       _control=self.control)
        self.update = way.update(self.run, self.param_groups, self.losses.train, self.scaler, job.group, job.messages)
        self.loader = make_train_loader(data.train, cfg.data, host.device, way.readers, way.reader_index, cfg.train.seed,
                                        cfg.train.grad_accum)
        self.prep = augment.build(cfg, data, host.device, self.channels_last, cfg.train.seed, way.readers, job.group,
                                  augment.float_dtype(self.model))
        self.evaluate = SplitEvaluator(self.prep, self.losses.eval, way.readers, way.reader_index, job.group, way.sharded)
        c = cfg.checkpoint
        self.checkpoints = ckpt.Checkpoints(job.run_dir / "checkpoints", c.keep_last, c.keep_best, info.is_main,
                                            self.guard, self.state_dict, way.sharded, self._saved)
        self.view = RunView(self.run)  # what every hook gets: the run, read-only but lr_scale
        given = from_config(cfg) + list(user.callbacks)
        first = [cb for cb in given if getattr(cb, "before_checkpoints", False)]  # EMA, SWA: before a step's checkpoint
        self.callbacks = CallbackList(first + self._own_callbacks(metrics) + way.callbacks(self.run, self.update, metrics)
                                      + [cb for cb in given if cb not in first], view=self.view)
        self.meta, self.metrics = user.meta, metrics
        self.step_once, self.graphs_note = graphs.choose(self, bool(user.train_step or user.loss_fn), log)  # or eager

    def _own_callbacks(self, metrics) -> list[Callback]:
        """brickyard's behaviours, then the config's built-ins. The order is part of the contract: checkpoints are
        written before a user's ``on_epoch_end`` sees ``run.last_checkpoint``. (``run.train_loss``, which
        ``NotLearning`` reads, is set by the trainer at a log step before any ``on_step_end``.)"""
        run, t, c = self.run, self.config.train, self.config.checkpoint
        own: list[Callback] = [NotLearning(stop=t.stop_if_not_learning),
                               Checkpointing(self.checkpoints, c.every_steps, c.every_epoch, c.monitor)]
        if t.watch:
            own.append(Watching(Watcher(run.model, t.watch), t.watch_every, metrics))
        if t.test_every:
            own.append(TestEvery(t.test_every, metrics, self.evaluate))
        if t.histograms_every:
            own.append(Histograms(t.histograms_every, metrics))
        if t.profile_steps:
            where = Path(t.profile_dir).expanduser() if t.profile_dir else run.run_dir / "profile"
            own.append(Profiling(*t.profile_steps, where, run.rank, run.device))
        return own + snapshot_callbacks(self.config, run)

    def wrap(self) -> None:
        """The gradient sync of the way of training, then ``torch.compile`` when asked; after a restore."""
        run, host = self.run, self.job.host
        model, self.grad_sync = self.way.grad_sync(run.model, run.device, self.job.group, host.own_cores)
        self.compiled = self.job.compiled
        run.forward = torch.compile(model) if self.compiled else model

    # state

    def state_dict(self) -> dict:
        """What a checkpoint holds (under FSDP gathered on every rank: a collective)."""
        run, data = self.run, self.data
        model_state, optimizer_state = self.way.full_state(run.model, run.optimizer)
        return {
            "model": model_state, "optimizer": graphs.plain_lr(optimizer_state), "scaler": self.scaler.state_dict(),
            "rng": ckpt.rng_state(run.device), "step": run.step, "epoch": run.step // run.steps_per_epoch,
            "best_metric": self.checkpoints.best_metric, "best_monitor": self.config.checkpoint.monitor,
            "best_step": self.checkpoints.best_step,
            "config": run.config.to_dict(),
            "boost": self.update.state_dict(), "callbacks": self.callbacks.state_dict(),
            "meta": {**self.meta, **self._calibration(), "classes": list(data.classes), "mean": list(data.mean), "std": list(data.std),
                     "image_size": list(data.image_size), "in_channels": data.in_channels,
                     "num_classes": data.num_classes, "data": data.name},
        }

    def _calibration(self) -> dict:
        """What a checkpoint keeps for eval and predict, chosen at the latest validation (the one whose weights
        ``best.pt`` holds when it writes one): the temperature (``train.calibrate``), several labels' threshold."""
        c = self.config
        return {**({"temperature": self.evaluate.temperature} if c.train.calibrate else {}),
                **({"task": "multilabel", "threshold": self.evaluate.threshold} if c.data.task == "multilabel" else {})}

    def load_state_dict(self, path: Path, state: dict) -> None:
        """Weights, optimiser, scaler, RNG, callbacks' state, the best metric and the step of ``state`` (read
        from ``path``); what does not fit is refused first, in one sentence."""
        run = self.run
        self.checkpoints.restore_check(self.way.whole_model(run.model), run.config, path, state)
        try:
            self.way.load_state(run.model, run.optimizer, state)
        except (ValueError, KeyError, IndexError) as err:
            raise CheckpointError(f"checkpoint {path}: optimiser state does not fit ({err}).") from None
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if state.get("boost"):
            self.update.load_state_dict(state["boost"])
        saved = state.get("callbacks")
        if saved is not None and not isinstance(saved, dict):
            raise CheckpointError(f"checkpoint {path}: its callbacks' state is a {type(saved).__name__}, not a mapping.")
        try:  # a state a callback does not take (a damaged or foreign checkpoint) is said here, not met mid-run
            self.callbacks.load_state_dict(saved or {})
        except BrickyardError:
            raise
        except Exception as err:  # noqa: BLE001  any state is a stranger's: a tensor where a mapping was saved
            raise CheckpointError(f"checkpoint {path}: a callback's saved state does not fit it ({reason(err)}).") from err
        ckpt.set_rng_state(state["rng"], run.device)
        if self.config.train.calibrate:
            self.evaluate.temperature = ckpt.temperature(state, path)
        if self.config.data.task == "multilabel":
            self.evaluate.threshold = ckpt.threshold(state, path)
        run.step = int(state["step"])
        self.checkpoints.best_metric = self._best_after_resume(state)
        step = state.get("best_step")
        self.checkpoints.best_step = step if isinstance(step, int) and not isinstance(step, bool) else None
        run.log.info(f"resumed from {path} at step {run.step} (epoch {run.step // run.steps_per_epoch})")

    def _best_after_resume(self, state: dict) -> float | None:
        """The best metric ``best.pt`` is compared with: the saved one, or where ``checkpoint.monitor`` changed since
        it was saved, the new monitor's score of the validation whose weights ``best.pt`` holds, read from the run's
        logged validations (a saved accuracy is never compared with a loss). None: the next validation writes it."""
        best, was, now = state.get("best_metric"), state.get("best_monitor"), self.config.checkpoint.monitor
        if not isinstance(best, (int, float)) or isinstance(best, bool) or not math.isfinite(best):
            return None  # none yet, or a stranger's value: the next validation writes best.pt
        if not isinstance(was, str) or was == now:  # a checkpoint of 0.2.0 has no monitor: the one it ran with
            return float(best)
        rows = [r for r in read_metrics(self.run.run_dir / "metrics.jsonl") if r.get("kind") == "val"]
        held = held_validation(rows, state.get("best_step"), best, was)
        score = rescored(held, now)
        if held is None or score is None:
            self.run.log.info(f"checkpoint.monitor changed from {was} to {now}: the validation best.pt holds is not in "
                              f"metrics.jsonl, so the next validation writes best.pt")
            return None
        self.run.log.info(f"checkpoint.monitor changed from {was} to {now}: best.pt (step {held['step']}) scores "
                          f"{score:g} under {now}; a later validation that beats it replaces it")
        return score

    def _saved(self, path: Path) -> None:
        self.run.last_checkpoint = path
        self.callbacks.on_checkpoint(self.run, path)

    # the loop

    def fit(self, started: float) -> dict:
        """Train until ``total_steps`` or an agreed stop; the behaviours happen in the callbacks. The loop owns
        the measurements (``run.meter``): each step's result, and the clock, which runs during steps only; it
        reports them to the loggers at log steps, validations and epoch ends (``_log_step``, ``Report``).
        Returns the summary (the test evaluation's included)."""
        run, cbs, meter, accum, vote = self.run, self.callbacks, self.meter, self.config.train.grad_accum, self.job.vote
        assert vote is not None  # a trainer's rank takes part in the vote (a serving rank builds no trainer)
        run.model.train()
        with _StopFlag(self.control):
            cbs.on_train_start(run)
            while run.step < run.total_steps and run.stopped is None:
                run.epoch, pos = divmod(run.step, run.steps_per_epoch)
                meter.start_epoch()
                self.report.open_window()
                cbs.on_epoch_start(run)
                batches = self.loader.epoch(run.epoch, pos * accum)
                for _ in range(pos, run.steps_per_epoch):
                    cbs.on_step_start(run)
                    result = self.step_once(self, batches)
                    meter.add(result)
                    run.step += 1
                    self.metrics.progress(run.step)
                    if run.step % self.log_every == 0 or run.step == run.total_steps:
                        self._log_step()
                    cbs.on_step_end(run, result.loss)
                    if stop := vote.should_stop(run.step, self.control.request):  # polled once per step
                        self.control.agreed, run.stopped = stop, stop.reason
                    if run.stopped or run.step >= run.total_steps:
                        break
                meter.pause()
                if run.interrupted:
                    break
                if run.step % run.steps_per_epoch == 0 or run.step >= run.total_steps or run.stopped:  # an epoch ends
                    self._end_epoch()
            self.metrics.progress(run.step, ended=True)
            cbs.on_loop_end(run)
        self.loader.close()  # the streaming loader's persistent workers
        self.update.finish()
        if run.interrupted:
            where = f" to {run.last_checkpoint}" if run.last_checkpoint else ""
            restarting = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0  # e.g. a node joined an elastic job
            then = " (a group torchrun restarts resumes there by itself)" if restarting else ""
            flags = os.environ.get("BRICKYARD_RESUME_FLAGS")  # the launcher's --devices (launch.torchrun.resume_flags)
            raise Interrupted(f"{run.stopped} at step {run.step}: saved a checkpoint{where}; resume with "
                              f"`brickyard train --run-dir {run.run_dir}{' ' + flags if flags else ''} --resume auto`{then}.")
        return self._summary(started)

    def _log_step(self) -> None:
        """The NaN guard, then the log window's row for every logger; it sets ``run.train_loss`` and
        ``run.train_accuracy``, which callbacks read (``NotLearning``)."""
        run = self.run
        self.guard(run)  # before the loss read-back below, this loop's only host sync
        row = self.report.train(run)
        run.train_loss, run.train_accuracy = row["loss"], row["accuracy"]
        self.metrics.write(**row)

    def _end_epoch(self) -> None:
        run = self.run
        self._agree_on_stop()  # a request made during the epoch (a time limit on one rank)
        if self._validation_due():
            self._validate()
            self._agree_on_stop()  # a decision on the validation metrics (early stopping)
        self.meter.end_epoch()
        self.metrics.write(**self.report.epoch(run))
        self.callbacks.on_epoch_end(run)

    def _validation_due(self) -> bool:
        """Every ``train.eval_every`` epochs and at the end; decided on what all ranks agree on only."""
        run, every = self.run, self.config.train.eval_every
        ended = run.step >= run.total_steps or run.stopped is not None
        return run.data.val is not None and ((every and math.ceil(run.step / run.steps_per_epoch) % every == 0) or ended)

    def _validate(self) -> None:
        run = self.run
        self.callbacks.on_validation_start(run)
        try:
            r = self.evaluate(run, run.data.val, validation=True)
        except DataError as err:  # a bad validation file: keep the epoch just trained before saying so
            kept = None if self.way.sharded else self.checkpoints.save(run)  # FSDP: saving needs every rank
            if kept is None:
                raise
            raise DataError(f"{err} The epoch trained before it is kept in {kept}: resume with `--resume auto` once the "
                            f"file is fixed.") from None
        run.metrics, run.validated_at = r, run.step
        self.metrics.write(**self.report.val(run, r))
        self.callbacks.on_validation_end(run, r)

    def _agree_on_stop(self) -> None:
        """At an epoch end every rank is at the same step: one all-reduce of the callbacks' stop requests (a
        decision on the shared validation metrics, or a time limit reached on one rank only). A signal is
        agreed through the job's vote instead, so that every rank names it."""
        run, c = self.run, self.control
        request = c.request.reason if c.request and c.request.kind == "request" else None
        if run.stopped is not None:
            return
        if run.world_size > 1:  # the ranks that vote on a stop: the readers, or every rank where the model is split
            flag = torch.tensor([float(request is not None)], device=run.device)
            if dist.all_reduce_sum(flag, self.way.vote_group(self.job.group)).item() > 0:
                c.agreed = dist.Stop("request", request or "a stop asked for on another rank")
        elif request is not None:
            c.agreed = dist.Stop("request", request)
        if c.agreed is not None:
            run.stopped = c.agreed.reason

    def _summary(self, started: float) -> dict:
        run, way = self.run, self.way
        facts = {"trainers": way.readers, "channels_last": self.channels_last, "compiled": self.compiled,
                 "cuda_graphs": isinstance(self.step_once, graphs.GraphedStep) and self.step_once.captured,
                 "model": self.meta.get("name"), "strategy": way.summary_name(run.world_size),
                 "rss_at_start_mb": self.job.rss_at_start_mb}
        summary = finish(run, self.metrics, started, self.evaluate, facts, self.callbacks)
        self.callbacks.on_train_end(run, summary)
        self.metrics.write(kind="summary", **{k: v for k, v in summary.items() if k != "run_dir"})
        return summary


def place(model: nn.Module, job: Job, data: DataBundle, log) -> tuple[nn.Module, nn.Module, bool]:
    """The model on its device (layout, SyncBatchNorm, activation checkpointing, then the way's sharding):
    (the whole model, the module this rank trains: the model or a pipeline's stage of it, channels_last)."""
    cfg, host, info = job.config, job.host, job.info
    t, device = cfg.train, host.device
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = dev.cudnn_benchmark(sum(p.numel() for p in model.parameters()))
    channels_last = host.channels_last and data.is_images and job.way.keeps_layout
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.preserve_format)
    if cfg.dist.sync_bn and info.distributed:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    checkpointed = activation_checkpointing.apply(model, t.activation_checkpointing)
    if checkpointed:
        log.info(f"activation checkpointing: {len(checkpointed)} blocks ({', '.join(checkpointed[:4])}"
                 f"{', ...' if len(checkpointed) > 4 else ''}) recompute their activations in the backward pass")
    stage = job.way.shard(model, host, log, (data.in_channels, *data.image_size) if data.is_images else ())
    return model, (model if stage is None else stage), channels_last



def serve(job: Job, model: nn.Module, data: DataBundle, log) -> None:
    """A serving rank's whole part in the job (a parameter server): no training run is built on it."""
    cfg = job.config
    model, _, _ = place(model, job, data, log)
    groups = param_groups(model, cfg.optim, find_head(model) if cfg.finetune.head_lr_mult != 1.0 else None,
                          cfg.finetune.head_lr_mult)
    job.way.serve([p.detach() for g in groups for p in g["params"]], job.plan, job.messages, log)
    dist.barrier()


class _StopFlag:
    """SIGINT/SIGTERM become a stop request (``"SIGTERM"``); a second Ctrl-C leaves at once."""

    def __init__(self, control: Control):
        self.control, self._old = control, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        c = self.control
        if c.request is not None and c.request.kind == "signal":
            raise KeyboardInterrupt
        c.request = dist.Stop("signal", signal.Signals(signum).name)  # a signal outranks a callback's request

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)
