"""Tensor parallel (``dist.tensor_parallel: N``): each layer's work split across the N processes of the job
(``distributed.tensor_parallel`` says which layers and how, on torch's ``parallelize_module``).

Every rank reads the same whole batch (one reader), so the learning rate, schedule, data order and augmentation
are those of one process, and every rank computes the same logits: each counts loss and accuracy in a group of
its own (as a data-parallel process of one would). What stays whole on every rank (embeddings, norms, attention
whose heads N does not divide) gets the same gradient everywhere from the same inputs, and the split layers'
collectives sit inside their forward and backward passes, so no gradient sync follows the backward pass.
Gradient clipping takes the norm over the shards and the whole tensors together (``clip_grad_norm_``). Saving
gathers the shards and evaluating runs the split forward pass: both are collectives every rank takes part in;
every rank takes part in the stop vote.

Checkpoints hold the model's own tensors whole under its own names (the base ``Way``'s ``full_state`` and
``load_state``, through ``distributed.fsdp``), so a run saved on N processes resumes on one, and the reverse.

Not built yet: replicas (a job of several tensor-parallel groups), FSDP or pipeline stages around the groups,
fp16's loss scaler (its check for infinite gradients would run on each rank's shards alone).
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

from brickyard.distributed import tensor_parallel as tp
from brickyard.errors import ConfigError
from brickyard.training.ways.base import Way

_FP16 = ("train.precision: fp16 needs the loss scaler, whose check for infinite gradients would see each rank's "
         "shards alone and could let the ranks disagree on a step; use bf16 or fp32 with dist.tensor_parallel.")


class TensorParallelWay(Way):
    name = "tensor_parallel"
    sharded = True  # evaluating runs the split forward pass and saving gathers the shards: every rank takes part

    def __init__(self, cfg, info, groups=None):
        super().__init__(cfg, info, groups)
        self.n = cfg.dist.tensor_parallel
        self.own, _ = groups or (None, None)  # this rank alone: where its metrics are counted
        self.group = None  # the mesh's process group, once split

    @property
    def readers(self) -> int:
        return 1  # every rank reads the whole batch

    @property
    def reader_index(self) -> int:
        return 0

    def check(self, model, resume):
        world = self.info.world_size
        if world != self.n:
            raise ConfigError(f"dist.tensor_parallel: {self.n} splits each layer across {self.n} processes and this job "
                              f"has {world}; run it on {self.n} (replicas of the group are not built yet).")
        if not tp.plan(model, self.n):
            raise ConfigError(f"dist.tensor_parallel: {type(model).__name__} has no layer tensor parallel can split (an "
                              f"nn.Linear); train it with dist.tensor_parallel: 1.")
        if self.cfg.train.precision == "fp16":
            raise ConfigError(_FP16)

    def groups(self):
        """(this rank alone, over which its metrics are summed; none of the way's own). Every rank makes every group,
        in the same order (``new_group`` is collective)."""
        if not self.info.distributed:
            return None, None
        alone = [tdist.new_group([r]) for r in range(self.info.world_size)]
        return alone[self.info.rank], None

    def vote_group(self, readers_group):
        return None  # every rank: the split layers need all of them at every step

    def shard(self, model, host, log, sample=()):
        """Split ``model``'s layers across the ranks, in place, before the optimiser sees its parameters."""
        if host.precision == "fp16":  # train.precision: auto chose it
            raise ConfigError(_FP16)
        # lazy: torch.distributed.device_mesh loads DTensor's operator tables (distributed.fsdp: _loaded)
        from torch.distributed.device_mesh import init_device_mesh
        plan = tp.plan(model, self.n)
        mesh = init_device_mesh(host.device.type, (self.n,))
        tp.apply(model, plan, mesh)
        self.group = mesh.get_group()
        same_random_state(host.device)  # dropout outside the split layers must draw alike on every rank
        held, total = tp.held(model)
        log.info(f"tensor parallel: rank {self.info.rank} of {self.n} holds {held:,} of {total:,} parameters "
                 f"({plan.describe(self.n)})")

    def clip(self, optimizer, max_norm):
        tp.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_norm, self.group)

    def capture_refusal(self):
        return "dist.tensor_parallel runs collectives inside each layer's forward and backward pass, which are not captured"

    def summary_name(self, world):
        return "tensor_parallel"


def same_random_state(device) -> None:
    """Rank 0's random state on every rank (rank 0 alone may have drawn numbers before: ``precision: auto`` measures
    on it), so that what every rank computes whole, dropout included, stays the same on each."""
    box = [(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)]
    tdist.broadcast_object_list(box, src=0)
    torch.set_rng_state(box[0][0])
    if box[0][1] is not None:
        torch.cuda.set_rng_state(box[0][1], device)
