import getpass
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
import traceback
from pathlib import Path

import pytest

import warm
import warm_workers

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "datasets"
if "BRICKYARD_DATA" not in os.environ and SHARED.is_dir():
    os.environ["BRICKYARD_DATA"] = str(SHARED)

# torch sets TORCHINDUCTOR_CACHE_DIR to its default the first time a process asks for inductor's cache, which a test
# training in-process may do halfway: set from the start, every process a test starts has the environment the warm
# servers (tests/warm.py, tests/warm_workers.py) were started with, before and after, and is forked from one
# (torch/_inductor/runtime/cache_dir_utils.py default_cache_dir, without importing inductor: 1.5 s a process)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())))

# tiny synthetic runs used across the suite: fast, deterministic, no files needed. fp32 is pinned:
# `precision: auto` picks bf16 on CPUs with AVX-512-BF16, and the equality tests compare at fp32 tolerance
SYNTH = [
    "train.precision=fp32",
    # the optimiser these tests were written for (the default recipe is Adam with label smoothing)
    "optim.name=nesterov", "optim.weight_decay=0.0005", "optim.label_smoothing=0",
    "data.name=synthetic", "data.synthetic.num_train=512", "data.synthetic.num_val=128",
    "data.synthetic.num_test=128", "data.batch_size=32", "model.name=mlp", "train.device=cpu",
    "train.progress=none", "train.threads=1", "optim.lr=0.05",
]

# How far two fp32 runs of the same steps may drift apart when their sums run in another order (another
# number of processes, another split of the batch, FSDP's shards): usually 1e-8..1e-6 after 20 steps, but
# where one ReLU's input lands on the other side of zero in one run, that image's gradient moves a row of
# weights by about 1e-4 (8.9e-5 on an AMD EPYC with AVX-512 for the 2-process parity test; the same test
# measured 1e-8 on an Intel Xeon). A real error is far larger: a learning rate 1% off moves these weights
# by 1.2e-3, one image missing from one step by 6e-2, a summed instead of averaged gradient by 1e-1.
ACROSS_ORDERS = 5e-4

# bench runs with the threads each process gets by default (bench measures the real set-up)
BENCH = [s for s in SYNTH if not s.startswith("train.threads")]


