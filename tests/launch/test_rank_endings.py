"""Every way a rank of ``brickyard.launch`` can end comes back within seconds as a ``LaunchError`` that names
the rank and its exception or exit code (the README's promise): ``KeyboardInterrupt`` and ``os._exit(0)`` on
rank 1 left rank 0 waiting forever, and ``sys.exit(3)``, ``os._exit(4)``, a signal and a value that cannot be
pickled said only torch's "To enable traceback see ...". Real processes, from a notebook-like stdin session."""
import subprocess
import sys
import textwrap

CASES = textwrap.dedent("""
    import os, signal, sys, time
    import brickyard

    def ends(how):
        if os.environ["RANK"] == "1":
            if how == "interrupt":
                raise KeyboardInterrupt
            if how == "exit3":
                sys.exit(3)
            if how == "exit0":
                sys.exit()
            if how == "_exit4":
                os._exit(4)
            if how == "_exit0":
                os._exit(0)
            if how == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "unpicklable":
                return lambda: 1
        time.sleep(0.5)
        return "rank 0's value"

    for how in ["interrupt", "exit3", "exit0", "_exit4", "_exit0", "killed", "unpicklable"]:
        start = time.monotonic()
        try:
            said = "RETURNED " + str(brickyard.launch(ends, devices="cpu:2", args=(how,)))
        except brickyard.launch.processes.LaunchError as e:
            said = "RAISED " + str(e).splitlines()[0]
        print(f"{how} | {time.monotonic() - start:.1f} | {said}", flush=True)
""")


def test_each_way_a_rank_ends_comes_back_within_seconds_naming_the_rank_and_its_exception_or_exit_code(tmp_path):
    r = subprocess.run([sys.executable, "-"], input=CASES, capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {how: (float(took), said) for how, took, said in (line.split(" | ") for line in r.stdout.splitlines())}
    expected = {
        "interrupt": "RAISED rank 1 failed: KeyboardInterrupt",
        "exit3": "RAISED rank 1 failed: SystemExit: sys.exit(3) ended it with exit code 3",
        "exit0": "RETURNED rank 0's value",  # sys.exit() returns None on that rank, as sys.exit(0) did
        "_exit4": "RAISED rank 1 failed: its process ended with exit code 4 and no Python exception",
        "_exit0": "RAISED rank 1 failed: its process ended with exit code 0 before its function returned",
        "killed": "RAISED rank 1 failed: its process was killed by signal 9 (SIGKILL).",
        "unpicklable": "RAISED rank 1 failed: its return value, a function, cannot be pickled to be sent back",
    }
    assert set(lines) == set(expected), r.stdout + r.stderr
    for how, start in expected.items():
        took, said = lines[how]
        assert said.startswith(start), (how, said)
        assert took < 30, (how, took)  # seconds, not the rendezvous timeout or forever
