"""Parameter-server mode (``dist.mode: ps``), built on ``torch.distributed`` collectives and
point-to-point messages of the default process group; no protocol of our own beyond the order of
the messages described here.

Layout: of the W processes, the last ``dist.ps.servers`` (S) are servers, ranks 0..T-1 trainers
(T = W - S), so rank 0 is a trainer and writes the run's files. The parameters are flattened into
one vector and split into S contiguous chunks; server i holds chunk i and the optimiser for it
(every supported optimiser is element-wise, so a flat chunk behaves exactly like the parameters).

- sync (``dist.ps.sync: true``): each step every trainer *pushes* its gradient: one
  ``reduce(chunk_i, dst=server_i)`` per chunk (servers add zeros); server i divides the sum by T,
  takes an optimiser step, and every chunk is ``broadcast`` back (the *pull*). This is the same
  mean gradient and the same update as collective mode.
- async (``sync: false``): a trainer sends each server a header ``[kind, step, lr]`` and its gradient
  chunk (``send``), then waits for the fresh chunk (``recv``). A server answers pushes in the order
  they come (``recv`` from any source), applying each gradient at once, except that a trainer more
  than ``dist.ps.max_staleness`` updates ahead of the slowest unfinished trainer is held back until
  the others catch up (stale-synchronous parallel). A ``kind = 1`` header says the trainer is done.

At the end all ranks take part in one ``broadcast`` of every chunk, so the trainers evaluate and
save the servers' final parameters.

All of it goes over a gloo group of every rank (``message_group``), on CPU tensors: NCCL can neither
receive from any source nor carry CPU tensors, and a parameter server is a CPU job. On GPUs the
trainers copy the flat gradient to the host and the fresh parameters back (one copy each per step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist

from brickyard.distributed.flat import flat_grads, load_flat
from brickyard.distributed.flat import flatten as _flat
from brickyard.errors import ConfigError
from brickyard.optim import build_optimizer, set_lr
from brickyard.optim.updates import Update

_HEADER, _GRAD, _PARAM = 11, 12, 13

# the servers' optimiser state is not in the checkpoints, so a parameter-server run cannot continue from one
NO_RESUME = "--resume and --max-restarts need dist.mode: collective; a parameter-server run cannot resume yet."


@dataclass(frozen=True)
class Layout:
    world: int
    servers: int

    @property
    def trainers(self) -> int:
        return self.world - self.servers

    def server_rank(self, i: int) -> int:
        return self.trainers + i

    def is_server(self, rank: int) -> bool:
        return rank >= self.trainers


def check_layout(cfg, world: int) -> Layout:
    s = cfg.dist.ps.servers
    if world - s < 1:
        raise ConfigError(f"dist.ps.servers: {s} server(s) leave no trainer among {world} processes; "
                          f"use --devices cpu:N with N > {s}.")
    return Layout(world, s)


def _bounds(total: int, parts: int) -> list[tuple[int, int]]:
    sizes = [len(c) for c in torch.arange(total).tensor_split(parts)]
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def message_group():
    """The gloo group of every rank that carries the parameter-server messages (all ranks call it)."""
    return tdist.new_group(backend="gloo")


class Client:
    """The trainer side: ``step(lr, step)`` replaces ``optimizer.step()``."""

    def __init__(self, params: list[torch.Tensor], layout: Layout, sync: bool, group=None):
        self.params, self.layout, self.sync, self.group = params, layout, sync, group
        self.bounds = _bounds(sum(p.numel() for p in params), layout.servers)

    def step(self, lr: float, step: int) -> None:
        grad = flat_grads(self.params).cpu()
        flat = torch.empty_like(grad)
        g = self.group
        if self.sync:
            for i, (a, b) in enumerate(self.bounds):
                tdist.reduce(grad[a:b], dst=self.layout.server_rank(i), group=g)
            for i, (a, b) in enumerate(self.bounds):
                tdist.broadcast(flat[a:b], src=self.layout.server_rank(i), group=g)
        else:
            header = torch.tensor([0.0, float(step), lr], dtype=torch.float64)
            for i, (a, b) in enumerate(self.bounds):
                tdist.send(header, self.layout.server_rank(i), group=g, tag=_HEADER)
                tdist.send(grad[a:b], self.layout.server_rank(i), group=g, tag=_GRAD)
            for i, (a, b) in enumerate(self.bounds):
                tdist.recv(flat[a:b], self.layout.server_rank(i), group=g, tag=_PARAM)
        load_flat(self.params, flat)

    def finish(self) -> None:
        """Tell async servers this trainer is done, then pull the final parameters."""
        if not self.sync:
            done = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
            for i in range(self.layout.servers):
                tdist.send(done, self.layout.server_rank(i), group=self.group, tag=_HEADER)
        flat = torch.empty(self.bounds[-1][1], dtype=self.params[0].dtype)
        for i, (a, b) in enumerate(self.bounds):
            tdist.broadcast(flat[a:b], src=self.layout.server_rank(i), group=self.group)
        load_flat(self.params, flat)


def serve(params: list[torch.Tensor], layout: Layout, rank: int, cfg, total_steps: int, schedule, log, group=None) -> dict:
    """The server side: hold chunk ``rank - T``, apply pushes until the trainers are done."""
    index = rank - layout.trainers
    bounds = _bounds(sum(p.numel() for p in params), layout.servers)
    a, b = bounds[index]
    chunk = _flat([p.detach() for p in params])[a:b].cpu().clone().requires_grad_(True)
    optimizer = build_optimizer(cfg.optim, [chunk])
    log.info(f"parameter server {index}: holds {b - a:,} of {bounds[-1][1]:,} parameters "
             f"({'sync' if cfg.dist.ps.sync else 'async, max staleness ' + str(cfg.dist.ps.max_staleness)})")
    stats = _serve_sync(chunk, optimizer, bounds, index, layout, total_steps, schedule, set_lr, group) if cfg.dist.ps.sync \
        else _serve_async(chunk, optimizer, layout, cfg.dist.ps.max_staleness, set_lr, group)
    for i, (lo, hi) in enumerate(bounds):  # the final pull
        part = chunk.detach().clone() if i == index else torch.empty(hi - lo)
        tdist.broadcast(part, src=layout.server_rank(i), group=group)
    log.info(f"parameter server {index}: {stats['updates']} updates, largest clock gap {stats['max_gap']} "
             f"(bound {cfg.dist.ps.max_staleness if not cfg.dist.ps.sync else 0})")
    return stats


def _serve_sync(chunk, optimizer, bounds, index, layout, total_steps, schedule, set_lr, group) -> dict:
    for step in range(total_steps):
        for i, (lo, hi) in enumerate(bounds):
            buf = torch.zeros(hi - lo)
            tdist.reduce(buf, dst=layout.server_rank(i), group=group)
            if i == index:
                chunk.grad = buf / layout.trainers
        set_lr(optimizer, schedule(step))
        optimizer.step()
        for i, (lo, hi) in enumerate(bounds):
            part = chunk.detach().clone() if i == index else torch.empty(hi - lo)
            tdist.broadcast(part, src=layout.server_rank(i), group=group)
    return {"updates": total_steps, "max_gap": 0}


def _serve_async(chunk, optimizer, layout, max_staleness, set_lr, group) -> dict:
    clock = {t: 0 for t in range(layout.trainers)}
    done: set[int] = set()
    held: dict[int, tuple[float, torch.Tensor]] = {}
    updates, max_gap = 0, 0

    def slowest() -> int:
        live = [c for t, c in clock.items() if t not in done]
        return min(live) if live else 0

    def apply(t: int, lr: float, grad: torch.Tensor) -> None:
        nonlocal updates, max_gap
        max_gap = max(max_gap, clock[t] - slowest())
        chunk.grad = grad
        set_lr(optimizer, lr)
        optimizer.step()
        clock[t] += 1
        updates += 1
        tdist.send(chunk.detach().clone(), t, group=group, tag=_PARAM)

    def release() -> None:
        for t in sorted(held, key=lambda t: clock[t]):
            if clock[t] - slowest() <= max_staleness:
                lr, grad = held.pop(t)
                apply(t, lr, grad)

    while len(done) < layout.trainers:
        header = torch.empty(3, dtype=torch.float64)
        src = tdist.recv(header, group=group, tag=_HEADER)
        if header[0].item() == 1.0:
            done.add(src)
            release()
            continue
        grad = torch.empty_like(chunk)
        tdist.recv(grad, src, group=group, tag=_GRAD)
        lr = header[2].item()
        if clock[src] - slowest() <= max_staleness:
            apply(src, lr, grad)
            release()
        else:
            held[src] = (lr, grad)
    return {"updates": updates, "max_gap": max_gap}


class ParameterServerUpdate(Update):
    """The step's update in parameter-server mode: push this trainer's gradient to the servers and pull
    the new parameters (``Client``)."""

    def __init__(self, client: Client):
        self.client = client

    def __call__(self, run, loss_sum, batch) -> None:
        self.client.step(run.lr, run.step)

    def finish(self) -> None:
        self.client.finish()
