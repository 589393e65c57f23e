"""``brickyard.launch(fn, devices="cpu:2", args=())``: one process per device for a function, from a
plain script or a notebook cell, as Accelerate's ``notebook_launcher`` and Lightning's ``ddp_notebook``.

The processes are started by torch's elastic launcher, the one torchrun is built on
(``torch.distributed.launcher.api.elastic_launch`` with ``torchrun --standalone``'s rendezvous: a c10d
store on a free local port). Each process gets torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so ``brickyard.fit`` inside ``fn`` trains its share
of one job, and ``BRICKYARD_DEVICE`` (``cpu``, or ``cuda``: each process its local rank's GPU).

Start method: ``fork`` where the platform has it and CUDA is not yet initialised in this process (a
function defined in a notebook cannot be imported by a freshly spawned interpreter; Accelerate forks
for the same reason), else ``spawn`` (``fn`` must then be importable: defined in a module, not in
``__main__`` of a notebook). ``start_method=`` chooses.

An exception on any rank ends the job; ``launch`` raises ``LaunchError`` naming the first failed rank
and its exception in the first line, followed by that rank's traceback as the worker printed it. So do
``KeyboardInterrupt``, ``sys.exit(N)`` (its code), a return value that cannot be pickled, and a process
that ends without an exception (``os._exit(N)``, a signal: its exit code or signal); ``sys.exit(0)``
returns None (``ranks.py`` says how). Ctrl-C in the launching process raises ``KeyboardInterrupt``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid

from brickyard.errors import BrickyardError
from brickyard.launch.ranks import Rank, Watch


class LaunchError(BrickyardError):
    """A rank of a ``brickyard.launch`` job failed: the first line names it, the rest is its traceback."""


@contextlib.contextmanager
def _environment(values: dict[str, str | None]):
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is not None:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_method(requested: str | None) -> str:
    import torch  # lazy, as the module: the CLI imports brickyard.launch before a command runs
    if requested is not None:
        if requested not in ("fork", "spawn", "forkserver"):
            raise BrickyardError(f"launch: start_method {requested!r} is not one of fork, spawn, forkserver.")
        if requested == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
            raise BrickyardError("launch: CUDA is already initialised in this process, and a forked process cannot use it; "
                                 "restart the notebook's kernel and call launch before anything touches the GPU, or use "
                                 "start_method='spawn' with a function defined in a module.")
        return requested
    if sys.platform == "win32" or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "spawn"
    return "fork"


def _failure(err) -> LaunchError:
    """One ``LaunchError`` from torch's ``ChildFailedError``: the first failure's rank, exception and traceback."""
    rank, failure = err.get_first_failure()
    message = failure.message
    if isinstance(message, str):
        try:
            message = json.loads(message)
        except ValueError:
            pass
    if isinstance(message, dict):  # {"message": text, "extraInfo": {...}}, or that nested under "message"
        inner = message["message"] if isinstance(message.get("message"), dict) else message
        text = str(inner.get("message", ""))
        trace = str((inner.get("extraInfo") or {}).get("py_callstack", ""))
    else:
        text, trace = str(message or ""), ""
    if failure.error_file == "<N/A>" or not text:  # no error file: torch's own text only links to its docs
        code, trace = failure.exitcode, ""
        text = (f"its process was killed by signal {-code} ({failure.signal_name()})." if code < 0 else
                f"its process ended with exit code {code} and no Python exception (os._exit, or a crash outside Python).")
    head = text.strip().splitlines()[-1].rstrip(": ") if text.strip() else text
    return LaunchError(f"rank {rank} failed: {head}" + (f"\n\nrank {rank}'s traceback:\n{trace.rstrip()}" if trace else ""))


def launch(fn, devices: str = "cpu:2", args: tuple = (), *, start_method: str | None = None, timeout_s: int = 300):
    """Run ``fn(*args)`` on one process per device of ``devices`` (``cpu:N``, ``cuda``/``all``, or GPU ids
    like ``0,1``, as ``brickyard run --devices``) and return rank 0's result."""
    # lazy: torch's launcher and brickyard's device parsing load only when a job starts
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from brickyard.launch.torchrun import parse_devices

    if not callable(fn):
        raise BrickyardError(f"launch: {fn!r} is not a function.")
    nproc, device, visible = parse_devices(devices)
    method = _start_method(start_method)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method=method, rdzv_configs={"timeout": timeout_s})
    env = {"BRICKYARD_DEVICE": device, "CUDA_VISIBLE_DEVICES": visible, "OMP_NUM_THREADS": None}
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [q.level for q in quiet]  # their error dump and SIGTERM notes repeat what LaunchError says
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    marks = tempfile.mkdtemp(prefix="brickyard-launch-")
    watch = Watch(marks)
    if os.name == "posix":  # a rank that ends with code 0 and no result would leave torch waiting forever
        watch.start()
    try:
        with _environment(env):
            results = elastic_launch(config, Rank(fn, marks))(*args)
    except ChildFailedError as err:
        raise (LaunchError(watch.cause) if watch.cause else _failure(err)) from None
    except SignalException as err:
        if err.sigval == signal.SIGINT:  # Ctrl-C: what a notebook or script expects from it
            raise KeyboardInterrupt from None
        raise
    finally:
        watch.finished.set()
        shutil.rmtree(marks, ignore_errors=True)
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return results[0]
