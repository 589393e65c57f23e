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
block boundaries allow), or with ``dist.pipeline.balance: time`` by the time of each piece's forward and backward
pass, measured once on rank 0 on a probe microbatch and shared (``timed_cuts``), or with ``balance: memory`` so that
the stage holding the most holds as little as the boundaries allow: parameters, gradients and optimiser state
counted, each piece's saved activations of a microbatch measured, times the microbatches the schedule keeps in
flight on that stage (``memory_cuts``); ``dist.pipeline.split`` names them instead.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch import nn

from brickyard.distributed.fsdp import full
from brickyard.errors import ConfigError


def pieces(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) whose composition is ``model``'s forward; a ``ConfigError`` for a model that is not a sequence."""
    own = getattr(model, "pipeline_pieces", None)
    if callable(own):
        return list(own())
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    raise ConfigError(f"dist.pipeline.stages: {type(model).__name__} is not a sequence of blocks; pipeline stages "
                      f"cut an nn.Sequential or a model with a pipeline_pieces() method (the registry's ResNets, VGG "
                      f"and ViTs have one).")


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _listed(names: list[str]) -> str:
    """Names for a sentence: all of up to 16, else the first 8 and the last 4 (the head's piece among them)."""
    return ", ".join(names if len(names) <= 16 else [*names[:8], "...", *names[-4:]])


def _holds(parts: list) -> list[bool]:
    """Whether each piece has a trainable parameter: a stage needs one (its optimiser steps something)."""
    return [any(q.requires_grad for q in m.parameters()) for _, m in parts]


def cuts(model: nn.Module, stages: int, split: tuple = ()) -> list[int]:
    """The piece index each stage begins at (``stages`` of them, the first 0): at the names in ``split``, else
    balanced by parameter count, every stage with a piece that has trainable weights. One sentence for more stages
    than blocks (or than blocks with weights), a name that is no block boundary, or a split leaving a stage no
    weights."""
    parts = pieces(model)
    names, holds = [n for n, _ in parts], _holds(parts)
    if stages > len(parts):
        raise ConfigError(f"dist.pipeline.stages: {stages} is more than the {len(parts)} blocks of "
                          f"{type(model).__name__} ({_listed(names)}).")
    weighted = [n for n, h in zip(names, holds) if h]
    if stages > len(weighted):
        raise ConfigError(f"dist.pipeline.stages: {stages} is more than the {len(weighted)} blocks of "
                          f"{type(model).__name__} that hold trainable weights ({_listed(weighted)}), and each stage "
                          f"needs some to train.")
    if split:
        modules = dict(model.named_modules())
        at = []
        for name in split:
            if name not in modules:
                raise ConfigError(f"dist.pipeline.split: {name!r} is not a module name of {type(model).__name__} "
                                  f"(module names are like those of `brickyard inspect`).")
            begins = [i for i, n in enumerate(names) if n == name or n.startswith(name + ".")]  # layer3: layer3.0
            if not begins or begins[0] == 0 or not _whole(names, begins):
                raise ConfigError(f"dist.pipeline.split: {name!r} is not a block boundary of {type(model).__name__}; "
                                  f"a stage can begin at {_listed(names[1:])}.")
            at.append(begins[0])
        at.sort()
        if len(set(at)) != len(at):
            raise ConfigError(f"dist.pipeline.split names a block twice: {list(split)}.")
        starts = [0, *at]
        for i, (a, b) in enumerate(zip(starts, starts[1:] + [len(parts)])):
            if not any(holds[a:b]):
                raise ConfigError(f"dist.pipeline.split: stage {i} ({names[a]}..{names[b - 1]}) would hold no trainable "
                                  f"weights, and each stage needs some to train; split at blocks with weights "
                                  f"({_listed(weighted)}).")
        return starts
    return _balanced([_count(m) for _, m in parts], stages, holds)


