"""The process group: joining it, the collectives brickyard uses, the stop vote and the heartbeat.

``DistInfo`` and ``from_env`` (this process's place in the job) live in ``brickyard.distributed.env``,
free of torch, and are re-exported here.
"""
from __future__ import annotations

import datetime
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist

from brickyard.distributed import network
from brickyard.distributed.env import DistInfo, from_env  # noqa: F401  (re-exported: dist.from_env())
from brickyard.errors import JobEnvironmentError, RendezvousError


def init(info: DistInfo, backend: str, device: torch.device, timeout_s: int) -> bool:
    """Join the process group; False when there was nothing to do (one process, or a group the caller made)."""
    if not info.distributed or tdist.is_initialized():
        return False
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}  # init_process_group's keywords, each of its own type
    if device.type == "cuda" and backend == "nccl":
        kwargs["device_id"] = device
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.master is not None:  # Slurm without MASTER_ADDR: rank 0's node from the node list
        # every task on this machine: the job's store listens on loopback only (``rendezvous``)
        one_machine = info.local_world_size == info.world_size
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1" if one_machine else info.master[0])
        os.environ.setdefault("MASTER_PORT", str(info.master[1]))
        network.use_interface(network.route_to(*info.master)[1])
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):  # torch's env:// would say "expected"
        raise JobEnvironmentError(f"environment: WORLD_SIZE={info.world_size} but MASTER_ADDR and MASTER_PORT are not both "
                                  f"set, so the processes cannot meet; start them with `brickyard train --devices cpu:N` "
                                  f"or torchrun.")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts; without a per-attempt prefix a restarted
        # group can read the dead workers' addresses and fail to connect
        base = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                              is_master=False, timeout=timeout)
        kwargs["store"] = tdist.PrefixStore(f"brickyard/attempt_{info.restart_count}", base)
    elif info.launcher == "slurm":
        kwargs["store"] = rendezvous(info, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout_s)
    tdist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timeout, **kwargs)
    return True


HANDSHAKE_S = 15  # a rendezvous that accepted a connection answers at once; a foreign program never does


def rendezvous(info: DistInfo, host: str, port: int, timeout_s: int):
    """The job's key-value store for tasks that srun started: rank 0 opens it on ``port``, the others
    connect. Each failure is a ``RendezvousError`` on the rank that sees it, within seconds where it
    can be known (a port another program holds) and within ``timeout_s`` where it cannot (rank 0
    never opened it), never a hang: torch's client, connected to a program that accepts and stays
    silent, waits past its own timeout (seen with torch 2.13), so a rank first waits for the port
    to accept, then gives the handshake ``HANDSHAKE_S`` seconds."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.rank == 0:
        in_use = RendezvousError(f"rank 0: port {port} on {host} is in use by another program, so the job's rendezvous "
                                 f"cannot open there; set MASTER_PORT to a free port (the same for every task).")
        extra: dict[str, Any] = {}
        if _is_loopback(host):  # torch's store listens on every interface unless handed a socket bound here
            try:
                extra["master_listen_fd"] = _listen_on(host, port).fileno()
            except OSError:
                raise in_use from None
        try:
            return tdist.TCPStore(host, port, info.world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                                  **extra)
        except RuntimeError as e:
            if "in use" not in str(e).lower():
                raise
            raise in_use from None
    _wait_until_listening(info.rank, host, port, timeout_s)
    made: dict = {}

    def connect():
        try:
            made["store"] = tdist.TCPStore(host, port, info.world_size, is_master=False, timeout=timeout)
        except RuntimeError as e:
            made["error"] = e

    thread = threading.Thread(target=connect, name="brickyard-rendezvous", daemon=True)
    thread.start()
    thread.join(HANDSHAKE_S)
    if "store" in made:
        return made["store"]
    raise RendezvousError(f"rank {info.rank}: the program listening at {host}:{port} does not answer as rank 0's "
                          f"rendezvous, so another program holds MASTER_PORT; set MASTER_PORT to a free port "
                          f"(the same for every task).")


_LISTENERS: list[socket.socket] = []  # the sockets handed to stores: they must outlive the process group


def _is_loopback(host: str) -> bool:
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def _listen_on(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only, for ``TCPStore(master_listen_fd=...)``."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((socket.gethostbyname(host), port))
        s.listen(1024)
    except OSError:
        s.close()
        raise
    _LISTENERS.append(s)
    return s


def _wait_until_listening(rank: int, host: str, port: int, timeout_s: int) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousError(f"rank {rank}: nothing answered at {host}:{port} within dist.timeout_s={timeout_s}s: "
                                      f"rank 0 did not open the job's rendezvous there (it failed before it could, or "
                                      f"{host} cannot be reached from this node).") from None
            time.sleep(0.25)


def shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over the ranks of ``group`` (default: all) in place; a no-op without a process group."""
    if tdist.is_initialized() and tdist.get_world_size(group) > 1:
        tdist.all_reduce(t, group=group)
    return t