@pytest.hookimpl(optionalhook=True)  # plain pytest, without xdist, runs the suite too
def pytest_xdist_auto_num_workers(config):
    """``make test`` runs ``pytest -n auto`` (pytest-xdist): one worker process a core this process may use,
    at most 4. Most tests wait on processes of their own (torch's import, a rendezvous, a timeout) or train on
    one thread, so on 2 cores two workers take the suite from 40 to 25 minutes (AMD EPYC, AVX2 only); past
    4, the tests that launch 2-3 processes each would crowd the cores their timeouts are measured on.
    Run directories, ports, network namespaces and Slurm clusters are each test's own; what the workers
    share ($BRICKYARD_CACHE: decoded data sets, precision measurements) is written atomically, as for two
    users at once.

    Where the time goes (2026-11-26, the same CPU, each process's CPU time logged at its exit): the suite starts
    about 670 Python processes, 571 of them import torch, and ``import torch`` alone costs 3.3-3.7 CPU-seconds
    there, so torch's import is about 2,000 of the suite's 2,700 CPU-seconds; the cores are busy throughout. A
    faster suite needs fewer processes, not more workers. ``OMP_WAIT_POLICY=PASSIVE`` changed nothing (25:53
    against 26:18 and 27:20): the tests pin one thread a process, so no OpenMP team spins. With the commands forked
    from a warm interpreter (``tests/warm.py``; 2026-11-27) the suite took 21:21 on 2 workers, and 21:24 on 3 with
    the cores 98.5% busy (``/proc/stat`` every 5 s): still no room for another worker."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: no affinity
    return max(1, min(4, cores))


# The slowest tests (40-150 s each on 2 cores under --durations), with their modules, go first. xdist's worksteal
# hands each worker a contiguous half of this order and an idle worker steals from the end of another's queue, so a
# long test collected late could start last and leave one core idle for minutes; first, they overlap the short
# tests. Whole modules move, so that a module-scoped fixture (a Slurm cluster, a reference run) is set up once.
SLOW_FIRST = (
    "tests/distributed/test_pipeline.py::test_vit_tiny_on_two_stages",
    "tests/launch/test_multinode.py::test_elastic_a_node_joins_then_leaves",
    "tests/distributed/test_tensor_parallel.py::test_vit_tiny_on_two_ranks",
    "tests/distributed/test_fsdp.py::test_fsdp_on_a_vit",
    "tests/launch/test_multinode.py::test_a_killed_node_returns",
    "tests/launch/test_slurm.py::test_scancel_saves_a_checkpoint",
    "tests/cli/test_cli.py::test_default_preset_reaches_99_percent",
    "tests/distributed/test_dist.py::test_sigterm_to_one_worker",
    "tests/training/test_device.py::test_tuned_allocator",
    "tests/training/test_global_batch.py::test_a_balanced_epoch",
    "tests/observe/test_trackers.py::test_mlflow_with_a_local_store",
    "tests/tools/test_export.py::test_registry_models_export_to_onnx_and_run_in_onnxruntime[vit_tiny",
    "tests/data/test_data.py::test_the_real_fashion_mnist_from_debian",
    "tests/training/test_rundir.py::test_a_second_process_on_a_live_run_directory",
    "tests/launch/test_slurm.py::test_the_readme_sbatch_script",
    "tests/observe/test_trackers.py::test_mlflow_against_a_real_tracking_server",
    "tests/distributed/test_dist.py::test_kill_a_worker",
)


def pytest_collection_modifyitems(config, items):
    """The modules of ``SLOW_FIRST`` first, in its order, each with its listed test first; the rest as collected."""
    def rank(nodeid: str) -> int:
        return next((i for i, prefix in enumerate(SLOW_FIRST) if nodeid.startswith(prefix)), len(SLOW_FIRST))
    module_rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_rank[module] = min(module_rank.get(module, len(SLOW_FIRST)), rank(item.nodeid))
    collected = {item.nodeid: n for n, item in enumerate(items)}
    items.sort(key=lambda item: (module_rank[item.nodeid.split("::")[0]], rank(item.nodeid), collected[item.nodeid]))


class _NoProcesses:
    """Makes a test marked ``fast`` fail the moment it starts a process or a process group.

    The fast tier (``make test-fast``, ``pytest -m fast``) is the suite's unit tier: pure logic and in-process
    training of a second or two. Starting a Python process costs 3-4 CPU-seconds for torch's import alone,
    and a process group waits on a rendezvous, so either would make the tier slow without anyone noticing.
    Every way to start one goes through the patched calls: ``subprocess`` (``run``, ``check_output``,
    ``os.popen``, asyncio's subprocesses) through ``Popen``; ``multiprocessing``, ``torch.multiprocessing``,
    process pools and loader workers through ``BaseProcess.start``; a bare ``os.fork``, ``os.forkpty``,
    ``os.posix_spawn``, ``os.system``; and ``torch.distributed.init_process_group``. The refusal is
    ``pytest.fail`` (a ``BaseException``, so an ``except Exception`` in the code under test does not swallow
    it), and a refusal that something did swallow still fails the test at its teardown."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self.refused: list[str] = []

    def refuse(self, what: str):
        def refused(*args, **kwargs):
            self.refused.append(what)
            pytest.fail(f"{self.nodeid} is marked fast but starts a process ({what}, from {_starter()}): the fast "
                        "tier runs no subprocess and no process group; drop the fast mark or keep the test in-process",
                        pytrace=False)
        return refused

    def install(self, monkeypatch):
        import multiprocessing.process
        # every run records platform.platform(), whose processor name Python reads once a process from
        # `uname -p` (a subprocess, not Python's) and caches: read it before the guard goes up
        platform.processor()
        monkeypatch.setattr(subprocess.Popen, "__init__", self.refuse("subprocess.Popen"))
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", self.refuse("multiprocessing start"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                monkeypatch.setattr(os, name, self.refuse(f"os.{name}"))
        import torch.distributed as tdist  # after the fork guards: torch's import runs no process of its own
        if tdist.is_available():
            monkeypatch.setattr(tdist, "init_process_group", self.refuse("torch.distributed.init_process_group"))
            monkeypatch.setattr(tdist.distributed_c10d, "init_process_group",
                                self.refuse("torch.distributed.init_process_group"))


def _starter() -> str:
    """The innermost caller outside Python's own library and this file: the code that started the process."""
    stdlib = sysconfig.get_paths()["stdlib"]
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(stdlib) and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "Python's own library"


_WORKERS: list[warm_workers.Workers] = []


def pytest_collection_finish(session):
    """torchrun's workers forked from a warm interpreter (``tests/warm_workers.py``), in each process that runs tests
    (not xdist's controller), unless only the fast tier runs (it starts no process) or ``BRICKYARD_TESTS_COLD=1``.
    Started once the tests are collected: importing them sets load-time variables (``TORCHINDUCTOR_CACHE_DIR``,
    ``KMP_INIT_AT_FORK``), and a server started before would match no worker."""
    config = session.config
    controller = getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ
    if controller or config.option.markexpr == "fast" or os.environ.get("BRICKYARD_TESTS_COLD") == "1" \
            or not sys.platform.startswith("linux") or "PYTHON_EXEC" in os.environ:
        return
    workers = warm_workers.Workers()
    # the threads run_torchrun gives each of 2 workers (``launch/torchrun.py``); other counts start cold
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
    workers.start({**os.environ, "OMP_NUM_THREADS": threads})
    os.environ["PYTHON_EXEC"] = workers.stand_in
    _WORKERS.append(workers)


def pytest_unconfigure(config):
    while _WORKERS:
        _WORKERS.pop().close()
        os.environ.pop("PYTHON_EXEC", None)


_CALL_PASSED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_CALL_PASSED] = report.passed
    return report


