"""Out of host memory outside training, the advice fits the command: plotting or exporting images trains
nothing, so it no longer names data.batch_size and data.cache. Real processes; the allocation that fails is
stood in for (a capped address space also stops the interpreter's own imports)."""
import sys

from conftest import run_cli


def test_the_advice_for_running_out_of_memory_fits_the_command(tmp_path):
    import subprocess
    code = ("import importlib, sys\nfrom brickyard.cli.main import main\nd = importlib.import_module('brickyard.cli.data')\n"
            "def boom(args): raise MemoryError('Unable to allocate 30 GiB')\n"
            "d.run = boom\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "data", "export", "mnist", str(tmp_path / "x"), "--jpeg", "64"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == (
        "error: out of host memory (Unable to allocate 30 GiB); try a smaller --jpeg or --max-size (pixels a side), "
        "or --limit."), r.stderr
    r = run_cli("data", "export", "mnist", str(tmp_path / "y"), "--jpeg", "100000")
    assert r.returncode == 2 and "--jpeg 100000 is past 4096 pixels a side" in r.stderr, r.stderr
