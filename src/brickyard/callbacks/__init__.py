"""Callbacks: how behaviour is added to a run without copying the loop.

A ``Callback`` has one no-op method per moment of training; subclass it and override the ones you
need, then pass instances to ``brickyard.fit(..., callbacks=[...])``. brickyard's own behaviours
(checkpoints, the progress log, TensorBoard, watched layers, boost snapshots) are callbacks on the
same interface, see ``brickyard.callbacks.own``.

The public hooks, in the order a run calls them::

    on_train_start(run)
      on_epoch_start(run)
        on_step_start(run)            (extra)
        on_before_update(run)         (extra: gradients are ready, the weights not yet changed)
        on_step_end(run, loss)        loss: this step's mean loss, a 0-dim tensor on the device
        on_validation_start(run)      (extra)
        on_validation_end(run, metrics)
        on_checkpoint(run, path)      after a checkpoint file is written (rank 0, which writes them)
      on_epoch_end(run)               (extra: an epoch done, or the loop stopping; after validation)
    on_loop_end(run)                  (extra: the loop is over, before the test evaluation)
    on_train_end(run, summary)

Callbacks run on every rank. ``on_validation_end`` and ``on_train_end`` follow collectives, so
every rank sees the same metrics there; ``on_step_end`` is not a sync point, and ``loss.item()``
in it forces one (a device-to-host copy) on GPUs: read it every N steps, as the progress log does.

``run.stop(reason)`` ends training after the current step on every rank: a stop asked for at the
end of an epoch takes effect there; one asked for in the middle takes effect at once in a single
process and, with several, at a step the ranks agree on through the job's store (within 20 steps). The run then saves a checkpoint, evaluates the test split and writes its summary
as a run that reached its end. A callback that raises ends the run in one sentence naming it.

A callback may keep state across a resume: ``state_dict()`` returns plain values and tensors,
saved in every checkpoint under the callback's ``key`` (its class name), and ``load_state_dict``
gets them back.
"""
from __future__ import annotations

import contextlib
import csv
import time
from pathlib import Path

import torch

from brickyard.errors import BrickyardError, ConfigError

HOOKS = ("on_train_start", "on_epoch_start", "on_step_start", "on_before_update", "on_step_end",
         "on_validation_start", "on_validation_end", "on_checkpoint", "on_epoch_end", "on_loop_end", "on_train_end")


class Callback:
    """Override any of the hooks; each gets the ``Run`` (see ``brickyard.training.run.Run``)."""

    def on_train_start(self, run): pass
    def on_epoch_start(self, run): pass
    def on_step_start(self, run): pass
    def on_before_update(self, run): pass
    def on_step_end(self, run, loss): pass
    def on_validation_start(self, run): pass
    def on_validation_end(self, run, metrics): pass
    def on_checkpoint(self, run, path): pass
    def on_epoch_end(self, run): pass
    def on_loop_end(self, run): pass
    def on_train_end(self, run, summary): pass

    @property
    def key(self) -> str:
        return type(self).__name__

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class CallbackList:
    """Calls a hook on every callback in order; an exception from a user's callback becomes one sentence."""

    def __init__(self, callbacks):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise ConfigError(f"callbacks: {cb!r} is not a brickyard.Callback (subclass it and override its hooks).")
        for hook in HOOKS:  # only the callbacks that override a hook are called for it
            wanted = [(cb, getattr(cb, hook), type(cb).__module__.startswith("brickyard.")) for cb in self.callbacks
                      if _overrides(cb, hook)]
            setattr(self, hook, self._caller(hook, wanted))

    @staticmethod
    def _caller(hook: str, wanted):
        def call(*args):
            for cb, fn, own in wanted:
                if own:
                    fn(*args)  # brickyard's own: its failures (a lost peer, a full disk) are handled where they mean something
                    continue
                try:
                    fn(*args)
                except (BrickyardError, torch.OutOfMemoryError):
                    raise
                except Exception as e:  # noqa: BLE001  the user's code: name it, no traceback
                    if isinstance(e, RuntimeError) and _is_comm_failure(e):
                        raise  # a collective in the callback met a lost peer: the run says which
                    text = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
                    raise BrickyardError(f"callback {type(cb).__name__}.{hook} raised {type(e).__name__}: {text}.") from None
        return call

    def state_dict(self) -> dict:
        states = {cb.key: cb.state_dict() for cb in self.callbacks}
        return {k: v for k, v in states.items() if v}

    def load_state_dict(self, state: dict) -> None:
        for cb in self.callbacks:
            if cb.key in (state or {}):
                cb.load_state_dict(state[cb.key])


def _is_comm_failure(e: BaseException) -> bool:
    from brickyard.training.failures import is_comm_failure
    return is_comm_failure(e)


def _overrides(cb, hook: str) -> bool:
    return getattr(type(cb), hook) is not getattr(Callback, hook)


# ---------------------------------------------------------------------------------------------
# Built-in callbacks for users (also reached through config keys, see ``from_config``)


