"""The suite's stand-in for torchrun's workers (``tests/warm_workers.py``) ends as the worker it stands for: its exit
code, its signal, a signal sent to it reaching the worker, and the worker gone when the stand-in is killed outright.
Every multi-process test relies on this; with it broken they would test something else than a user's job."""
import os
import signal
import subprocess
import time

import pytest

import conftest

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
