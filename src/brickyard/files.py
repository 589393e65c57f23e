"""Every file brickyard writes, written one way: whole or not at all, never through a planted link.

``write_atomic(path, data)`` makes a temporary file with ``mkstemp`` in the target's own folder (a
new name that cannot exist yet, opened with ``O_EXCL``, so a symbolic link planted at any name is
never followed), writes and fsyncs it, gives it the permissions the umask allows (``mkstemp``'s
0600 would hide a shared cache from its other users), renames it over the target and fsyncs the
folder. A crash, a full disk or a file-size limit at any point leaves the old file as it was and at
most a temporary ``.NAME.XXXXXXXX.tmp`` beside it, which ``remove_stale_temps`` takes away on the
next start of that run.

What this does not promise: two processes writing the same target both succeed and the last rename
wins (a run directory has one writer: ``training.rundir.RunDir``'s lock), and a file appended line
by line (``metrics.jsonl``, logs) can end in a cut line after a crash (``RunDir.repair_metrics``).

Files of tensors (checkpoints, snapshots, subspaces) are written by ``write_torch`` and read back by
``read_torch``, which verifies every member of ``torch.save``'s zip against the CRC-32 stored with it
(``torch.load`` does not: a flipped byte in a tensor loads as a slightly different weight) and loads
with ``weights_only=True``, so a file cannot run code.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from brickyard.errors import CheckpointError

Writer = Callable[[BinaryIO], object]

# mkstemp's names: the prefix, eight characters of its alphabet, the suffix
_TEMP = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}\.tmp$")


def os_error(e: OSError) -> str:
    """The sentence for a file the system refused (a full disk, a size limit, permissions): its name and the reason."""
    return f"{printable(e.filename) + ': ' if e.filename else ''}{e.strerror or e}."


def printable(path) -> str:
    """A file name as a message can show it: a name that is not valid UTF-8 (bytes Python keeps as
    surrogates) gets backslash escapes instead of breaking the log or the console."""
    return os.fsdecode(path).encode("utf-8", "backslashreplace").decode("utf-8")


def umask() -> int:
    """The process's umask, read without changing it (``/proc``), else by setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def file_mode() -> int:
    """What ``open(path, "w")`` would give a new file: 0666 less the umask."""
    return 0o666 & ~umask()


@contextlib.contextmanager
def naming(path):
    """Inside, an ``OSError`` that names no file (a write's: no space, a size limit) or only one of
    ``write_atomic``'s temporaries names ``path`` instead, as the CLI says it: "PATH: reason"."""
    try:
        yield
    except OSError as e:
        if e.filename is None or _TEMP.match(os.path.basename(os.fsdecode(e.filename))):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def write_atomic(path: str | Path, data: bytes | str | Writer) -> Path:
    """Replace ``path`` with ``data`` (bytes, text, or a function that writes to a binary file) in one
    step; see the module docstring. An ``OSError`` (no space, a size limit, no permission, a folder that
    takes no new file) leaves the old file and no temporary behind and is raised naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                os.fsync(f.fileno())
                os.fchmod(f.fileno(), file_mode())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    sync_folder(path.parent)
    return path


def sync_folder(folder: Path) -> None:
    """fsync a folder, so that a rename in it survives a power cut (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json(path: str | Path, obj) -> Path:
    return write_atomic(path, json.dumps(obj, indent=2) + "\n")


def write_if_changed(path: str | Path, text: str) -> bool:
    """Write ``text`` atomically unless ``path`` already holds exactly it; True when it wrote."""
    path = Path(path)
    try:
        if path.is_file() and not path.is_symlink() and path.read_bytes() == text.encode():
            return False
    except OSError:
        pass
    write_atomic(path, text)
    return True


def copy_atomic(source: str | Path, target: str | Path) -> Path:
    """A copy of ``source`` that appears at ``target`` whole or not at all."""
    def copy(f):
        with open(source, "rb") as src:
            while chunk := src.read(1 << 22):
                f.write(chunk)
    return write_atomic(target, copy)


def remove_stale_temps(folder: Path, targets: Callable[[str], bool]) -> list[Path]:
    """Remove the temporaries ``write_atomic`` left in ``folder`` (a crash between mkstemp and rename)
    for the files ``targets(name)`` says are brickyard's. Only plain files of that exact name shape go;
    call it only while holding the folder's lock (a live writer's temporary looks the same)."""
    removed = []
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        m = _TEMP.match(p.name)
        if m and targets(m.group("target")) and p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


class _Writes:
    """A binary file as ``torch.save`` writes to it, keeping the first ``OSError`` of a write: torch's zip
    writer swallows it and raises "[enforce fail at inline_container.cc] unexpected pos" instead, which
    says nothing of a full disk, a quota or a file-size limit."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name):  # flush, fileno, tell ...: the file's own
        return getattr(self.f, name)


def write_torch(obj, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path``, atomically (``write_atomic``); a failed write is the ``OSError``
    the system gave (no space, a quota, a size limit), naming ``path``."""
    import torch  # lazy: this module is imported by the command line, which starts without torch

    def save(f):
        out = _Writes(f)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise
    return write_atomic(path, save)


def _damaged_member(path: Path) -> str | None:
    """The first member of the zip whose data does not match its stored CRC-32 (or that cannot be read)."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"({e})"
    except Exception as e:  # noqa: BLE001  zipfile raises zlib errors and others on damaged data
        return f"({type(e).__name__})"


def read_torch(path: str | Path, what: str = "checkpoint"):
    """A file written by ``torch.save``, verified and loaded weights-only on the CPU; a missing, foreign,
    damaged or code-carrying file is a ``CheckpointError`` sentence that calls it ``what``."""
    import torch  # lazy: this module is imported by the command line, which starts without torch
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist.")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{what} {path} cannot be read: it is not a file written by torch.save "
                              f"(another format, or cut short).")
    bad = _damaged_member(path)
    if bad is not None:
        raise CheckpointError(f"{what} {path} is damaged: {bad} does not match the checksum written with it "
                              f"(a bad disk, or a copy cut short or altered).")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001  any unpickling failure means a bad file
        found = pickled_object(e)
        if found is not None:
            raise CheckpointError(f"{what} {path} holds Python objects besides tensors{found}, which brickyard does not "
                                  f"unpickle (that can run code): it is not a file brickyard wrote.") from None
        raise CheckpointError(f"{what} {path} cannot be read ({load_failure(e)}).") from None


def load_failure(e: BaseException) -> str:
    """A ``torch.load`` failure as the reason inside a sentence: its first line without terminal colours
    (torch's weights-only refusal bolds a phrase), at most 160 characters, or its type's name."""
    lines = [x.strip() for x in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if x.strip()]
    return lines[0][:160] if lines else type(e).__name__


def pickled_object(e: BaseException) -> str | None:
    """Where ``torch.load(weights_only=True)`` refused a file for pickling a Python object (a ``Path`` in a
    Lightning checkpoint's hyper-parameters, a whole pickled model): `` (such as pathlib.PosixPath)``, or ""
    when torch did not name it; None for any other failure."""
    text = str(e)
    found = re.search(r"unsupported(?: global:)? GLOBAL (\S+)", text, re.IGNORECASE)  # both of torch 2.6+'s wordings
    if found:
        return f" (such as {found.group(1)})"
    return "" if "Weights only load failed" in text else None
