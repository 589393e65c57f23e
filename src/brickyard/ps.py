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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as tdist

from brickyard.errors import ConfigError
from brickyard.flat import flat_grads, flatten as _flat, load_flat

_HEADER, _GRAD, _PARAM = 11, 12, 13


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


class Client:
    """The trainer side: ``step(lr, step)`` replaces ``optimizer.step()``."""

    def __init__(self, params: list[torch.Tensor], layout: Layout, sync: bool):
        self.params, self.layout, self.sync = params, layout, sync
        self.bounds = _bounds(sum(p.numel() for p in params), layout.servers)

    def step(self, lr: float, step: int) -> None:
        grad = flat_grads(self.params)
        flat = _flat([p.detach() for p in self.params])
        if self.sync:
            for i, (a, b) in enumerate(self.bounds):
                part = grad[a:b].contiguous()
                tdist.reduce(part, dst=self.layout.server_rank(i))
            for i, (a, b) in enumerate(self.bounds):
                part = flat[a:b].contiguous()
                tdist.broadcast(part, src=self.layout.server_rank(i))
                flat[a:b] = part
        else:
            header = torch.tensor([0.0, float(step), lr], dtype=torch.float64)
            for i, (a, b) in enumerate(self.bounds):
                tdist.send(header, self.layout.server_rank(i), tag=_HEADER)
                tdist.send(grad[a:b].contiguous(), self.layout.server_rank(i), tag=_GRAD)
            for i, (a, b) in enumerate(self.bounds):
                part = torch.empty(b - a, dtype=flat.dtype)
                tdist.recv(part, self.layout.server_rank(i), tag=_PARAM)
                flat[a:b] = part
        load_flat(self.params, flat)

    def finish(self) -> None:
        """Tell async servers this trainer is done, then pull the final parameters."""
        if not self.sync:
            done = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
            for i in range(self.layout.servers):
                tdist.send(done, self.layout.server_rank(i), tag=_HEADER)
        flat = _flat([p.detach() for p in self.params])
        for i, (a, b) in enumerate(self.bounds):
            part = flat[a:b].contiguous()
            tdist.broadcast(part, src=self.layout.server_rank(i))
            flat[a:b] = part
        load_flat(self.params, flat)


def serve(params: list[torch.Tensor], layout: Layout, rank: int, cfg, total_steps: int, schedule, log) -> dict:
    """The server side: hold chunk ``rank - T``, apply pushes until the trainers are done."""
    from brickyard.optim import build_optimizer, set_lr
    index = rank - layout.trainers
    bounds = _bounds(sum(p.numel() for p in params), layout.servers)
    a, b = bounds[index]
    chunk = _flat([p.detach() for p in params])[a:b].clone().requires_grad_(True)
    optimizer = build_optimizer(cfg.optim, [chunk])
    log.info(f"parameter server {index}: holds {b - a:,} of {bounds[-1][1]:,} parameters "
             f"({'sync' if cfg.dist.ps.sync else 'async, max staleness ' + str(cfg.dist.ps.max_staleness)})")
    stats = _serve_sync(chunk, optimizer, bounds, index, layout, total_steps, schedule, set_lr) if cfg.dist.ps.sync \
        else _serve_async(chunk, optimizer, layout, cfg.dist.ps.max_staleness, set_lr)
    for i, (lo, hi) in enumerate(bounds):  # the final pull
        part = chunk.detach().clone() if i == index else torch.empty(hi - lo)
        tdist.broadcast(part, src=layout.server_rank(i))
    log.info(f"parameter server {index}: {stats['updates']} updates, largest clock gap {stats['max_gap']} "
             f"(bound {cfg.dist.ps.max_staleness if not cfg.dist.ps.sync else 0})")
    return stats


def _serve_sync(chunk, optimizer, bounds, index, layout, total_steps, schedule, set_lr) -> dict:
    for step in range(total_steps):
        for i, (lo, hi) in enumerate(bounds):
            buf = torch.zeros(hi - lo)
            tdist.reduce(buf, dst=layout.server_rank(i))
            if i == index:
                chunk.grad = buf / layout.trainers
        set_lr(optimizer, schedule(step))
        optimizer.step()
        for i, (lo, hi) in enumerate(bounds):
            part = chunk.detach().clone() if i == index else torch.empty(hi - lo)
            tdist.broadcast(part, src=layout.server_rank(i))
    return {"updates": total_steps, "max_gap": 0}


def _serve_async(chunk, optimizer, layout, max_staleness, set_lr) -> dict:
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
        tdist.send(chunk.detach().clone(), t, tag=_PARAM)

    def release() -> None:
        for t in sorted(held, key=lambda t: clock[t]):
            if clock[t] - slowest() <= max_staleness:
                lr, grad = held.pop(t)
                apply(t, lr, grad)

    while len(done) < layout.trainers:
        header = torch.empty(3, dtype=torch.float64)
        src = tdist.recv(header, tag=_HEADER)
        if header[0].item() == 1.0:
            done.add(src)
            release()
            continue
        grad = torch.empty_like(chunk)
        tdist.recv(grad, src, tag=_GRAD)
        lr = header[2].item()
        if clock[src] - slowest() <= max_staleness:
            apply(src, lr, grad)
            release()
        else:
            held[src] = (lr, grad)
    return {"updates": updates, "max_gap": max_gap}
