"""The search space of a sweep: a YAML mapping of config keys to the values a trial draws.

    optim.lr: {log_uniform: [1.0e-4, 0.1]}      # a float, uniform in its logarithm (Optuna's suggest_float(log=True))
    optim.weight_decay: {uniform: [0.0, 0.1]}   # a float, uniform
    train.epochs: {int: [1, 4]}                 # a whole number, low to high inclusive; `step: 2`, `log: true` too
    model.name: {choice: [mnist_fast, lenet5]}  # one of the list (a plain list means the same)
    data.mixup: 0.2                             # a fixed value: every trial sets it

Checked as from a stranger, before any trial starts: a key that is not a config key, a kind not listed above, a
range whose low is not below its high, and every value a trial could draw that the config refuses (its low and high,
each choice) are one sentence naming the key. The grid sampler takes choices and whole numbers only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from brickyard.errors import BrickyardError, ConfigError

KINDS = ("log_uniform", "uniform", "int", "choice")


@dataclass(frozen=True)
class Param:
    key: str
    kind: str                     # one of KINDS, or "fixed"
    values: tuple                 # (low, high) for a range; the choices; (value,) for a fixed one
    step: int | None = None       # int: the spacing of the values
    log: bool = False             # int: uniform in the logarithm

    def suggest(self, trial):
        """The value an Optuna trial draws for this key."""
        if self.kind == "fixed":
            return self.values[0]
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.values))
        low, high = self.values
        if self.kind == "int":
            return trial.suggest_int(self.key, low, high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.key, low, high, log=self.kind == "log_uniform")

    def grid(self) -> list:
        """Every value of this key, for the grid sampler."""
        if self.kind in ("choice", "fixed"):
            return list(self.values)
        if self.kind == "int" and not self.log:
            return list(range(self.values[0], self.values[1] + 1, self.step or 1))
        raise ConfigError(f"--space {self.key}: the grid sampler takes choices and whole numbers; a {self.kind} range "
                          f"has no grid: give its values as {{choice: [...]}}.")

    def edges(self) -> list:
        """The values the config must take for every trial to be valid: a range's ends, each choice."""
        return list(self.values)


def read_space(path: str | Path) -> list[Param]:
    """The parameters of the space file at ``path`` (module docstring)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--space {p}: no such file.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--space {p} cannot be read ({e}).") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"--space {p} is not YAML ({str(e).splitlines()[0]}).") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"--space {p} must map config keys to what a trial draws, e.g. optim.lr: "
                          f"{{log_uniform: [1.0e-4, 0.1]}}.")
    return [_param(str(k), v, p) for k, v in raw.items()]


def _param(key: str, spec, path: Path) -> Param:
    where = f"--space {path}: {key}"
    if isinstance(spec, list):
        spec = {"choice": spec}
    if not isinstance(spec, dict):  # a fixed value: set as --set would set it
        return Param(key, "fixed", (spec,))
    kinds = [k for k in spec if k in KINDS]
    extra = sorted(set(spec) - set(KINDS) - {"step", "log"})
    if len(kinds) != 1 or extra:
        raise ConfigError(f"{where} must be one of {{log_uniform: [low, high]}}, {{uniform: [low, high]}}, "
                          f"{{int: [low, high]}} or {{choice: [...]}}, not {spec!r}.")
    kind, values = kinds[0], spec[kinds[0]]
    if kind == "choice":
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: choice takes a list of one value or more.")
        odd = next((v for v in values if v is not None and not isinstance(v, (bool, int, float, str))), None)
        if odd is not None:  # Optuna's categorical values are None, booleans, numbers and strings
            raise ConfigError(f"{where}: choice {odd!r} is not a single value (a number, a string, true/false or null).")
        return Param(key, kind, tuple(values))
    if not (isinstance(values, list) and len(values) == 2 and all(_number(v) for v in values)):
        raise ConfigError(f"{where}: {kind} takes [low, high], two numbers, not {values!r}.")
    low, high = values
    if not low < high:
        raise ConfigError(f"{where}: {kind} [{low}, {high}]: low must be below high.")
    if kind == "log_uniform" and low <= 0:
        raise ConfigError(f"{where}: log_uniform [{low}, {high}] needs a low above 0 (its logarithm).")
    if kind == "int":
        step, log = spec.get("step"), spec.get("log", False)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{where}: int takes whole numbers [low, high], not {values!r}.")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 1):
            raise ConfigError(f"{where}: step {step!r} must be a whole number of 1 or more.")
        if log not in (True, False) or (log and (low < 1 or step not in (None, 1))):
            raise ConfigError(f"{where}: log: true takes a low of 1 or more and no step.")
        return Param(key, kind, (low, high), step, bool(log))
    if "step" in spec or "log" in spec:
        raise ConfigError(f"{where}: step and log belong to int ranges; {kind} is continuous.")
    return Param(key, kind, (float(low), float(high)))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def override(key: str, value) -> str:
    """``KEY=VALUE`` as ``--set`` takes it (the value as YAML, so a string stays a string)."""
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def check(params: list[Param], config: str, overrides: list[str]) -> None:
    """Every value a trial could draw, set on ``config`` one key at a time: one sentence naming the key where the
    config refuses it (an unknown key, a value out of its range or choices)."""
    from brickyard.config import load_config  # the config package imports torch-free modules only
    from brickyard.models import check_name  # the registry: a model name the config cannot check itself
    for p in params:
        for v in p.edges():
            try:
                cfg = load_config(config, [*overrides, override(p.key, v)])
                if p.key == "model.name":
                    check_name(cfg.model.name)
            except BrickyardError as e:
                raise ConfigError(f"--space {p.key}: {v!r} is not a value this config takes ({str(e).rstrip('.')}).") from None
