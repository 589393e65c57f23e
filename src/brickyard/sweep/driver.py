"""The sweep's loop: Optuna's ask and tell around ordinary runs, until the study holds ``trials`` finished trials.

Each trial asks the study for its values (the sampler decides), trains ``SWEEP_DIR/trial-NNNN`` (with ``--folds K``:
``trial-NNNN/fold-I`` for each fold, its value the folds' mean), and tells the study what came of it: complete with
its value, pruned, or failed with its one sentence (the sweep goes on). Several sweep processes on one storage share
the count: a process stops when the study's complete, pruned and running trials reach ``trials``.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from brickyard.config import load_config
from brickyard.config.checks import VAL_METRICS
from brickyard.errors import BrickyardError, ConfigError, DataError
from brickyard.files import write_atomic
from brickyard.sweep.space import Param, override
from brickyard.sweep.study import counts, fail_stale, optuna_module
from brickyard.sweep.trial import PRUNED, Report, best_value, reporting, summary_of
from brickyard.training.resolve import MULTI_ONLY, SINGLE_ONLY
from brickyard.training.trainer import Interrupted

SINGLE_SETS = ("mnist", "fashion-mnist", "cifar10", "cifar100", "synthetic")  # one label an image, whatever the config
PLACEMENT = ("train.threads", "train.device", "data.num_workers")  # where a process trains, not what: may differ


@dataclass
class Sweep:
    """What a sweep process was asked for (the command line, checked)."""
    config: str
    overrides: list[str]
    params: list[Param]
    metric: str
    trials: int
    dir: Path
    storage: str                  # a database URL or the journal file's path
    name: str
    folds: int = 0
    devices: str | None = None
    pruner: tuple = ("median", 5, 0.0, 1.0, None)  # (name, startup trials, warm-up epochs, first and last validation epochs)
    said: list[str] = field(default_factory=list)

    def settings(self) -> dict:
        """What the study keeps of it: a process joining the study must have asked for the same."""
        kept = [o for o in self.overrides if o.partition("=")[0] not in PLACEMENT]
        return {"config": self.config, "overrides": kept, "metric": self.metric, "folds": self.folds,
                "space": [[p.key, p.kind, list(p.values), p.step, p.log] for p in self.params]}


class TrialFailed(BrickyardError):
    """A trial that failed with its one sentence: Optuna records it failed and the sweep goes on."""


def run(sweep: Sweep, study) -> None:
    """Trials until the study holds ``sweep.trials`` finished ones (or as many have failed in this process), through
    Optuna's ``study.optimize``: its ``MaxTrialsCallback`` counts every process's complete and pruned trials after
    each trial (so K processes at once may finish up to K - 1 more), and on a database its heartbeat marks a dead
    machine's trials failed (``study.open_storage``)."""
    optuna = optuna_module()
    stale = fail_stale(study)
    if stale:
        print(f"sweep {sweep.name}: {stale} trial(s) of a sweep process that ended were marked failed and queued again",
              flush=True)
    c = counts(study)
    if c.get("complete", 0) + c.get("pruned", 0) >= sweep.trials:
        return
    failed = []

    def objective(trial):
        state, value, why = one(sweep, study, trial)
        shown = f"{sweep.metric} {value:.4f}" if value is not None else why or state
        print(f"trial {trial.number}: {state}, {shown} ({trial.user_attrs.get('run_dir')})", flush=True)
        if state == "pruned":
            raise optuna.TrialPruned()
        if state == "fail":
            failed.append(trial.number)
            if trial.user_attrs.get("config_error") and not counts(study).get("complete", 0):
                raise ConfigError(f"trial {trial.number} failed, and no trial has completed yet: {why}")  # every trial would
            raise TrialFailed(why or "failed")
        return value

    def enough_failures(study, trial):
        if len(failed) >= sweep.trials:
            print(f"sweep {sweep.name}: stopping after {len(failed)} failed trials in this process", flush=True)
            study.stop()

    done = optuna.study.MaxTrialsCallback(sweep.trials, states=(optuna.trial.TrialState.COMPLETE,
                                                                optuna.trial.TrialState.PRUNED))
    study.optimize(objective, catch=(TrialFailed,), callbacks=[done, enough_failures], gc_after_trial=True)


