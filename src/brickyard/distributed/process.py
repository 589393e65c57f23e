"""This process's place in a (possibly 1-process) job, read from the launcher's environment.

Contract: torchrun sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; under Slurm's ``srun`` the rank, world size and local rank
come from ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` (with ``SLURM_NODEID`` and
``SLURM_TASKS_PER_NODE`` for the processes on this node), and, when ``MASTER_ADDR`` is not set,
the master is the first host of ``SLURM_JOB_NODELIST`` (expanded as Slurm writes it,
``node[01-03,07]``) on port ``MASTER_PORT`` or 15000 + the last four digits of the job id. With
none of these, the process is rank 0 of 1 and takes the same code path without a process group.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch.distributed is imported inside the functions that use it: ``from_env`` is all that the CLI
# needs before a command runs, so `brickyard --help` and argument errors come back without torch.


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0
    master: tuple[str, int] | None = None  # derived under Slurm when MASTER_ADDR is not set

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
        return _from_slurm(env)
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


def _from_slurm(env) -> DistInfo:
    from brickyard.errors import BrickyardError
    world = int(env["SLURM_NTASKS"])
    per_node = slurm_tasks_per_node(env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or str(world))
    node = int(env.get("SLURM_NODEID", 0))
    local_world = per_node[node] if node < len(per_node) else per_node[-1]
    master = None
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_STEP_NODELIST")
        if not nodelist:
            raise BrickyardError("under Slurm (SLURM_NTASKS > 1) brickyard needs MASTER_ADDR or SLURM_JOB_NODELIST "
                                 "to find rank 0; run it with srun inside an allocation.")
        port = env.get("MASTER_PORT") or str(15000 + int(env.get("SLURM_JOB_ID", "0")[-4:] or 0))
        master = (slurm_hosts(nodelist)[0], int(port))
    return DistInfo(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), world, local_world, master=master)


def slurm_hosts(nodelist: str) -> list[str]:
    """Expand a Slurm host list: ``node[01-03,07],gpu5`` -> node01, node02, node03, node07, gpu5
    (zero padding kept; several bracket groups in one name multiply: ``r[1-2]n[1-2]``)."""
    from brickyard.errors import BrickyardError
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            break
        if ch == "," and depth == 0:
            items.append(nodelist[start:i].strip())
            start = i + 1
    if depth != 0 or not all(items):
        raise BrickyardError(f"Slurm node list {nodelist!r} is not of the form node[01-03,07],other.")
    return [host for item in items for host in _expand_one(item, nodelist)]


def _expand_one(item: str, nodelist: str) -> list[str]:
    from brickyard.errors import BrickyardError
    if "[" not in item:
        return [item]
    head, _, rest = item.partition("[")
    body, _, tail = rest.partition("]")
    numbers = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) < int(lo):
            raise BrickyardError(f"Slurm node list {nodelist!r}: {part!r} is not a number or a range like 01-03.")
        numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return [head + n + t for n in numbers for t in _expand_one(tail, nodelist)]


def slurm_tasks_per_node(spec: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) -> tasks of each node in order: [2, 2, 2, 1]."""
    out = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        out += [int(count)] * int(times.rstrip(")") or 1)
    return out


def init(info: DistInfo, backend: str, device: torch.device, timeout_s: int) -> bool:
    """Join the process group; False when there was nothing to do (one process, or a group the caller made)."""
    import torch.distributed as tdist
    if not info.distributed or tdist.is_initialized():
        return False
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {}
    if device.type == "cuda" and backend == "nccl":
        kwargs["device_id"] = device
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.master is not None:  # Slurm without MASTER_ADDR: rank 0's node from the node list
        os.environ.setdefault("MASTER_ADDR", info.master[0])
        os.environ.setdefault("MASTER_PORT", str(info.master[1]))
        from brickyard.launch import nodes
        nodes.use_interface(nodes.route_to(*info.master)[1])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts; without a per-attempt prefix a restarted
        # group can read the dead workers' addresses and fail to connect
        base = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                              is_master=False, timeout=timeout)
        kwargs["store"] = tdist.PrefixStore(f"brickyard/attempt_{info.restart_count}", base)
    tdist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout, **kwargs)
    return True


