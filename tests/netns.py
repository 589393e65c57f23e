"""Several network hosts on one machine, for multi-node tests: Linux network namespaces joined by veth
pairs to a bridge that lives in a switch namespace of its own.

Host i has the address 192.168.250.(i+1)/24 on its interface ``eth0`` and only that network, so a
job that works here works between machines that reach each other by those addresses and nothing
else. Everything is made by the test that asks for it and removed afterwards, also when the test
fails: the namespaces (which takes their links along), the processes still running in them, and
the ``/etc/netns/NAME`` folders that give a host its own ``/etc/hosts``. No address outside these
namespaces is used, and no traffic leaves them.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SUBNET = "192.168.250"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"byprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Hosts:
    """``n`` hosts; ``names`` maps a host name (for /etc/hosts) to each host, e.g. node01, node02."""

    def __init__(self, n: int, names: list[str] | None = None):
        self.tag = f"by{os.getpid() % 100000}{int(time.time() * 1000) % 1000}"
        self.switch = f"{self.tag}sw"
        self.hosts = [f"{self.tag}h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []
        self._host_of: dict[int, int] = {}
        try:
            self._make(names)
        except BaseException:
            self.close()
            raise

    def _make(self, names) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            if names:  # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
                    f"{self.addr(j)} {name}\n" for j, name in enumerate(names)))

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def popen(self, i: int, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        """``python -m brickyard ARGV`` on host ``i`` (``env`` adds to ours; None unsets), in a process group of its own (to kill a whole node)."""
        # a crash in native code prints where Python was (a node died once of SIGSEGV with nothing on stderr)
        full_env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
        full_env.update(env or {})
        full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[i], sys.executable, "-m", "brickyard", *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                             start_new_session=True)
        self.procs.append(p)
        self._host_of[p.pid] = i
        return p

    def wait(self, p: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
        """``p``'s ``(returncode, stdout, stderr)``. When it has not ended within ``timeout`` s, every process
        of its host gets SIGABRT first: faulthandler (on in ``popen``'s environment) prints each one's Python
        stacks, every thread's, to that stderr, which the failure shows, so a hang says where it hung."""
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            i = self._host_of[p.pid]
            self._kill_all(self.hosts[i], signal.SIGABRT)
            try:
                out, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self._kill_all(self.hosts[i])
                out, err = p.communicate(timeout=30)
            raise AssertionError(f"host {i} had not ended after {timeout:g}s; the Python stacks of its processes "
                                 f"(SIGABRT) and what it printed before:\n{err[-20000:]}") from None
        return p.returncode, out, err

    def kill_node(self, i: int) -> None:
        """SIGKILL every process on host ``i`` (launcher, agent and workers: torchrun starts workers in
        sessions of their own, so killing the command's process group is not enough)."""
        self._kill_all(self.hosts[i])
        for p in self.procs:
            if p.poll() is None and self._host_of.get(p.pid) == i:
                p.wait(timeout=30)

    @staticmethod
    def _kill_all(ns: str, sig: int = signal.SIGKILL) -> None:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except (ProcessLookupError, ValueError):
                pass

    def cut(self, i: int) -> None:
        """Take host ``i`` off the network (its switch port down)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        for ns in [*self.hosts, self.switch]:
            self._kill_all(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