def timed_cuts(model: nn.Module, stages: int, x: torch.Tensor, repeats: int = 3) -> list[int]:
    """The piece index each stage begins at, balanced by the time of each piece's forward and backward pass on the
    probe batch ``x`` (the fastest of ``repeats``), measured on a copy of ``model`` in evaluation mode (the model's
    weights, buffers and the random state are left as they were). Device time on a GPU (synchronised per piece)."""
    probe = copy.deepcopy(model).eval()
    seconds, h = [], x
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        for _, piece in pieces(probe):
            h = h.detach().requires_grad_(h.is_floating_point())
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                out = piece(h)
                out.float().sum().backward()
                if x.device.type == "cuda":
                    torch.cuda.synchronize(x.device)
                best = min(best, time.perf_counter() - start)
            seconds.append(best)
            h = out.detach()
    return _balanced(seconds, stages, _holds(pieces(probe)))


def planned_cuts(model: nn.Module, p, x: torch.Tensor, state_copies: int, shards: int = 1, microbatches: int = 0) -> list[int]:
    """Where ``dist.pipeline`` (``p``) cuts ``model``: at its split points, by parameter count, or balanced by time or
    by memory measured on the probe microbatch ``x`` (under the caller's autocast; ``shards``: FSDP's shards of a
    stage, over which its parameters, gradients and optimiser state are divided; ``microbatches``: a step's, by
    default ``p``'s count)."""
    if p.split or p.balance == "params":
        return cuts(model, p.stages, p.split)
    cuts(model, p.stages)  # more stages than pieces: its sentence
    if p.balance == "time":
        return timed_cuts(model, p.stages, x)
    m = microbatches or p.microbatch_count()
    return memory_cuts(model, p.stages, x, state_copies, lambda i: in_flight(p.schedule, m, p.stages, i), shards)


def in_flight(schedule: str, microbatches: int, stages: int, index: int) -> int:
    """Microbatches whose activations stage ``index`` holds at once: all of them under GPipe (every forward before
    the first backward), at most ``stages - index`` under 1F1B (``Schedule1F1B``'s warm-up forwards)."""
    return min(microbatches, stages - index) if schedule == "1f1b" and microbatches >= stages else microbatches


def memory_cuts(model: nn.Module, stages: int, x: torch.Tensor, state_copies: int, flight, shards: int = 1) -> list[int]:
    """The piece index each stage begins at, so that the largest stage's memory is least: each piece's parameters,
    their gradients and ``state_copies`` optimiser copies (counted), and the activations autograd saves in its
    forward of the probe microbatch ``x`` (measured on a copy of ``model`` in training mode, the random state left
    as it was), times ``flight(i)``, the microbatches stage i holds at once; the first three divided by ``shards``."""
    probe, fixed, saved, h = copy.deepcopy(model).train(), [], [], x
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        for _, piece in pieces(probe):
            h = h.detach().requires_grad_(h.is_floating_point())
            held, h = saved_bytes(piece, h)
            grads = sum(q.numel() * q.element_size() for q in piece.parameters() if q.requires_grad)
            fixed.append((sum(q.numel() * q.element_size() for q in piece.parameters()) + grads * (1 + state_copies)) / shards)
            saved.append(held)
    holds = _holds(pieces(probe))
    return _least_largest(lambda i, a, b: sum(fixed[a:b]) + sum(saved[a:b]) * flight(i) if any(holds[a:b]) else math.inf,
                          len(fixed), stages)