def barrier() -> None:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()


def broadcast_object(obj, src: int = 0, group=None):
    if not (tdist.is_initialized() and tdist.get_world_size(group) > 1):
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src, group=group)
    return box[0]


def _job_store(info: DistInfo):
    """The key-value store the process group was made with (torchrun's), or None for one process."""
    if not (info.distributed and tdist.is_initialized()):
        return None
    try:
        return tdist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class Stop:
    """Why a run ends early: ``kind`` "signal" (SIGINT, SIGTERM: a checkpoint, then exit code 130) or
    "request" (a callback's ``run.stop``, a time limit, early stopping: the test evaluation and the
    summary follow); ``reason`` is what the log and the summary say ("SIGTERM to rank 1")."""
    kind: str
    reason: str


class StopVote:
    """Every rank stops on a signal at the same step, so rank 0 can save and nobody waits on a collective.

    A signal reaches the ranks at slightly different steps (torchrun forwards SIGTERM to each; a scheduler
    may signal only one process). Every ``every`` steps each rank looks in the job's store: a rank that has
    been signalled proposes to stop at the next look (the first proposal wins, ``compare_set``); the others
    read it there. The ranks are never more than one step apart (each step all-reduces), so every rank
    reads the agreed step before it reaches it. One store round trip (~0.1 ms on one machine) per
    ``every`` steps; one process stops at once, as before.

    torch's store has no authentication: anyone who reaches its port can write. A proposal therefore
    carries a token rank 0 draws for this job and hands the ranks over the process group (never through
    the store); a value without it, or not of this form, is ignored and said once in the log.
    Collective at construction (the token): every rank of ``group`` makes its ``StopVote`` together.
    """

    def __init__(self, info: DistInfo, every: int = 10, warn=None, group=None):
        self.every, self.store, self.rank = every, _job_store(info), info.rank
        self.key = f"brickyard/stop/{info.restart_count}"
        self.at, self.agreed = None, None  # the agreed step and ``Stop`` ("SIGTERM to rank 1")
        self.warn, self.ignored = warn, False
        self.token = broadcast_object(secrets.token_hex(16), group=group) if self.store is not None else ""

    def should_stop(self, step: int, request: Stop | None) -> Stop | None:
        """Call after every step with this process's request to stop, if any; the agreed ``Stop`` once due."""
        if self.store is None:
            return request
        if self.at is None and step % self.every == 0:
            if request is not None:
                proposal = f"{step + self.every}|{self.rank}|{request.kind}|{self.token}|{request.reason}"
                self._agree(self.store.compare_set(self.key, "", proposal))
            elif self.store.check([self.key]):
                self._agree(self.store.get(self.key))
        if self.at is not None and step >= self.at:
            return request or self.agreed  # this process's own request says it best
        return None

    def _agree(self, value: bytes) -> None:
        """Take the proposal in the store; one that is not of brickyard's form (anyone on the network
        can write to torch's store) is ignored and said once."""
        try:
            at, rank, kind, token, reason = value.decode().split("|", 4)
            at, rank = int(at), int(rank)
            if token != self.token or kind not in ("signal", "request") or not 0 < at < 2**62:
                raise ValueError(kind)
        except (ValueError, UnicodeDecodeError):
            if not self.ignored and self.warn is not None:
                self.warn(f"ignored a stop request in the job's store that brickyard did not write: {value[:80]!r}")
            self.ignored = True
            return
        if rank != self.rank:
            reason = f"{reason} to rank {rank}" if kind == "signal" else f"{reason} (rank {rank})"
        self.at, self.agreed = at, Stop(kind, reason)

    # An error one rank meets alone (a corrupt image in its share of the data) ends that rank, and the others
    # then see only a collective that lost its peer. The rank leaves its sentence in the job's store before it
    # leaves the group, and a rank whose collective failed says that sentence instead, with whatever launched
    # the job: srun, a torchrun the user started, one brickyard launcher a machine. Under brickyard's launcher
    # on one machine, torchrun's error files carry it too (``errorfile``). The key holds the job's token, which
    # travelled over the process group, so a value at it was written by a rank of this run.

    @property
    def _cause_key(self) -> str:
        return f"brickyard/cause/{self.token}"

    def leave_cause(self, message: str, code: int) -> None:
        """Leave this rank's error (``code``: the exit code it ends with) for the ranks its leaving fails;
        the first rank's to arrive stays. Never waits more than a few seconds on the store."""
        if self.store is not None:
            value = f"{self.rank}|{code}|{message}"
            _within(CAUSE_STORE_S, lambda: self.store.compare_set(self._cause_key, "", value))

    def cause_left(self, wait: float = 0.5) -> tuple[int, int, str] | None:
        """(rank, exit code, sentence) of the error another rank left, looking for up to ``wait`` seconds;
        None when none did, or the store is gone (the rank that held it has ended, a cut network)."""
        if self.store is None:
            return None

        def read():
            end = time.monotonic() + wait
            while not self.store.check([self._cause_key]):
                if time.monotonic() > end:
                    return None
                time.sleep(0.05)
            return self.store.get(self._cause_key)

        value = _within(wait + CAUSE_STORE_S, read)
        try:
            rank, code, message = value.decode().split("|", 2)
            rank, code = int(rank), int(code)
        except (AttributeError, ValueError, UnicodeDecodeError):
            return None
        message = message.strip().splitlines()[0][:1000] if message.strip() else ""
        if rank == self.rank or not 0 <= rank < 2**31 or not 0 < code < 256 or not message:
            return None
        return rank, code, message


