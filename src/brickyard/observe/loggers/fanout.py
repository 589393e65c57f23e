"""``Loggers``: the fan-out every row of a run goes through, to every logger, at the same moments.

A logger with a ``timeout_s`` (the trackers: a server outside the process) runs on a thread of its own
(``_Worker``): the training thread hands it a row and goes on; a call that has not returned within its bound, or
that raised, drops that logger with one warning. Its thread is a daemon, so a client stuck in a socket read holds up
neither a stop nor the process's exit.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable

from brickyard.errors import BrickyardError, reason
from brickyard.observe.loggers import ALWAYS, Logger, RunInfo, create

STOP_WAIT_S = 2.0  # what finish() gives a threaded logger after a failure or a signal: a stop is never held up
TIMEOUT_ENV = "BRICKYARD_LOGGER_TIMEOUT_S"


def _bounds(logger: Logger) -> tuple[float, float] | None:
    """The logger's time bounds (each row, then start and a finished run's end), or None: it runs inline.
    ``$BRICKYARD_LOGGER_TIMEOUT_S`` sets both where a logger has them."""
    if logger.timeout_s is None:
        return None
    override = os.environ.get(TIMEOUT_ENV)
    if override:
        try:
            seconds = max(0.1, float(override))
        except ValueError:
            raise BrickyardError(f"{TIMEOUT_ENV}={override!r} is not a number of seconds, e.g. 30.") from None
        return seconds, seconds
    return float(logger.timeout_s), float(logger.start_timeout_s or logger.timeout_s)


class _Worker:
    """One logger's calls, run in order on a daemon thread; ``busy_since`` says how long the current one has run."""

    def __init__(self, logger: Logger, timeout: float, long_timeout: float):
        self.logger, self.timeout, self.long_timeout = logger, timeout, long_timeout
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.busy_since: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"brickyard-logger-{logger.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fn, args = self.calls.get()
            if fn is None:
                return
            self.busy_since = time.monotonic()
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001  said by the training thread, which drops this logger
                self.error = e
                return
            finally:
                self.busy_since = None

    def submit(self, fn, *args) -> None:
        self.calls.put((fn, args))

    def stalled(self) -> bool:
        since = self.busy_since
        return since is not None and time.monotonic() - since > self.timeout

    def done_by(self, deadline: float) -> bool:
        """Wait until the calls handed over so far have run (True), or ``deadline`` (a monotonic time) passes."""
        done = threading.Event()
        self.submit(done.set)
        while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if self.error is not None or time.monotonic() >= deadline:
                return False
        return True

    def close(self) -> None:
        self.calls.put((None, ()))


