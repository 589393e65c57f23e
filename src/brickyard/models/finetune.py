"""Fine-tuning: start from saved weights, replace the head, freeze layers.

``finetune.init_from`` accepts a brickyard checkpoint, a plain ``state_dict`` file (``.pt``,
``.pth``) such as torchvision's ImageNet weights, a ``.safetensors`` file, or published weights by
name (``torchvision:resnet50``, ``models.pretrained``); all are loaded
without executing code (``torch.load(weights_only=True)`` / safetensors). The registry's ResNets
and VGG use torchvision's key names, so those files load unchanged; a ``module.`` prefix left
by DataParallel/DDP is stripped.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path

import torch
from torch import nn

from brickyard.errors import CheckpointError, ConfigError
from brickyard.files import load_failure, pickled_object
from brickyard.models import pretrained


def find_head(model: nn.Module) -> str:
    """The name of the classifier: the last ``nn.Linear`` in the model."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ConfigError("finetune: the model has no nn.Linear classifier to reset or to give head_lr_mult.")
    return names[-1]


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    path = pretrained.fetch(path) if pretrained.is_named(path) else Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"finetune.init_from: {path} does not exist.")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file  # optional dependency
        except ImportError:
            raise CheckpointError(f"{path}: reading .safetensors needs the safetensors package (pip install safetensors).") from None
        try:
            state = load_file(str(path))
        except Exception as e:  # noqa: BLE001  any parse failure means a bad file
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}).") from None
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise unreadable(path, e) from None
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            state = state["model"]  # a brickyard checkpoint
        elif isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a state_dict of tensors.")
    return {k.removeprefix("module."): v for k, v in state.items()}


def unreadable(path, e: BaseException) -> CheckpointError:
    """The sentence for a file ``torch.load(weights_only=True)`` refused: one that pickles Python objects
    besides tensors (a Lightning ``.ckpt`` whose ``hyper_parameters`` hold a ``Path``, a whole pickled model)
    gets the way to keep only its weights; anything else, torch's first line without its terminal colours."""
    found = pickled_object(e)
    if found is not None:
        return CheckpointError(
            f"{path} holds Python objects besides tensors{found}, and unpickling them can run code, so brickyard reads "
            f"weights only; if you trust the file, save its tensors alone, for a Lightning checkpoint with "
            f"`python -c \"import torch; torch.save(torch.load('{path}', weights_only=False)['state_dict'], "
            f"'weights.pt')\"`, and set finetune.init_from to weights.pt.")
    return CheckpointError(f"{path} cannot be read as weights ({load_failure(e)}).")


def _matching(state: dict[str, torch.Tensor], own: dict, source, log) -> dict[str, torch.Tensor]:
    """``state`` as the model names its tensors, or a ``CheckpointError``. Where no key is the model's but every
    key starts with one same component (a Lightning module's attribute, ``model.conv1.weight``; ``module.`` is
    already gone), that component is dropped when the keys then match."""
    if state and not any(k in own for k in state):
        first = {k.partition(".")[0] for k in state}
        if len(first) == 1 and all("." in k for k in state):
            prefix = first.pop() + "."
            stripped = {k.removeprefix(prefix): v for k, v in state.items()}
            if any(k in own for k in stripped):
                log.info(f"the keys in {source} start with {prefix!r} (a wrapping module's attribute); read without it")
                state = stripped
    if not any(k in own for k in state):
        theirs, ours = ", ".join(list(state)[:3]) or "none", ", ".join(list(own)[:3])
        raise CheckpointError(f"finetune.init_from: none of the {len(state)} tensors in {source} is one of the model's "
                              f"(the file's names look like {theirs}; the model's like {ours}): it holds another model.")
    return state


def _keep_eval(module: nn.Module, inputs) -> None:
    """Forward pre-hook: a frozen batch norm keeps its running statistics, whatever mode the model is in."""
    module.training = False


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def layers(model: nn.Module) -> list[str]:
    """The model's layers as Keras counts them for freezing: the modules that hold parameters of their
    own, in the order they were defined (``named_modules``)."""
    return [name for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]


