"""`python -m brickyard ARGS` for the suite, forked from a warm interpreter instead of started cold.

Each command is still a process of its own (its own pid, file descriptors, environment, working directory, signal
handlers, exit status, ``atexit`` at its end, and the processes a launcher starts are started as a user's are); what
it shares with the others is what every one of them would do first: start Python and import torch and brickyard
(2.6 of a small training command's 3.4 CPU-seconds on an AMD EPYC core). A server, one an xdist worker, imports
them once and forks a child per command, as ``multiprocessing``'s forkserver does; the server runs nothing else,
so every child starts from the state right after the imports.

A variable read when a library loads (``OMP_NUM_THREADS``, ``PYTHONPATH``, ``LD_PRELOAD``, ...) is the server's:
commands whose values of these differ go to servers of their own, each started with them (at most ``KEEP`` at
once). ``BRICKYARD_TESTS_COLD=1`` starts every command cold instead, as a user's shell does.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading

# variables a library reads once, when it loads: a command whose environment differs from a server's in one of these
# goes to a server started with its values (OpenMP and MKL read their thread settings at load, Python its paths,
# glibc its allocator)
LOAD_TIME = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "NCCL", "LD_", "PYTHON",
             "MALLOC", "GLIBC", "ATEN", "DNNL", "ONEDNN", "BRICKYARD_TESTS_COLD")

_SERVER = r"""
import json, os, pkgutil, runpy, sys
import torch
import brickyard
for m in pkgutil.walk_packages(brickyard.__path__, "brickyard."):
    if not m.name.endswith(".__main__"):  # `python -m brickyard.config` writes a table
        __import__(m.name)
try:
    import torch.utils.tensorboard  # every run writes its events (the [viz] extra)
except ImportError:
    pass
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid:
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
        continue
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY), (2, req["err"], os.O_WRONLY)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(os.devnull)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.argv = ["brickyard", *req["args"]]
    runpy.run_module("brickyard", run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # never back into the loop: a child ends as a process does, atexit and all
"""


KEEP = 3


def load_time(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(LOAD_TIME)))


_servers: dict[tuple, Server] = {}
_servers_lock = threading.Lock()


def run(args, env: dict[str, str], timeout: float, cwd) -> subprocess.CompletedProcess | None:
    """``python -m brickyard ARGS`` forked from the warm server for ``env``'s load-time variables; None: start it
    cold (``BRICKYARD_TESTS_COLD=1``, or another thread's command is running in that server)."""
    if env.get("BRICKYARD_TESTS_COLD") == "1":
        return None
    key = load_time(env)
    with _servers_lock:
        if key not in _servers:
            if os.environ.get("BRICKYARD_TESTS_WARM_LOG"):  # which load-time variables made another server
                with open(os.environ["BRICKYARD_TESTS_WARM_LOG"], "a") as f:
                    f.write(f"{os.getpid()} {sorted(set(key) - set(next(iter(_servers), ())))}\n")
            idle = [k for k, s in _servers.items() if not s.lock.locked()]
            if len(_servers) >= KEEP and idle:
                _servers.pop(idle[0]).close()
            _servers[key] = Server(env)
        server = _servers[key]
    return server.run(args, env, timeout, cwd)


class Server:
    """One warm interpreter; ``run`` forks it once a command, or returns None when it is busy."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.pending = b""

    def line(self, timeout: float | None = None) -> str | None:
        """The server's next line, or None when none came within ``timeout`` (its pipe read raw: no buffer hides
        a line from select)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the warm interpreter ended (exit {self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def start(self) -> bool:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, bufsize=0, env=self.env, cwd=tempfile.gettempdir())
            first = self.line(300)
            if first != "ready":
                self.kill()
                raise RuntimeError(f"the warm interpreter did not start (it said {first!r})")
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()  # its loop ends at the end of its input
            self.proc.wait()
            self.proc = None

    def kill(self) -> None:
        """End the server where its answers can no longer be read in step (a command interrupted mid-way): the
        next command starts a new one."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc, self.pending = None, b""

    def run(self, args, env: dict[str, str], timeout: float, cwd) -> subprocess.CompletedProcess | None:
        if not self.lock.acquire(blocking=False):  # a second thread's command goes cold
            return None
        try:
            if not self.start():
                return None
            with tempfile.TemporaryDirectory() as tmp:
                out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
                open(out, "w").close()
                open(err, "w").close()
                request = {"args": [str(a) for a in args], "env": env, "cwd": str(cwd or os.getcwd()),
                           "out": out, "err": err}
                try:
                    code = self._exchange(request, timeout)
                except BaseException:  # a timeout, Ctrl-C: its answers are out of step now
                    self.kill()
                    raise
                with open(out) as f_out, open(err) as f_err:
                    return subprocess.CompletedProcess(["brickyard", *args], code, f_out.read(), f_err.read())
        finally:
            self.lock.release()

    def _exchange(self, request: dict, timeout: float) -> int:
        """Send one command; its exit status (``subprocess.TimeoutExpired`` past ``timeout``, the command killed)."""
        data = (json.dumps(request) + "\n").encode()
        while data:
            data = data[os.write(self.proc.stdin.fileno(), data):]
        pid = int(self.line(60))
        code = self.line(timeout)
        if code is None:  # as subprocess.run's timeout: kill the command, then say so
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(["brickyard", *request["args"]], timeout)
        return int(code)

