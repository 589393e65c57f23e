"""Activation checkpointing (``train.activation_checkpointing``): chosen blocks keep only their inputs
in the forward pass and run their forward again during the backward pass, trading compute for memory.

Each matched module's forward goes through ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``
(PyTorch's recommended variant; the RNG state is restored for the recomputation, so dropout draws the
same mask). ``auto`` picks the blocks per model family: a vision transformer's ``blocks.N``, a
ResNet's residual blocks ``layerN.M``, VGG's ``features``; other models have no blocks to choose.
Patterns are ``fnmatch`` patterns on module names (``blocks.*``, ``layer3.*``); a module inside one
already chosen is not wrapped again, and a pattern that matches no module is one sentence.

Batch norm inside a checkpointed block would update its running statistics twice (once in the
recomputation): brickyard puts them back after a forward that runs during the backward pass, so the
statistics, like the gradients, are those of a run without checkpointing.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from brickyard.models import bn_state, find_blocks, restore_bn_state


def apply(model: nn.Module, setting) -> list[str]:
    """Checkpoint the modules that ``setting`` (``auto`` or patterns) names; returns their names."""
    outer = choose(model, setting)
    modules = dict(model.named_modules())
    for name in outer:
        _wrap(modules[name])
    return outer


def choose(model: nn.Module, setting) -> list[str]:
    """The names of the modules ``setting`` picks (``models.find_blocks``); a pattern that matches nothing
    is a ``ConfigError``. Changes nothing, so a run can check this before it writes anything."""
    return find_blocks(model, setting, "train.activation_checkpointing")


def _wrap(module: nn.Module) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    for bn in (m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
        bn.register_forward_pre_hook(_stash_stats)
        bn.register_forward_hook(_restore_stats)


def _recomputing() -> bool:
    """True while autograd runs a backward pass (the checkpoint's recomputation happens inside one)."""
    return torch._C._current_graph_task_id() != -1


def _stash_stats(bn, args):
    if bn.training and _recomputing():
        bn._brickyard_stats = bn_state(bn)


def _restore_stats(bn, args, out):
    saved = getattr(bn, "_brickyard_stats", None)
    if saved is not None:
        restore_bn_state(saved)
        bn._brickyard_stats = None
