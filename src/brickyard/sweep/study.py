"""A sweep's Optuna study: its storage, sampler and pruner, the settings it was started with, and its trials' states.

Storage: by default Optuna's ``JournalStorage`` on a file in the sweep's directory (``study.journal``; an
append-only log under a file lock, which Optuna recommends for several processes on one machine); or any database
URL Optuna takes (``postgresql://...``, ``mysql://...``, ``sqlite:///...``), where several machines share one sweep,
each started with the same command, and Optuna's heartbeat marks a dead machine's trial failed.

The study keeps what it was started with (config, overrides, space, metric, folds) and a command that differs is
one sentence: two sweeps never write into one study. A trial whose process is gone (a sweep killed with SIGKILL on
this machine) is marked failed when a sweep next opens the study, and its values are queued again.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from pathlib import Path

from brickyard.errors import BrickyardError, ConfigError

JOURNAL = "study.journal"


def optuna_module():
    """Optuna, quiet (brickyard says what a sweep does); one sentence where it is not installed."""
    try:
        import optuna  # an optional extra: brickyard train never imports it
    except ImportError:
        raise BrickyardError("brickyard sweep runs on Optuna, which is not installed: pip install 'brickyard[sweep]' "
                             "(or pip install optuna).") from None
    optuna.logging.set_verbosity(logging.ERROR)  # a failed trial is said by the sweep, in one line
    return optuna


def open_storage(spec: str):
    """The storage of ``spec``: a database URL, or the path of a journal file; one sentence where it cannot be used."""
    optuna = optuna_module()
    if "://" not in spec:  # a journal file (its path): Optuna's storage for processes of one machine
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
        return optuna.storages.JournalStorage(JournalFileBackend(spec, lock_obj=JournalFileOpenLock(spec)))
    error: BaseException = RuntimeError("no attempt")
    for attempt in range(3):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks the heartbeat and the retry callback experimental
                return optuna.storages.RDBStorage(spec, heartbeat_interval=30, grace_period=90,
                                                  engine_kwargs={"pool_pre_ping": True}, **_retry(optuna))
        except Exception as e:  # noqa: BLE001  SQLAlchemy's errors, said in one line below
            if ("UniqueViolation" in str(e) or "already exists" in str(e)) and attempt < 2:
                time.sleep(0.5 + attempt)  # two machines made the tables at once: the other's are there now
                continue
            error = e
            break
    raise _unusable(error, spec)


def _retry(optuna) -> dict:
    """A dead machine's trial queued again once (Optuna's heartbeat callback; its older name before Optuna 4.9)."""
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
        return {"heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)}
    return {"failed_trial_callback": optuna.storages.RetryFailedTrialCallback(max_retry=1)}


def _unusable(e: BaseException, spec: str) -> BrickyardError:
    """A database storage that cannot be used (no driver, unreachable, refused, a bad URL), in one sentence."""
    shown = _redacted(spec)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, ImportError):  # SQLAlchemy's dialect could not import its driver (Optuna re-raises it)
        name = getattr(e.__cause__, "name", None) or getattr(e, "name", None) or "its driver"
        package = {"psycopg": "'brickyard[postgresql]'", "psycopg2": "psycopg2-binary", "MySQLdb": "mysqlclient"}.get(name, name)
        return BrickyardError(f"--storage {shown}: its database driver {name} is not installed (pip install {package}).")
    return BrickyardError(f"--storage {shown} cannot be used ({_redacted_text(first, spec)[:200]}).")


def _redacted_text(text: str, url: str) -> str:
    """``text`` with the password of ``url`` left out (a driver's message may repeat the URL)."""
    cred = url.partition("://")[2].rpartition("@")[0]
    password = cred.partition(":")[2]
    return text.replace(password, "***") if password else text


def _redacted(url: str) -> str:
    """A URL without its password."""
    scheme, _, rest = url.partition("://")
    cred, at, host = rest.rpartition("@")
    return f"{scheme}://{cred.split(':')[0] + ':***' if ':' in cred else cred}{at}{host}" if at else url


def sampler_of(name: str, params, seed: int | None):
    """Optuna's sampler ``name`` over ``params``, seeded with ``seed`` (the caller mixes in what tells processes and
    resumed sweeps apart: a seed alone would draw the same start-up trials again)."""
    optuna = optuna_module()
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.GridSampler({p.key: p.grid() for p in params}, seed=seed)


def pruner_of(name: str, startup: int, warmup: float = 0.0, first: float = 1.0, last: float | None = None):
    """Optuna's pruner ``name``. Reports are at hundredths of an epoch (``trial.Report``), so epochs are resources of 100.

    - ``median``: after ``startup`` finished trials and, in each trial, after ``warmup`` epochs;
    - ``hyperband``: Optuna's ``HyperbandPruner`` with reduction factor 3 over the run's validations, from the first
      (``first`` epochs) to the run's end (``last`` epochs). Optuna's own defaults (``min_resource=1``,
      ``max_resource="auto"``: ``optuna/pruners/_hyperband.py`` ``__init__`` and ``_try_initialization``) would put
      every bracket's first rungs (steps 1, 3, ... 81) before the first validation at step 100, so that all brackets
      judge at the same point, and would judge nothing until a trial completes (the baseline never competes);
      ``last`` None (a run measured in steps, not epochs) keeps ``"auto"``.
    """
    optuna = optuna_module()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup, n_warmup_steps=round(100 * warmup))
    if name == "hyperband":
        low = max(1, round(100 * first))
        high = "auto" if last is None else max(low, round(100 * last))
        return optuna.pruners.HyperbandPruner(min_resource=low, max_resource=high, reduction_factor=3)
    return optuna.pruners.NopPruner()


