"""What brickyard reads from the job's store is input from a stranger: torch's store has no
authentication. Real TCPStores on loopback; one process plays every rank."""
import datetime
import socket

import pytest
import torch.distributed as tdist

from brickyard.distributed import process
from brickyard.distributed.env import DistInfo

pytestmark = pytest.mark.fast  # in-process: no subprocess, no process group


def _store():
    server = tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    return server, tdist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=10))


def _vote(store, rank=1):
    said = []
    vote = process.StopVote(DistInfo(), every=10, warn=said.append)  # one process: no store, no token yet
    vote.store, vote.rank, vote.token = store, rank, "f00d" * 8  # as a rank of a job would have them
    return vote, said


def test_values_brickyard_did_not_write_are_ignored_and_said_once():
    server, stranger = _store()
    vote, said = _vote(server)
    for value in ("garbage", "1|0|signal", "20|0|signal|wrong-token|SIGTERM", "x|0|signal|" + vote.token + "|SIGTERM",
                  "20|0|teleport|" + vote.token + "|now", "99999999999999999999999|0|signal|" + vote.token + "|SIGTERM",
                  b"\xff\xfe|0"):
        stranger.set(vote.key, value)
        for step in (10, 20, 30):
            assert vote.should_stop(step, None) is None, value  # never a crash, never a stop
    assert len(said) == 1 and said[0].startswith("ignored a stop request in the job's store that brickyard did not write")
    # what a rank of this job writes still stops every rank, named as before
    stranger.set(vote.key, f"40|0|signal|{vote.token}|SIGTERM")
    assert vote.should_stop(40, None) == process.Stop("signal", "SIGTERM to rank 0")


def test_a_request_carries_the_token_and_stops_at_the_agreed_step():
    server, _ = _store()
    vote, _ = _vote(server, rank=0)
    assert vote.should_stop(10, process.Stop("request", "time limit")) is None  # proposed for step 20
    assert server.get(vote.key).decode() == f"20|0|request|{vote.token}|time limit"
    assert vote.should_stop(20, process.Stop("request", "time limit")) == process.Stop("request", "time limit")


def test_a_one_machine_rendezvous_listens_on_loopback_only():
    server, _ = _store()
    assert _listening(server.port) != ["127.0.0.1"]  # torch's store alone listens everywhere: this test can tell
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = process.rendezvous(DistInfo(rank=0, world_size=1), "127.0.0.1", port, 10)
    store.set("k", "v")
    assert _listening(port) == ["127.0.0.1"]  # not 0.0.0.0 / :: as torch's own store


def _listening(port: int) -> list[str]:
    """The addresses a socket listens on at ``port`` (the kernel's table: state 0A is LISTEN)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                out.append(socket.inet_ntoa(bytes.fromhex(addr)[::-1]) if len(addr) == 8 else "::")
    return out