def saved_bytes(module: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(bytes autograd saves in ``module``'s forward of ``x``, beside its parameters and ``x``; the output,
    detached). Runs the backward pass too, and leaves no gradient behind."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    own = {q.untyped_storage().data_ptr() for q in module.parameters()} | {x.untyped_storage().data_ptr()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    y.float().sum().backward()
    module.zero_grad(set_to_none=True)
    return sum(v for k, v in seen.items() if k not in own), y.detach()


def _least_largest(cost, n: int, stages: int) -> list[int]:
    """Stage starts over ``n`` pieces minimising the largest ``cost(stage, first piece, end)`` (each stage one piece
    or more): the textbook linear-partition dynamic programme, O(stages x n^2) calls of ``cost``."""
    best = {(0, b): (cost(0, 0, b), [0]) for b in range(1, n + 1)}  # (stages so far - 1, end) -> (largest, starts)
    for i in range(1, stages):
        for b in range(i + 1, n + 1):
            best[i, b] = min(((max(best[i - 1, a][0], cost(i, a, b)), best[i - 1, a][1] + [a]) for a in range(i, b)),
                             key=lambda t: t[0])
    return best[stages - 1, n][1]


def _whole(names: list[str], begins: list[int]) -> bool:
    """Whether the pieces at ``begins`` are consecutive: a module made of several pieces, cut before its first."""
    return begins == list(range(begins[0], begins[0] + len(begins)))


def _balanced(sizes: list, stages: int, holds: list[bool]) -> list[int]:
    """Stage starts whose prefix sums of ``sizes`` come nearest k/N of the total, each stage one piece or more and
    at least one of them a piece that ``holds`` weights (``cuts`` made sure there are ``stages`` of those)."""
    total, prefix, held = sum(sizes), [0], [0]
    for s, h in zip(sizes, holds):
        prefix.append(prefix[-1] + s)
        held.append(held[-1] + h)
    starts = [0]
    for k in range(1, stages):
        lo, hi = starts[-1] + 1, len(sizes) - (stages - k)  # room for the stages after this one
        ok = [i for i in range(lo, hi + 1) if held[i] > held[starts[-1]] and held[-1] - held[i] >= stages - k]
        starts.append(min(ok or range(lo, hi + 1), key=lambda i: abs(prefix[i] - total * k / stages)))
    return starts


def stage_module(model: nn.Module, starts: list[int], index: int) -> nn.Sequential:
    """Stage ``index``'s pieces as one module (the model's own parameters, not copies)."""
    parts = pieces(model)
    end = starts[index + 1] if index + 1 < len(starts) else len(parts)
    mine = [m for _, m in parts[starts[index]:end]]
    if index and getattr(mine[0], "inplace", False):  # ReLU(inplace=True) would write into the received activation
        mine.insert(0, _Copy())
    if index + 1 < len(starts):  # sent to the next stage: gloo and NCCL send dense tensors only (a view, a permute)
        mine.append(_Dense())
    return nn.Sequential(*mine)


class _Dense(nn.Module):
    """A stage's output made contiguous before it is sent."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()


def release_others(model: nn.Module, stage: nn.Module) -> None:
    """Free what ``model`` holds outside ``stage``: the other stages' parameters and buffers move to the meta device,
    which keeps shapes and no memory. The model keeps its names, shapes and parameter count for the run's log and
    the checkpoint's checks; its state is gathered from the stages (``gather_state``)."""
    keep = {id(t) for t in (*stage.parameters(), *stage.buffers())}  # tensor by tensor: a piece may be made anew
    for module in model.modules():                                    # at each call (a ViT's head of norm and fc)
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in keep:
                setattr(module, name, nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if id(b) not in keep:
                setattr(module, name, b.to("meta"))


@dataclass(frozen=True)
class Io:
    """What stage ``index`` receives and sends for one sample: shapes (the batch dimension left out) and dtypes, as
    its forward under the run's autocast makes them (``io``)."""
    received: tuple[tuple[int, ...], torch.dtype]
    sent: tuple[tuple[int, ...], torch.dtype]

    def batch(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeros of ``n`` samples, as ``PipelineStage`` takes them for ``input_args`` and ``output_args``."""
        (r_shape, r_dtype), (s_shape, s_dtype) = self.received, self.sent
        return (torch.zeros((n, *r_shape), dtype=r_dtype, device=device),
                torch.zeros((n, *s_shape), dtype=s_dtype, device=device))


def io(model: nn.Module, starts: list[int], index: int, x: torch.Tensor) -> Io:
    """Stage ``index``'s ``Io``, from the probe batch ``x`` through the model's own pieces (``examples``): made once,
    while the rank still holds the pieces before its stage, under the caller's autocast."""
    received, sent = examples(model, starts, index, x)
    return Io((tuple(received.shape[1:]), received.dtype), (tuple(sent.shape[1:]), sent.dtype))


def examples(model: nn.Module, starts: list[int], index: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the input stage ``index`` receives, its output) for the microbatch ``x``: the shapes and dtypes torch's
    ``PipelineStage`` takes as ``input_args`` / ``output_args``, so that it infers none itself. (Its inference runs
    a stage's forward in training mode on an uninitialised input, which batch norm would count in its running
    statistics: ``_forward_metadata_inference`` in torch/distributed/pipelining/stage.py.) Computed here through
    the model's own pieces without a gradient and in evaluation mode (no statistic or random draw changes), each
    module's mode restored after."""
    parts = pieces(model)
    end = starts[index + 1] if index + 1 < len(starts) else len(parts)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            h = x
            for _, piece in parts[:starts[index]]:
                h = piece(h)
            received = h
            for _, piece in parts[starts[index]:end]:
                h = piece(h)
    finally:
        for m, mode in modes:
            m.training = mode
    return received.contiguous(), h.contiguous()  # as sent (``_Dense``)


class _Copy(nn.Module):
    """A later stage's input copied before an in-place first piece: the activation a stage receives is a leaf that
    requires grad, which autograd does not let an in-place operation write to."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


def own_names(model: nn.Module, stage: nn.Module) -> dict[str, str]:
    """The stage's state-dict names to the model's own (the same tensors)."""
    names = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    return {k: names[id(t)] for k, t in stage.state_dict(keep_vars=True).items()}


def gather_state(stage: nn.Module, names: dict[str, str], order: list[str], optimizer, groups: Groups,
                 group) -> tuple[dict, dict]:
    """(the whole model's state under its own names, in ``order``; the optimiser's state as one process holds it):
    gathered from every stage of ``group`` (one pipeline), a collective. ``names``: the stage's state names to the
    model's.

    One process's ``optimizer.state_dict()`` numbers the parameters through its groups in order; the stages'
    states are keyed by name here and numbered that way, so a run of any layout (one process, FSDP, other
    stages) reads the optimiser state of this one, and this one reads theirs (``stage_optimizer_state``)."""
    mine = {names[k]: full(v).detach().cpu() for k, v in stage.state_dict().items()}  # FSDP's shards gathered
    sd = optimizer.state_dict()
    states, hyper = {}, {}
    for g, whole, held in zip(sd["param_groups"], groups.kept, groups.held):
        hyper[whole] = {k: v for k, v in g.items() if k != "params"}
        states.update({name: {k: full(v).detach().cpu() if isinstance(v, torch.Tensor) else v
                              for k, v in sd["state"][i].items()}
                       for i, name in zip(g["params"], held) if i in sd["state"]})  # on the host: pickled to the others
    parts: list = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(parts, (mine, states, hyper), group=group)
    whole_state = {k: v for m, _, _ in parts for k, v in m.items()}
    by_name = {k: v for _, s, _ in parts for k, v in s.items()}
    settings = {g: h for _, _, hs in parts for g, h in hs.items()}
    return ({k: whole_state[k] for k in order if k in whole_state},
            _numbered(by_name, groups.layout, range(len(groups.layout)), groups.layout, settings))


def _numbered(by_name: dict, layout: list[list[str]], kept, held: list[list[str]], settings: dict) -> dict:
    """An optimiser ``state_dict`` of the groups ``kept`` (indices in ``layout``), holding ``held``'s names."""
    state, out, i = {}, [], 0
    for whole, names in zip(kept, held):
        ids = []
        for name in names:
            if name in by_name:
                state[i] = by_name[name]
            ids.append(i)
            i += 1
        out.append({**settings[whole], "params": ids, **({"names": names} if "names" in settings[whole] else {})})
    return {"state": state, "param_groups": out}


def stage_optimizer_state(saved: dict, groups: Groups) -> dict:
    """The part of one process's optimiser state ``saved`` that a stage's optimiser holds. ``ValueError`` for the
    state of other groups (the trainer says it in one sentence)."""
    saved_groups = saved.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups.layout):
        raise ValueError(f"{len(saved_groups) if isinstance(saved_groups, list) else 'no'} parameter groups where "
                         f"the model has {len(groups.layout)}")
    by_name = {}
    for g, names in zip(saved_groups, groups.layout):
        ids = g.get("params") if isinstance(g, dict) else None
        if not isinstance(ids, list) or len(ids) != len(names):
            raise ValueError(f"a parameter group of {len(ids) if isinstance(ids, list) else 'no'} parameters where "
                             f"the model's has {len(names)}")
        by_name.update({name: saved["state"][i] for i, name in zip(ids, names) if i in saved["state"]})
    settings = {w: {k: v for k, v in g.items() if k != "params"} for w, g in enumerate(saved_groups)}
    return _numbered(by_name, groups.layout, groups.kept, groups.held, settings)


@dataclass(frozen=True)
class Groups:
    """A stage's optimiser groups against the whole model's: ``layout`` names the parameters of each of the whole
    model's groups (as one process makes them), ``kept`` is the index in ``layout`` of each group the stage's
    optimiser has, ``held`` the names of that group's parameters the stage holds."""
    layout: list[list[str]]
    kept: list[int]
    held: list[list[str]]


def held_groups(groups: list[dict], stage: nn.Module, names: dict[str, str]) -> tuple[list[dict], Groups]:
    """The whole model's optimiser ``groups`` (each with ``names``) cut to the parameters ``stage`` holds, found by
    name (``names``: the stage's to the model's) and taken from the stage: FSDP replaces a stage's parameters with
    its own, which a piece made anew for the stage (a ViT's tokens) holds while the model keeps the old ones.
    Groups left empty are dropped."""
    own = {names[k]: p for k, p in stage.named_parameters()}
    cut, kept = [], []
    for i, g in enumerate(groups):
        mine = [(n, own[n]) for n in g["names"] if n in own]
        if mine:
            cut.append({**g, "names": [n for n, _ in mine], "params": [p for _, p in mine]})
            kept.append(i)
    return cut, Groups([list(g["names"]) for g in groups], kept, [g["names"] for g in cut])


def broadcast_from_last(t: torch.Tensor | None, n: int, device: torch.device, group=None) -> torch.Tensor:
    """The last stage's ``t`` (n x ..., float32) on every rank of ``group`` (one pipeline): its shape, then its values."""
    last = tdist.get_global_rank(group, tdist.get_world_size(group) - 1) if group is not None else tdist.get_world_size() - 1
    shape = torch.zeros(8, dtype=torch.int64, device=device)
    if t is not None:
        shape[0] = t.dim()
        shape[1:1 + t.dim()] = torch.tensor(t.shape)
    tdist.broadcast(shape, last, group=group)
    out = t.detach().float().contiguous() if t is not None else torch.empty(
        tuple(shape[1:1 + int(shape[0])].tolist()), device=device)
    tdist.broadcast(out, last, group=group)
    return out


class StageClock:
    """How long this rank's stage computes in each step against the step's wall time: what is left is waiting
    for the other stages (the pipeline's fill and drain, the bubble, and the sends). ``timed`` wraps the stage's
    ``forward_one_chunk`` and ``backward_one_chunk``, the two calls torch's schedules make for a microbatch's
    compute (``torch/distributed/pipelining/schedules.py``, ``ScheduleGPipe._step_microbatches`` and
    ``Schedule1F1B._step_microbatches``); the first ``warmup`` steps (buffers made) are not counted. Host time:
    on a GPU the calls return once their kernels are queued, so the compute is undercounted there."""

    def __init__(self, warmup: int = 2):
        self.warmup, self.steps, self.busy, self.wall = warmup, 0, 0.0, 0.0
        self._busy_now = 0.0

    def timed(self, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._busy_now += time.perf_counter() - start
        return run

    def step(self, wall: float) -> None:
        if self.warmup:
            self.warmup -= 1
        else:
            self.steps, self.busy, self.wall = self.steps + 1, self.busy + self._busy_now, self.wall + wall
        self._busy_now = 0.0

    def row(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "busy_ms": round(1e3 * self.busy / n, 3), "step_ms": round(1e3 * self.wall / n, 3),
                "idle": round(1 - self.busy / self.wall, 4) if self.wall else None}
