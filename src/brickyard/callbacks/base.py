"""The callback contract: how behaviour is added to a run without copying the loop.

A ``Callback`` has one no-op method per moment of training; subclass it and override the ones you
need, then pass instances to ``brickyard.fit(..., callbacks=[...])``. brickyard's own behaviours
(checkpoints, early stopping, watched layers, boost snapshots) are callbacks on the same interface; the
progress lines and the metrics are loggers (``brickyard.observe.loggers``), fed by the trainer.

The hooks, in the order a run calls them::

    on_train_start(run)
      on_epoch_start(run)
        on_step_start(run)
        on_before_update(run)         gradients are ready (synced across ranks), the weights not yet changed
        on_step_end(run, loss)        loss: this step's mean loss, a 0-dim tensor on the device
        on_validation_start(run)
        on_validation_end(run, metrics)
        on_checkpoint(run, path)      after a checkpoint file is written (rank 0, which writes them)
      on_epoch_end(run)               an epoch done, or the loop stopping; after validation
    on_loop_end(run)                  the loop is over, before the test evaluation
    summary(run) -> dict              what this callback adds to the run's summary (after the test evaluation)
    on_train_end(run, summary)

Callbacks run on every rank, in the order given, after brickyard's own. ``on_validation_end`` and
``on_train_end`` follow collectives, so every rank sees the same metrics there; ``on_step_end`` is
not a sync point, and ``loss.item()`` in it forces one (a device-to-host copy) on GPUs: read it
every N steps, as the trainer does at its log steps.

The ``run`` a hook gets is read-only (``training.run.RunView``): every field and method reads as on the
``Run``, and setting one of its fields raises ``AttributeError`` naming it and what to do instead, but
``run.lr_scale``; ``run.stop()`` and ``run.use_eval_weights()`` ask the trainer for the rest. A callback's own
state belongs on the callback (``self.x``); a name the run does not have is still kept on it, as before.

``run.stop(reason)`` ends training after the current step on every rank: a stop asked for at the
end of an epoch takes effect there; one asked for in the middle takes effect at once in a single
process and, with several, at a step the ranks agree on through the job's store (within 20 steps).
The run then saves a checkpoint, evaluates the test split and writes its summary.

An exception in a user's callback ends the run as ``brickyard.errors.UserCodeError``: one sentence
naming the callback and hook (what the CLI prints), the user's exception as its ``__cause__`` and
the user's traceback as its own (what Python prints).

State across a resume: ``state_dict()`` returns plain values and tensors, saved in every checkpoint
under the callback's ``state_key`` and handed back to ``load_state_dict``. The key is the class name
plus what tells two instances apart (``EarlyStopping{'monitor': 'val_loss', ...}``), as in Lightning's
``Callback.state_key`` (``src/lightning/pytorch/callbacks/callback.py``, ``_generate_state_key``): a
subclass lists the constructor arguments that matter in ``state_key_fields``.
"""
from __future__ import annotations

import math

import torch

from brickyard.errors import BrickyardError, ConfigError, is_comm_failure, user_code_error

HOOKS = ("on_train_start", "on_epoch_start", "on_step_start", "on_before_update", "on_step_end",
         "on_validation_start", "on_validation_end", "on_checkpoint", "on_epoch_end", "on_loop_end", "on_train_end")


class Callback:
    """Override any of the hooks; each gets the run, read-only but ``lr_scale`` (a ``RunView`` of the
    ``brickyard.Run``: ``training.run``)."""

    state_key_fields: tuple[str, ...] = ()  # attributes that tell two instances of one class apart
    # called before brickyard's checkpoints are written (EMA, SWA: a step's checkpoint holds that step's average)
    before_checkpoints: bool = False

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

    def summary(self, run) -> dict:
        """What this callback adds to the run's summary (``summary.json``, what ``fit`` returns): plain
        values under keys of its own. Called once on every rank, after the test evaluation."""
        return {}

    @property
    def state_key(self) -> str:
        """Where this callback's state is saved in a checkpoint: the class name, and the values of
        ``state_key_fields`` when it has any."""
        if not self.state_key_fields:
            return type(self).__qualname__
        return f"{type(self).__qualname__}{ {k: getattr(self, k) for k in self.state_key_fields} }"

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def argument(who: str, name: str, value, whole: bool = False, above: float | None = None, least: float | None = None,
             below: float | None = None):
    """A callback's numeric argument checked where the user passes it: a real number (a whole one where ``whole``),
    finite, and within the bounds given; otherwise one sentence naming the callback and the argument (a NaN patience
    would never stop a run, a string one would fail as a TypeError mid-run)."""
    real = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if whole:
        real = real and float(value).is_integer()
    ok = real and (above is None or value > above) and (least is None or value >= least) and (below is None or value < below)
    if not ok:
        kind = "a whole number" if whole else "a finite number"
        bounds = [f"above {above:g}" if above is not None else "", f"at least {least:g}" if least is not None else "",
                  f"below {below:g}" if below is not None else ""]
        where = " and ".join(b for b in bounds if b)
        raise ConfigError(f"{who}: {name} {value!r} must be {kind}{' ' + where if where else ''}.")
    return int(value) if whole else value


