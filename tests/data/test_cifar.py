"""CIFAR-10 and CIFAR-100: the real download code against a loopback HTTP server that serves small archives
in the official binary layout, the checksum, the parser, the cache, and training on it.

Pinned: fp32, one thread, a few steps. The archives are built here (a few records per file), so their
MD5 is not the published one: the tests that download put theirs in the spec, as a mirror's would be.
"""
import hashlib
import io
import tarfile

import numpy as np
import pytest

from brickyard import api
from brickyard.config import load_config
from brickyard.data import build_data, cifar
from brickyard.errors import DataError
from conftest import SYNTH, run_cli, sets

NAMES10 = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _records(n: int, label_bytes: int, classes: int, seed: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    labels = np.arange(n) % classes
    head = np.stack([labels // 5 if label_bytes == 2 else labels, labels][-label_bytes:], 1).astype(np.uint8)
    return np.concatenate([head, images.reshape(n, -1)], 1).tobytes(), images, labels


def make_archive(name: str, per_file: int = 12):
    """(archive bytes, train images, train labels, test images, test labels) in the official layout."""
    spec = cifar.SPECS[name]
    classes = 10 if name == "cifar10" else 100
    files, train, test = {}, [], []
    for i, f in enumerate(spec.train + spec.test):
        raw, x, y = _records(per_file if classes == 10 else 2 * classes, spec.label_bytes, classes, i)
        files[f] = raw
        (train if f in spec.train else test).append((x, y))
    names = NAMES10 if classes == 10 else [f"class{i}" for i in range(classes)]
    files[spec.names] = ("\n".join(names) + "\n\n").encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f, data in files.items():
            info = tarfile.TarInfo(f"{spec.folder}/{f}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cat = lambda parts, k: np.concatenate([p[k] for p in parts])  # noqa: E731
    return buf.getvalue(), cat(train, 0), cat(train, 1), cat(test, 0), cat(test, 1)




def _serve(monkeypatch, www, url, name, archive: bytes, md5: str | None = None):
    spec = cifar.SPECS[name]
    (www / spec.archive).write_bytes(archive)
    monkeypatch.setenv("BRICKYARD_CIFAR_URL", url)
    monkeypatch.setitem(cifar.SPECS, name, cifar.CifarSpec(**{**spec.__dict__, "md5": md5 or hashlib.md5(archive).hexdigest()}))


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.fast
def test_download_checksum_parse_and_cache(name, http_folder, cache_dir, monkeypatch):
    www, url = http_folder
    archive, xtr, ytr, xte, yte = make_archive(name)
    _serve(monkeypatch, www, url, name, archive)
    got = cifar.load(name, None, allow_download=True)
    assert (cache_dir / name / cifar.SPECS[name].archive).read_bytes() == archive  # downloaded into the cache
    assert np.array_equal(got["train"][0], xtr) and np.array_equal(got["train"][1], ytr)
    assert np.array_equal(got["test"][0], xte) and np.array_equal(got["test"][1], yte)
    assert got["train"][0].shape[1:] == (3, 32, 32) and len(got["classes"]) == (10 if name == "cifar10" else 100)
    (www / cifar.SPECS[name].archive).unlink()  # the second load needs no server: the archive and decoded cache
    again = cifar.load(name, None, allow_download=True)
    assert np.array_equal(again["train"][0], xtr) and list(again["classes"]) == list(got["classes"])
    (cached,) = (cache_dir / name).glob(".*.npz")  # replaced by something else: labels out of range
    np.savez(cached, xtr=xtr, ytr=np.full(len(ytr), 999), xte=xte, yte=yte, classes=np.array(got["classes"]))
    third = cifar.load(name, None, allow_download=True)
    assert np.array_equal(third["train"][1], ytr)  # decoded from the archive again, not the planted labels


def test_the_bundle_splits_off_validation_and_trains(http_folder, cache_dir, monkeypatch, tmp_path):
    www, url = http_folder
    archive, xtr, ytr, _, _ = make_archive("cifar10", per_file=40)
    _serve(monkeypatch, www, url, "cifar10", archive)
    cfg = load_config("cifar10-resnet18", SYNTH[:1] + ["data.global_batch_size=20", "train.max_steps=3",
                                                       "train.progress=none", "train.threads=1", "train.plots=false",
                                                       "model.name=convnet"])
    data = build_data(cfg.data)
    assert data.name == "cifar10" and data.in_channels == 3 and data.image_size == (32, 32) and data.classes[0] == "airplane"
    assert len(data.train) + len(data.val) == len(xtr) and len(data.test) == 40
    assert np.array_equal(data.train.images.numpy(), xtr[:len(data.train)])
    summary = api.train_config(cfg, tmp_path / "run")
    assert summary["steps"] == 3 and summary["data"] == "cifar10"
    # the CLI reads the same cache: no server needed now
    (www / cifar.SPECS["cifar10"].archive).unlink()
    r = run_cli("train", "cifar10-resnet18", *sets("train.precision=fp32", "data.global_batch_size=20", "train.max_steps=2",
                                                   "train.progress=none", "train.threads=1", "model.name=convnet"),
                "--run-dir", str(tmp_path / "cli"), env={"BRICKYARD_CACHE": str(cache_dir)})
    assert r.returncode == 0, r.stderr
    info = run_cli("data", "info", "cifar10", env={"BRICKYARD_CACHE": str(cache_dir)})
    assert info.returncode == 0 and "cifar10: 200 train + 40 test images of 10 classes (airplane, automobile" in info.stdout, info.stdout


@pytest.mark.fast
def test_a_corrupt_download_is_one_sentence_and_nothing_is_kept(http_folder, cache_dir, monkeypatch):
    www, url = http_folder
    archive = make_archive("cifar10")[0]
    _serve(monkeypatch, www, url, "cifar10", archive[: len(archive) // 2], md5=hashlib.md5(archive).hexdigest())
    with pytest.raises(DataError, match=r"is not the published cifar-10-binary.tar.gz \(MD5 [0-9a-f]{32}, expected"):
        cifar.load("cifar10", None, allow_download=True)
    assert not (cache_dir / "cifar10" / "cifar-10-binary.tar.gz").exists()


@pytest.mark.fast
def test_a_damaged_or_foreign_file_in_place_is_one_sentence(tmp_path):
    folder = tmp_path / "c10"
    folder.mkdir()
    (folder / "cifar-10-binary.tar.gz").write_bytes(b"not a tar archive")
    with pytest.raises(DataError, match="is truncated or not a gzipped tar archive"):
        cifar.load("cifar10", str(folder), allow_download=False)
    inner = folder / "x" / "cifar-10-batches-bin"
    inner.mkdir(parents=True)
    for f in cifar.SPECS["cifar10"].train + cifar.SPECS["cifar10"].test:
        (inner / f).write_bytes(b"\0" * 3073 * 2 + b"\1")  # one byte too many
    (inner / "batches.meta.txt").write_text("\n".join(NAMES10))
    with pytest.raises(DataError, match="not a whole number of 3073-byte records"):
        cifar.load("cifar10", str(folder / "x"), allow_download=False)


def test_missing_without_download_names_the_places(tmp_path):
    with pytest.raises(DataError, match="cifar100 not found; put cifar-100-binary.tar.gz in"):
        cifar.load("cifar100", str(tmp_path), allow_download=False)
    r = run_cli("train", "cifar10-resnet18", "--set", f"data.root={tmp_path}", "--set", "data.download=false",
                "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stderr.startswith("error: cifar10 not found"), r.stderr
