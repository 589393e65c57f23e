"""The Python API: ``fit`` for your own model and data, and what the CLI's commands call.

``import brickyard`` stays light (``brickyard/__init__.py`` loads this module on first use of
``brickyard.fit``); this module itself imports the training engine at the top.
"""
from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Set
from pathlib import Path

import torch
from torch import nn

from brickyard import models
from brickyard.config import Config, build, load_config
from brickyard.data import DataBundle, build_data, from_loaders, from_user
from brickyard.data.augment import DevicePrep, float_dtype
from brickyard.data.folds import folded
from brickyard.distributed import env as dist_env
from brickyard.errors import ConfigError, DataError
from brickyard.models import pretrained
from brickyard.models.finetune import prepare
from brickyard.observe.logs import Logger
from brickyard.training import checkpoint as ckpt
from brickyard.training import device as dev
from brickyard.training.evaluation import evaluate
from brickyard.training.loop import train
from brickyard.training.memory import device_batch
from brickyard.training.precision import for_model
from brickyard.training.rundir import default_path

__all__ = ["fit", "resolve_config", "train_config", "build_model", "load_checkpoint_model", "evaluate_checkpoint"]


def resolve_config(config=None, overrides=()) -> Config:
    """A ``Config`` from a Config, a dict of sections, a preset name or a YAML path. ``None`` is the
    default recipe, the one `brickyard train` uses (preset ``mnist``: the schema's defaults but for
    ``train.epochs``)."""
    if config is None:
        return load_config(None, overrides)
    if isinstance(config, Config):
        return build(config.to_dict(), overrides) if overrides else config
    if isinstance(config, dict):
        return build(config, overrides)
    if isinstance(config, (str, Path)):
        return load_config(str(config), overrides)
    raise ConfigError(f"config: expected a Config, a dict, a preset name or a YAML path, got {type(config).__name__}.")


def fit(model: nn.Module, train_data, val_data=None, test_data=None, config=None, *, callbacks=(), loss_fn=None,
        train_step=None, num_classes=None, run_dir=None, resume=None, overrides=(), epochs=None, batch_size=None,
        validation_split=None, class_weight=None, validation_data=None, validation_freq=None, verbose=None,
        loggers=()) -> dict:
    """Train your own ``nn.Module`` on your own data; returns the summary the CLI writes.

    ``train_data`` / ``val_data`` / ``test_data``: ``(inputs, labels)`` tensors or NumPy arrays (inputs N x anything:
    images N x C x H x W, uint8 0-255 or float, points, signals), a ``torch.utils.data.Dataset`` of
    pairs, or a ``DataLoader`` of one (its batch per device; ``data.from_loaders``). Integer labels are
    classes: their count is the largest label + 1, or for a Dataset the width of the model's output
    (``num_classes`` overrides both). One-hot label rows (Keras's ``to_categorical``)
    are read as the classes they encode. Accuracy and the confusion matrix are reported when the outputs are
    class logits (N x C) for integer labels or for rows of class probabilities (a Dataset's one-hot rows, soft
    targets), scored by their largest share as Keras's ``categorical_accuracy`` scores them.

    ``callbacks``: ``brickyard.Callback`` instances. ``loggers``: ``brickyard.observe.loggers.Logger`` instances, which
    get every row ``metrics.jsonl`` gets, besides the ``train.loggers`` the config names (rank 0; docs/extending.md).
    ``loss_fn(outputs, targets)`` returns the mean loss
    (default: cross-entropy with ``optim.label_smoothing``). ``train_step(run, batch)`` replaces the
    forward pass and loss: it gets ``(inputs, targets)`` on the device and returns the mean loss, or
    ``(loss, outputs)``; brickyard does the backward pass (unless the step calls ``run.backward``), the
    gradient sync, the NaN guard, the learning rate, the update and the hooks
    (``brickyard.training.step``). An exception in any of these is a ``UserCodeError`` that keeps the
    user's traceback.

    Under ``torchrun`` (or ``brickyard run --devices ...``) every process calls ``fit`` and trains its
    share; a process group you made yourself is used and left alone. ``fit`` restores the global torch
    settings it changes (deterministic algorithms, cuDNN benchmark, CPU threads) when it returns.
    ``$BRICKYARD_RUN_DIR``, ``$BRICKYARD_LOG_DIR`` and ``$BRICKYARD_RESUME`` (set by `brickyard run`) are
    the defaults of ``run_dir``, the worker logs and ``resume``.

    ``class_weight``: Keras's ``{class: weight}`` (classes left out weigh 1), or one weight a class; it sets
    ``optim.class_weights`` (``training.step.make_loss_sum``: Keras's weighted loss).

    ``epochs``, ``batch_size`` and ``validation_split`` are Keras's ``fit`` keywords, set on top of ``config`` and
    ``overrides``: ``train.epochs``, ``data.global_batch_size`` (Keras's batch is the global one: each of N
    processes takes its share) and ``data.val_fraction`` (a random part held out, where Keras takes the last).
    So are ``validation_data`` (``val_data``), ``validation_freq`` (``train.eval_every``, epochs between validations)
    and ``verbose`` (``train.progress``: 0 none, 1 a bar, 2 plain lines; brickyard's set-up lines print at every
    level), as keras/src/trainers/trainer.py documents them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fit: model must be a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(overrides, str):
        overrides = [overrides]  # one KEY=VALUE, not its characters
    val_data = _keras_validation(train_data, val_data, validation_data)
    (train_data, val_data, test_data), from_loader, loader_notes = from_loaders(train_data, val_data, test_data)
    keras = _keras_keywords(epochs, _batch(batch_size), validation_split, validation_freq, verbose)
    overrides = [*from_loader, *overrides, *(f"{key}={value}" for key, value in keras.items() if value is not None)]
    cfg = _fit_config(config, overrides)
    data = _user_data(cfg, (train_data, val_data, test_data), num_classes, model,
                      loss_fn is not None or train_step is not None, loader_notes)
    if class_weight is not None:
        cfg = cfg.replace(**{"optim.class_weights": _class_weights(class_weight, data.num_classes)})
    _prepare(model, cfg, data)
    run_dir, resume = run_dir or os.environ.get("BRICKYARD_RUN_DIR"), resume or os.environ.get("BRICKYARD_RESUME") or None
    return train(cfg, model, data, Path(run_dir) if run_dir else None, resume, {"name": type(model).__name__},
                 log_dir=os.environ.get("BRICKYARD_LOG_DIR"), callbacks=callbacks, loss_fn=loss_fn, train_step=train_step,
                 loggers=loggers)


def _user_data(cfg: Config, splits, num_classes, model, own_loss: bool, notes: list) -> DataBundle:
    """fit's data as a bundle (``from_user``), what its loaders said first, cut into ``data.folds`` where set."""
    train_data, val_data, test_data = splits
    data = from_user(train_data, val_data, test_data, num_classes, model, own_loss=own_loss, transforms=cfg.data)
    data.notes[:0] = notes
    return folded(data, cfg.data.folds, cfg.data.fold) if cfg.data.folds else data  # k-fold cross-validation


