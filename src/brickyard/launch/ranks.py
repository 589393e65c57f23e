"""Every way a rank of ``brickyard.launch`` can end, made into a failure the launcher can name; no torch.

torch's elastic launcher counts a worker that exits with code 0 as done and waits for its return value;
rank 0, its value handed over, waits for the launcher (``queue_finished_reading_event`` in torch's
``distributed/elastic/multiprocessing/api.py``). A rank that ends with code 0 and no value therefore
hangs the job: torch's process wrapper (``torch/multiprocessing/spawn.py``: ``_wrap``) ends one that
raised ``KeyboardInterrupt`` that way, and so did ``sys.exit()`` and ``os._exit(0)``. A value that cannot
be pickled, a ``sys.exit(N)`` and an ``os._exit(N)`` failed with no words but torch's link to its docs.

``Rank`` wraps the user's function in each process: ``KeyboardInterrupt``, ``sys.exit(N)`` and a value
that cannot be pickled are written to the worker's error file (the layout torch's ``ErrorHandler`` writes,
so ``ChildFailedError`` carries it back) and end the process with a non-zero code; ``sys.exit()`` and
``sys.exit(0)`` return None, as torch's ``record`` does for ``sys.exit(0)``. ``Watch`` runs in the
launching process for what no wrapper sees (``os._exit(0)``): a rank whose process is gone before its
function returned ends the job, and its sentence replaces the failures of the ranks ended for it.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # set by torch's elastic agent, one file a worker


def _end(message: str, trace: str, code: int):
    """Write ``message`` (and ``trace``) to this worker's error file and end the process with ``code``."""
    path = os.environ.get(ERROR_FILE)
    if path:
        data = {"message": {"message": message, "extraInfo": {"py_callstack": trace, "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(data, f)
        except OSError:  # the launcher then says the exit code
            print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


def _unsendable(result) -> str | None:
    """Why ``result`` cannot travel back to the launching process (the queue pickles it so), or None."""
    try:
        ForkingPickler.dumps(result)
    except Exception as e:  # pickling fails with TypeError, AttributeError, PicklingError and more
        return (f"its return value, a {type(result).__name__}, cannot be pickled to be sent back ({type(e).__name__}: "
                f"{e}); return numbers, strings, tensors, or lists and dicts of them.")
    return None


class Rank:
    """``fn(*args)`` as one rank runs it; ``marks`` is the folder the launcher's ``Watch`` reads (this
    process's id when it starts, ``RANK.done`` once its value is ready to be sent back)."""

    def __init__(self, fn, marks: str):
        self.fn, self.marks = fn, marks
        # torch's launcher names the entry point in its logs and failure records
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args):
        rank = os.environ.get("RANK", "0")
        _mark(Path(self.marks) / f"{rank}.pid", str(os.getpid()))
        try:
            result = self.fn(*args)
        except KeyboardInterrupt:
            _end("KeyboardInterrupt", traceback.format_exc(), 130)
        except SystemExit as e:
            if e.code not in (None, 0):
                code = e.code if isinstance(e.code, int) else 1  # sys.exit("text") exits with 1
                _end(f"SystemExit: sys.exit({e.code!r}) ended it with exit code {code}", traceback.format_exc(), code)
            result = None
        why = _unsendable(result)
        if why is not None:
            _end(why, "", 1)
        _mark(Path(self.marks) / f"{rank}.done", "")
        return result


def _mark(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # whole or absent: the watch never reads half an id


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # a process that ended but is not yet reaped still counts: torch reaps it within 0.1 s
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Watch(threading.Thread):
    """In the launching process: when a rank's process is gone for ``grace`` seconds before its function
    returned (torch, which reaps it, ends the job itself for any exit code but 0), ``cause`` says so and
    the other ranks are stopped (SIGTERM, SIGKILL ``kill_after`` seconds later), so torch's launcher
    returns. POSIX only: ``os.kill(pid, 0)`` tests a process there (on Windows it would stop it)."""

    def __init__(self, marks: str, grace: float = 2.0, kill_after: float = 3.0):
        super().__init__(name="brickyard-launch-watch", daemon=True)
        self.marks, self.grace, self.kill_after = Path(marks), grace, kill_after
        self.cause: str | None = None
        self.finished = threading.Event()

    def _pids(self) -> dict[str, int]:
        out = {}
        for p in self.marks.glob("*.pid"):
            try:
                out[p.stem] = int(p.read_text())
            except (OSError, ValueError):
                continue
        return out

    def run(self) -> None:
        gone: dict[str, float] = {}
        while not self.finished.wait(0.2):
            for rank, pid in self._pids().items():
                if (self.marks / f"{rank}.done").exists() or _alive(pid):
                    continue
                if time.monotonic() - gone.setdefault(rank, time.monotonic()) > self.grace:
                    self.cause = (f"rank {rank} failed: its process ended with exit code 0 before its function "
                                  "returned (os._exit(0), or a library that ended the process), so it has no result.")
                    self._stop_others(pid)
                    return

    def _stop_others(self, ended: int) -> None:
        others = [pid for pid in self._pids().values() if pid != ended]
        for sig, wait in ((signal.SIGTERM, self.kill_after), (signal.SIGKILL, 0.0)):
            for pid in others:
                if _alive(pid):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            if self.finished.wait(wait):
                return