def baseline(sweep: Sweep, study) -> str:
    """A new study's first trial: the config's own values of the space's keys (the recipe a sweep has to beat), queued
    where each lies in its range or choices; what was done, in words."""
    if study.get_trials(deepcopy=False) or isinstance(study.sampler, optuna_module().samplers.GridSampler):
        return ""  # a grid visits its own points (and the config's values where they are among them)
    cfg = load_config(sweep.config, sweep.overrides)
    own = {}
    for p in sweep.params:
        if p.kind == "fixed":
            continue
        section, _, key = p.key.rpartition(".")
        v = getattr(_section(cfg, section), key)
        inside = v in p.values if p.kind == "choice" else (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                          and p.values[0] <= v <= p.values[1])
        if not inside:
            return f"the config's own {p.key} ({v!r}) lies outside the space: no baseline trial"
        own[p.key] = v
    study.enqueue_trial(own)
    return "trial 0 is the config's own values (the baseline): " + ", ".join(f"{k}={v}" for k, v in own.items())


def _section(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def one(sweep: Sweep, study, trial) -> tuple[str, float | None, str | None]:
    """Train one trial: ``(state, value, why)``; a failure's sentence is kept in the trial's ``error`` attribute.
    Ctrl-C marks the trial failed, queues its values again and goes on up."""
    run_dir = sweep.dir / f"trial-{trial.number:04d}"
    trial.set_user_attr("host", socket.gethostname())
    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("run_dir", str(run_dir))
    values = {p.key: p.suggest(trial) for p in sweep.params}
    overrides = [*sweep.overrides, *(override(k, v) for k, v in values.items()), f"checkpoint.monitor={sweep.metric}"]
    try:
        return _train(sweep, trial, run_dir, overrides)
    except (KeyboardInterrupt, Interrupted):  # Optuna records it failed; its values are queued for the sweep that goes on
        trial.set_user_attr("error", "interrupted (Ctrl-C or SIGTERM)")
        study.enqueue_trial(trial.params, skip_if_exists=False)
        raise KeyboardInterrupt from None
    except BrickyardError as e:
        trial.set_user_attr("error", str(e))
        trial.set_user_attr("config_error", isinstance(e, (ConfigError, DataError)))  # the command's or the data's: every trial meets it
        return "fail", None, str(e)
    except Exception as e:  # noqa: BLE001  a crash fails this trial, said in a line; the traceback stays beside it
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "sweep-error.txt", traceback.format_exc())
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        why = f"{type(e).__name__}: {first} (traceback in {run_dir / 'sweep-error.txt'})"
        trial.set_user_attr("error", why)
        return "fail", None, why


def _train(sweep: Sweep, trial, run_dir: Path, overrides: list[str]) -> tuple[str, float | None, str | None]:
    scores = []
    folds = range(sweep.folds) if sweep.folds else [None]
    for fold in folds:
        where = run_dir if fold is None else run_dir / f"fold-{fold}"
        extra = [] if fold is None else [f"data.folds={sweep.folds}", f"data.fold={fold}"]
        # with folds the pruner has no one curve to compare: each fold's run is whole
        if fold is None:
            spec = (sweep.storage, sweep.name, trial._trial_id, sweep.metric, sweep.pruner)
            with reporting(*spec):
                train_run(sweep, [*overrides, *extra], where, [Report(*spec)])
        else:
            train_run(sweep, [*overrides, *extra], where, [])
        stopped = str(summary_of(where).get("stopped") or "")
        if stopped.startswith(PRUNED):
            so_far = best_value(where, sweep.metric)
            return "pruned", None, f"{stopped}, its best {sweep.metric} {so_far:.4f}" if so_far is not None else stopped
        value = best_value(where, sweep.metric)
        if value is None:  # every trial would: the sweep ends where none has completed (``run``)
            raise ConfigError(f"the run in {where} wrote no {sweep.metric} (no validation ran, or the run scores no "
                              f"such metric)")
        scores.append(value)
    if sweep.folds:
        trial.set_user_attr("folds", scores)
        trial.set_user_attr("spread", statistics.pstdev(scores))
    return "complete", sum(scores) / len(scores), None