class Loggers:
    """The run's loggers (rank 0; none elsewhere). ``write(**row)`` is the one way a row leaves the run."""

    def __init__(self, loggers: Iterable[Logger] = (), warn: Callable[[str], None] = print):
        self.loggers = list(loggers)
        for lg in self.loggers:
            lg.name = getattr(lg, "name", "") or type(lg).__name__
        self.warn = warn
        self.workers: dict[int, _Worker] = {}
        self.started: list[Logger] = []
        self.histograms_wanted = any(type(lg).log_histograms is not Logger.log_histograms for lg in self.loggers)
        self.displays = [lg for lg in self.loggers if type(lg).progress is not Logger.progress]  # called every step

    def start(self, run: RunInfo) -> None:
        """Start each logger in order; the first that fails is one sentence, the ones started are finished."""
        for lg in list(self.loggers):
            bounds = _bounds(lg)
            if bounds is None:
                self._start_inline(lg, run)
                continue
            w = self.workers[id(lg)] = _Worker(lg, *bounds)
            w.submit(lg.start, run)
            if not w.done_by(time.monotonic() + w.long_timeout):
                if w.error is not None:
                    self._drop(lg, None)
                    raise _start_error(lg, w.error)
                self._drop(lg, f"did not start within {w.long_timeout:g} s")
                continue
            self.started.append(lg)

    def _start_inline(self, lg: Logger, run: RunInfo) -> None:
        try:
            lg.start(run)
        except Exception as e:  # noqa: BLE001  one sentence naming the logger
            raise _start_error(lg, e) from None
        self.started.append(lg)

    def write(self, **row) -> None:
        """Hand one row to every logger (``time`` added where missing): inline ones now, threaded ones queued."""
        if not self.loggers:
            return
        row.setdefault("time", round(time.time(), 3))
        for lg in list(self.loggers):  # a user's logger gets a copy: one that changes its row changes no other's
            self._call(lg, lg.log, row if lg.essential else dict(row))

    def progress(self, step: int, ended: bool = False) -> None:
        """Tell the loggers that show progress (``Logger.progress``) that a step was taken, or that the loop ended."""
        for lg in self.displays:
            if lg in self.loggers:  # not one dropped since
                self._call(lg, lg.progress, step, ended)

    def histograms(self, step: int, model) -> None:
        """Weight and gradient histograms of ``model`` for the loggers that take them (copies on the CPU)."""
        if not (self.histograms_wanted and self.loggers):
            return
        tensors = {}
        for name, p in model.named_parameters():
            tensors[f"weights/{name}"] = p.detach().float().cpu()
            if p.grad is not None:
                tensors[f"grads/{name}"] = p.grad.detach().float().cpu()
        for lg in list(self.loggers):
            if type(lg).log_histograms is not Logger.log_histograms:
                self._call(lg, lg.log_histograms, step, tensors)

    def _call(self, lg: Logger, fn, *args) -> None:
        w = self.workers.get(id(lg))
        if w is not None:
            if w.error is not None:
                self._drop(lg, f"failed: {reason(w.error, 240, joined=True)}")
            elif w.stalled():
                self._drop(lg, f"did not answer within {w.timeout:g} s")
            else:
                w.submit(fn, *args)
            return
        try:
            fn(*args)
        except Exception as e:
            if lg.essential:
                raise
            self._drop(lg, f"failed: {reason(e, 240, joined=True)}")

    def _drop(self, lg: Logger, why: str | None, then: str = "dropped, training goes on without it") -> None:
        """Take ``lg`` out of the run; ``why``: the one warning (None: an error raised instead)."""
        if lg in self.loggers:
            self.loggers.remove(lg)
        if lg in self.started:
            self.started.remove(lg)
        w = self.workers.pop(id(lg), None)
        if w is not None:
            w.close()
        if why:
            self.warn(f"train.loggers: {lg.name} {why}; {then}.")

    def finish(self, ok: bool) -> None:
        """Finish every started logger: the inline ones first, in order (an essential one's error is raised once
        all are finished), then the threaded ones together, each within its bound (``STOP_WAIT_S`` when not
        ``ok``): a tracker that uploads ``metrics.jsonl`` at its end finds it complete."""
        first_error = None
        for lg in [lg for lg in self.started if id(lg) not in self.workers]:
            try:
                lg.finish(ok)
            except Exception as e:
                if lg.essential:
                    first_error = first_error or e
                else:
                    self.warn(f"train.loggers: {lg.name} failed at the end: {reason(e, 240, joined=True)}.")
        now, waiting = time.monotonic(), []
        for lg in [lg for lg in self.started if id(lg) in self.workers]:
            w = self.workers[id(lg)]
            w.submit(lg.finish, ok)
            waiting.append((lg, w, w.long_timeout if ok else min(w.timeout, STOP_WAIT_S)))
        for lg, w, bound in waiting:
            if w.done_by(now + bound):
                w.close()
                continue
            why = f"failed at the end: {reason(w.error, 240, joined=True)}" if w.error is not None else \
                f"did not finish within {bound:g} s"
            self._drop(lg, why, "left behind")
        self.loggers, self.started, self.workers = [], [], {}
        if first_error is not None:
            raise first_error


def for_run(names: Iterable[str], given: Iterable[Logger] = (), warn: Callable[[str], None] = print,
            rank: int = 0) -> Loggers:
    """This process's loggers. Rank 0: ``metrics.jsonl`` and the console first, then the ``train.loggers`` names
    (sorted), then ``given`` (instances passed to ``fit``); any other rank: the console alone (its own log file)."""
    if rank != 0:
        return Loggers([create("console")], warn)
    chosen = list(ALWAYS) + sorted(set(names) - set(ALWAYS))
    return Loggers([create(name) for name in chosen] + list(given), warn)


def _start_error(lg: Logger, e: BaseException) -> BrickyardError:
    """A logger's failure to start as one sentence: a ``BrickyardError`` says it already."""
    if isinstance(e, BrickyardError):
        return e
    return BrickyardError(f"train.loggers: {lg.name} could not start: {reason(e, 240, joined=True)}")
