"""Data parallel with all-reduce (``dist.mode: collective``): every rank holds the whole model and the
gradients are averaged across ranks after each backward pass."""
from __future__ import annotations

import torch
from torch import nn

from brickyard.distributed import gradsync
from brickyard.errors import BrickyardError
from brickyard.training.ways.base import Way


class Collective(Way):
    name = "ddp"

    def grad_sync(self, model, device, group, own_cores):
        if self.info.world_size == 1:
            return model, gradsync.GradSync()
        return grad_sync(self.cfg.dist, model, device, group, own_cores)


def grad_sync(d, model: nn.Module, device: torch.device, group=None, own_cores: bool = True):
    """(the model to call, its ``gradsync.GradSync``) for ``dist.grad_sync`` (``d`` is the config's ``dist``).
    ``auto`` takes flat on CPUs (measured faster there: no idle core to overlap with; a user's step is
    synced by brickyard after its backward too) and DDP on GPUs, with SyncBatchNorm, and for parameters
    of several dtypes. Why a rule and not a measurement: timing both would take collective steps on every
    rank before training (DDP's buckets settle after a few), and the ordering held on every machine
    measured (``benchmarks/cpu_scaling.py``, ``brickyard bench --devices cpu:2`` reports each part)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    fits = bool(trainable) and len({(p.dtype, p.device) for p in trainable}) == 1
    if d.grad_sync == "flat" and not fits:  # sync_bn is refused with the config
        raise BrickyardError("dist.grad_sync: flat needs trainable parameters of one dtype on one device; use dist.grad_sync: ddp.")
    how = d.grad_sync
    if how == "auto":
        how = "flat" if device.type == "cpu" and fits and not d.sync_bn else "ddp"
    if how == "flat":
        return model, gradsync.FlatGrads(model, group, spin=own_cores)
    ddp = nn.parallel.DistributedDataParallel(model, **({"device_ids": [device.index]} if device.type == "cuda" else {}))
    return ddp, gradsync.GradSync(ddp)
