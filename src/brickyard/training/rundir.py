"""``RunDir``: the one owner of a run directory while a run is in it.

What a run directory guarantees (``docs/training.md``, "The run directory"):

- **One writer.** Rank 0 holds an exclusive ``flock`` on ``RUN_DIR/.lock`` from before it reads or
  writes anything there until the process ends (the kernel drops it when the process dies, even by
  SIGKILL, so a crash never leaves a stale lock). A second brickyard process on the same directory
  is refused in one sentence naming the holder's pid, host and command.
- **Atomic files.** Everything brickyard writes whole (checkpoints, ``config.yaml``, ``env.json``,
  ``summary.json``, plots) goes through ``brickyard.files.write_atomic``; ``config.yaml`` is written
  only when it changes, and a ``config.yaml`` that brickyard did not write (a user's own file in a
  folder used as ``--run-dir``) is never replaced: the run is refused before anything is written.
- **One run per directory.** A directory that holds a run is continued with ``--resume``, never
  trained into afresh, and ``--resume FILE`` from elsewhere into it is refused: its rotation would
  delete that run's checkpoints.
- **Repair after a crash**, on resume, under the lock: ``metrics.jsonl`` loses the rows past the
  step it resumes from (the replayed steps would appear twice) and a line cut by the crash, and
  the temporaries of interrupted writes are removed. Nothing else is touched.

What it does not guarantee: the appended files (``metrics.jsonl``, logs, ``metrics.csv``) are
flushed per line, not fsync'd, so a power cut can lose their last lines; ``flock`` on NFS holds only
where the server supports it (Linux NFSv4 does; the lock is advisory either way).
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import socket
import sys
from pathlib import Path

from brickyard.config import RESOLVED_HEADER, Config, save_config
from brickyard.distributed import slurm
from brickyard.errors import BrickyardError
from brickyard.files import file_mode, remove_stale_temps, write_atomic

LOCK = ".lock"
# the files brickyard writes whole in a run directory and in its checkpoints/: their temporaries are ours to remove
_OURS = re.compile(r"^(step-\d+\.pt|best\.pt|config\.yaml|env\.json|summary\.json|metrics\.jsonl|metrics\.csv|"
                   r"test_errors\.pt|[\w.-]+\.png|snap-\d+\.pt|subspace\.pt)$")


def default_path(name: str) -> Path:
    """The one place a run directory is named when the user names none: under srun, one name every task
    agrees on from the job and step ids (each task's own clock could name another folder a second
    later), ``runs/NAME-slurmJOB.STEP``; else ``runs/NAME-YYYYmmdd-HHMMSS``, with ``-2``, ``-3``, ...
    when runs start within the same second. Torch-free (the command line names it before torch loads)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).replace("..", "_").lstrip(".") or "run"  # a name, never a path
    named = slurm.run_name(name)
    if named:
        return named
    base = Path("runs") / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


