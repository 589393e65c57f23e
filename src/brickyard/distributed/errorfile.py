"""A worker's user error, handed to brickyard's launcher through torchrun's error file; no torch.

torchrun's agent gives each worker a file to describe its failure in (``TORCHELASTIC_ERROR_FILE``) and
reads it back into the ``ProcessFailure`` of ``ChildFailedError.failures`` (torch's
``distributed/elastic/multiprocessing/errors/__init__.py``: ``ProcessFailure.__post_init__`` and
``_get_error_data`` read ``{"message": {"message": ..., "extraInfo": {"timestamp": ...}}}``, the layout
``ErrorHandler.record_exception`` in ``error_handler.py`` writes). Under brickyard's own launcher on one
machine, every worker that ends with a ``BrickyardError`` (or a full disk, or host memory) writes its
sentence there instead of printing it, and the launcher says one line: the cause, from whichever rank met
it. Without that, only rank 0 spoke, so a problem only another rank met (a corrupt image in its share of
the data) showed as rank 0's "a collective lost a peer", or as nothing.

The extra ``"brickyard"`` entry says whether the error follows another rank's (a collective that lost
its peer): the launcher says such an error only when no rank left a cause of its own. The file is written
by ``brickyard.files.write_atomic``, as every file brickyard writes (whole or not at all).
"""
from __future__ import annotations

import json
import os
import time

from brickyard.files import write_atomic

LAUNCHER_SAYS = "BRICKYARD_LAUNCHER_SAYS_ERRORS"  # set by brickyard's launcher for its workers
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"            # set by torchrun's agent, one file a worker


def launcher_says(env=None) -> bool:
    """Whether this worker's errors are said by brickyard's launcher: it started this torchrun job on one
    machine, and no restart follows this failure (torchrun restarts the group without handing failures back,
    so a worker that will be restarted says its error itself)."""
    env = os.environ if env is None else env
    if env.get(LAUNCHER_SAYS) != "1" or not env.get(ERROR_FILE):
        return False
    count, most = env.get("TORCHELASTIC_RESTART_COUNT", "0"), env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return not (count.isdecimal() and most.isdecimal() and int(count) < int(most))


def record(message: str, rank: int, follows: bool, code: int) -> bool:
    """Write ``message`` (the worker exits with ``code``) to this worker's error file, replacing it whole;
    False where it cannot be written (the caller then prints it itself)."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        return False
    data = {"message": {"message": message, "extraInfo": {"timestamp": int(time.time()), "py_callstack": ""}},
            "brickyard": {"rank": rank, "follows": bool(follows), "exit": int(code), "time": time.time()}}
    try:
        write_atomic(path, json.dumps(data))  # whole or not at all, as every file brickyard writes
        return True
    except OSError:  # write_atomic leaves no temporary behind
        return False


def cause(failures: dict) -> tuple[str, int] | None:
    """The one sentence to say for torchrun's failed workers (global rank -> ``ProcessFailure``) and the
    exit code of the worker that wrote it, or None when none of them recorded one: a cause (not a
    consequence of another rank's failure) before a consequence, rank 0's before another's, then the
    earliest; prefixed with its rank where that is not 0."""
    said = []
    for rank, failure in failures.items():
        data = getattr(failure, "error_file_data", None)
        if not isinstance(data, dict) or not isinstance(data.get("brickyard"), dict):
            continue  # no file, or one torch's own handler wrote
        mine, message = data["brickyard"], data.get("message")
        message = message.get("message") if isinstance(message, dict) else message
        if not isinstance(message, str) or not message:
            continue
        when, code = mine.get("time"), mine.get("exit")
        said.append((bool(mine.get("follows")), rank != 0, when if isinstance(when, (int, float)) else 0.0, rank,
                     message, code if isinstance(code, int) and 0 < code < 256 else 2))
    if not said:
        return None
    _, _, _, rank, message, code = min(said)
    return (message if rank == 0 else by_rank(message, rank)), code


def by_rank(message: str, rank: int) -> str:
    """``message`` said for ``rank``: prefixed ``rank N:`` unless it already is."""
    return message if message.startswith(f"rank {rank}:") else f"rank {rank}: {message}"
