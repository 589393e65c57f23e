"""Everything Slurm-specific, in one place: the environment variables ``srun`` sets for each task.

Contract (one task per process, started by ``srun``): the rank, world size and local rank come from
``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` (with ``SLURM_NODEID`` and
``SLURM_TASKS_PER_NODE`` for the processes on this node), and, when ``MASTER_ADDR`` is not set, the
master is the first host of ``SLURM_JOB_NODELIST`` (expanded as Slurm writes it, ``node[01-03,07]``)
on port ``MASTER_PORT`` or 15000 + the last four digits of the job id. As Lightning's
``plugins/environments/slurm.py``, read from the environment only; no ``scontrol`` call.
"""
from __future__ import annotations

import os
from pathlib import Path

from brickyard.distributed.env import env_int
from brickyard.errors import JobEnvironmentError


def from_slurm(env, make):
    """``make(rank, local_rank, world, local_world, master=...)`` (a ``DistInfo``) from Slurm's variables."""
    world = env_int(env, "SLURM_NTASKS", 1, low=1)
    per_node = slurm_tasks_per_node(env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or str(world))
    node = env_int(env, "SLURM_NODEID", 0)
    local_world = per_node[node] if node < len(per_node) else per_node[-1]
    master = None
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_STEP_NODELIST")
        if not nodelist:
            raise JobEnvironmentError("under Slurm (SLURM_NTASKS > 1) brickyard needs MASTER_ADDR or SLURM_JOB_NODELIST "
                                      "to find rank 0; run it with srun inside an allocation.")
        job = env.get("SLURM_JOB_ID", "0")[-4:]
        port = env_int(env, "MASTER_PORT", 15000 + (int(job) if job.isdecimal() else 0), low=1, high=65535)
        master = (slurm_hosts(nodelist)[0], port)
    return make(env_int(env, "SLURM_PROCID", 0, high=world - 1), env_int(env, "SLURM_LOCALID", 0, high=world - 1), world,
                local_world, master=master, launcher="slurm")


def slurm_hosts(nodelist: str) -> list[str]:
    """Expand a Slurm host list: ``node[01-03,07],gpu5`` -> node01, node02, node03, node07, gpu5
    (zero padding kept; several bracket groups in one name multiply: ``r[1-2]n[1-2]``)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            break
        if ch == "," and depth == 0:
            items.append(nodelist[start:i].strip())
            start = i + 1
    if depth != 0 or not all(items):
        raise JobEnvironmentError(f"Slurm node list {nodelist!r} is not of the form node[01-03,07],other.")
    return [host for item in items for host in _expand_one(item, nodelist)]


def _expand_one(item: str, nodelist: str) -> list[str]:
    if "[" not in item:
        return [item]
    head, _, rest = item.partition("[")
    body, _, tail = rest.partition("]")
    numbers = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdecimal() or not (hi or lo).isdecimal() or int(hi or lo) < int(lo):
            raise JobEnvironmentError(f"Slurm node list {nodelist!r}: {part!r} is not a number or a range like 01-03.")
        numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return [head + n + t for n in numbers for t in _expand_one(tail, nodelist)]


def slurm_tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) -> tasks of each node in order: [2, 2, 2, 1]."""
    out = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        times = times.removesuffix(")") or "1"
        if not (count.isdecimal() and times.isdecimal()) or int(count) < 1 or len(out) + int(times) > 1 << 16:
            raise JobEnvironmentError(f"environment: SLURM_TASKS_PER_NODE={spec!r} is not Slurm's form (2(x3),1: tasks "
                                      f"of each node); run brickyard with srun inside an allocation.")
        out += [int(count)] * int(times)
    return out


def task_of_a_step(env=None) -> bool:
    """This process is one of several tasks that ``srun`` started (a job step of more than one task)."""
    env = os.environ if env is None else env
    return env_int(env, "SLURM_NTASKS", 1, low=1) > 1 and "SLURM_PROCID" in env and "SLURM_STEP_ID" in env


def batch_script_of_several_tasks(env=None) -> int:
    """The task count when this process is the batch script of an allocation of several tasks (``sbatch -n
    2``: ``SLURM_NTASKS=2`` and ``SLURM_PROCID=0`` but no job step), where brickyard was not started by
    srun; else 0."""
    env = os.environ if env is None else env
    n = env_int(env, "SLURM_NTASKS", 1, low=1)
    return n if n > 1 and "SLURM_PROCID" in env and "SLURM_STEP_ID" not in env and "RANK" not in env else 0


def leave_the_allocation_tasks() -> None:
    """Run as the user asked (``--devices``) in a batch script: not as one of the allocation's tasks."""
    os.environ.pop("SLURM_PROCID", None)


def run_name(preset: str, env=None) -> Path | None:
    """Under srun, the default run directory every task agrees on: ``runs/<preset>-slurm<job>.<step>``."""
    env = os.environ if env is None else env
    if not task_of_a_step(env) or "SLURM_JOB_ID" not in env:
        return None
    return Path("runs") / f"{preset}-slurm{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
