"""CIFAR-10 and CIFAR-100 from their authors' binary archives ("suitable for C programs"), never the
pickled ones: reading them runs no code.

Layout, from https://www.cs.toronto.edu/~kriz/cifar.html: CIFAR-10's archive holds
``cifar-10-batches-bin/data_batch_{1..5}.bin`` and ``test_batch.bin``, records of 1 label byte and
3072 image bytes (1024 red, 1024 green, 1024 blue, each 32x32 row by row), and ``batches.meta.txt``
(the class names, one per line). CIFAR-100's holds ``cifar-100-binary/train.bin`` and ``test.bin``,
records of a coarse label byte, a fine label byte and the same 3072 bytes, and
``fine_label_names.txt``; brickyard trains on the 100 fine labels.

Lookup as for MNIST (``data.idx``): ``data.root`` when given, else ``$BRICKYARD_DATA/NAME/``, then the
cache ``~/.cache/brickyard/NAME/``; a folder counts when it holds the archive or the extracted files.
A missing archive is downloaded from the published URL (``BRICKYARD_CIFAR_URL`` overrides the folder
it is fetched from: a mirror, or a test's server), its MD5 checked against the published one before it
is kept, and the decoded arrays cached as ``.npy`` beside it.
"""
from __future__ import annotations

import hashlib
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from brickyard.data import idx
from brickyard.errors import DataError
from brickyard.files import write_atomic


@dataclass(frozen=True)
class CifarSpec:
    archive: str
    md5: str            # of the archive, as published on the authors' page
    folder: str         # the folder inside the archive
    train: tuple[str, ...]
    test: tuple[str, ...]
    names: str          # the class names file
    label_bytes: int    # bytes before the image in each record (the label is the last of them)


