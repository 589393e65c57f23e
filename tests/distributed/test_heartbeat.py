"""The heartbeat's watch on the job's store: a rank whose own write fails (the store out of reach) calls ``on_lost``
after a grace period, and brickyard's own command then ends itself with the collective error's sentence and every
thread's stack in its workerlog, however its main thread waits. A real ``TCPStore`` served by a process the test
kills; the ending is run in a subprocess of its own."""
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from brickyard.distributed import process as dist
from brickyard.distributed.env import DistInfo

SERVE = "import sys, time, datetime, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, 2, True, " \
        "timeout=datetime.timedelta(seconds=30), wait_for_workers=False); print(s.port, flush=True); time.sleep(600)"


def _served():
    server = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline())
    return server, TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=2))


def test_a_store_out_of_reach_calls_on_lost_after_the_grace_and_a_stopped_heartbeat_does_not():
    info = DistInfo(rank=1, world_size=2)
    server, store = _served()
    lost = threading.Event()
    try:
        beat = dist.Heartbeat(info, interval=0.2, on_lost=lost.set, grace=1.0, store=store)
        time.sleep(0.6)
        assert store.get("brickyard/heartbeat/1")  # it writes while the store answers
        server.kill()
        server.wait()
        start = time.monotonic()
        assert lost.wait(15) and time.monotonic() - start >= 1.0  # not before the grace
        beat.stop()
    finally:
        server.kill()
    server, store = _served()
    lost.clear()
    try:
        quiet = dist.Heartbeat(info, interval=0.2, on_lost=lost.set, grace=0.5, store=store)
        time.sleep(0.5)
        quiet.stop()  # the run ended first
        server.kill()
        assert not lost.wait(4)
    finally:
        server.kill()


def test_a_command_cut_off_ends_itself_with_the_sentence_and_its_stacks(tmp_path):
    code = textwrap.dedent(f"""
        import threading, time
        from brickyard.training import failures
        def waits_forever():
            time.sleep(600)
        threading.Thread(target=waits_forever, daemon=True).start()
        time.sleep(0.2)
        failures.cut_off(1, {str(tmp_path)!r}, 15)()
        print("not reached")
    """)
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "192.168.250.1",
           "MASTER_PORT": "29400"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "not reached" not in r.stdout
    said = ("error: rank 1: this node lost its connection to the job's store at 192.168.250.1:29400, is the network "
            "between the nodes down? (training had not ended 15s later, so this process ended itself; the stacks of "
            f"its threads are in {tmp_path / 'workerlog.1'})")
    assert r.stderr.strip() == said + "."  # the node's first worker says it
    log = (tmp_path / "workerlog.1").read_text()
    assert log.startswith(said) and "in waits_forever" in log
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**env, "LOCAL_RANK": "1"})
    assert quiet.returncode == 2 and quiet.stderr == ""  # another worker of the node keeps it to its log


def test_only_brickyards_own_command_ends_itself():
    r = subprocess.run([sys.executable, "-c", "import importlib, brickyard.distributed.env as e; m = importlib.import_module('brickyard.cli.main'); "
                        "print('fit', e.OWN_PROCESS); m.main = lambda: print('command', e.OWN_PROCESS) or 0; m.run()"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["fit", "False", "command", "True"]
