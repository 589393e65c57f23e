"""The syntax inside a config value (a transform, a RandAugment policy, an initialisation, a logger name),
checked by the sections (``schema``'s ``check()`` methods) when a config is built and read again by the
parts that use the value (``data``, ``models``). Each raises ``ConfigError`` naming the key."""
from __future__ import annotations

import importlib.metadata
import math
import re

from brickyard.errors import ConfigError

_SIZED = ("resize", "center_crop", "random_resized_crop", "random_crop")

# test-time augmentation (training.evaluation.views): data.tta, and eval's and predict's --tta
TTA = ("none", "flip", "flip-shift", "five-crop", "multi-scale")
# the validation metrics a key or callback can watch: a loss (lower is better) and scores (higher is better)
VAL_METRICS = ("val_loss", "val_accuracy", "val_top5", "val_precision_macro", "val_recall_macro", "val_f1_macro",
               "val_f1_weighted", "val_balanced_accuracy", "val_map", "val_map_micro", "val_f1_micro")



def check_transform(key: str, spec) -> None:
    name, _, arg = str(spec).partition(":")
    if name in ("hflip", "grayscale", "rgb") and not arg:
        return
    size, _, pad = arg.partition(":") if name == "random_crop" else (arg, "", "")
    dims = size.split("x")
    if (name in _SIZED and 1 <= len(dims) <= 2 and all(d.isdigit() and int(d) > 0 for d in dims)
            and (not pad or (pad.isdigit() and int(pad) <= 4096))):
        return
    raise ConfigError(f"{key}: transform {spec!r} is not one of resize:S, center_crop:S, random_resized_crop:S, "
                      f"random_crop:S or random_crop:S:P (S a size like 224 or 28x28, P pixels of padding), hflip, "
                      f"grayscale, rgb.")


def rand_augment_policy(policy: str) -> tuple[int, float, float]:
    """``(n, m, mstd)`` of a ``data.rand_augment`` policy, timm's ``rand_augment_transform`` syntax
    (``rand-m9-n2-mstd0.5``, the ``rand-`` prefix optional): ``n`` operations per image (default 2),
    magnitude ``m`` out of 10 (default 10), ``mstd`` the magnitude's noise (above 100: uniform in 0-m).
    A ``ConfigError`` naming the part otherwise."""
    parts = str(policy).strip().split("-")
    if parts and parts[0] == "rand":
        parts = parts[1:]
    n, m, mstd = 2, 10.0, 0.0
    for part in parts:
        match = re.fullmatch(r"(mstd|n|m)(\d+(?:\.\d+)?)", part)
        if not match:
            raise ConfigError(f"data.rand_augment: {policy!r}: {part!r} is not one of nN (operations per image), mM "
                              f"(magnitude 0-10) or mstdS (the magnitude's noise), e.g. n2-m9 or rand-m9-mstd0.5.")
        key, value = match.group(1), float(match.group(2))
        if key == "n":
            if not value.is_integer() or not 1 <= value <= 16:
                raise ConfigError(f"data.rand_augment: {policy!r}: n is the number of operations per image, 1 to 16.")
            n = int(value)
        elif key == "m":
            if value > 30:
                raise ConfigError(f"data.rand_augment: {policy!r}: m is a magnitude out of 10 (at most 30).")
            m = value
        else:
            mstd = math.inf if value > 100 else value
    return n, m, mstd


INITS = ("default", "normal:STD", "xavier", "xavier_normal", "kaiming", "kaiming_uniform")


def init_method(how: str) -> tuple[str, float | None]:
    """``(name, std)`` of a ``model.init`` value (``std`` for ``normal:STD`` only); a ``ConfigError`` otherwise."""
    how = str(how).strip()
    name, _, arg = how.partition(":")
    if name == "normal":
        try:
            std = float(arg)
        except ValueError:
            std = -1.0
        if not 0 < std < 100:
            raise ConfigError(f"model.init: {how!r}: give the standard deviation, e.g. normal:0.01.")
        return name, std
    if name not in INITS or arg:  # normal:STD is handled above
        raise ConfigError(f"model.init: {how!r} is not one of {', '.join(INITS)}.")
    return name, None


BUILT_IN_LOGGERS = ("tensorboard", "csv", "mlflow", "wandb")


def logger_names() -> tuple[str, ...]:
    """The names ``train.loggers`` accepts, in the order its error lists them: the built-ins, then those a user's
    installed package adds under the ``brickyard.loggers`` entry-point group (``brickyard.observe.loggers``, which
    sits above config in the layers, builds them from the same group)."""
    added = {e.name for e in importlib.metadata.entry_points(group="brickyard.loggers")}
    return BUILT_IN_LOGGERS + tuple(sorted(added - set(BUILT_IN_LOGGERS) - {"jsonl"}))


def cross_check(cfg) -> None:
    """Every rule among a config's keys (``cfg.check()``: each section's own, then those across sections);
    kept for the callers of the function that held them all."""
    cfg.check()