def shutdown() -> None:
    import torch.distributed as tdist
    if tdist.is_initialized():
        tdist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` (default: all) in place; a no-op without a process group."""
    import torch.distributed as tdist
    if tdist.is_initialized() and tdist.get_world_size(group) > 1:
        tdist.all_reduce(t, group=group)
    return t


def barrier() -> None:
    import torch.distributed as tdist
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()


def broadcast_object(obj, src: int = 0):
    import torch.distributed as tdist
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src)
    return box[0]


def _job_store(info: DistInfo):
    """The key-value store the process group was made with (torchrun's), or None for one process."""
    import torch.distributed as tdist
    if not (info.distributed and tdist.is_initialized()):
        return None
    try:
        return tdist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError):
        return None


class StopVote:
    """Every rank stops on a signal at the same step, so rank 0 can save and nobody waits on a collective.

    A signal reaches the ranks at slightly different steps (torchrun forwards SIGTERM to each; a scheduler
    may signal only one process). Every ``every`` steps each rank looks in the job's store: a rank that has
    been signalled proposes to stop at the next look (the first proposal wins, ``compare_set``); the others
    read it there. The ranks are never more than one step apart (each step all-reduces), so every rank
    reads the agreed step before it reaches it. One store round trip (~0.1 ms on one machine) per
    ``every`` steps; one process stops at once, as before.
    """

    def __init__(self, info: DistInfo, every: int = 10):
        self.every, self.store, self.rank = every, _job_store(info), info.rank
        self.key = f"brickyard/stop/{info.restart_count}"
        self.at, self.cause = None, None  # the agreed step; "SIGTERM to rank 1"

    def should_stop(self, step: int, signal_name: str | None) -> bool:
        """Call after every step with this process's reason to stop, if any (a signal's name, a callback's reason)."""
        if self.store is None:
            self.cause = signal_name
            return signal_name is not None
        if self.at is None and step % self.every == 0:
            if signal_name is not None:
                proposal = f"{step + self.every}|{self.rank}|{signal_name}"
                self._agree(self.store.compare_set(self.key, "", proposal))
            elif self.store.check([self.key]):
                self._agree(self.store.get(self.key))
        if self.at is not None and step >= self.at:
            self.cause = signal_name or self.cause  # this process's own signal says it best
            return True
        return False

    def _agree(self, value: bytes) -> None:
        at, rank, name = value.decode().split("|", 2)
        if int(rank) != self.rank:
            name = f"{name} to rank {rank}" if name.startswith("SIG") else f"{name} (rank {rank})"
        self.at, self.cause = int(at), name


class Heartbeat:
    """A daemon thread that writes this rank's wall time to the job's store every ``interval`` s.

    When a collective times out, ``silent_ranks()`` names the ranks whose heartbeat stopped (a
    process that is frozen, swapped out or on a lost machine), so the error can say which rank
    stopped answering. Without a store (one process) it does nothing.
    """

    def __init__(self, info: DistInfo, interval: float = 1.0):
        import threading
        import time
        self.info, self.interval = info, interval
        self.store = _job_store(info)
        self.last_ok = time.time()
        self._stop = threading.Event()
        self._thread = None
        if self.store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="brickyard-heartbeat")
            self._thread.start()

    def _beat(self) -> None:
        import time
        while not self._stop.is_set():
            try:
                self.store.set(f"brickyard/heartbeat/{self.info.rank}", repr(time.time()))
            except Exception:  # noqa: BLE001  the store went away: the job is ending
                return
            self.last_ok = time.time()
            self._stop.wait(self.interval)

    @property
    def _silent_after(self) -> float:
        """Seconds without a heartbeat after which a rank counts as silent."""
        return 3 * self.interval + 1

    def silent_ranks(self) -> list[int] | None:
        """The ranks whose heartbeat stopped; None when this rank itself no longer reaches the store
        (its own writes stopped, or reading the others' does not finish within a few seconds)."""
        import threading
        import time
        if self.store is None:
            return []
        if time.time() - self.last_ok > self._silent_after:
            return None
        found: list[list[int]] = []
        reader = threading.Thread(target=lambda: found.append(self._read_silent()), daemon=True)
        reader.start()
        reader.join(timeout=self._silent_after)  # a store across a cut network never answers
        return found[0] if found else None

    def _read_silent(self) -> list[int]:
        import time
        now, silent = time.time(), []
        for r in range(self.info.world_size):
            key = f"brickyard/heartbeat/{r}"
            try:
                last = float(self.store.get(key)) if self.store.check([key]) else 0.0
            except Exception:  # noqa: BLE001
                continue
            if now - last > self._silent_after:
                silent.append(r)
        return silent

    def stop(self) -> None:
        """End the thread before the process group (and its store) goes: a store call cut off by the
        group's teardown or by the interpreter's exit can abort the process (seen under `brickyard run`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval)


def is_comm_failure(e: BaseException) -> bool:
    """An error that says a collective lost its peers (a timeout, a closed connection) rather than a bug."""
    text = str(e).lower()
    return any(k in text for k in ("timed out", "timeout", "connection closed", "connection reset", "nccl", "gloo"))
