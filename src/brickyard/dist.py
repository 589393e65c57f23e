"""This process's place in a (possibly 1-process) job, read from the launcher's environment.

Contract: torchrun sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; under Slurm's ``srun`` the ``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS`` and ``SLURM_NTASKS_PER_NODE`` variables are used instead
(``MASTER_ADDR``/``MASTER_PORT`` must then be exported by the batch script). With none of
these, the process is rank 0 of 1 and takes the same code path without a process group.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def from_env(env=None) -> DistInfo:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                        int(env.get("LOCAL_WORLD_SIZE", 1)), int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "MASTER_ADDR" in env:
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS"]).split("(")[0])
        return DistInfo(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env["SLURM_NTASKS"]), per_node)
    return DistInfo()


def init(info: DistInfo, backend: str, device: torch.device, timeout_s: int) -> None:
    """Join the process group (a no-op for one process)."""
    if not info.distributed or tdist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda" and backend == "nccl":
        kwargs["device_id"] = device
    tdist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                             timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all ranks in place (no-op without a process group)."""
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.all_reduce(t)
    return t


def barrier() -> None:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()


def broadcast_object(obj, src: int = 0):
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src)
    return box[0]
