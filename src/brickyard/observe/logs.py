"""Logging through Python's ``logging``: the ``brickyard`` logger and its children, rank-aware.

A run's lines are records of the ``brickyard.run`` logger, each carrying its process's ``rank``. While
a run is open (``Logger``), brickyard adds handlers to the ``brickyard`` logger:

- one file per worker, ``logs/workerlog.N`` (every line ``HH:MM:SS [rank N] ...``), and ``train.log``
  on rank 0;
- on rank 0 only, the console: information on stdout, warnings on stderr as ``warning: ...``; errors
  go to the files only (the CLI prints the error once). The console handler is added only when the
  application has not configured logging itself (no handler on ``brickyard`` nor on the root logger):
  an application's own handlers, formats and levels then get the records instead, as with any library.

On ranks other than 0 the records do not propagate past ``brickyard`` while the run is open, so an
application's handlers see rank 0's lines once, as Accelerate's ``main_process_only`` does. The
``brickyard`` logger's level is the application's to set (``logging.getLogger("brickyard").setLevel(
logging.WARNING)`` keeps warnings only, in the files too); when it is unset, a run uses INFO.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = logging.getLogger("brickyard")


class _FileFormatter(logging.Formatter):
    def __init__(self):
        super().__init__(datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        tag = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
        line = f"{self.formatTime(record, self.datefmt)} [rank {getattr(record, 'rank', '?')}] {tag}{record.getMessage()}"
        if record.exc_info:  # a crash, or an error in the user's code: the whole traceback follows the line
            line += "\n" + self.formatException(record.exc_info)
        return line


class _RunFile(logging.FileHandler):
    """A run's log file. A line that cannot be written (a full disk, a file-size limit) is lost quietly:
    logging's own habit of printing a traceback would bury the one sentence the user needs, which the
    command line says anyway."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


class _Console(logging.Handler):
    """Rank 0's console: plain information lines on stdout, ``warning: ...`` on stderr, no errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR and getattr(record, "console", True)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.levelno >= logging.WARNING:
                print(f"warning: {record.getMessage()}", file=sys.stderr, flush=True)
            else:
                print(record.getMessage(), file=sys.stdout, flush=True)
        except Exception:  # noqa: BLE001  logging's own convention: a handler never raises
            self.handleError(record)


def app_configured_logging() -> bool:
    """The application (not brickyard) put handlers on the ``brickyard`` or the root logger."""
    def app(h):  # pytest's capture handlers are not an application's configuration
        return not getattr(h, "_brickyard", False) and not type(h).__module__.startswith("_pytest")
    return any(app(h) for h in ROOT.handlers + logging.getLogger().handlers)


class Logger(logging.LoggerAdapter):
    """The run's logger (``run.log``): ``info(msg, console=True)``, ``warning``, ``error``; records of
    ``brickyard.run`` with this process's rank. With ``files`` it opens the run's log files until
    ``close()``; without, it only adds the rank (a logger for work before a run opens)."""

    def __init__(self, rank: int = 0, files: tuple[Path, ...] = (), console: bool = True):
        super().__init__(logging.getLogger("brickyard.run"), {"rank": rank})
        self.rank, self.handlers = rank, []
        self._saved = (ROOT.level, ROOT.propagate)
        for f in files:
            f.parent.mkdir(parents=True, exist_ok=True)
            self._add(_RunFile(f, mode="a", encoding="utf-8", errors="backslashreplace"), _FileFormatter())
        if console and rank == 0 and not app_configured_logging() and not any(
                isinstance(h, _Console) for h in ROOT.handlers):
            self._add(_Console(), None)
        self._opened = bool(self.handlers) or rank != 0
        if self._opened:
            if ROOT.level == logging.NOTSET:
                ROOT.setLevel(logging.INFO)
            if rank != 0:
                ROOT.propagate = False

    def _add(self, handler: logging.Handler, formatter) -> None:
        handler._brickyard = True
        if formatter is not None:
            handler.setFormatter(formatter)
        ROOT.addHandler(handler)
        self.handlers.append(handler)

    def process(self, msg, kwargs):
        kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
        return msg, kwargs

    def info(self, msg, *args, console: bool = True, **kwargs) -> None:
        kwargs["extra"] = {**(kwargs.get("extra") or {}), "console": console}
        super().info(msg, *args, **kwargs)

    def close(self) -> None:
        for h in self.handlers:
            ROOT.removeHandler(h)
            h.close()
        if self._opened:
            ROOT.setLevel(self._saved[0])
            ROOT.propagate = self._saved[1]
        self.handlers, self._opened = [], False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