def _prepare(model: nn.Module, cfg: Config, data: DataBundle) -> None:
    """``model.init`` and ``model.whiten`` on the user's model, before it trains."""
    models.initialise(model, cfg.model.init)
    if cfg.model.whiten:
        models.whiten(model, data, type(model).__name__)


def _fit_config(config, overrides) -> Config:
    """``fit``'s config: ``config`` and ``overrides``, on the device `brickyard run --devices` chose."""
    cfg = resolve_config(config, overrides)
    if cfg.optim.lr == "find":
        raise ConfigError("optim.lr: find runs the range test on the registry models of `brickyard train`; for your own "
                          "model set optim.lr (a number).")
    if os.environ.get("BRICKYARD_DEVICE") and cfg.train.device == "auto":  # `brickyard run --devices cpu:2`
        cfg = cfg.replace(**{"train.device": os.environ["BRICKYARD_DEVICE"]})
    return cfg


def _batch(batch_size):
    """Keras's ``batch_size`` (the global batch) as ``data.global_batch_size``, where 0 means "data.batch_size on
    each device": a 0, a negative or a fraction is one sentence, not a run at 256 a device."""
    if batch_size is None:
        return None
    try:
        n = None if isinstance(batch_size, bool) else operator.index(batch_size)  # int, NumPy's integers
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ConfigError(f"batch_size: {batch_size!r} is not a batch; Keras's batch_size is the global batch, a whole "
                          f"number of 1 or more.")
    return n


def _keras_keywords(epochs, batch_size, validation_split, validation_freq, verbose) -> dict:
    """Keras's ``fit`` keywords as the config keys they set (None: not given)."""
    if verbose is not None and verbose not in (0, 1, 2):
        raise ConfigError(f"verbose: {verbose!r} is not one of Keras's 0 (silent), 1 (a progress bar) or 2 (a line an "
                          f"epoch).")
    return {"train.epochs": epochs, "data.global_batch_size": batch_size, "data.val_fraction": validation_split,
            "train.eval_every": validation_freq, "train.progress": {0: "none", 1: "bar", 2: "plain"}.get(verbose)}


