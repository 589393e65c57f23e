"""Photo-sized image folders: the generator, the fast read path against the step-by-step pipeline, the
disk cache, and the bad inputs around them.

Tolerance for "equal up to the resize filter": the fast path decodes JPEGs at a reduced DCT scale where
it can and resamples once with Pillow's antialiased bilinear filter; the step-by-step path decodes in
full and resizes with torch's. Per image: mean absolute difference <= 4 grey levels of 255 and fewer
than 1% of values differ by more than 32 (measured here: <= 3.5 and <= 0.6%).
"""
import os
import random

import numpy as np
import pytest
import torch

from brickyard.config import load_config
from brickyard.data import build_data
from brickyard.data.imagefolder import DiskCache, decode, read
from brickyard.data.photos import make_photo_folder
from brickyard.data.transforms import Pipeline
from brickyard.errors import DataError
from conftest import run_cli


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    make_photo_folder(root, classes=3, per_class={"train": 6, "val": 2, "test": 2}, seed=5, min_size=300, max_size=520)
    return root


def test_the_generator_is_deterministic_and_photo_like(photos, tmp_path):
    again = tmp_path / "again"
    make_photo_folder(again, classes=3, per_class={"train": 6, "val": 2, "test": 2}, seed=5, min_size=300, max_size=520)
    files = sorted(p.relative_to(photos) for p in photos.rglob("*.jpg"))
    assert files == sorted(p.relative_to(again) for p in again.rglob("*.jpg")) and len(files) == 30
    assert all((photos / f).read_bytes() == (again / f).read_bytes() for f in files)  # byte for byte
    sizes = {decode(photos / f).shape for f in files}
    assert len(sizes) > 5 and all(c == 3 and 300 <= min(h, w) and max(h, w) <= 520 for c, h, w in sizes)
    other = tmp_path / "other"
    make_photo_folder(other, classes=3, per_class={"train": 1}, seed=6)
    first = "train/00-disc/00000.jpg"
    assert (other / first).read_bytes() != (photos / first).read_bytes()  # another seed, other images
    r = run_cli("data", "make-photos", str(tmp_path / "cli"), "--classes", "12", "--per-class", "1", "1", "1", "--max-size", "96")
    assert r.returncode == 0 and "wrote 12 train, 12 val, 12 test JPEG images of 12 classes" in r.stdout, r.stderr
    assert sorted(p.name for p in (tmp_path / "cli" / "train").iterdir())[-1] == "11-square-holed"
    bad = run_cli("data", "make-photos", str(tmp_path / "bad"), "--classes", "1")
    assert bad.returncode == 2 and bad.stderr.startswith("error: data make-photos: --classes must be at least 2")


@pytest.mark.parametrize("specs, tolerance", [
    (["random_resized_crop:224", "hflip"], 0.5),  # one crop, one resize: the same filter, rounding apart
    (["resize:256", "center_crop:224"], 4),  # two resizes against one, and the JPEG draft scale
    (["resize:64x64"], 4),
    (["random_crop:224", "hflip"], 0.5),  # a crop of the pixels themselves
    (["resize:256", "random_crop:224"], 4),  # as resize and centre crop
    (["resize:64x64", "random_crop:64:4"], 0),  # padded: past the image, so read step by step
])
@pytest.mark.fast
def test_the_fast_path_equals_the_step_by_step_pipeline_up_to_the_resize_filter(photos, specs, tolerance):
    pipe = Pipeline(specs, 3)
    for f in sorted((photos / "train").rglob("*.jpg")):
        fast = read(f, pipe, random.Random(0))
        slow = pipe(decode(f), random.Random(0))  # full decode, torch crops and antialiased resizes: the same draws
        assert fast.shape == slow.shape and fast.dtype == torch.uint8
        d = (fast.float() - slow.float()).abs()
        assert d.mean() <= tolerance and (d > 32).float().mean() < 0.01, (f, d.mean().item(), (d > 32).float().mean().item())


