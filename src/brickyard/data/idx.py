"""MNIST-format (IDX) data sets: lookup, download, checksum and a decoded ``.npy`` cache.

Lookup for a data set NAME: ``data.root`` when given (that folder and no other), else
``$BRICKYARD_DATA/NAME/``, then ``~/.cache/brickyard/NAME/``. A folder counts when it holds all four
files (gzipped or not).
Missing files are downloaded into ``data.root`` (when given) or the cache folder. The MD5 of
the *decompressed* bytes is verified once; the decoded arrays are then cached as ``.npy``
(beside the files, or in the cache folder when that one is read-only) so later runs start fast.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from brickyard.errors import DataError
from brickyard.files import write_atomic


@dataclass(frozen=True)
class IdxSpec:
    mirrors: tuple[str, ...]
    md5: dict  # file stem -> md5 of the decompressed content
    classes: tuple[str, ...]
    package: str = ""  # the Debian package that installs the authors' files under /usr/share/datasets


FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

SPECS = {
    "mnist": IdxSpec(
        mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "https://storage.googleapis.com/cvdf-datasets/mnist/"),
        md5=dict(zip(FILES, ("6bbc9ace898e44ae57da46a324031adb", "a25bea736e30d166cdddb491f175f624",
                             "2646ac647ad5339dbf082846283269ea", "27ae3e4e09519cfbb04c329615203637"))),
        classes=tuple(str(i) for i in range(10)),
    ),
    "fashion-mnist": IdxSpec(
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        md5=dict(zip(FILES, ("f4a8712d7a061bf5bd6d2ca38dc4d50a", "9018921c3c673c538a1fc5bad174d6f9",
                             "8181f5470baa50b63fa0f6fddb340f0a", "15d484375f8d13e6eb1aabb0c3f46965"))),
        classes=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
        package="dataset-fashion-mnist",
    ),
}


def cache_dir(name: str) -> Path:
    return Path(os.environ.get("BRICKYARD_CACHE", Path.home() / ".cache" / "brickyard")) / name


def system_data() -> Path:
    """Where Debian's dataset packages put the authors' files (``$BRICKYARD_SYSTEM_DATA`` moves it)."""
    return Path(os.environ.get("BRICKYARD_SYSTEM_DATA", "/usr/share/datasets"))


def _package(name: str) -> str:
    """The end of a "files not found" sentence: the Debian package that installs them, where there is one."""
    package = SPECS[name].package if name in SPECS else ""
    return f" (on Debian: apt-get install {package})" if package else ""


def candidate_dirs(name: str, root: str | None) -> list[Path]:
    """Where ``name`` is looked for: an explicit ``root`` alone (that folder is meant, downloads go
    there), else ``$BRICKYARD_DATA/NAME``, Debian's ``/usr/share/datasets/NAME`` (``apt-get install
    dataset-fashion-mnist``) and the cache."""
    if root:
        return [Path(root).expanduser()]
    dirs = []
    if os.environ.get("BRICKYARD_DATA"):
        dirs.append(Path(os.environ["BRICKYARD_DATA"]).expanduser() / name)
    dirs.append(system_data() / name)
    dirs.append(cache_dir(name))
    return dirs


def _find(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def locate(name: str, root: str | None) -> Path | None:
    """The first candidate folder that holds all four files, or None."""
    for folder in candidate_dirs(name, root):
        if all(_find(folder, stem) for stem in FILES):
            return folder
    return None


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except PermissionError:
        raise DataError(f"{path} cannot be read: permission denied (ask its owner to make it readable).") from None
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"{path} is truncated or not a valid file ({e}); delete it to download it again.") from None


def decode(raw: bytes, path: Path) -> np.ndarray:
    """Decode one IDX file (uint8 images N x H x W or labels N)."""
    if len(raw) < 8 or raw[0] != 0 or raw[1] != 0 or raw[2] != 8:
        raise DataError(f"{path} is not an IDX file of unsigned bytes.")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    if len(raw) - offset != int(np.prod(dims)):
        raise DataError(f"{path} is truncated: header says {dims}, found {len(raw) - offset} bytes of data.")
    return np.frombuffer(raw, np.uint8, offset=offset).reshape(dims)


def download(name: str, folder: Path) -> None:
    spec = SPECS[name]
    for stem in FILES:
        if _find(folder, stem):
            continue
        errors = []
        for mirror in spec.mirrors:
            url = f"{mirror}{stem}.gz"
            try:
                data = _fetch(url)
            except OSError as e:
                errors.append(f"{url}: {e}")
                continue
            got = hashlib.md5(gzip.decompress(data)).hexdigest() if data[:2] == b"\x1f\x8b" else None
            if got != spec.md5[stem]:
                errors.append(f"{url}: checksum {got} != {spec.md5[stem]}")
                continue
            write_atomic(folder / f"{stem}.gz", data)
            break
        else:
            places = " or ".join(str(d) for d in candidate_dirs(name, None))
            raise DataError(
                f"cannot download {name} file {stem}.gz ({errors[-1] if errors else 'no mirror'}); "
                f"put the four {name} files in {places} or set data.root{_package(name)}."
            )


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        total = int(response.headers.get("Content-Length") or 0)
        chunks, done = [], 0
        bar = _progress(total, url.rsplit("/", 1)[-1])
        while chunk := response.read(1 << 16):
            chunks.append(chunk)
            done += len(chunk)
            bar(done)
        bar(None)
        return b"".join(chunks)


def _progress(total: int, label: str):
    def update(done):
        if not sys.stderr.isatty():
            return
        if done is None:
            sys.stderr.write("\n")
        elif total:
            sys.stderr.write(f"\rdownloading {label} {100 * done // total:3d}%")
        sys.stderr.flush()
    return update


def load_idx(name: str, root: str | None, allow_download: bool) -> dict[str, np.ndarray]:
    """The four arrays, verified; from the ``.npy`` cache when it is fresh."""
    if name not in SPECS:
        raise DataError(f"unknown IDX data set {name!r}; known: {', '.join(SPECS)}.")
    folder = locate(name, root)
    if folder is None:
        if not allow_download:
            places = " or ".join(str(d) for d in candidate_dirs(name, root))
            raise DataError(f"{name} files not found; put the four files in {places} (data.download is off)"
                            f"{_package(name)}.")
        folder = Path(root).expanduser() if root else cache_dir(name)
        download(name, folder)
    return {stem: _load_one(name, folder, stem) for stem in FILES}


def _cache_path(name: str, source: Path) -> Path:
    st = source.stat()
    tag = f"{source.name}.{st.st_size}.{int(st.st_mtime)}.npy"
    beside = source.parent / f".{tag}"
    if os.access(source.parent, os.W_OK) and system_data() not in source.parents:  # never into a package's folder
        return beside
    return cache_dir(name) / "decoded" / tag


def _load_one(name: str, folder: Path, stem: str) -> np.ndarray:
    source = _find(folder, stem)
    cached = _cache_path(name, source)
    if cached.is_file():
        try:
            array = np.load(cached, mmap_mode="r")
            if _fits(name, stem, array):
                return array
            cached.unlink(missing_ok=True)  # not what decoding gives: built again below
        except PermissionError:
            pass  # another user's cache in a shared folder: theirs to keep; decoded from the source instead
        except (OSError, ValueError):
            cached.unlink(missing_ok=True)  # cut short or damaged: built again below
    raw = _read_bytes(source)
    expected = SPECS[name].md5[stem]
    got = hashlib.md5(raw).hexdigest()
    if got != expected:
        raise DataError(f"{source} has MD5 {got} (decompressed), expected {expected}; the file is corrupt or truncated.")
    array = decode(raw, source)
    if not cached.exists():
        try:
            write_atomic(cached, lambda f: np.save(f, array))
        except OSError:
            pass  # a read-only cache only costs start-up time
    return array


def _fits(name: str, stem: str, array: np.ndarray) -> bool:
    """A cached array has the dtype, shape and label range decoding gives (the cache is a file in a shared
    folder, which anything could have replaced; its images are not read here, its labels are: 60 kB)."""
    if array.dtype != np.uint8 or len(array) != (60_000 if stem.startswith("train") else 10_000):  # both sets' counts
        return False
    if "images" in stem:
        return array.ndim == 3 and array.shape[1:] == (28, 28)
    return array.ndim == 1 and int(array.max()) < len(SPECS[name].classes)


def classes(name: str) -> tuple[str, ...]:
    return SPECS[name].classes
