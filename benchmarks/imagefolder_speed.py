"""Images per second of brickyard's image-folder loader against a plain PyTorch pipeline, on photo-sized
JPEGs (`brickyard data make-photos`, 400-600 px a side) at 224 px.

- brickyard: `data.name: imagefolder` with the default photo transforms (random_resized_crop:224,
  hflip), its streaming loader (a DataLoader fed by brickyard's batch plan) and the device-side
  normalisation (`DevicePrep`), timed until the normalised float batch is in hand.
- plain: a `Dataset` that opens each file with Pillow, converts it to RGB, takes a random resized crop
  (the same area and aspect rule) with Pillow's bilinear resize, converts it to a float tensor and
  normalises it, in a `DataLoader` with the same workers and batch size.

The two run in turn (A B A B ...) for `--rounds` epochs each over the same files; the figure is the
median of the per-round ratios. Both use `--workers` worker processes and one torch thread in the main
process, as a 2-core machine gives a 1-process run.

    python benchmarks/imagefolder_speed.py [--images 480] [--workers 1] [--rounds 3] [--batch 64]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from brickyard.config import load_config
from brickyard.data import build_data
from brickyard.data.augment import DevicePrep
from brickyard.data.imagefolder import DiskCache
from brickyard.data.loaders import make_train_loader
from brickyard.data.photos import make_photo_folder

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Plain(torch.utils.data.Dataset):
    def __init__(self, files):
        self.files = files
        self.mean, self.std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        im = Image.open(self.files[i]).convert("RGB")
        w, h = im.size
        for _ in range(10):
            target = w * h * float(torch.empty(1).uniform_(0.08, 1.0))
            ratio = math.exp(float(torch.empty(1).uniform_(math.log(3 / 4), math.log(4 / 3))))
            cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
            if 0 < cw <= w and 0 < ch <= h:
                top, left = int(torch.randint(0, h - ch + 1, (1,))), int(torch.randint(0, w - cw + 1, (1,)))
                break
        else:
            ch = cw = min(w, h)
            top, left = (h - ch) // 2, (w - cw) // 2
        im = im.resize((224, 224), Image.BILINEAR, box=(left, top, left + cw, top + ch))
        if float(torch.rand(1)) < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(224, 224, 3).permute(2, 0, 1).float() / 255
        return (x - self.mean) / self.std, 0


def plain_epoch(files, workers: int, batch: int) -> float:
    loader = torch.utils.data.DataLoader(Plain(files), batch_size=batch, shuffle=True, num_workers=workers)
    start, n = time.perf_counter(), 0
    for x, _ in loader:
        n += len(x)
    return n / (time.perf_counter() - start)


def brickyard_epoch(root: Path, workers: int, batch: int, epoch: int, cache: str = "none") -> float:
    cfg = load_config("mnist", ["data.name=imagefolder", f"data.root={root}", f"data.num_workers={workers}",
                                f"data.global_batch_size={batch}", "data.val_fraction=0", "data.augment=none",
                                f"data.cache={cache}"])
    data = build_data(cfg.data)
    loader = make_train_loader(data.train, cfg.data, torch.device("cpu"), 1, 0, seed=0)
    prep = DevicePrep(data.mean, data.std)
    start, n = time.perf_counter(), 0
    for x, _, _, _ in loader.epoch(epoch):
        n += len(prep(x))
    rate = n / (time.perf_counter() - start)
    loader.close()
    return rate


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=480)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "photos"
        make_photo_folder(root, classes=4, per_class={"train": a.images // 4}, seed=0, min_size=400, max_size=600)
        files = sorted((root / "train").rglob("*.jpg"))
        print(f"torch {torch.__version__}, {len(files)} JPEGs of 400-600 px, 224 px out, batch {a.batch}, "
              f"{a.workers} worker(s), {a.rounds} rounds in turn", flush=True)
        start = time.perf_counter()
        DiskCache(files, root, "train")  # written once, as the first run with data.cache: disk does
        print(f"disk cache written in {time.perf_counter() - start:.1f} s "
              f"({sum(f.stat().st_size for f in (root / '.brickyard-cache').iterdir()) / 2**20:.0f} MiB)", flush=True)
        ratios, cached = [], []
        for r in range(a.rounds):
            ours = brickyard_epoch(root, a.workers, a.batch, r)
            disk = brickyard_epoch(root, a.workers, a.batch, r, "disk")
            plain = plain_epoch(files, a.workers, a.batch)
            ratios.append(ours / plain)
            cached.append(disk / plain)
            print(f"round {r}: brickyard {ours:6.1f} img/s, with data.cache: disk {disk:6.1f} img/s, plain {plain:6.1f} img/s; "
                  f"ratios {ours / plain:.2f} and {disk / plain:.2f}", flush=True)
        for name, rs in (("brickyard / plain", ratios), ("brickyard with data.cache: disk / plain", cached)):
            print(f"{name}: median ratio {statistics.median(rs):.2f} (min {min(rs):.2f}, max {max(rs):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
