"""``ReduceLROnPlateau``: lower the learning rate when a validation metric stops improving (``schedule.name:
plateau``, or the callback given to ``fit`` on top of any schedule)."""
from __future__ import annotations

import math

from brickyard.callbacks.base import Callback, monitored
from brickyard.config.checks import VAL_METRICS
from brickyard.errors import ConfigError

MONITORS = VAL_METRICS


class ReduceLROnPlateau(Callback):
    """Keras's ``ReduceLROnPlateau``, counted in validations (``train.eval_every`` epochs apart; Keras validates
    every epoch). Read from keras/src/callbacks/reduce_lr_on_plateau.py (commit 040582f), ``on_epoch_end``:

    - a value is an improvement when it beats the best by more than ``min_delta`` (lower for a loss, higher for an
      accuracy: Keras's ``auto`` mode, "acc" in the name);
    - in cooldown, each validation counts the cooldown down and the wait is 0; otherwise a validation without
      improvement adds 1 to the wait, and at ``patience`` the rate, when above ``min_lr``, becomes
      ``max(rate x factor, min_lr)``, the cooldown starts and the wait is 0.

    torch's ``ReduceLROnPlateau`` (torch/optim/lr_scheduler.py in torch 2.13, ``step``) differs: it lowers the rate
    after ``patience + 1`` validations without improvement, and its default threshold is relative (1e-4 of the
    best). Use it with ``schedule.name: none`` in a callback of your own for its behaviour.

    The rate brickyard's schedule gives is multiplied by ``run.lr_scale``, which this callback sets to the product of
    its reductions, so warm-up, or a cosine or one-cycle schedule under it, keep their shape. The validation metrics
    are the job's (every rank reads the same), so every rank lowers its rate at the same step; the state (best, wait,
    cooldown, scale) is saved in each checkpoint and a resumed run goes on as the uninterrupted one would.
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10, min_delta: float = 1e-4,
                 cooldown: int = 0, min_lr: float = 0.0):
        if not isinstance(monitor, str) or monitor not in MONITORS:
            raise ConfigError(f"ReduceLROnPlateau: monitor {monitor!r} is not one of {', '.join(MONITORS)}.")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor < 1:
            raise ConfigError(f"ReduceLROnPlateau: factor {factor!r} must lie between 0 and 1 (the rate is multiplied "
                              f"by it).")
        for name, value in (("patience", patience), ("cooldown", cooldown)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"ReduceLROnPlateau: {name} {value!r} must be a whole number of validations, 0 or more.")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in (min_delta, min_lr)):
            raise ConfigError(f"ReduceLROnPlateau: min_delta ({min_delta!r}) and min_lr ({min_lr!r}) must be 0 or more.")
        self.monitor, self.factor, self.patience, self.min_delta = monitor, factor, patience, min_delta
        self.cooldown, self.min_lr = cooldown, min_lr
        self.higher = not monitor.endswith("loss")  # Keras's auto mode: "acc" in the name is maximised
        self.best = -math.inf if self.higher else math.inf
        self.wait, self.cooldown_counter, self.scale, self.reduced_at = 0, 0, 1.0, []

    state_key_fields = ("monitor",)

    def on_train_start(self, run):
        run.lr_scale = self.scale  # a resumed run's reductions (load_state_dict came first)

    def on_validation_end(self, run, metrics):
        value = monitored(metrics, self.monitor, f"ReduceLROnPlateau: monitor {self.monitor!r}")
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        better = value > self.best + self.min_delta if self.higher else value < self.best - self.min_delta
        if better:
            self.best, self.wait = value, 0
            return
        if self.cooldown_counter > 0:
            return
        self.wait += 1
        if self.wait < self.patience:
            return
        old = run.lr  # the rate of the latest step, as Keras reads the optimiser's
        if old > self.min_lr:
            new = max(old * self.factor, self.min_lr)
            self.scale *= new / old
            run.lr_scale = self.scale
            self.reduced_at.append(run.step)
            run.log.info(f"ReduceLROnPlateau: {self.monitor} has not improved by more than {self.min_delta:g} for "
                         f"{self.wait} validation(s) (best {self.best:.4f}); learning rate {old:.3g} -> {new:.3g}")
            self.cooldown_counter, self.wait = self.cooldown, 0

    def summary(self, run) -> dict:
        return {"lr_reduced_at": list(self.reduced_at)}

    def state_dict(self):
        return {"best": self.best, "wait": self.wait, "cooldown_counter": self.cooldown_counter, "scale": self.scale,
                "reduced_at": list(self.reduced_at)}

    def load_state_dict(self, state):
        best, wait, counter, scale, at = (state[k] for k in ("best", "wait", "cooldown_counter", "scale", "reduced_at"))
        counts = (wait, counter, *at) if isinstance(at, (list, tuple)) else (None,)
        if not (isinstance(best, float) and not math.isnan(best) and isinstance(scale, float) and 0 < scale <= 1
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts)):
            raise ValueError(f"ReduceLROnPlateau: {str(state)[:120]} is not its state")
        self.best, self.wait, self.cooldown_counter, self.scale, self.reduced_at = best, wait, counter, scale, list(at)


def check(cfg, callbacks, data) -> None:
    """Before anything is written: a plateau schedule needs validations to read, and a schedule in this process."""
    given = [cb for cb in callbacks if isinstance(cb, ReduceLROnPlateau)]
    if cfg.schedule.name != "plateau" and not given:
        return
    if given and cfg.schedule.name == "plateau":
        raise ConfigError("schedule.name: plateau adds a ReduceLROnPlateau of its own (schedule.monitor, gamma, patience), "
                          "and callbacks holds another; keep one of them.")
    if given and cfg.schedule.name == "none":
        raise ConfigError("ReduceLROnPlateau scales brickyard's learning-rate schedule, and schedule.name none leaves the "
                          "rates to a scheduler of your own: give torch's ReduceLROnPlateau to that, or pick a schedule.")
    what = "schedule.name plateau" if cfg.schedule.name == "plateau" else "ReduceLROnPlateau"
    monitor = cfg.schedule.monitor if cfg.schedule.name == "plateau" else given[0].monitor
    if data.val is None:
        raise ConfigError(f"{what} lowers the learning rate when {monitor} stops improving, and this run has no "
                          f"validation data: hold some out (data.train_on_all false, data.val_fraction, fit's val_data), "
                          f"or pick another schedule.")
    if monitor != "val_loss" and not data.num_classes:
        raise ConfigError(f"{what} watches {monitor}, which scores classes, and this run's labels are not classes; "
                          f"watch val_loss.")
    if not cfg.train.eval_every:
        raise ConfigError(f"{what} lowers the learning rate between validations, and train.eval_every 0 validates only "
                          f"at the end; set it to the epochs between validations.")
    if cfg.dist.mode == "ps":
        raise ConfigError(f"{what}: in dist.mode ps the parameter servers apply the schedule, and they do not see the "
                          f"validations; use dist.mode collective or another schedule.")