def train_run(sweep: Sweep, overrides: list[str], run_dir: Path, report: list) -> None:
    """One run of a trial, as ``brickyard train CONFIG --set ... --run-dir RUN_DIR [--devices ...]`` runs it: in this
    process (with ``report``, the trial's callback), or under torchrun for several processes (whose workers make their
    own from ``BRICKYARD_TRIAL``)."""
    from brickyard import api  # the training engine: trials of one process train in this one
    from brickyard.launch import torchrun as launch
    cfg = load_config(sweep.config, overrides)
    launch.process_env(cfg)  # what the processes need before torch starts CUDA, as brickyard train sets it
    if cfg.train.compile:
        import torch  # the compiler's caches of the trial before (its recompile limit counts them)
        torch._dynamo.reset()
    nproc, device, visible = launch.parse_devices(sweep.devices) if sweep.devices else (1, None, None)
    if nproc == 1:
        if device is not None:  # one device of --devices: this process trains on it
            cfg = cfg.replace(**{"train.device": device if device == "cpu" or visible is None else f"cuda:{visible}"})
        api.train_config(cfg, run_dir, callbacks=report)
        return
    args = argparse.Namespace(config=sweep.config, overrides=overrides, devices=sweep.devices, run_dir=str(run_dir),
                              resume=None, log_dir=None, max_restarts=0, nnodes="1", node_rank=None, master=None)
    code = launch.launch(args, cfg)
    if code == 130:  # its workers were interrupted (Ctrl-C, SIGTERM) and saved
        raise KeyboardInterrupt
    if code:
        raise BrickyardError(f"its run exited with status {code}")


def task_of(cfg) -> str | None:
    """``single`` or ``multilabel`` as the run will resolve ``data.task`` where the config and the data set's kind say
    it without loading the images (a CSV-tagged folder: its training CSV); None where only the run can tell."""
    d = cfg.data
    if d.task != "auto":
        return d.task
    if d.name.endswith("-mosaic"):
        return "multilabel"
    if d.name in SINGLE_SETS:
        return "single"
    if d.name == "imagefolder" and d.root:
        from brickyard.data import tagged  # reads the training CSV's tags only
        root = Path(d.root).expanduser()
        if not tagged.tagged(root):
            return "single" if (root / "train").is_dir() else None
        try:
            return tagged.task_of(root / "train.csv", tagged.read_split(root, "train")[1], "auto")
        except BrickyardError:
            return None  # the run says what is wrong with the folder, in its one sentence
    return None


def _has_val(root: Path) -> bool:
    from brickyard.data import tagged  # a CSV-tagged folder's validation split is its val.csv
    return (root / "val.csv").is_file() if tagged.tagged(root.expanduser()) else (root.expanduser() / "val").is_dir()


def check(sweep: Sweep) -> None:
    """What makes every trial fail, as one sentence before the first: no validation to score, a metric the run's
    task does not score (where the config says the task)."""
    if sweep.metric not in VAL_METRICS:
        raise ConfigError(f"--metric {sweep.metric} is not a validation metric; one of {', '.join(VAL_METRICS)}.")
    cfg = load_config(sweep.config, [*sweep.overrides, f"checkpoint.monitor={sweep.metric}"])
    d = cfg.data
    no_val = d.train_on_all or (d.name == "imagefolder" and d.root and not d.val_fraction and not _has_val(Path(d.root)))
    if no_val and not sweep.folds:
        raise ConfigError(f"--metric {sweep.metric}: this config keeps no validation split to score a trial on "
                          f"({'data.train_on_all' if d.train_on_all else f'{d.root} has no val/'}); use --folds K"
                          f"{', or drop data.train_on_all' if d.train_on_all else ', or data.val_fraction'}.")
    task = task_of(cfg)
    if task and sweep.metric in (SINGLE_ONLY if task == "multilabel" else MULTI_ONLY):
        raise ConfigError(f"--metric {sweep.metric} is not scored for {'several labels' if task == 'multilabel' else 'one label'} "
                          f"an image; use {'val_map' if task == 'multilabel' else 'val_accuracy'} or val_loss.")