@pytest.fixture(autouse=True)
def _no_load_time_variable_leaks(request):
    """The variables read when a library loads (``warm.LOAD_TIME``) as each test found them: a leaked one would change
    how every later process of this pytest worker starts (cold instead of forked from a warm interpreter).
    Set up before, torn down after, every other fixture of the test (``monkeypatch`` included)."""
    before = warm.load_time(os.environ)
    yield
    after = warm.load_time(os.environ)
    if after != before:  # put back, not failed: a library a test loads may set one itself (TORCHINDUCTOR_CACHE_DIR)
        for k, _ in set(before) ^ set(after):
            os.environ.pop(k, None)
        os.environ.update(dict(before))


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request, monkeypatch):
    """The guard of ``_NoProcesses`` around every test marked ``fast`` (in ``make test`` as in ``make test-fast``)."""
    if request.node.get_closest_marker("fast") is None:
        yield
        return
    guard = _NoProcesses(request.node.nodeid)
    guard.install(monkeypatch)
    yield
    if guard.refused and request.node.stash.get(_CALL_PASSED, False):  # a test the refusal failed fails once
        pytest.fail(f"{request.node.nodeid} is marked fast but tried to start a process ({guard.refused[0]}), "
                    "and the refusal was caught inside the test", pytrace=False)


def have_mnist() -> bool:
    from brickyard.data import idx
    return idx.locate("mnist", None) is not None


needs_mnist = pytest.mark.skipif(not have_mnist(), reason="MNIST files not found (set BRICKYARD_DATA)")


def run_cli(*args, env=None, timeout=600, cwd=None):
    """Run `python -m brickyard ARGS` as a real process; returns CompletedProcess. The process is forked from a warm
    interpreter that has imported torch (``tests/warm.py``), or started cold where that could differ."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    done = warm.run(args, full_env, timeout, cwd)
    if done is not None:
        return done
    return subprocess.run([sys.executable, "-m", "brickyard", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


_MANY = """
import contextlib, io, json, os, sys
from brickyard.cli.main import main
for argv in json.loads(sys.argv[1]):
    out, err, env = io.StringIO(), io.StringIO(), dict(os.environ)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's refusals
            code = e.code
    os.environ.clear()  # what a launcher set for its workers is not the next command's environment
    os.environ.update(env)
    print(json.dumps({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}), flush=True)
