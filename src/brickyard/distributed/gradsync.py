"""How the ranks' gradients meet: DDP, or one flat all-reduce after the backward pass (``dist.grad_sync``).

``assemble.grad_sync`` picks one; the training step and ``bench`` use it through ``GradSync``'s three
calls, so a new way (compression, a hierarchy of groups) is one more class here.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as tdist

from brickyard.distributed.flat import flatten, load_flat


class GradSync:
    """How the ranks' gradients meet, on one interface for the step: ``skip()`` around a micro-batch whose
    gradients only accumulate, a call after the last backward, ``zero_grad(optimizer)`` after the update.

    This base is for one process, a parameter server (which syncs in its update) and DDP, which
    all-reduces inside the backward pass; it only passes ``no_sync`` on to DDP.
    """
    name = "none"

    def __init__(self, ddp=None):
        self.ddp = ddp
        if ddp is not None:
            self.name = "ddp"

    def skip(self):
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    def __call__(self) -> None:
        pass

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)


class FlatGrads(GradSync):
    """One all-reduce of one flat buffer after the backward pass, without DDP (``dist.grad_sync: flat``).

    Each trainable parameter's ``.grad`` is a view into the buffer with the parameter's own strides (as
    DDP's ``gradient_as_bucket_view``), so backward accumulates into it and nothing is copied;
    ``zero_grad`` zeroes the buffer and keeps the views. Like DDP it divides by the world size before
    the sum, makes the ranks' weights and buffers equal to rank 0's at the start, and gives rank 0's
    floating buffers (batch-norm statistics) to every rank after each step. For small models on CPUs,
    where a step has no idle core to overlap communication with, it saves DDP's autograd hooks and
    bucket copies; on GPUs DDP's overlap wins and ``auto`` keeps it. On CPUs it waits for the all-reduce
    awake (``spin_wait``).
    """
    name = "flat"
    SPIN_S = 0.02  # longest wait spent awake; longer ones (rank 0 writing a checkpoint) sleep

    def __init__(self, model, group=None, spin: bool = True):
        super().__init__()
        self.spin_s = self.SPIN_S if spin else 0.0  # awake only on cores of its own: a spinning process slows those it shares with
        self.group, self.world = group, tdist.get_world_size(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        broadcast_flat(list(model.parameters()) + self.buffers, group)
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=self.params[0].dtype, device=self.params[0].device)
        self.views, offset = [], 0
        for p in self.params:  # a parameter's own strides where it is dense (channels_last), else contiguous ones
            part = self.flat[offset:offset + p.numel()]
            dense = p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last))
            self.views.append(part.as_strided(p.shape, p.stride()) if dense else part.view(p.shape))
            offset += p.numel()
        self._attach()

    def _attach(self) -> None:
        for p, v in zip(self.params, self.views):
            if p.grad is not v:  # set to None or replaced (a user's step): bring it back into the buffer
                if p.grad is None:
                    v.zero_()
                else:
                    v.copy_(p.grad)
                p.grad = v

    def __call__(self) -> None:
        self._attach()
        self.flat.mul_(1.0 / self.world)  # as DDP: times 1/world before the sum
        if self.flat.device.type == "cpu":
            spin_wait(tdist.all_reduce(self.flat, group=self.group, async_op=True), self.spin_s)
        else:  # on a GPU the all-reduce is queued on the stream: waiting here would be a host sync
            tdist.all_reduce(self.flat, group=self.group)
        if self.buffers:
            broadcast_flat(self.buffers, self.group)

    def zero_grad(self, optimizer) -> None:
        self.flat.zero_()
        self._attach()


def spin_wait(work, limit_s: float) -> None:
    """Wait for a collective awake, yielding the core to any thread that can run, for at most ``limit_s``
    seconds, then asleep (``work.wait()``, which also raises its error).

    A process that sleeps in the all-reduce gives its core up; on a virtual machine the idle core is
    taken back by the host, and waking it again cost 1-1.5 ms of a 12 ms step here (2-core VM, paired
    blocks of ``benchmarks/cpu_scaling.py``). One process with 2 threads never pays this: OpenMP's
    threads spin between parallel regions."""
    end = time.perf_counter() + limit_s
    while not work.is_completed() and time.perf_counter() < end:
        _yield()
    work.wait()


def _yield() -> None:
    if hasattr(os, "sched_yield"):
        os.sched_yield()
    else:  # not on every platform
        time.sleep(0)


def broadcast_flat(tensors, group=None) -> None:
    """Rank 0's values of ``tensors`` to every rank, one broadcast per dtype."""
    src = tdist.get_global_rank(group, 0) if group is not None else 0
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        buffer = flatten(same)
        tdist.broadcast(buffer, src, group=group)
        load_flat(same, buffer)