def all_but_last(model: nn.Module, item: str) -> list[str]:
    """The parameter names that ``finetune.freeze: all_but_last:N`` freezes: those of every layer but
    the last N (``layers``)."""
    _, _, arg = item.partition(":")
    own = layers(model)
    if item.partition(":")[0] != "all_but_last" or not arg.strip().isdigit() or not 1 <= int(arg) <= len(own):
        raise ConfigError(f"finetune.freeze: {item!r}: write all_but_last:N with N from 1 to {len(own)} (the layers "
                          f"that hold parameters: {', '.join(own[-3:])} are the last three).")
    kept = set(own[-int(arg):])
    return [f"{layer}.{p}" if layer else p for layer in own if layer not in kept
            for p, _ in model.get_submodule(layer).named_parameters(recurse=False)]


def prepare(model: nn.Module, cfg, num_classes: int, log) -> nn.Module:
    """Apply ``cfg`` (a ``FinetuneConfig``) to ``model`` in place and return it."""
    head = find_head(model) if (cfg.reset_head or cfg.head_lr_mult != 1.0) else None
    if cfg.init_from:
        own = model.state_dict()
        state = _matching(load_weights(cfg.init_from), own, cfg.init_from, log)
        if cfg.reset_head:
            state = {k: v for k, v in state.items() if not k.startswith(head + ".")}
        for k, v in state.items():
            if k in own and tuple(own[k].shape) != tuple(v.shape):
                hint = " (set finetune.reset_head: true to replace the classifier)" if k.startswith(str(head or find_head(model)) + ".") else ""
                raise CheckpointError(f"finetune.init_from: {k} has shape {tuple(v.shape)} in {cfg.init_from}, the model expects {tuple(own[k].shape)}{hint}.")
            # NaN or inf weights would end training at the first step's guard, far from the file that caused it
            if k in own and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise CheckpointError(f"finetune.init_from: {k} in {cfg.init_from} holds NaN or infinite values.")
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not (cfg.reset_head and k.startswith(head + "."))]
        log.info(f"loaded {len(state) - len(result.unexpected_keys)} tensors from {cfg.init_from}")
        if missing:
            log.warning(f"keys missing from {cfg.init_from} (left as initialised): {', '.join(missing)}")
        if result.unexpected_keys:
            log.warning(f"keys in {cfg.init_from} that the model does not have (ignored): {', '.join(result.unexpected_keys)}")
    if cfg.reset_head:
        old = model.get_submodule(head)
        new = nn.Linear(old.in_features, num_classes, bias=old.bias is not None)
        nn.init.xavier_uniform_(new.weight)
        if new.bias is not None:
            nn.init.zeros_(new.bias)
        _replace(model, head, new)
        log.info(f"new head {head}: Linear({old.in_features} -> {num_classes}), Xavier-initialised")
    if cfg.freeze:
        names = [n for n, _ in model.named_parameters()]
        patterns = [p for p in cfg.freeze if not str(p).startswith("all_but_last")]
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                raise ConfigError(f"finetune.freeze: pattern {pattern!r} matches no parameter; names look like {', '.join(names[:4])}, ...")
        frozen = [n for n, p in model.named_parameters() if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
        for item in cfg.freeze:
            if str(item).startswith("all_but_last"):
                frozen += [n for n in all_but_last(model, str(item)) if n not in frozen]
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
        for m in model.modules():
            own_params = list(m.parameters(recurse=False))
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and own_params and not any(p.requires_grad for p in own_params):
                m.register_forward_pre_hook(_keep_eval)
        log.info(f"frozen: {len(frozen)} parameter tensors ({sum(model.get_parameter(n).numel() for n in frozen):,} values) "
                 f"by {', '.join(cfg.freeze)}")
    return model
