"""The suite's stand-in for torchrun's workers (``tests/warm_workers.py``) ends as the worker it stands for: its exit
code, its signal, a signal sent to it reaching the worker, and the worker gone when the stand-in is killed outright;
on a multi-node test's host, the worker is on that host. Every multi-process test relies on this; with it broken
they would test something else than a user's job."""
import json
import os
import signal
import subprocess
import time

import pytest

import conftest
import netns

SCRIPT = """
import os, signal, sys, time
how = sys.argv[1]
if how == "forward":  # before the pid is told: the test signals as soon as it reads it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
print(os.getpid(), "torch" in sys.modules, flush=True)
if how == "exit":
    sys.exit(3)
if how == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(60)
"""


def _start(tmp_path, how):
    workers = conftest._WORKERS[0]
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    env = {**workers.envs[0], "TORCHELASTIC_RUN_ID": "x"}  # the server's load-time variables; torchrun's own aside
    proc = subprocess.Popen([workers.stand_in, "-u", str(script), how], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    pid, warm = proc.stdout.readline().split()
    assert int(pid) != proc.pid and warm == "True"  # forked from the warm server: torch already imported
    return proc, int(pid)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_stand_in_ends_as_its_worker_does(tmp_path):
    if not conftest._WORKERS:  # started after collection (conftest.pytest_collection_finish): asked here, not at import
        pytest.skip("no warm server for torchrun's workers (BRICKYARD_TESTS_COLD=1)")
    proc, _ = _start(tmp_path, "exit")
    assert proc.wait(30) == 3
    proc, _ = _start(tmp_path, "signal")
    assert proc.wait(30) == -signal.SIGTERM
    proc, worker = _start(tmp_path, "forward")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 7 and _gone(worker)
    proc, worker = _start(tmp_path, "sleep")
    os.kill(worker, signal.SIGKILL)  # a worker killed by its pid, as the tests kill one
    assert proc.wait(30) == -signal.SIGKILL
    proc, worker = _start(tmp_path, "sleep")
    proc.kill()  # the stand-in killed outright: its worker goes too
    proc.wait(30)
    deadline = time.time() + 10
    while not _gone(worker) and time.time() < deadline:
        time.sleep(0.05)
    assert _gone(worker)


HOST = """
import json, os, socket, sys
print(json.dumps({"warm": "torch" in sys.modules, "ns": [str(os.stat(f"/proc/self/ns/{k}").st_ino) for k in ("net", "mnt")],
                  "links": sorted(name for _, name in socket.if_nameindex()), "hosts": open("/etc/hosts").read()}))
"""


def test_a_worker_forked_for_a_stand_in_on_a_host_is_on_that_host(tmp_path):
    """Forked from a server outside the host, the worker joins the stand-in's network namespace (its interfaces,
    the host's address) and mount namespace (the host's own /etc/hosts), as ``ip netns exec`` put the stand-in."""
    if not conftest._WORKERS:
        pytest.skip("no warm server for torchrun's workers (BRICKYARD_TESTS_COLD=1)")
    if netns.unavailable():
        pytest.skip(f"no network hosts: {netns.unavailable()}")
    workers = conftest._WORKERS[0]
    script = tmp_path / "where.py"
    script.write_text(HOST)
    hosts = netns.Hosts(1, names=["node01"])
    try:
        ns = hosts.hosts[0]
        env = {**workers.envs[0], "TORCHELASTIC_RUN_ID": "x"}
        out = subprocess.run(["ip", "netns", "exec", ns, workers.stand_in, "-u", str(script)], capture_output=True,
                             text=True, env=env, timeout=60)
        there = subprocess.run(["ip", "netns", "exec", ns, "stat", "-L", "-c", "%i", "/proc/self/ns/net",
                                "/proc/self/ns/mnt"], capture_output=True, text=True, timeout=60).stdout.split()
    finally:
        hosts.close()
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["warm"]  # forked from the warm server, not started cold
    assert got["ns"] == there and there[0] != str(os.stat("/proc/self/ns/net").st_ino)
    assert got["links"] == ["eth0", "lo"] and "192.168.250.1 node01" in got["hosts"], got