def _keras_validation(train_data, val_data, validation_data):
    """``val_data``, or Keras's ``validation_data`` in its place (one of them). ``fit(model, x, y)`` as Keras's
    ``model.fit(x, y)`` is written would take ``y`` for the validation data: arrays of one length in both places are
    one sentence that shows the pair instead."""
    if validation_data is not None:
        if val_data is not None:
            raise ConfigError("val_data and validation_data (Keras's name) are both given; pass one of them.")
        if isinstance(validation_data, tuple) and len(validation_data) == 3:
            raise DataError("validation_data: (x, y, sample_weight) weighs the validation samples, which brickyard does "
                            "not; pass (x, y).")
        val_data = validation_data
    if hasattr(train_data, "__array__") and hasattr(val_data, "__array__") and not isinstance(train_data, (tuple, list)) \
            and len(train_data) == len(val_data):
        raise DataError("train_data is one array and val_data another of the same length: fit takes the training data "
                        "as one (inputs, labels) pair, fit(model, (x, y)), where Keras's model.fit takes fit(x, y).")
    return val_data


def _class_weights(given, num_classes: int) -> tuple:
    """``fit(class_weight=)``: a ``{class: weight}`` mapping as Keras takes it (whole-number keys; a class left out
    weighs 1, as in Keras's ``class_weight_to_sample_weights``) or a sequence of one weight a class, as the tuple
    ``optim.class_weights`` holds. Each weight is one number (a 0-d array or tensor is read as its number). A key
    outside the classes or not a whole number (``1.7``), a weight of several numbers, a table of weights (a 2-D
    array) and labels without classes (a regression) are one sentence each (Keras skips a key it lacks silently)."""
    if num_classes < 1:
        raise ConfigError("class_weight weighs classes, and these labels are floats (a regression) with no classes; "
                          "leave class_weight out, or weigh the samples in your own loss_fn.")
    if isinstance(given, Mapping):
        weights: list = [1.0] * num_classes
        for key, value in given.items():
            k = _class_index(key)
            if not 0 <= k < num_classes:
                raise ConfigError(f"class_weight: class {k} is outside the data's classes 0..{num_classes - 1}.")
            weights[k] = _one_weight(value, f"class {k}'s weight")
        return tuple(weights)
    shape = tuple(getattr(given, "shape", ()) or ())
    if isinstance(given, (str, bytes, Set)) or not hasattr(given, "__len__") or len(shape) > 1:
        got = f"an array of shape {shape}" if len(shape) > 1 else type(given).__name__
        raise ConfigError(f"class_weight: expected {{class: weight}} or one weight a class, got {got}.")
    return tuple(_one_weight(w, f"weight {i}") for i, w in enumerate(given))


def _class_index(key) -> int:
    """A ``class_weight`` key as a class index: an integer of any kind, a whole float (``2.0``), digits."""
    if isinstance(key, bool):
        raise ConfigError(f"class_weight: the key {key!r} is not a class index.")
    try:
        return operator.index(key)  # int, NumPy's integers, a 0-d integer tensor
    except TypeError:
        pass
    if isinstance(key, float) and key.is_integer():
        return int(key)
    if isinstance(key, str) and key.strip().isdecimal():
        return int(key)
    if isinstance(key, float):  # 1.7 was read as class 1
        raise ConfigError(f"class_weight: the key {key!r} is not a whole number, so not a class index.")
    raise ConfigError(f"class_weight: the key {key!r} is not a class index.")


def _one_weight(value, what: str):
    """``value`` as one number: NumPy's scalars and 0-d arrays and tensors give theirs (``optim.class_weights``
    then checks that it is a finite number, 0 or more); an array of several numbers is one sentence."""
    shape = getattr(value, "shape", None)
    if isinstance(value, (list, tuple)) or (shape is not None and len(shape) != 0):
        got = f"an array of shape {tuple(shape)}" if shape is not None else f"a {type(value).__name__} of {len(value)}"
        raise ConfigError(f"class_weight: {what} is {got}, not one number.")
    return value.item() if hasattr(value, "item") else value


def build_model(cfg: Config, data: DataBundle) -> nn.Module:
    return models.build(cfg, data)


def found_lr(cfg: Config, run_dir=None, resume=None) -> Config:
    """``optim.lr: find`` resolved: the rate in the run's ``config.yaml`` when resuming, else the range
    test's suggestion (``tools.lrfind``, on every rank of the job alike), said on the console."""
    if cfg.optim.lr != "find":
        return cfg
    saved = Path(run_dir) / "config.yaml" if run_dir else None
    if resume and saved is not None and saved.is_file():
        lr = load_config(str(saved)).optim.lr
        if isinstance(lr, float):
            return cfg.replace(**{"optim.lr": lr})
    # here, not at the top: the range test (and bench's set-up it reuses) loads only when asked for
    from brickyard.distributed import env as dist_info
    from brickyard.errors import BrickyardError
    from brickyard.tools import lrfind
    r = lrfind.sweep(cfg.replace(**{"optim.lr": 1.0}))
    r["configured_lr"] = None
    if dist_info.rank_from_env() == 0:
        print(lrfind.line(r).replace("lr-find: suggested", "optim.lr: find: the range test suggests"), flush=True)
    if r["suggested_lr"] is None:
        raise BrickyardError("optim.lr: find: the range test could not suggest a rate (the loss diverged at once); set optim.lr.")
    return cfg.replace(**{"optim.lr": float(f"{r['suggested_lr']:.3g}")})