def monitored(metrics: dict, monitor: str, who: str, advice: str = "") -> float:
    """The value of ``monitor`` (``val_loss``, ``val_accuracy``, ``val_f1_macro``, ...) in a validation's ``metrics``; one
    sentence naming the metrics this run has where it has no such value (``who``: the callback or key that watches,
    ``advice``: what to do instead, appended)."""
    value = metrics.get(monitor[len("val_"):])
    if value is None:
        have = ", ".join(f"val_{k}" for k, v in metrics.items() if isinstance(v, float))
        raise ConfigError(f"{who} is not among this run's metrics ({have}){advice}.")
    return value


class CallbackList:
    """Calls a hook on every callback in order. Two callbacks with one ``state_key`` are refused (their
    states would overwrite each other in a checkpoint). Made with a ``view`` (the trainer's ``RunView``), it hands
    every hook and ``summary`` that view in place of the run it is called with: callbacks see the run read-only."""

    def __init__(self, callbacks, view=None):
        self.callbacks, self.view = list(callbacks), view
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise ConfigError(f"callbacks: {cb!r} is not a brickyard.Callback (subclass it and override its hooks).")
        keys = [cb.state_key for cb in self.callbacks if _overrides(cb, "state_dict")]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ConfigError(f"callbacks: two callbacks save their state under {twice[0]!r}; give them different "
                              f"arguments or set state_key_fields (or a state_key property) that tells them apart.")
        for hook in HOOKS:  # only the callbacks that override a hook are called for it
            wanted = [(cb, getattr(cb, hook), type(cb).__module__.startswith("brickyard.")) for cb in self.callbacks
                      if _overrides(cb, hook)]
            setattr(self, hook, self._caller(hook, wanted, view))

    @staticmethod
    def _caller(hook: str, wanted, view):
        def call(run, *args):
            args = (run if view is None else view, *args)
            for cb, fn, own in wanted:
                if own:
                    fn(*args)  # brickyard's own: its failures (a lost peer, a full disk) are handled where they mean something
                    continue
                try:
                    fn(*args)
                except (BrickyardError, torch.OutOfMemoryError):
                    raise
                except Exception as e:  # noqa: BLE001  the user's code: one sentence, and the user's traceback kept
                    if isinstance(e, RuntimeError) and is_comm_failure(e):
                        raise  # a collective in the callback met a lost peer: the run says which
                    raise user_code_error(f"callback {type(cb).__name__}.{hook}", e) from e
        return call

    def summary(self, run) -> dict:
        out = {}
        for cb in self.callbacks:
            if _overrides(cb, "summary"):
                out.update(cb.summary(run if self.view is None else self.view) or {})
        return out

    def state_dict(self) -> dict:
        states = {cb.state_key: cb.state_dict() for cb in self.callbacks}
        return {k: v for k, v in states.items() if v}

    def load_state_dict(self, state: dict) -> None:
        state = state or {}
        for cb in self.callbacks:
            if cb.state_key in state:
                cb.load_state_dict(state[cb.state_key])
            elif type(cb).__name__ in state and cb.state_key_fields:  # a checkpoint keyed by class name alone
                cb.load_state_dict(state[type(cb).__name__])


def _overrides(cb, hook: str) -> bool:
    return getattr(type(cb), hook) is not getattr(Callback, hook)