class EarlyStopping(Callback):
    """Stop when ``monitor`` (``val_loss``, ``val_accuracy``, ``val_top5``) has not improved by more than
    ``min_delta`` for ``patience`` validations; with ``restore_best`` the weights of the best validation
    are put back when it stops (kept on the CPU, one copy of the model)."""

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, restore_best: bool = True):
        if not monitor.startswith("val_"):
            raise ConfigError(f"EarlyStopping: monitor {monitor!r} must be a validation metric such as val_loss or val_accuracy.")
        if patience < 1:
            raise ConfigError(f"EarlyStopping: patience {patience} must be at least 1.")
        self.monitor, self.patience, self.min_delta, self.restore_best = monitor, patience, abs(min_delta), restore_best
        self.sign = -1.0 if monitor.endswith("loss") else 1.0  # larger is better after multiplying
        self.best, self.wait, self.best_step, self.best_weights = None, 0, None, None

    def on_validation_end(self, run, metrics):
        name = self.monitor[len("val_"):]
        value = metrics.get(name)
        if value is None:
            have = ", ".join(f"val_{k}" for k, v in metrics.items() if isinstance(v, float))
            raise ConfigError(f"EarlyStopping: monitor {self.monitor!r} is not among this run's metrics ({have}).")
        if self.best is None or self.sign * (value - self.best) > self.min_delta:
            self.best, self.wait, self.best_step = value, 0, run.step
            if self.restore_best:
                self.best_weights = {k: v.detach().to("cpu", copy=True) for k, v in run.model.state_dict().items()}
            return
        self.wait += 1
        if self.wait >= self.patience:
            if self.restore_best and self.best_weights is not None:
                run.model.load_state_dict(self.best_weights)
            run.log.info(f"early stopping: {self.monitor} has not improved for {self.wait} validation(s); best "
                         f"{self.best:.4f} at step {self.best_step}" + ("; its weights restored" if self.restore_best else ""))
            run.stop(f"EarlyStopping on {self.monitor}")

    def state_dict(self):
        return {"best": self.best, "wait": self.wait, "best_step": self.best_step}

    def load_state_dict(self, state):
        self.best, self.wait, self.best_step = state["best"], state["wait"], state["best_step"]


class EMA(Callback):
    """An exponential moving average of the weights, ``avg = decay * avg + (1 - decay) * w`` after every
    step. Validation, the test evaluation, ``best.pt`` and the final weights use the average; the
    training steps use the raw weights, which every step checkpoint keeps for an exact resume."""

    def __init__(self, decay: float = 0.999):
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"EMA: decay {decay} must be between 0 and 1, e.g. 0.999.")
        self.decay, self.avg = decay, None

    def on_train_start(self, run):
        self.live = list(run.model.parameters()) + list(run.model.buffers())  # updated in place, so kept once
        self.avg = ([t.detach().clone() for t in self.live] if self.avg is None
                    else [a.to(t.device) for a, t in zip(self.avg, self.live)])
        self.floats = [(a, w) for a, w in zip(self.avg, self.live) if a.is_floating_point()]
        self.counters = [(a, w) for a, w in zip(self.avg, self.live) if not a.is_floating_point()]  # num_batches_tracked
        run.eval_weights = self.applied

    def on_step_end(self, run, loss):
        with torch.no_grad():
            torch._foreach_lerp_([a for a, _ in self.floats], [w for _, w in self.floats], 1.0 - self.decay)
            _copy([a for a, _ in self.counters], [w for _, w in self.counters])

    def on_loop_end(self, run):
        with torch.no_grad():  # the run ends with the averaged weights
            _copy(self.live, self.avg)
        run.eval_weights = contextlib.nullcontext

    @contextlib.contextmanager
    def applied(self):
        """Swap the averaged weights in (for an evaluation or a save) and the raw ones back after."""
        raw = [w.detach().clone() for w in self.live]
        with torch.no_grad():
            _copy(self.live, self.avg)
        try:
            yield
        finally:
            with torch.no_grad():
                _copy(self.live, raw)

    def state_dict(self):
        return {"decay": self.decay, "avg": self.avg} if self.avg is not None else {}

    def load_state_dict(self, state):
        self.avg = list(state["avg"]) if state.get("avg") is not None else None


def _copy(dst, src) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


class MaxTime(Callback):
    """Stop once the training loop has run ``seconds`` (wall clock from the first step, evaluation included)."""

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ConfigError(f"MaxTime: seconds {seconds} must be positive.")
        self.seconds, self.start = float(seconds), None

    def on_train_start(self, run):
        self.start = time.perf_counter()

    def on_step_end(self, run, loss):
        if time.perf_counter() - self.start >= self.seconds:
            run.stop(f"MaxTime {self.seconds:g}s")


class CSVLogger(Callback):
    """One CSV row per validation: step, epoch, learning rate, training loss and the validation metrics.
    Written by rank 0, flushed after each row; appends when the file exists (a resumed run). A relative
    ``path`` is taken in the run directory."""

    COLUMNS = ("step", "epoch", "lr", "train_loss", "val_loss", "val_accuracy", "val_top5", "seconds")

    def __init__(self, path="metrics.csv"):
        self.path, self.f, self.writer = Path(path), None, None

    def on_train_start(self, run):
        if run.rank != 0:
            return
        self.path = self.path if self.path.is_absolute() else Path(run.run_dir) / self.path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self.f = open(self.path, "a", newline="", buffering=1)
        self.writer = csv.writer(self.f)
        if new:
            self.writer.writerow(self.COLUMNS)
        self.start = time.perf_counter()

    def on_validation_end(self, run, metrics):
        if self.writer is None:
            return
        self.writer.writerow([run.step, round(run.step / run.steps_per_epoch, 4), run.lr, run.train_loss,
                              metrics.get("loss"), metrics.get("accuracy"), metrics.get("top5"),
                              round(time.perf_counter() - self.start, 3)])

    def on_train_end(self, run, summary):
        if self.f is not None:
            self.f.close()
            self.f = None


def from_config(cfg) -> list[Callback]:
    """The built-ins that ``train.*`` keys ask for, so the CLI reaches them too."""
    t, out = cfg.train, []
    if t.early_stopping:
        out.append(EarlyStopping(t.early_stopping_monitor, t.early_stopping, t.early_stopping_min_delta))
    if t.ema:
        out.append(EMA(t.ema))
    if t.max_time_s:
        out.append(MaxTime(t.max_time_s))
    if t.csv_log:
        out.append(CSVLogger("metrics.csv"))
    return out
