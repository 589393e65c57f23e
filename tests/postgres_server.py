"""A real PostgreSQL server for the tests: Debian's ``initdb`` and ``postgres``, a data directory of its own in a fresh
temporary folder, listening on a free port of loopback only (trust authentication, for the local user ``postgres``),
stopped by PID. Nothing under /etc or /var is touched.

``.ci/run`` installs Debian's ``postgresql`` where it is root and it is missing; ``unavailable()`` says why the
server cannot start here, and the tests skip with that reason. PostgreSQL refuses to run as root: as root, the server
runs as the ``postgres`` user the package creates.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True) if Path("/usr/lib/postgresql").is_dir() else []
    return next((str(v / name) for v in versions if (v / name).is_file()), None)


def unavailable() -> str | None:
    missing = [b for b in ("initdb", "postgres") if _binary(b) is None]
    if missing:
        return f"PostgreSQL is not installed ({', '.join(missing)} not found; apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running PostgreSQL as root needs the postgres user, which is missing"
    if _driver() is None:
        return "no PostgreSQL driver for SQLAlchemy is installed (pip install 'psycopg[binary]')"
    return None


def _driver() -> str | None:
    """The driver SQLAlchemy reaches PostgreSQL through here: psycopg (3), else psycopg2."""
    import importlib.util
    return next((d for d in ("psycopg", "psycopg2") if importlib.util.find_spec(d) is not None), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``with Server() as url:``: a database URL (``postgresql+psycopg://postgres@127.0.0.1:PORT/postgres``)."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="brickyard-pg-"))
        self.port, self.proc = _free_port(), None

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def __enter__(self) -> str:
        data = self.root / "data"
        if os.geteuid() == 0:
            os.chown(self.root, pwd.getpwnam("postgres").pw_uid, -1)
        subprocess.run(self._as_owner([_binary("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True, timeout=120)
        self.proc = subprocess.Popen(self._as_owner([_binary("postgres"), "-D", str(data), "-p", str(self.port),
                                                     "-h", "127.0.0.1", "-k", str(self.root)]),
                                     stdout=subprocess.DEVNULL, stderr=open(self.root / "server.log", "wb"))
        deadline = time.time() + 60
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return f"postgresql+{_driver()}://postgres@127.0.0.1:{self.port}/postgres"
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"PostgreSQL did not start: {(self.root / 'server.log').read_text()[-2000:]}")

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            # the postmaster's own PID (runuser, which started it, does not pass signals on): SIGINT, a fast shutdown
            try:
                pid = int((self.root / "data" / "postmaster.pid").read_text().split()[0])
                os.kill(pid, signal.SIGINT)
            except (OSError, ValueError, IndexError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
