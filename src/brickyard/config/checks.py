"""The checks of a config that involve several keys (or a key's inner syntax), run when it is built:
before any process starts, data loads or training begins. ``cross_check(cfg)`` raises ``ConfigError``."""
from __future__ import annotations

import math
import re

from brickyard.errors import ConfigError

_SIZED = ("resize", "center_crop", "random_resized_crop", "random_crop")


def _check_transform(key: str, spec) -> None:
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


def cross_check(cfg) -> None:
    """The checks that involve several keys, when the config is built: before any process starts,
    data loads or training begins."""
    b, o = cfg.boost, cfg.optim
    if len(o.betas) != 2 or not all(isinstance(v, (int, float)) and 0 <= v < 1 for v in o.betas):
        raise ConfigError(f"optim.betas: {list(o.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999].")
    bad = [w for w in o.class_weights if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
           or w < 0]
    if bad:  # their count is checked against the data's classes when training starts (training.step)
        raise ConfigError(f"optim.class_weights: {bad[0]!r} is not a weight (a finite number, 0 or more).")
    steps = tuple(cfg.train.profile_steps)
    if steps and (len(steps) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in steps)
                  or steps[1] <= steps[0] or steps[1] - steps[0] > 1000):
        raise ConfigError(f"train.profile_steps: {list(steps)} must be [first, last] step numbers, first < last, "
                          f"at most 1,000 steps apart, e.g. [10, 15].")
    for name in cfg.train.loggers:
        if name not in ("tensorboard", "csv", "mlflow", "wandb"):
            raise ConfigError(f"train.loggers: {name!r} is not one of tensorboard, csv, mlflow, wandb.")
    if cfg.data.rand_augment:
        rand_augment_policy(cfg.data.rand_augment)
    init_method(cfg.model.init)
    if cfg.schedule.name == "plateau" and not 0 < cfg.schedule.gamma < 1:
        raise ConfigError(f"schedule.gamma: {cfg.schedule.gamma:g} must lie between 0 and 1 for schedule.name plateau "
                          f"(each reduction multiplies the rate by it), e.g. 0.1 or 0.5.")
    if cfg.model.whiten and cfg.finetune.init_from:
        raise ConfigError(f"model.whiten sets the first convolution from the data and finetune.init_from loads it from "
                          f"{cfg.finetune.init_from}; choose one.")
    for item in cfg.finetune.freeze:
        if str(item).startswith("all_but_last") and not str(item).partition(":")[2].strip().isdigit():
            raise ConfigError(f"finetune.freeze: {item!r}: write all_but_last:N, N the number of layers left to train.")
    for key in ("train_transforms", "eval_transforms"):
        specs = tuple(getattr(cfg.data, key))
        if specs != ("auto",):
            for spec in specs:
                _check_transform(f"data.{key}", spec)
    if cfg.data.train_on_all and cfg.data.val_fraction:
        raise ConfigError(f"data.train_on_all trains on every training image, so nothing is left for data.val_fraction "
                          f"({cfg.data.val_fraction}); set one of them.")
    kept = list(cfg.data.classes)
    twice = next((c for i, c in enumerate(kept) if c in kept[:i]), None)
    if twice is not None:
        raise ConfigError(f"data.classes: {twice!r} is listed twice; list each class index once.")
    if len(kept) == 1:
        raise ConfigError(f"data.classes: {kept} keeps one class; a classifier needs at least 2.")
    if cfg.data.tta == "flip-shift" and cfg.data.shift == 0:
        raise ConfigError("data.tta: flip-shift moves each image data.shift pixels four ways, and data.shift is 0; "
                          "set data.shift (e.g. 1), or data.tta: flip for the mirror alone.")
    g, accum = cfg.data.global_batch_size, cfg.train.grad_accum
    if g and g % accum:
        raise ConfigError(f"data.global_batch_size: {g} is not divisible by train.grad_accum ({accum}); "
                          f"each accumulation step takes an equal share.")
    if b.dim_reduce.enabled and cfg.train.grad_accum != 1:
        raise ConfigError("boost.dim_reduce works with train.grad_accum: 1 (the line search needs one batch per step).")
    if (b.dim_reduce.enabled or b.snapshots.enabled) and not b.dim_reduce.pca_path and b.snapshots.keep <= b.dim_reduce.n_components:
        raise ConfigError(f"boost.snapshots.keep: {b.snapshots.keep} must exceed boost.dim_reduce.n_components "
                          f"({b.dim_reduce.n_components}); PCA needs more snapshots than components.")
    if cfg.dist.grad_sync == "flat" and cfg.dist.sync_bn:
        raise ConfigError("dist.grad_sync: flat does not run SyncBatchNorm (dist.sync_bn: true); use dist.grad_sync: ddp or auto.")
    _check_fsdp(cfg)
    dr = b.dim_reduce
    if dr.rho is not None and not 0 < dr.rho < 1:
        raise ConfigError(f"boost.dim_reduce.rho: {dr.rho} must be between 0 and 1 (the backtracking factor, e.g. 0.4).")
    if dr.alpha is not None and dr.alpha < 0:
        raise ConfigError(f"boost.dim_reduce.alpha: {dr.alpha} must be at least 0.")
    if dr.max_search is not None and (isinstance(dr.max_search, bool) or not isinstance(dr.max_search, int) or dr.max_search < 1):
        raise ConfigError(f"boost.dim_reduce.max_search: {dr.max_search} must be a whole number of at least 1.")
    if b.dim_reduce.enabled and cfg.dist.mode == "ps":
        raise ConfigError("boost.dim_reduce runs in the collective mode (dist.mode: collective).")
    stops = [k for k, on in (("train.early_stopping", cfg.train.early_stopping), ("train.max_time_s", cfg.train.max_time_s)) if on]
    if stops and cfg.dist.mode == "ps" and cfg.dist.ps.sync:
        raise ConfigError(f"{stops[0]}: a synchronous parameter-server run cannot stop before its last step yet; "
                          f"use dist.mode: collective.")


def _check_fsdp(cfg) -> None:
    """What ``dist.strategy: fsdp`` does not combine with (each needs the whole model on every rank)."""
    if cfg.dist.strategy != "fsdp":
        return
    b, t = cfg.boost, cfg.train
    other = [(on, key) for on, key in (
        (cfg.dist.mode == "ps", "dist.mode: ps (the servers hold the parameters)"),
        (b.dim_reduce.enabled or b.snapshots.enabled, "boost (its snapshots and subspace are of the whole parameter vector)"),
        (cfg.dist.grad_sync != "auto", f"dist.grad_sync: {cfg.dist.grad_sync} (FSDP syncs the gradients itself)"),
        (cfg.dist.sync_bn, "dist.sync_bn"),
        (bool(t.watch) or bool(t.histograms_every), "train.watch and train.histograms_every (they read whole weights)"),
    ) if on]
    if other:
        raise ConfigError(f"dist.strategy: fsdp does not combine with {other[0][1]}; use dist.strategy: ddp for it.")
