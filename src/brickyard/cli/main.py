"""The ``brickyard`` command line: argparse at the edge, the Python API underneath.

``main(argv=None)`` returns the exit code: 0 on success, 2 for a user error (printed as one line
starting with ``error:``), 130 when interrupted (after a checkpoint was written). Each command is
one module of this package with ``add(subparsers)`` and ``run(args) -> int``.

Start-up time: building the parser imports every command module, so they import torch (and what
imports it) inside ``run``, each with a comment; `brickyard --help` and a bad argument or config
key come back in about 0.1 s instead of 1-2 s.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import time

from brickyard.cli import bench, boost, data, export, inspect, lrfind, memory, models, plot, predict, presets, sweep, train
from brickyard.cli import eval as eval_cmd
from brickyard.cli import run as run_cmd
from brickyard.distributed import env as dist
from brickyard.distributed import errorfile
from brickyard.errors import BrickyardError
from brickyard.files import os_error

# the order `brickyard --help` lists them in; command name -> module of this package
MODULES = {"train": "train", "eval": "eval", "data": "data", "plot": "plot", "inspect": "inspect", "predict": "predict",
           "export": "export", "bench": "bench", "lr-find": "lrfind", "sweep": "sweep", "memory": "memory", "boost": "boost", "run": "run",
           "models": "models", "presets": "presets"}
_ADDERS = (train, eval_cmd, data, plot, inspect, predict, export, bench, lrfind, sweep, memory, boost, run_cmd, models, presets)


class _Parser(argparse.ArgumentParser):
    """argparse with brickyard's one-line errors (its own print the usage first); subcommands inherit it."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`).\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="brickyard", description="Train image classifiers on one CPU, one GPU, "
                                "the GPUs you pick, or many machines.",
                                epilog="run `brickyard COMMAND --help` for a command's options and examples.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for module in _ADDERS:
        module.add(sub)
    return p


def run() -> None:
    """The console-script entry point: ``main()``, then leave without the interpreter's teardown.

    With torch, torch._dynamo and matplotlib loaded, Python spends 0.5-1 s destroying modules at
    exit. After a successful command everything brickyard wrote is closed (logs, metrics, event
    files, checkpoints, the loader's workers), so only the standard streams need flushing."""
    dist.OWN_PROCESS = True
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # leaving now: a second Ctrl-C must not print a traceback
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        os._exit(0)
    raise SystemExit(code)


RANK_ZERO_GRACE_S = 3.0
CAUSE_GRACE_S = 1.0  # under brickyard's launcher, a cause met on a rank other than 0 (rank 0 may meet the same)


def _after_rank_zero(seconds: float = RANK_ZERO_GRACE_S) -> None:
    """A rank that keeps its error to its workerlog waits a moment before it exits: torchrun's agent ends
    every worker as soon as one exits, so a rank 1 that left first took rank 0 down before rank 0 had said the
    error, and the command ended with its exit code and no line (seen once in three full test runs). When rank
    0 exits first, the agent ends this wait at once. Under brickyard's launcher, an error that follows another
    rank's (a lost peer) waits too, so that the rank with the cause leaves first."""
    time.sleep(seconds)


def _say(message: str, code: int, every_rank: bool = False, follows: bool = False) -> None:
    """A command's one-line error, said once for the job. Under brickyard's launcher on one machine it goes
    to this worker's error file, and the launcher says the cause, from whichever rank met it (``follows``:
    an error another rank's caused, said only when no rank left a cause). An interruption, and everything
    outside that launcher, is printed by rank 0 (and each node's first worker), or by every rank for
    ``every_rank`` errors, while the others wait for rank 0 to say it."""
    rank = dist.rank_from_env()
    # an interruption (130) is said by rank 0 as before: when the launcher itself was stopped, torchrun
    # hands it no failures to read
    if code != 130 and errorfile.launcher_says() and errorfile.record(message, rank, follows, code):
        if follows or rank != 0:
            _after_rank_zero(RANK_ZERO_GRACE_S if follows else CAUSE_GRACE_S)
    elif dist.prints_errors() or every_rank:  # other ranks hit the same error; theirs is in their workerlog
        print(f"error: {message}", file=sys.stderr)
    else:
        _after_rank_zero()


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return importlib.import_module(f"brickyard.cli.{MODULES[args.command]}").run(args)
    except BrickyardError as e:
        _say(str(e), e.exit_code, every_rank=getattr(e, "every_rank", False), follows=getattr(e, "follows", False))
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a run or output folder that cannot be made or written, a full disk
        _say(os_error(e), 1)
        return 1
    except MemoryError as e:  # the host's memory, before a run could explain it (building a model, loading data)
        advice = _memory_advice(args.command) or "try a smaller model, data.batch_size or data.cache: none"
        _say(f"out of host memory ({_first_line(e)}); {advice}.", 1)
        return 1
    except Exception as e:  # noqa: BLE001  a bug of brickyard's (or torch's): one line here, the traceback kept
        if type(e).__name__ == "OutOfMemoryError":  # torch's, outside a run (the run explains its own)
            print(f"error: out of memory ({_first_line(e)}); try a smaller model or data.batch_size.", file=sys.stderr)
            return 1
        asked = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", str(e))
        if asked:  # torch's host allocator, outside a run: a data set or a model sized past the host's memory
            advice = _memory_advice(args.command) or "try a smaller model, data set or data.batch_size"
            _say(f"out of host memory: {int(asked.group(1)) / 1e9:,.1f} GB asked for at once; {advice}.", 1)
            return 1
        where = getattr(e, "logged_in", None) or [_save_traceback(e)]
        print(f"error: brickyard crashed ({type(e).__name__}: {_first_line(e)}); the traceback is in "
              f"{' and '.join(where)}; please report it.", file=sys.stderr)
        return 1


def _memory_advice(command: str) -> str | None:
    """What a command that runs no training says to try when the host's memory runs out (its module's
    ``MEMORY_ADVICE``), or None: then the batch size and the cache, which a run's data sets."""
    return getattr(sys.modules.get(f"brickyard.cli.{MODULES[command]}"), "MEMORY_ADVICE", None)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else "no message"


def _save_traceback(e: BaseException) -> str:
    """The crash's traceback in a file of its own (a command without a run log); its path."""
    import tempfile  # only on a crash
    import traceback
    fd, path = tempfile.mkstemp(prefix="brickyard-crash-", suffix=".txt")
    with os.fdopen(fd, "w", errors="backslashreplace") as f:
        f.write("".join(traceback.format_exception(e)))
    return path
