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

from brickyard.errors import JobEnvironmentError

# Set by the console entry point (``cli.main.run``): this process is brickyard's own command, which may end itself
# when its node is cut off from the job (``Heartbeat``'s ``on_lost``); never in a user's Python process.
OWN_PROCESS = False


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


def env_int(env, name: str, default: int, low: int = 0, high: int = 1 << 31) -> int:
    """``env[name]`` as a whole number from ``low`` to ``high`` (``default`` when unset): a launcher's
    variable set by hand or by a broken job script is one sentence, not a ``ValueError``."""
    value = env.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not low <= number <= high:
        span = f"from {low} to {high}" if high < 1 << 31 else f"of at least {low}"
        raise JobEnvironmentError(f"environment: {name}={value!r} is not a whole number {span}; the launcher "
                                  f"(torchrun, srun) sets it, so check the job script, or unset it to run one process.")
    return number


def from_env(env=None) -> DistInfo:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = env_int(env, "WORLD_SIZE", 1, low=1)
        info = DistInfo(env_int(env, "RANK", 0, high=world - 1), env_int(env, "LOCAL_RANK", 0, high=world - 1), world,
                        env_int(env, "LOCAL_WORLD_SIZE", 1, low=1, high=world),
                        env_int(env, "TORCHELASTIC_RESTART_COUNT", 0))
        if info.local_rank >= info.local_world_size:
            raise JobEnvironmentError(f"environment: LOCAL_RANK={info.local_rank} is not below LOCAL_WORLD_SIZE="
                                      f"{info.local_world_size}; check the job script, or unset both to run one process.")
        if world > 1 and env.get("MASTER_PORT"):
            env_int(env, "MASTER_PORT", 0, low=1, high=65535)
        return info
    if env_int(env, "SLURM_NTASKS", 1, low=1) > 1 and "SLURM_PROCID" in env:
        from brickyard.distributed.slurm import from_slurm  # slurm.py reads its numbers with env_int, from here
        return from_slurm(env, DistInfo)
    return DistInfo()


def _lenient(value) -> int:
    return int(value) if value and value.isdecimal() else 0


def rank_from_env(env=None) -> int:
    """This process's global rank, read without checking the rest (for error messages: only rank 0 prints)."""
    env = os.environ if env is None else env
    value = env.get("RANK") or (env.get("SLURM_PROCID") if _lenient(env.get("SLURM_NTASKS")) > 1 else None)
    return _lenient(value)


def prints_errors(env=None) -> bool:
    """Whether this process says a failure on its console: global rank 0, and in a torchrun job across
    machines also each node's local rank 0 (that node's console shows no other)."""
    env = os.environ if env is None else env
    if rank_from_env(env) == 0:
        return True
    return env.get("LOCAL_RANK") == "0" and _lenient(env.get("GROUP_WORLD_SIZE")) > 1