class RunDir:
    """The run directory of this process's run; only rank 0 (``owner``) locks, repairs and writes."""

    def __init__(self, path: Path, owner: bool):
        self.path, self.owner = Path(path), owner
        self._fd: int | None = None
        self._made = False  # this process created the lock file

    # the lock

    def lock(self, resume: str | None, restarting: bool) -> None:
        """Take the directory for this process (or raise naming the process that has it), then check that
        this run may start here (``check_start``)."""
        if not self.owner:
            return
        self._take()
        try:
            self.check_start(resume, restarting)
        except BaseException:
            self._let_go()
            raise

    def claim(self) -> None:
        """Write this process into the lock file, once the run has started (a start refused before then
        changes nothing in the directory): what a second process on another host is told."""
        if self._fd is not None:
            who = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:300]}
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, (json.dumps(who) + "\n").encode(), 0)

    def _let_go(self) -> None:
        """Unlock after a refused start: a lock file this process made goes too (the folder may be the user's own)."""
        if self._fd is not None and self._made:
            (self.path / LOCK).unlink(missing_ok=True)  # still held: no other process has it
        self.unlock()

    def _take(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._made = not (self.path / LOCK).exists()
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path / LOCK, flags, file_mode())
        except OSError as e:
            raise BrickyardError(f"run directory {self.path} cannot be locked ({self.path / LOCK}: "
                                 f"{e.strerror}).") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise BrickyardError(f"run directory {self.path} is in use by {holder}; wait for it to end, stop it, "
                                 f"or pick another --run-dir.") from None
        except OSError as e:  # a file system without flock
            os.close(fd)
            raise BrickyardError(f"run directory {self.path} cannot be locked ({e.strerror}); use a directory "
                                 f"on a file system that supports flock.") from None
        self._fd = fd

    def probe(self, resume: str | None, restarting: bool) -> None:
        """What ``lock`` and ``check_start`` would say, said now and the lock let go (the launcher, before
        its workers start: rank 0 takes the lock for the run). A directory that does not exist yet is free."""
        if not self.path.is_dir():
            return
        self._take()
        try:
            self.check_start(resume, restarting)
        finally:
            self._let_go()

    def unlock(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock file stays: removing it would let two processes lock two files
            self._fd = None

    # what may start here

    def holds_run(self) -> bool:
        return (self.path / "metrics.jsonl").is_file() or any((self.path / "checkpoints").glob("step-*.pt"))

    def check_start(self, resume: str | None, restarting: bool) -> None:
        """Before anything in the directory is opened: a fresh run needs a directory without a run, and a
        ``config.yaml`` here must be brickyard's."""
        if not self.owner:
            return
        if not resume and not restarting and self.holds_run():
            raise BrickyardError(f"run directory {self.path} already holds a run; continue it with --resume auto, "
                                 f"or pick another --run-dir.")
        config = self.path / "config.yaml"
        if config.is_symlink() or (config.exists() and not self._ours(config, resume)):
            raise BrickyardError(f"run directory {self.path} holds a config.yaml that brickyard did not write (your "
                                 f"own file?); it is never replaced: pick another --run-dir (e.g. {self.path / 'runs'}).")

    def check_resume_file(self, resume: str) -> None:
        """``--resume FILE`` continues FILE's run here: refused when this directory holds another run,
        whose checkpoints the new run's rotation would delete (a file of this run's own is fine)."""
        if self.owner and self.holds_run() and Path(resume).resolve().parent != (self.path / "checkpoints").resolve():
            raise BrickyardError(f"--resume {resume}: run directory {self.path} holds another run, whose "
                                 f"checkpoints this run would rotate away; resume into a new --run-dir, or "
                                 f"continue that run with --resume auto.")

    def _ours(self, config: Path, resume: str | None) -> bool:
        """brickyard's resolved dump: marked by its first line, or (written before the mark existed) in a
        directory holding a run that is being resumed."""
        try:
            with open(config, "rb") as f:
                first = f.readline().decode(errors="replace").rstrip("\n")
        except OSError:
            return False
        return first == RESOLVED_HEADER or (bool(resume) and self.holds_run())

    # repair after a crash

    def repair(self, step: int) -> list[str]:
        """On resume at ``step``: drop the temporaries of interrupted writes and the metrics rows past
        ``step`` (and a cut last line). Returns what it did, as phrases for the log."""
        if not self.owner:
            return []
        done = []
        for folder in (self.path, self.path / "checkpoints"):
            removed = remove_stale_temps(folder, lambda name: bool(_OURS.match(name)))
            if removed:
                done.append(f"removed {len(removed)} temporary file(s) of interrupted writes in {folder}")
        past, unreadable = metrics_repair(self.path / "metrics.jsonl", step)
        if past:
            done.append(f"dropped {past} metrics.jsonl row(s) past step {step} (they are trained again)")
        if unreadable:
            lines = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
            done.append(f"dropped {len(unreadable)} metrics.jsonl line(s) that were not JSON rows (line {lines}: cut by "
                        f"a crash or written by something else)")
        return done

    def save_config(self, cfg: Config) -> bool:
        return save_config(cfg, self.path / "config.yaml") if self.owner else False


def _read_holder(fd: int) -> str:
    """Who holds the lock on ``fd``'s file: this machine's kernel knows (``/proc/locks``); else what the
    holder wrote into the file when its run started (another host sharing the folder)."""
    try:
        inode = os.fstat(fd).st_ino
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(inode):
                    pid = int(parts[4])
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        command = c.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
                    return f"process {pid} on this machine ({command})"
    except (OSError, ValueError):
        pass
    try:
        who = json.loads(os.pread(fd, 4096, 0).decode())
        return f"process {int(who['pid'])} on {who['host']} ({who['command']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def repair_metrics(path: Path, step: int) -> int:
    """Keep the rows of ``metrics.jsonl`` at or before ``step`` (and those without a step); drop a line that
    is not a JSON object (cut by a crash, or written by something else). Rewritten atomically, only when
    something goes; returns how many lines went (``metrics_repair`` says which)."""
    past, unreadable = metrics_repair(path, step)
    return past + len(unreadable)


def metrics_repair(path: Path, step: int) -> tuple[int, list[int]]:
    """``repair_metrics``: (rows past ``step`` dropped, the line numbers of lines that were not JSON rows)."""
    if not path.is_file():
        return 0, []
    raw = path.read_bytes()
    keep, past, unreadable = [], 0, []
    for number, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            unreadable.append(number)
            continue
        s = row.get("step")
        if isinstance(s, (int, float)) and s > step:
            past += 1
            continue
        keep.append(line)
    if past or unreadable or (raw and not raw.endswith(b"\n")):  # the next row must not be glued onto a cut one
        write_atomic(path, b"".join(x + b"\n" for x in keep))
    return past, unreadable
