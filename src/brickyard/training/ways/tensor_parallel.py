"""Tensor parallel (``dist.tensor_parallel: N``): each layer's work split across the N processes of a group
(``distributed.tensor_parallel`` says which layers and how, on torch's ``parallelize_module``).

Layout: a job of ``world`` processes is ``world / N`` groups (replicas) of N ranks, the tensor-parallel dimension
innermost as torchtitan orders its mesh (``torchtitan/distributed/parallel_dims.py``: pp, dp_replicate, dp_shard,
cp, tp): rank r is shard ``r % N`` of replica ``r // N``, so a group's ranks, which meet in every layer, sit side by
side on one machine. Every rank of a group reads the same batch, the replicas their shares of the recipe's global
batch (as data-parallel processes do), so the learning rate, schedule, data order and augmentation are those of
one process, and the ranks of a group compute the same logits: each counts loss and accuracy summed over the ranks
that hold the same shards in the other replicas (alone, with one replica). What stays whole on every rank
(embeddings, norms, attention whose heads N does not divide) gets the same gradient across a group from the same
inputs, and the split layers' collectives sit inside their forward and backward passes, so within a group no
gradient sync follows the backward pass; across replicas the gradients' local parts are averaged over the ranks
that hold the same shards (``distributed.tensor_parallel.ReplicaGrads``). Gradient clipping takes the norm over
the shards and the whole tensors together (``clip_grad_norm_``). Saving gathers the shards and evaluating runs the
split forward pass: both are collectives every rank takes part in; every rank takes part in the stop vote.

Checkpoints hold the model's own tensors whole under its own names (the base ``Way``'s ``full_state`` and
``load_state``, through ``distributed.fsdp``), so a run saved on N processes resumes on one, on other replicas, or
in a pipeline's stages, and the reverse. Inside pipeline stages, ``training.ways.pipeline`` splits each stage.

Not built yet: FSDP around the groups, fp16's loss scaler (its check for infinite gradients would run on each
rank's shards alone).
"""
from __future__ import annotations

import torch
import torch.distributed as tdist

from brickyard.distributed import fsdp
from brickyard.distributed import tensor_parallel as tp
from brickyard.distributed.gradsync import GradSync
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
        self.replicas = max(1, info.world_size // self.n)
        self.replica, self.index = divmod(info.rank, self.n)
        self.peers, self.group = groups or (None, None)  # the same shards in every replica (metrics), this rank's group

    @property
    def readers(self) -> int:
        return self.replicas  # every rank of a group reads its replica's share

    @property
    def reader_index(self) -> int:
        return self.replica

    def check(self, model, resume):
        self.check_layout()
        tp.require_plan(model, self.n)

    def check_layout(self):
        world = self.info.world_size
        if world % self.n:
            raise ConfigError(f"dist.tensor_parallel: {self.n} does not divide the job's {world} processes; a job runs "
                              f"whole groups (processes = {self.n} x replicas).")
        if self.cfg.train.precision == "fp16":
            raise ConfigError(_FP16)

    def groups(self):
        """(the ranks that hold this rank's shards in every replica, over which metrics are summed and gradients
        averaged; this rank's tensor-parallel group). Every rank makes every group, in the same order (``new_group``
        is collective)."""
        if not self.info.distributed:
            return None, None
        n, r = self.n, self.replicas
        peers = [tdist.new_group([k * n + t for k in range(r)]) for t in range(n)]
        tp_groups = [tdist.new_group([k * n + t for t in range(n)]) for k in range(r)]
        return peers[self.index], tp_groups[self.replica]

    def vote_group(self, readers_group):
        return None  # every rank: the split layers need all of them at every step

    def shard(self, model, host, log, sample=()):
        """Split ``model``'s layers across the ranks, in place, before the optimiser sees its parameters."""
        if host.precision == "fp16":  # train.precision: auto chose it
            raise ConfigError(_FP16)
        plan = tp.plan(model, self.n)
        tp.apply(model, plan, fsdp.group_mesh(self.group, host.device))
        same_random_state(host.device)  # dropout outside the split layers must draw alike on every rank
        held, total = tp.held(model)
        place = f", replica {self.replica} of {self.replicas}" if self.replicas > 1 else ""
        log.info(f"tensor parallel: rank {self.index} of {self.n}{place} holds {held:,} of {total:,} parameters "
                 f"({plan.describe(self.n)})")

    def grad_sync(self, model, device, group, own_cores):
        return model, tp.ReplicaGrads(model, self.peers, spin=own_cores) if self.replicas > 1 else GradSync()

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
