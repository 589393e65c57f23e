"""Pipeline stages (``dist.pipeline.stages``): a model cut at block boundaries into stages, one a process.

The engine is torch's: ``torch.distributed.pipelining`` (torch 2.13, ``stage.py``: ``PipelineStage.__init__``
takes the stage's module, its index, the number of stages and the device; ``schedules.py``:
``PipelineScheduleSingle.step`` takes the whole batch as positional arguments on the first stage and
``target=`` and ``losses=`` on the last, ``eval`` runs the forward passes only, ``ScheduleGPipe`` and
``Schedule1F1B`` take ``loss_fn`` and ``scale_grads``). torchtitan cuts its language models the same way
(``torchtitan/distributed/pipeline_parallel.py``: ``pipeline_module_split`` keeps each stage's modules of a
deep copy, ``build_pipeline_schedule`` picks the schedule class by name). Nothing here sends a tensor itself
but the last stage's logits, broadcast so that every rank counts loss and accuracy as one process does.

A model is a sequence of pieces whose composition is its ``forward``: an ``nn.Sequential``'s children, or a
registry model's ``pipeline_pieces()`` (the ViTs: the tokens, each block, the classifier). A stage is an
``nn.Sequential`` of consecutive pieces, holding the model's own parameters; its state is read and written
under the model's own names, so a checkpoint holds the whole model as one process writes it.

Balance: the cut points are chosen by parameter count (each stage as close to 1/N of the parameters as the
block boundaries allow), not by measured time or memory; ``dist.pipeline.split`` names them instead.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from brickyard.errors import ConfigError


def pieces(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) whose composition is ``model``'s forward; a ``ConfigError`` for a model that is not a sequence."""
    own = getattr(model, "pipeline_pieces", None)
    if callable(own):
        return list(own())
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    raise ConfigError(f"dist.pipeline.stages: {type(model).__name__} is not a sequence of blocks; pipeline stages "
                      f"cut an nn.Sequential or a registry ViT so far.")


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def cuts(model: nn.Module, stages: int, split: tuple = ()) -> list[int]:
    """The piece index each stage begins at (``stages`` of them, the first 0): at the names in ``split``, else
    balanced by parameter count. One sentence for more stages than blocks or a name that is no block boundary."""
    parts = pieces(model)
    names = [n for n, _ in parts]
    if stages > len(parts):
        raise ConfigError(f"dist.pipeline.stages: {stages} is more than the {len(parts)} blocks of "
                          f"{type(model).__name__} ({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}).")
    if split:
        modules = dict(model.named_modules())
        for name in split:
            if name not in modules:
                raise ConfigError(f"dist.pipeline.split: {name!r} is not a module name of {type(model).__name__} "
                                  f"(module names are like those of `brickyard inspect`).")
            if name not in names[1:]:
                raise ConfigError(f"dist.pipeline.split: {name!r} is not a block boundary of {type(model).__name__}; "
                                  f"a stage can begin at {', '.join(names[1:7])}{', ...' if len(names) > 7 else ''}.")
        at = sorted(names.index(n) for n in split)
        if len(set(at)) != len(at):
            raise ConfigError(f"dist.pipeline.split names a block twice: {list(split)}.")
        return [0, *at]
    return _balanced([_count(m) for _, m in parts], stages)


def _balanced(sizes: list[int], stages: int) -> list[int]:
    """Stage starts whose prefix sums of ``sizes`` come nearest k/N of the total, each stage one piece or more."""
    total, prefix = sum(sizes), [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    starts = [0]
    for k in range(1, stages):
        lo, hi = starts[-1] + 1, len(sizes) - (stages - k)  # room for the stages after this one
        starts.append(min(range(lo, hi + 1), key=lambda i: abs(prefix[i] - total * k / stages)))
    return starts


def stage_module(model: nn.Module, starts: list[int], index: int) -> nn.Sequential:
    """Stage ``index``'s pieces as one module (the model's own parameters, not copies)."""
    parts = pieces(model)
    end = starts[index + 1] if index + 1 < len(starts) else len(parts)
    return nn.Sequential(*(m for _, m in parts[starts[index]:end]))


def own_names(model: nn.Module, stage: nn.Module) -> dict[str, str]:
    """The stage's state-dict names to the model's own (the same tensors)."""
    names = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    return {k: names[id(t)] for k, t in stage.state_dict(keep_vars=True).items()}


def gather_state(stage: nn.Module, names: dict[str, str], order: list[str], optimizer) -> tuple[dict, dict]:
    """(the whole model's state under its own names, in ``order``; every stage's optimiser state, by stage):
    gathered from every rank, a collective."""
    mine = {names[k]: v.detach().cpu() for k, v in stage.state_dict().items()}
    parts: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(parts, (mine, optimizer.state_dict()))
    whole = {k: v for m, _ in parts for k, v in m.items()}
    return {k: whole[k] for k in order if k in whole}, {"stages": [o for _, o in parts]}


def broadcast_from_last(t: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """The last stage's ``t`` (n x ..., float32) on every rank: its shape, then its values."""
    last = tdist.get_world_size() - 1
    shape = torch.zeros(8, dtype=torch.int64, device=device)
    if t is not None:
        shape[0] = t.dim()
        shape[1:1 + t.dim()] = torch.tensor(t.shape)
    tdist.broadcast(shape, last)
    out = t.detach().float().contiguous() if t is not None else torch.empty(
        tuple(shape[1:1 + int(shape[0])].tolist()), device=device)
    tdist.broadcast(out, last)
    return out