URL = "https://www.cs.toronto.edu/~kriz/"
SPECS = {
    "cifar10": CifarSpec("cifar-10-binary.tar.gz", "c32a1d4ab5d03f1284b67883e8d87530", "cifar-10-batches-bin",
                         tuple(f"data_batch_{i}.bin" for i in range(1, 6)), ("test_batch.bin",), "batches.meta.txt", 1),
    "cifar100": CifarSpec("cifar-100-binary.tar.gz", "03b5dce01913d631647c71ecec9e9cb8", "cifar-100-binary",
                          ("train.bin",), ("test.bin",), "fine_label_names.txt", 2),
}
IMAGE = 3 * 32 * 32
# per-channel mean and std of the training images (RGB, on 0..1), as commonly published for each set
STATS = {"cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
         "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))}


def _extracted(folder: Path, spec: CifarSpec) -> Path | None:
    inner = folder / spec.folder
    return inner if all((inner / f).is_file() for f in spec.train + spec.test + (spec.names,)) else None


def locate(name: str, root: str | None) -> Path | None:
    """The first candidate folder that holds the archive or its extracted files."""
    spec = SPECS[name]
    for folder in idx.candidate_dirs(name, root):
        if (folder / spec.archive).is_file() or _extracted(folder, spec):
            return folder
    return None


def download(name: str, folder: Path) -> None:
    spec = SPECS[name]
    url = os.environ.get("BRICKYARD_CIFAR_URL", URL).rstrip("/") + "/" + spec.archive
    try:
        data = idx._fetch(url)
    except OSError as e:
        raise DataError(f"cannot download {name} from {url} ({e}); put {spec.archive} in "
                        f"{' or '.join(str(d) for d in idx.candidate_dirs(name, None))} or set data.root.") from None
    got = hashlib.md5(data).hexdigest()
    if got != spec.md5:
        raise DataError(f"{url} is not the published {spec.archive} (MD5 {got}, expected {spec.md5}); nothing was "
                        f"kept: download it again or place the file by hand.")
    write_atomic(folder / spec.archive, lambda f: f.write(data))


def _members(folder: Path, spec: CifarSpec) -> dict[str, bytes]:
    """The files brickyard reads, from the extracted folder or straight from the archive (nothing extracted)."""
    wanted = spec.train + spec.test + (spec.names,)
    inner = _extracted(folder, spec)
    if inner is not None:
        return {f: (inner / f).read_bytes() for f in wanted}
    path = folder / spec.archive
    try:
        with tarfile.open(path, "r:gz") as tar:
            out = {}
            for f in wanted:
                member = tar.extractfile(f"{spec.folder}/{f}")
                if member is None:
                    raise KeyError(f)
                out[f] = member.read()
            return out
    except KeyError as e:
        raise DataError(f"{path} has no {spec.folder}/{e.args[0]}: it is not the {spec.archive} of the CIFAR "
                        f"authors; delete it to download it again.") from None
    except (OSError, EOFError, tarfile.TarError) as e:
        raise DataError(f"{path} is truncated or not a gzipped tar archive ({e}); delete it to download it again.") from None


def decode(raw: bytes, spec: CifarSpec, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Records -> (images N x 3 x 32 x 32 uint8, labels N int64)."""
    record = spec.label_bytes + IMAGE
    if len(raw) == 0 or len(raw) % record:
        raise DataError(f"{what} has {len(raw)} bytes, not a whole number of {record}-byte records: it is truncated "
                        f"or of another format.")
    rows = np.frombuffer(raw, np.uint8).reshape(-1, record)
    labels = rows[:, spec.label_bytes - 1].astype(np.int64)
    return rows[:, spec.label_bytes:].reshape(-1, 3, 32, 32), labels


def _fits(got: dict, n_classes: int) -> bool:
    """Cached arrays as ``decode`` gives them: uint8 N x 3 x 32 x 32 images, as many labels, all in range."""
    for x, y in (got["train"], got["test"]):
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (3, 32, 32) or y.shape != (len(x),) or len(x) == 0:
            return False
        if not np.issubdtype(y.dtype, np.integer) or int(y.min()) < 0 or int(y.max()) >= n_classes:
            return False
    return len(got["classes"]) == n_classes


def load(name: str, root: str | None, allow_download: bool) -> dict:
    """``{"train": (x, y), "test": (x, y), "classes": [...]}``, from the ``.npy`` cache when it is fresh."""
    spec = SPECS[name]
    folder = locate(name, root)
    if folder is None:
        if not allow_download:
            places = " or ".join(str(d) for d in idx.candidate_dirs(name, root))
            raise DataError(f"{name} not found; put {spec.archive} in {places} (data.download is off).")
        folder = Path(root).expanduser() if root else idx.cache_dir(name)
        download(name, folder)
    source = folder / spec.archive if (folder / spec.archive).is_file() else folder / spec.folder / spec.train[0]
    st = source.stat()
    cached = folder / f".{name}.{st.st_size}.{int(st.st_mtime)}.npz"
    if not os.access(folder, os.W_OK):
        cached = idx.cache_dir(name) / "decoded" / cached.name.lstrip(".")
    if cached.is_file():
        try:
            with np.load(cached) as z:
                got = {"train": (z["xtr"], z["ytr"]), "test": (z["xte"], z["yte"]), "classes": [str(c) for c in z["classes"]]}
            if _fits(got, 10 if name == "cifar10" else 100):
                return got
            cached.unlink(missing_ok=True)  # not what decoding gives (anything sharing the folder could write it)
        except PermissionError:
            pass  # another user's cache in a shared folder: theirs to keep; decoded from the archive instead
        except (OSError, ValueError, KeyError):
            cached.unlink(missing_ok=True)  # cut short or damaged: built again below
    raw = _members(folder, spec)
    parts = {}
    for split, files in (("train", spec.train), ("test", spec.test)):
        decoded = [decode(raw[f], spec, f"{folder}: {f}") for f in files]
        parts[split] = (np.concatenate([x for x, _ in decoded]), np.concatenate([y for _, y in decoded]))
    classes = [c.strip() for c in raw[spec.names].decode("utf-8", "replace").splitlines() if c.strip()]
    n_classes = 10 if name == "cifar10" else 100
    if len(classes) != n_classes or int(max(parts["train"][1].max(), parts["test"][1].max())) >= n_classes:
        raise DataError(f"{folder}: {spec.names} and the labels do not describe {n_classes} classes: the files are not "
                        f"{name}'s.")
    if not cached.exists():  # one this user cannot read (above) is left as it is
        try:
            write_atomic(cached, lambda f: np.savez(f, xtr=parts["train"][0], ytr=parts["train"][1],
                                                    xte=parts["test"][0], yte=parts["test"][1], classes=np.array(classes)))
        except OSError:
            pass  # a read-only place: decoded again next time
    return {**parts, "classes": classes}
