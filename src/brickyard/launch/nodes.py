"""Several machines under torchrun: which node hosts the rendezvous, the address and interface each
node is reached by, and the watch that ends a node whose agent lost the others.

torchrun's c10d rendezvous guesses whether a node hosts the store by comparing the endpoint with
the machine's hostname and addresses; in network namespaces, containers and on many clusters the
guess is wrong and every node waits for a store nobody started. Here the node given
``--node-rank 0`` (or, without ranks, the one that owns ``--master``'s address) hosts it, and each
node names its own address (``--local-addr``) and interface (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``, unless set) on the route to the master.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from pathlib import Path

from brickyard.distributed.network import route_to, use_interface
from brickyard.errors import BrickyardError

LAST_CALL_S = 5  # elastic jobs: once MIN nodes are in, how long the rendezvous waits for more


def torchrun_argv(job) -> list[str]:
    """torchrun's arguments for a job (a ``launch.Job``) across machines: c10d rendezvous, ``is_host``
    said, ``--local-addr``."""
    host, _, port = job.master.rpartition(":")
    is_host = job.hosts_rendezvous()
    # each rendezvous round gets a fresh store for the workers (hosted by global rank 0), so a node that
    # returns after a crash, with its own restart count, meets the survivors in the same store
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if is_host and not port_free(host, int(port)):
        raise BrickyardError(f"--master {job.master}: port {port} is already in use on this machine; pick another.")
    count = f"{job.min_nodes}:{job.nnodes}" if job.elastic else str(job.nnodes)
    out = [f"--nnodes={count}", "--rdzv-backend=c10d", f"--rdzv-endpoint={job.master}", "--rdzv-id=brickyard",
           f"--rdzv-conf=is_host={int(is_host)},join_timeout={job.timeout_s},read_timeout={job.timeout_s}"
           + (f",last_call_timeout={LAST_CALL_S}" if job.elastic else "")]
    addr, iface = route_to(host, int(port))
    local = host if is_host else addr
    use_interface(iface)
    return out + ([f"--local-addr={local}"] if local else [])


def owns_address(host: str) -> bool:
    """Whether ``host`` is one of this machine's addresses (a socket can be bound to it)."""
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False
    return port_free(addr, 0)


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` (as torch's stores do: connections of a job that
    just ended, in TIME_WAIT, do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("localhost", "") else "127.0.0.1", port))
            return True
        except OSError:
            return False


class AgentWatch:
    """Ends a multi-node command whose workers are gone while torchrun's agent still waits.

    Between checks of its workers the agent asks the rendezvous store whether nodes are waiting to
    join; with the network to that store cut the call never returns (seen with a link set down:
    the workers ended with their sentence, the command hung). This daemon thread watches this
    process's children: a worker that has ended stays a zombie until the agent reaps it, which a
    working agent does within a second, also while it waits at the exit barrier or rendezvous
    again. When workers have run, none is alive and some have stayed unreaped for ``grace``
    seconds, the agent is stuck: the watch reaps them and ends the command with their exit code.
    Linux only (``/proc``); elsewhere it does nothing.
    """

    def __init__(self, grace: float):
        self.grace = grace

    def start(self) -> None:
        if Path("/proc/self/task").is_dir():
            threading.Thread(target=self._watch, daemon=True, name="brickyard-agent-watch").start()

    @staticmethod
    def _children() -> dict[int, str]:
        """Child pid -> state letter (R, S, Z, ...)."""
        out = {}
        for children in Path("/proc/self/task").glob("*/children"):
            for pid in children.read_text().split():
                try:
                    out[int(pid)] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                except (OSError, IndexError):
                    pass
        return out

    def _watch(self) -> None:
        seen, alive_at = False, time.monotonic()
        while True:
            time.sleep(1.0)
            kids = self._children()
            if any(state != "Z" for state in kids.values()):
                seen, alive_at = True, time.monotonic()
            elif seen and kids and time.monotonic() - alive_at > self.grace:  # unreaped: the agent is stuck
                codes = []
                for pid in kids:
                    try:
                        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, os.WNOHANG)[1]))
                    except ChildProcessError:
                        pass
                code = next((c for c in codes if c), 0)
                if code not in (0, 2, 130):  # 2 and 130: the node's first worker has said why
                    print(f"error: this node's workers ended (exit code {code}) and torchrun's agent lost the "
                          f"rendezvous store; see the worker logs.", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(code if 0 <= code < 256 else 1)


@contextlib.contextmanager
def workers_say_a_lost_store():
    """While torchrun's agent runs here, a rendezvous store it cannot reach between two checks of healthy workers
    counts as no node waiting to join, instead of ending the agent with a rendezvous error.

    Between checks, the agent asks the store whether nodes wait to join (torch's ``agent/server/api.py``
    ``_invoke_run``, the ``WorkerState.HEALTHY`` branch; ``rendezvous/dynamic_rendezvous.py``
    ``num_nodes_waiting`` records the failure and raises it again). When one rank's error ends the job, the node
    hosting the store can end before another node's agent has seen its own workers end: those workers have said
    the cause (``error: rank 1: ...``), and the agent's rendezvous error would add a second, wrong sentence (the
    nodes had all joined). Left to the next check, the agent sees its workers' exit and ends the way a failed job
    ends; workers still running meet the lost peer in their next collective, and a store cut off mid-call is the
    ``AgentWatch``'s. A rendezvous for a restart still fails as before."""
    # torch loads here, not at the top: the CLI imports this module before a command runs
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    asks = DynamicRendezvousHandler.num_nodes_waiting

    def num_nodes_waiting(handler) -> int:
        try:
            return asks(handler)
        except RendezvousError:
            return 0
    DynamicRendezvousHandler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]
    try:
        yield
    finally:
        DynamicRendezvousHandler.num_nodes_waiting = asks  # type: ignore[method-assign]


class RollCall:
    """Each node's launcher signs in on the rendezvous store (its node rank, or its address), so a
    job whose nodes did not all come can say which are missing. A daemon thread: it connects when
    the host's store is up, signs in, and keeps a copy of the list for the error message. Every
    store call waits at most ``STEP_S``, and torch's own retries with backoff can add a few seconds to a
    connection attempt (1.3-2.8 s a call to a closed port, 4.4 s once under load): ``close()`` waits up to
    ``JOIN_S`` for the thread to end, so it is never inside a C++ store call when the interpreter exits (that
    aborts the process), however long the job's timeout."""

    KEY = "brickyard/nodes"
    STEP_S = 1
    JOIN_S = 10

    def __init__(self, job):  # a launch.Job
        self.job, self.joined, self.connected = job, [], False
        self._done = threading.Event()
        host, _, port = job.master.rpartition(":")
        self.label = str(job.node_rank) if job.node_rank is not None else (route_to(host, int(port))[0] or host)
        self._thread = threading.Thread(target=self._run, args=(host, int(port)), daemon=True, name="brickyard-roll-call")
        self._thread.start()

    def _connect(self, host: str, port: int):
        # torch loads here, not at the top: the CLI imports this module before a command runs
        from torch.distributed import TCPStore
        deadline = time.monotonic() + self.job.timeout_s
        while not self._done.is_set():
            try:
                return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=self.STEP_S))
            except Exception:  # noqa: BLE001  not up yet: try again until the launch's own timeout
                if time.monotonic() > deadline:
                    raise
                self._done.wait(0.2)  # (a refused connection returns at once)
        raise ConnectionError("closed")

    def _run(self, host: str, port: int) -> None:
        try:
            store = self._connect(host, port)
            self.connected = True
            store.append(self.KEY, self.label + ",")
            while not self._done.is_set() and len(self.joined) < self.job.nnodes:  # then nothing more to learn
                self.joined = sorted({x for x in store.get(self.KEY).decode().split(",") if x})
                time.sleep(1.0)
        except Exception:  # noqa: BLE001  no store (yet, or any more): the launcher's error says what it knows
            return

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=self.JOIN_S)

    def failure(self) -> str:
        """The sentence for a rendezvous that did not complete."""
        job = self.job
        if not job.hosts_rendezvous() and not self.connected:
            return (f"the node that hosts the rendezvous ({job.master}, --node-rank 0) did not answer within "
                    f"{job.timeout_s}s; start it, or check the address and port.")
        ranks = job.node_rank is not None and all(x.isdigit() for x in self.joined)
        if ranks:
            missing = [r for r in range(job.min_nodes or job.nnodes) if str(r) not in self.joined]
            if missing:
                names = ", ".join(map(str, missing))
                return (f"node{'s' if len(missing) > 1 else ''} {names} never joined the job at {job.master} within "
                        f"{job.timeout_s}s (joined: {', '.join(self.joined) or 'none'}); start "
                        f"{'them' if len(missing) > 1 else 'it'} with the same --nnodes and --master.")
        if len(self.joined) >= job.nnodes:  # every node was in: the store went away after the job began
            return (f"the job's store at {job.master} went away after every node had joined (joined: "
                    f"{', '.join(self.joined)}): the node that hosts it ended or was cut off; its output says why.")
        return (f"not all {job.nnodes} nodes joined the job at {job.master} within {job.timeout_s}s "
                f"(joined: {', '.join(self.joined) or 'none known'}).")
