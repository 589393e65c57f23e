"""The model registry: ``@register`` names a factory ``f(num_classes, in_channels, image_size, **options)``.

Models are plain ``nn.Module``s; they know nothing of devices, ranks or logging.
"""
from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable

import torch
from torch import nn

from brickyard.config.checks import init_method
from brickyard.errors import ConfigError, reason
from brickyard.models.whitening import whiten

_REGISTRY: dict[str, tuple[Callable[..., nn.Module], str]] = {}


def register(name: str, doc: str):
    def wrap(fn):
        _REGISTRY[name] = (fn, doc)
        return fn
    return wrap


def _load_all():
    from brickyard.models import alexnet, resnet, small, vgg, vit  # noqa: F401  (registration side effect)


def names() -> list[str]:
    _load_all()
    return list(_REGISTRY)


def describe(name: str) -> str:
    _load_all()
    return _REGISTRY[name][1]


def check_name(name: str) -> None:
    """A ``ConfigError`` unless ``name`` is a registered model."""
    _load_all()
    if name not in _REGISTRY:
        raise ConfigError(f"model.name: {name!r} is not one of {', '.join(_REGISTRY)}.")


def create(name: str, num_classes: int = 10, in_channels: int = 1, image_size: tuple[int, int] = (28, 28),
           **options) -> nn.Module:
    """The model ``name``; ``options`` are the ``model.*`` keys a family takes (``patch_size`` for ViTs),
    passed when set (not 0 or None)."""
    check_name(name)
    factory = _REGISTRY[name][0]
    options = {k: v for k, v in options.items() if v}
    takes = inspect.signature(factory).parameters
    for key in options:
        if key not in takes:
            raise ConfigError(f"model.{key}: {name} does not take it (it applies to {', '.join(_takers(key))}).")
    return factory(num_classes=num_classes, in_channels=in_channels, image_size=tuple(image_size), **options)


def _takers(key: str) -> list[str]:
    return [n for n, (f, _) in _REGISTRY.items() if key in inspect.signature(f).parameters]


NATURAL_INPUT = {"mnist_cnn": (1, 28), "mnist_fast": (1, 28), "lenet": (1, 28), "mlp": (1, 28), "convnet": (1, 28), "fashion_fast": (1, 28), "fashion_lean": (1, 28), "fashion_wide": (1, 28),
                 "resnet18": (3, 32), "alexnet": (1, 224)}  # d2l's AlexNet: Fashion-MNIST upsampled; the rest are ImageNet layouts: 3 x 224 x 224


def natural_input(name: str) -> tuple[int, tuple[int, int]]:
    """(channels, (height, width)) a model is built for, as `brickyard models` shows it."""
    channels, side = NATURAL_INPUT.get(name, (3, 224))
    return channels, (side, side)


def bn_state(model: nn.Module) -> list:
    """(buffer, saved copy) of every normalisation statistic in ``model`` (itself included), so that a
    forward pass that must not count (a line-search trial, a recomputation) can be undone."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            for b in (m.running_mean, m.running_var, m.num_batches_tracked):
                if b is not None:
                    out.append((b, b.detach().clone()))
    return out


def restore_bn_state(saved: list) -> None:
    with torch.no_grad():
        for buf, copy in saved:
            buf.copy_(copy)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build(cfg, data):
    """The registry model that ``cfg`` (a ``Config``) names, sized for ``data`` (a ``DataBundle``), its
    weights initialised as ``model.init`` says."""
    m = cfg.model
    channels = m.in_channels or data.in_channels
    model = create(m.name, m.num_classes or data.num_classes, channels, data.image_size,
                   patch_size=m.patch_size, drop_path=m.drop_path, head=None if m.head == "default" else m.head)
    if m.in_channels and data.in_channels and m.in_channels != data.in_channels:  # after create: sizes past memory say so
        raise ConfigError(f"model.in_channels: {m.in_channels}, but the data's images have {data.in_channels}; leave it 0 to "
                          f"follow the data{' or convert the folder with data.channels: 1 or 3' if data.name == 'imagefolder' else ''}.")
    if m.num_classes and m.num_classes < data.num_classes:
        raise ConfigError(f"model.num_classes: {m.num_classes} outputs cannot score the data's {data.num_classes} classes; "
                          f"leave it 0 to follow the data.")
    if data.train_size is not None:
        _reads(model, m.name, channels, data)
    initialise(model, m.init)
    if m.whiten:
        whiten(model, data, m.name)
    return model


def _reads(model: nn.Module, name: str, channels: int, data) -> None:
    """A model built for ``data``'s evaluation size must also read its training size (an image folder whose
    train and eval transforms end at different sizes): one forward of a blank image, or a ``ConfigError``."""
    was = model.training
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, channels, *data.train_size))
    except Exception as e:
        (th, tw), (eh, ew) = data.train_size, data.image_size
        raise ConfigError(f"data.train_transforms end at {th}x{tw} and data.eval_transforms at {eh}x{ew}, and {name} built "
                          f"for {eh}x{ew} cannot read {th}x{tw} ({reason(e)}); end both at the same size.") from None
    finally:
        model.train(was)


def architecture(m) -> dict:
    """The ``model.*`` options (of a ``ModelConfig``) that change a model's layers, as a checkpoint's
    ``meta["options"]`` records them to rebuild it (drop path and init change no layer)."""
    options = {"patch_size": m.patch_size, "head": None if m.head == "default" else m.head}
    return {k: v for k, v in options.items() if v}


def initialise(model: nn.Module, how: str) -> nn.Module:
    """Re-initialise every convolution's and linear layer's weights as ``how`` says (``model.init``) and
    their biases to zero; ``default`` keeps the model's own. ``normal:STD`` is d2l's ``normal(0, STD)``,
    ``xavier`` Keras's default (Glorot uniform), ``kaiming`` He normal for ReLU (fan-in), as torch.nn.init."""
    name, std = init_method(how)
    if name == "default":
        return model
    fill = {"normal": lambda w: nn.init.normal_(w, 0.0, std), "xavier": nn.init.xavier_uniform_,
            "xavier_normal": nn.init.xavier_normal_, "kaiming": lambda w: nn.init.kaiming_normal_(w, nonlinearity="relu"),
            "kaiming_uniform": lambda w: nn.init.kaiming_uniform_(w, nonlinearity="relu")}[name]
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):
                fill(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
    return model


# the repeated blocks of each model family: what activation checkpointing recomputes and FSDP shards one by one
BLOCKS = {"ViT": ["blocks.*"], "ResNet": ["layer?.*"], "VGG": ["features"]}


def find_blocks(model: nn.Module, setting, key: str) -> list[str]:
    """The names of the modules that ``setting`` (``auto``: the family's ``BLOCKS``, or ``fnmatch``
    patterns on module names) picks, none inside another; a pattern that matches nothing is a
    ``ConfigError`` about ``key``. Changes nothing."""
    patterns = BLOCKS.get(type(model).__name__, []) if setting == "auto" else list(setting or [])
    chosen: list[str] = []
    for pattern in patterns:
        found = [name for name, _ in model.named_modules() if name and fnmatch.fnmatchcase(name, pattern)]
        if not found:
            raise ConfigError(f"{key}: {pattern!r} matches no module of {type(model).__name__} "
                              f"(module names are like those of `brickyard inspect`).")
        chosen += [n for n in found if n not in chosen]
    return [n for n in chosen if not any(n.startswith(o + ".") for o in chosen if o != n)]