def train_config(cfg: Config, run_dir=None, resume=None, log_dir=None, callbacks=()) -> dict:
    """Train the registry model and data set that ``cfg`` names (what ``brickyard train`` runs), with ``callbacks``
    besides the config's (a sweep trial's ``Report``)."""
    run_dir = Path(run_dir) if run_dir else default_path(cfg.preset)
    cfg = found_lr(cfg, run_dir, resume)
    data = build_data(cfg.data)
    torch.manual_seed(cfg.train.seed)  # the initial weights are part of what a seed reproduces
    model = build_model(cfg, data)
    meta = {"name": cfg.model.name, "registry": True, "options": models.architecture(cfg.model)}
    ft = cfg.finetune
    if pretrained.is_named(ft.init_from) and pretrained.model_for(ft.init_from) != cfg.model.name:
        raise ConfigError(f"finetune.init_from: {ft.init_from} holds the weights of {pretrained.model_for(ft.init_from)}; "
                          f"set model.name: {pretrained.model_for(ft.init_from)} (this run builds {cfg.model.name}).")
    if ft.init_from or ft.reset_head or ft.freeze:
        with Logger(dist_env.from_env().rank) as log:
            prepare(model, ft, cfg.model.num_classes or data.num_classes, log)
    return train(cfg, model, data, run_dir, resume, meta, log_dir=log_dir, callbacks=callbacks)


def load_checkpoint_model(path) -> tuple[nn.Module, dict, Config]:
    """Rebuild a registry model from a brickyard checkpoint or run directory; returns (model, state, config)."""
    return ckpt.load_model(path)


def evaluate_checkpoint(path, split: str = "test", device: str = "auto", tta: str | None = None, limit: int = 0,
                        calibrated: bool = True) -> dict:
    """One split's loss and accuracy for a checkpoint, as its run's test pass computes them. ``tta``
    (none, flip, flip-shift, five-crop, multi-scale) overrides the run's ``data.tta``; flip-shift moves images the run's
    ``data.shift`` pixels, or 1 where the run had none. ``limit``: the first that many images of the split
    (0: all of it; the run's ``data.eval_limit`` does not apply). The result's ``count`` says how many.
    ``calibrated``: divide the logits by the temperature the checkpoint keeps (``train.calibrate``), as its run's
    test did; False scores the raw outputs."""
    path = ckpt.pick(Path(path))
    model, state, cfg = ckpt.load_model(path)
    tta = cfg.data.tta if tta is None else tta
    data = build_data(cfg.data)
    part = getattr(data, split)
    if part is None:
        have = ", ".join(s for s in ("train", "val", "test") if getattr(data, s) is not None)
        why = ("data.train_on_all trained on the validation images" if split == "val" and cfg.data.train_on_all
               else f"{cfg.data.root} has no {split}/ folder" if cfg.data.name == "imagefolder" and split != "train"
               else f"{cfg.data.name} has none")
        raise ConfigError(f"--split {split}: this run's data has no {split} split ({why}); it has {have}.")
    if tta != "none" and cfg.data.task == "multilabel":
        raise ConfigError(f"--tta {tta} averages the class probabilities of one label an image; this checkpoint tags "
                          f"several (data.task: multilabel): evaluate it without.")
    if tta != "none" and not data.is_images:
        raise ConfigError(f"--tta {tta} moves and mirrors images (N x C x H x W); this data set's inputs are not images.")
    d = dev.resolve_device(device)
    # channels-last and precision as the run's own test pass had them on this machine (auto: measured)
    cl = data.is_images and dev.resolve_channels_last(cfg.train.channels_last, cfg.train.precision, d)
    model.to(d, memory_format=torch.channels_last if cl else torch.preserve_format)
    batch = device_batch(cfg, 1)
    precision = for_model(cfg.train.precision, model, data, batch if batch > 1 else cfg.data.eval_batch_size, d, cl)
    prep = DevicePrep(data.mean, data.std, channels_last=cl, device=d, float_dtype=float_dtype(model))
    r = evaluate(model, part, prep, d, precision, cfg.data.eval_batch_size, data.num_classes,
                 tta=tta, shift=cfg.data.shift or 1, limit=limit,
                 temperature=ckpt.temperature(state, path) if calibrated else 1.0,
                 multilabel=cfg.data.task == "multilabel", threshold=ckpt.threshold(state, path))
    return {"checkpoint": str(path), "split": split, "step": state["step"], "tta": tta, **r}
