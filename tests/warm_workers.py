"""torchrun's workers for the suite, forked from a warm interpreter instead of started cold (``tests/warm.py`` does
the same for the commands a test runs).

torchrun starts each worker as ``$PYTHON_EXEC -u -m brickyard train ...`` (``torch/distributed/run.py``: "PYTHON_EXEC
- System executable override"). In the suite ``PYTHON_EXEC`` is a stand-in (``stand_in``: Python without site, no
torch, about 20 ms) that hands its arguments, environment, working directory, umask, CPU affinity and its standard
input, output and error (the descriptors themselves) to a warm server of this pytest worker over a Unix socket. The
server forks a keeper, which forks the worker: the worker runs ``brickyard`` as ``python -u -m`` would, in a session
of its own, as torchrun's workers are. The stand-in stays torchrun's child and mirrors the worker: signals it gets
go to the worker, the worker's pid is what the worker logs (tests signal it by that), and its end is the stand-in's
end (its exit code, or the same signal). A stand-in killed outright (SIGKILL, as torchrun's last resort or a test)
takes the worker with it: the keeper sees its socket close and kills the worker.

Where the worker could differ from a cold one, the stand-in starts it cold (``exec`` of the real Python): another
value of a variable read when a library loads (``warm.LOAD_TIME``; torchrun's own per-job variables aside), another
network namespace (the multi-node tests' hosts) or user, arguments other than ``-u -m MODULE`` or ``-u SCRIPT``, no
server, or ``BRICKYARD_TESTS_COLD=1``.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

from warm import LOAD_TIME

# torchrun's variables for each job and rank, read when a process group starts, never when a library loads
PER_JOB = ("TORCHELASTIC_", "TORCH_NCCL_", "PYTHON_EXEC")


def key(env, net: int, uid: int) -> str:
    """The server a worker with ``env`` in network namespace ``net`` as ``uid`` may fork from."""
    loaded = sorted((k, v) for k, v in env.items() if k.startswith(LOAD_TIME) and not k.startswith(PER_JOB))
    return hashlib.sha256(json.dumps([loaded, net, uid]).encode()).hexdigest()[:16]


_STAND_IN = r'''#!{python} -S
import json, os, signal, socket, sys
REAL, FOLDER = {python!r}, {folder!r}
sys.path.insert(0, {tests!r})

def cold():
    os.execv(REAL, [REAL, *sys.argv[1:]])

args = sys.argv[1:]
if os.environ.get("BRICKYARD_TESTS_COLD") == "1" or not args or args[0] != "-u":
    cold()
if args[1:2] == ["-m"] and len(args) > 2:
    target = {{"module": args[2], "argv": args[3:]}}
elif len(args) > 1 and not args[1].startswith("-"):
    target = {{"script": args[1], "argv": args[2:]}}
else:
    cold()
from warm_workers import key
path = os.path.join(FOLDER, key(os.environ, os.stat("/proc/self/ns/net").st_ino, os.getuid()) + ".sock")
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(path)
except OSError:
    cold()
umask = os.umask(0o22)
os.umask(umask)
request = dict(target, env=dict(os.environ), cwd=os.getcwd(), umask=umask, cpus=sorted(os.sched_getaffinity(0)))
socket.send_fds(s, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
pid, early = None, []
def forward(n, _):
    if pid is None:  # before the worker's pid came: sent on once it has
        early.append(n)
        return
    try:
        os.kill(pid, n)
    except ProcessLookupError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
f = s.makefile("r")
pid = int(f.readline())
for n in early:
    forward(n, None)
line = f.readline()
code = int(line) if line.strip() else -signal.SIGKILL
if code < 0:
    if -code != signal.SIGKILL:
        signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
os._exit(code)
'''

_SERVER = r'''
import io, json, os, pkgutil, runpy, signal, socket, sys, threading
sys.path.insert(0, {tests!r})
import torch
import brickyard
for m in pkgutil.walk_packages(brickyard.__path__, "brickyard."):
    if not m.name.endswith(".__main__"):
        __import__(m.name)
try:
    import torch.utils.tensorboard
except ImportError:
    pass
from warm_workers import key
path = os.path.join({folder!r}, key(os.environ, os.stat("/proc/self/ns/net").st_ino, os.getuid()) + ".sock")
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(64)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the keepers end on their own
print("ready", flush=True)


def run(conn, request, fds):
    os.setsid()  # torchrun starts each worker in a session of its own
    for fd, given in zip((0, 1, 2), fds):
        os.dup2(given, fd)
    for given in fds:
        os.close(given)
    conn.close()
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["cpus"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin = open(0, "r", closefd=False)
    for fd, name in ((1, "stdout"), (2, "stderr")):  # python -u: unbuffered, each write goes out at once
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                                            write_through=True))
    if "module" in request:
        sys.path[0] = os.getcwd()
        sys.argv = [request["module"], *request["argv"]]
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))
        sys.argv = [request["script"], *request["argv"]]


def keep(conn, request, fds):
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    listener.close()
    pid = os.fork()
    if pid == 0:
        return request  # the worker: it runs at the top level, out of every try, so that it ends as a process does
    for given in fds:
        os.close(given)
    conn.sendall(f"{{pid}}\n".encode())

    def watch():  # the stand-in gone (killed outright): so is its worker
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    threading.Thread(target=watch, daemon=True).start()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    try:
        conn.sendall(f"{{code}}\n".encode())
    except OSError:
        pass
    os._exit(0)


while True:
    conn, _ = listener.accept()
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        data += more
    if os.fork() == 0:
        try:
            request = keep(conn, json.loads(data), fds)  # the keeper ends inside; the worker comes back
        except BaseException:
            os._exit(1)
        break
    for given in fds:
        os.close(given)
    conn.close()

run(conn, request, fds)
if "module" in request:
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(request["script"], run_name="__main__")
'''


class Workers:
    """This pytest worker's warm server for torchrun's workers and the stand-in that reaches it; ``env()`` is what
    the suite's processes get (``PYTHON_EXEC``)."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="bw-", dir="/tmp")  # a short path: a socket's is 107 bytes at most
        tests = os.path.dirname(os.path.abspath(__file__))
        self.stand_in = os.path.join(self.folder, "python")
        with open(self.stand_in, "w") as f:
            f.write(_STAND_IN.format(python=sys.executable, folder=self.folder, tests=tests))
        os.chmod(self.stand_in, 0o755)
        self.server_code = _SERVER.format(folder=self.folder, tests=tests)
        self.servers: list[subprocess.Popen] = []
        self.envs: list[dict[str, str]] = []  # each server's environment, as it was started

    def ensure(self, env: dict[str, str]) -> None:
        """A server for ``env``'s load-time variables, started unless one is there."""
        net = os.stat("/proc/self/ns/net").st_ino
        if all(key(e, net, os.getuid()) != key(env, net, os.getuid()) for e in self.envs):
            self.start(env)

    def start(self, env: dict[str, str]) -> None:
        """A server for workers whose load-time environment is ``env``'s (it answers ``ready`` once warm)."""
        proc = subprocess.Popen([sys.executable, "-c", self.server_code], env=env, stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir(), start_new_session=True)
        self.servers.append(proc)
        self.envs.append(dict(env))
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the warm server for torchrun's workers did not start")

    def close(self) -> None:
        for proc in self.servers:
            proc.kill()
            proc.wait()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)