CAUSE_STORE_S = 3.0  # the longest a failing rank waits on the job's store (one that never answers: a cut network)


def _within(seconds: float, call):
    """``call()``'s result, or None when it raises or has not returned within ``seconds`` (a store across a
    cut network never answers; the call is left to a daemon thread)."""
    found = []

    def target():
        try:
            found.append(call())
        except Exception:  # noqa: BLE001  the store went away: the job is ending
            pass

    thread = threading.Thread(target=target, daemon=True, name="brickyard-store")
    thread.start()
    thread.join(timeout=seconds)
    return found[0] if found else None


LOST_GRACE_S = 15.0  # after this rank's own write to the store failed, how long the process has to end by itself


class Heartbeat:
    """A daemon thread that writes this rank's wall time to the job's store every ``interval`` s.

    When a collective times out, ``silent_ranks()`` names the ranks whose heartbeat stopped (a
    process that is frozen, swapped out or on a lost machine), so the error can say which rank
    stopped answering. Without a store (one process) it does nothing.

    ``on_lost``: called on a daemon timer ``grace`` s after one of this rank's writes failed while it ran (the store
    went out of reach: a cut network, the store's host gone), unless the process has ended by then; ``stop()`` does
    not disarm it once armed, since a hang can come after it (the process group's teardown). brickyard's own
    commands end themselves there, so that a node cut off from the job ends in bounded time even when its main
    thread waits on something with no timeout of its own: a cut-network test once left a worker that had met the
    store's timeout running for minutes, its error unsaid.
    """

    def __init__(self, info: DistInfo, interval: float = 1.0, on_lost=None, grace: float = LOST_GRACE_S, store=None):
        self.info, self.interval, self.on_lost, self.grace = info, interval, on_lost, grace
        self.store = store if store is not None else _job_store(info)
        self.last_ok = time.time()
        self._stop = threading.Event()
        self._thread = None
        if self.store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="brickyard-heartbeat")
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.set(f"brickyard/heartbeat/{self.info.rank}", repr(time.time()))
            except Exception:  # noqa: BLE001  the store went away: the job is ending
                if self.on_lost is not None and not self._stop.is_set():
                    timer = threading.Timer(self.grace, self.on_lost)
                    timer.daemon = True
                    timer.start()
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
        if self.store is None:
            return []
        if time.time() - self.last_ok > self._silent_after:
            return None
        return _within(self._silent_after, self._read_silent)

    def _read_silent(self) -> list[int]:
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