def open_study(name: str, storage, settings: dict, sampler, pruner, resume: bool):
    """``(study, made)``: the study ``name`` in ``storage``, made here with ``settings`` (kept in its user attributes;
    ``made`` True), or joined where it exists with the same settings; other settings, or ``resume`` of a study that
    does not exist, are one sentence. Of several processes starting one sweep at once (machines sharing a database),
    the storage lets one make it (the others' ``create_study`` meets ``DuplicatedStudyError``), so one queues the
    baseline."""
    optuna = optuna_module()
    exists = name in [s.study_name for s in optuna.study.get_all_study_summaries(storage)]
    if resume and not exists:
        raise ConfigError(f"--resume: there is no sweep {name!r} in this storage to continue; drop --resume to start it.")
    direction = "minimize" if settings["metric"].endswith("loss") else "maximize"
    made = False
    if not exists:
        try:
            study = optuna.create_study(storage=storage, study_name=name, sampler=sampler, pruner=pruner,
                                        direction=direction)
            made = True
        except optuna.exceptions.DuplicatedStudyError:  # another process made it in between
            pass
    if not made:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    kept = study.user_attrs.get("settings")
    if kept is None:
        study.set_user_attr("settings", settings)
    elif kept != settings:
        differ = sorted(k for k in set(kept) | set(settings) if kept.get(k) != settings.get(k))
        raise ConfigError(f"sweep {name!r} was started with another {', '.join(differ)}; continue it with the same "
                          f"command, or start a new sweep in another --dir.")
    return study, made


def fail_stale(study) -> int:
    """Mark failed the running trials of this machine whose process is gone, queue their values again; how many."""
    optuna = optuna_module()
    stale = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        host, pid = t.user_attrs.get("host"), t.user_attrs.get("pid")
        if host != socket.gethostname() or not isinstance(pid, int) or _alive(pid):
            continue
        try:  # another sweep process may be failing it at this moment: whoever finishes it first queues it again
            optuna.trial.Trial(study, t._trial_id).set_user_attr("error", "its sweep process ended before it finished")
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        except (RuntimeError, ValueError):  # Optuna's UpdateFinishedTrialError is a RuntimeError
            continue
        study.enqueue_trial(t.params, skip_if_exists=False)
        stale += 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks it experimental
        try:  # a database's heartbeat: trials of machines that stopped beating
            optuna.storages.fail_stale_trials(study)
        except Exception:  # noqa: BLE001  storages without a heartbeat (the journal) have nothing to fail
            pass
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def counts(study) -> dict:
    """Trials by state name (complete, pruned, fail, running, waiting)."""
    out: dict = {}
    for t in study.get_trials(deepcopy=False):
        out[t.state.name.lower()] = out.get(t.state.name.lower(), 0) + 1
    return out


def storage_spec(sweep_dir: Path, url: str | None) -> str:
    return url or str((sweep_dir / JOURNAL).resolve())