@pytest.mark.fast
def test_the_disk_cache_is_written_once_read_as_the_files_and_refuses_what_it_does_not_hold(photos, tmp_path):
    cfg = load_config("mnist", ["data.name=imagefolder", f"data.root={photos}", "data.cache=disk",
                                "data.train_transforms=[resize:128x128]"])
    data = build_data(cfg.data)
    made = sorted((photos / ".brickyard-cache").iterdir())
    assert [p.suffix for p in made] == [".npy", ".u8"]
    stamp = made[1].stat().st_mtime_ns
    cached = torch.stack([data.train.dataset[i][0] for i in range(len(data.train))])
    plain = build_data(load_config("mnist", ["data.name=imagefolder", f"data.root={photos}",
                                             "data.train_transforms=[resize:128x128]"]).data)
    files = torch.stack([plain.train.dataset[i][0] for i in range(len(plain.train))])
    assert (cached.float() - files.float()).abs().mean() <= 4  # JPEG draft scale only: the same resize
    build_data(cfg.data)
    assert made[1].stat().st_mtime_ns == stamp  # memory-mapped again, not written again
    # a cache file from another folder put in this one's place
    other = tmp_path / "other"
    make_photo_folder(other, classes=3, per_class={"train": 2}, seed=1, max_size=128)
    DiskCache(sorted((other / "train").rglob("*.jpg")), other, "train")
    theirs = next((other / ".brickyard-cache").glob("*.idx.npy"))
    ours_index = made[0]
    saved = ours_index.read_bytes()
    try:
        ours_index.write_bytes(theirs.read_bytes())
        with pytest.raises(DataError, match="holds another data set's images"):
            build_data(cfg.data)
        ours_index.write_bytes(saved)
        tampered = np.load(ours_index)
        tampered[1, 0] += 10**9  # an image said to start past the end of the pixels: reads would leave the file
        np.save(ours_index, tampered)
        with pytest.raises(DataError, match="is not one brickyard wrote for this folder's"):
            build_data(cfg.data)
        ours_index.write_bytes(saved)
        with open(made[1], "r+b") as f:  # cut short
            f.truncate(1000)
        with pytest.raises(DataError, match="was cut short; delete it to rebuild the cache"):
            build_data(cfg.data)
    finally:
        for p in made:
            p.unlink()


@pytest.mark.fast
def test_an_unreadable_jpeg_is_one_sentence_on_the_fast_path(photos, tmp_path):
    bad = tmp_path / "bad.jpg"
    data = (next((photos / "train").rglob("*.jpg"))).read_bytes()
    bad.write_bytes(data[:200])
    with pytest.raises(DataError, match="bad.jpg is unreadable or truncated"):
        read(bad, Pipeline(["random_resized_crop:224"], 3))


def test_loader_workers_are_planned_against_the_cores(photos, tmp_path):
    """auto: a streaming CPU run gives half of each process's cores to the loader and the rest to its
    threads; with two processes on this machine each gets its share; a number asked for is kept."""
    from brickyard.data.loaders import plan_workers
    assert plan_workers("auto", False, True, 8) == 0 and plan_workers("auto", True, True, 8) == 4
    assert plan_workers("auto", True, False, 16) == 8 and plan_workers(3, True, True, 1) == 3
    cores = len(os.sched_getaffinity(0))
    base = ["train", "--set", "data.name=imagefolder", "--set", f"data.root={photos}", "--set", "model.name=convnet",
            "--set", "data.train_transforms=[random_resized_crop:32, hflip]", "--set", "data.eval_transforms=[resize:32x32]",
            "--set", "train.max_steps=2", "--set", "train.progress=none", "--set", "train.plots=false",
            "--set", "data.global_batch_size=4", "--set", "train.precision=fp32"]
    one = run_cli(*base, "--run-dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    workers = cores // 2
    assert f"{max(1, cores - workers)} threads, {workers} loader workers" in one.stdout, one.stdout
    two = run_cli(*base, "--devices", "cpu:2", "--run-dir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr
    per = max(1, cores // 2)
    assert f"{max(1, per - per // 2)} threads, {per // 2} loader workers" in two.stdout, two.stdout
    asked = run_cli(*base, "--set", "data.num_workers=2", "--set", "train.threads=1", "--run-dir", str(tmp_path / "asked"))
    assert asked.returncode == 0 and "1 threads, 2 loader workers" in asked.stdout, asked.stdout
