"""A real one-node Slurm cluster for the tests: Debian's munged, slurmctld and slurmd, started with a
config and state directory of their own (ports chosen free, nothing under /etc or /var touched) and
stopped by PID.

``.ci/run`` installs the packages (slurmctld, slurmd, slurm-client, munge) when it is root and they are
missing; ``unavailable()`` says why the cluster cannot start here, and the tests skip with that reason.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "sinfo", "squeue")


def unavailable() -> str | None:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} not found; apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """``with Cluster(tmp) as c: c.run(["srun", "-n", "2", ...])``; ``c.env`` points the clients at it."""

    def __init__(self, root: Path, cpus: int = 2):
        self.root, self.cpus, self.procs = Path(root), cpus, []
        self.node = socket.gethostname().split(".")[0]

    def __enter__(self):
        r = self.root
        for d in ("state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "run", 0o755)  # munged wants its socket's folder readable by all
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        (r / "plugstack.conf").write_text("")
        conf = r / "slurm.conf"
        conf.write_text("\n".join([
            "ClusterName=brickyardtest", f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={r}/run/munge.socket", "CredType=cred/munge",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/run/slurmctld.pid", f"SlurmdPidFile={r}/run/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "SchedulerType=sched/backfill",
            f"PlugStackConfig={r}/plugstack.conf", "KillWait=20",  # scancel: SIGTERM, then SIGKILL 20 s later
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""]))
        self.env = {**os.environ, "SLURM_CONF": str(conf)}
        logs = r / "log"
        self._start(["munged", "-F", "-f", f"--socket={r}/run/munge.socket", f"--key-file={key}",
                     f"--pid-file={r}/run/munged.pid", f"--log-file={logs}/munged.log", f"--seed-file={r}/run/munged.seed"],
                    logs / "munged.out")
        time.sleep(0.5)
        self._start(["slurmctld", "-D", "-f", str(conf)], logs / "slurmctld.out")
        self._start(["slurmd", "-D", "-f", str(conf), "-N", self.node], logs / "slurmd.out")
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if out.stdout.strip() == "idle":
                return self
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the test Slurm cluster did not become idle in 60 s; logs in {logs}")

    def _start(self, argv, out: Path):
        self.procs.append(subprocess.Popen(argv, env=getattr(self, "env", None), stdout=out.open("w"),
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def run(self, argv, timeout=300, cwd=None, env=None, **kw):
        return subprocess.run(argv, env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, **kw)

    def popen(self, argv, cwd=None, env=None):
        return subprocess.Popen(argv, env={**self.env, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=cwd, start_new_session=True)

    def wait_idle(self, timeout=60) -> None:
        """Until no job is left (one test's job must not hold the CPUs of the next)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.run(["squeue", "-h"]).stdout.strip():
                return
            time.sleep(0.3)

    def __exit__(self, *exc):
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return False
