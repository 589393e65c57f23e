"""This process's place in a (possibly 1-process) job, read from the launcher's environment; no torch.

Contract: torchrun sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; under Slurm's ``srun`` the same comes from Slurm's variables
(``brickyard.distributed.slurm``). With none of these, the process is rank 0 of 1 and takes the same
code path without a process group.

Kept free of torch: the CLI reads it before a command runs, so `brickyard --help` and argument
errors come back without importing torch (about 1 s).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from brickyard.distributed.slurm import from_slurm


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0
    master: tuple[str, int] | None = None  # derived under Slurm when MASTER_ADDR is not set
    launcher: str = ""                     # "slurm" for tasks srun started; their rendezvous is brickyard's own store

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
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return from_slurm(env, DistInfo)
    return DistInfo()


def rank_from_env(env=None) -> int:
    """This process's global rank, read without checking the rest (for error messages: only rank 0 prints)."""
    env = os.environ if env is None else env
    value = env.get("RANK") or (env.get("SLURM_PROCID") if int(env.get("SLURM_NTASKS", "1") or 1) > 1 else None)
    return int(value) if value and value.isdigit() else 0


def prints_errors(env=None) -> bool:
    """Whether this process says a failure on its console: global rank 0, and in a torchrun job across
    machines also each node's local rank 0 (that node's console shows no other)."""
    env = os.environ if env is None else env
    if rank_from_env(env) == 0:
        return True
    return env.get("LOCAL_RANK") == "0" and int(env.get("GROUP_WORLD_SIZE", "1") or 1) > 1