"""


def run_cli_many(*commands, env=None, timeout=600, cwd=None):
    """Run each of ``commands`` (argument lists of `brickyard`) in turn: each a process forked from the warm
    interpreter (``run_cli``), or with ``BRICKYARD_TESTS_COLD=1`` all through ``cli.main.main`` in one cold process,
    torch imported once instead of once a command; returns a CompletedProcess-like object per command (returncode,
    stdout, stderr captured apart), ``timeout`` each. For commands whose process itself is not what a test checks."""
    import json
    from types import SimpleNamespace
    full_env = dict(os.environ)
    full_env.update(env or {})
    if full_env.get("BRICKYARD_TESTS_COLD") != "1":
        return [run_cli(*c, env=env, timeout=timeout, cwd=cwd) for c in commands]
    r = subprocess.run([sys.executable, "-c", _MANY, json.dumps([[str(a) for a in c] for c in commands])],
                       capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)
    done = [SimpleNamespace(**json.loads(line)) for line in r.stdout.splitlines() if line.startswith('{"returncode"')]
    assert r.returncode == 0 and len(done) == len(commands), r.stderr[-3000:]
    return done


def popen_cli(args, **kwargs) -> subprocess.Popen:
    """`python -u -m brickyard ARGS` started as ``subprocess.Popen(..., **kwargs)`` would start it, through the suite's
    stand-in for Python (``tests/warm_workers.py``: forked from a warm interpreter, its signals and exit the stand-in's),
    or cold where there is none. For a command a test waits for or signals, not one whose process itself it inspects."""
    if _WORKERS:  # a server for a command's environment (torchrun's workers get one thread each: theirs differs)
        _WORKERS[0].ensure(kwargs.get("env") or dict(os.environ))
    return subprocess.Popen([os.environ.get("PYTHON_EXEC") or sys.executable, "-u", "-m", "brickyard", *args], **kwargs)


def sigterm_rank_one(args, run: Path, rows: int):
    """`brickyard ARGS --run-dir RUN` on 2 processes, SIGTERM to rank 1 alone (as a scheduler may send it) once it has
    logged its pid and ``rows`` training rows are written; returns (returncode, stderr) of the command."""
    import re
    import signal
    import time
    proc = popen_cli([*args, "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log1, metrics = run / "logs" / "workerlog.1", run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (log1.is_file() and "pid" in log1.read_text() and metrics.is_file()
                                          and metrics.read_text().count('"train"') >= rows):
        time.sleep(0.05)
    os.kill(int(re.search(r"pid (\d+)", log1.read_text()).group(1)), signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def sets(*items):
    out = []
    for item in items:
        out += ["--set", item]
    return out


# One image in the training set is truncated; with train.seed=1 (pinned in ONE_BAD_IMAGE) it falls in rank 1's
# share of the first step on 2 processes. The tests read the workerlogs to confirm which rank met it.
ONE_BAD_IMAGE = ["data.name=imagefolder", "model.name=convnet", "train.epochs=1", "data.batch_size=8",
                 "data.global_batch_size=0", "train.seed=1", "train.precision=fp32", "train.threads=1",
                 "train.progress=none", "train.plots=false", "train.tensorboard=false"]


def one_bad_image(root: Path) -> Path:
    """An image folder of 2 classes x 40 JPEGs in train/ and val/, whose train/b/039.jpg is cut off."""
    import torch
    from PIL import Image
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(40):
                pixels = (torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(root / split / c / f"{i:03d}.jpg")
    (root / "train" / "b" / "039.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    return root


def readers_of_the_bad_image(logs: Path) -> list[int]:
    """The ranks whose workerlog in ``logs`` says they read the cut image (not that another rank left word of it)."""
    ranks = sorted(int(p.suffix[1:]) for p in logs.glob("workerlog.*"))
    return [n for n in ranks if any("039.jpg is unreadable" in line and "the cause, left by" not in line
                                    for line in (logs / f"workerlog.{n}").read_text().splitlines())]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty, private download cache, so tests never touch ~/.cache, and no system data folder (Debian's
    /usr/share/datasets), so the tests of downloads download."""
    d = tmp_path / "cache"
    monkeypatch.setenv("BRICKYARD_CACHE", str(d))
    monkeypatch.setenv("BRICKYARD_SYSTEM_DATA", str(tmp_path / "no-system-data"))
    return d


def free_port() -> int:
    """A port free now (for a test's own listener or a master that is meant not to answer)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_folder(tmp_path):
    """A loopback HTTP server of the folder ``tmp_path/www`` (downloads tested for real, offline);
    yields (folder, base URL ending in /)."""
    import functools
    import http.server
    import threading
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield www, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
