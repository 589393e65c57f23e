"""The time-to-accuracy reference: a tuned plain PyTorch script, no brickyard.

It trains the default preset's recipe the way a careful person writes it by hand: MNIST decoded once
into a `.npy` cache, in-memory batches sliced from a shuffled tensor, channels_last, bf16 autocast
where the CPU or GPU runs bf16 natively (fp32 elsewhere, as brickyard's `precision: auto`), Adam
(betas 0.7/0.9) with label smoothing 0.1, batch 256 and a one-cycle schedule, then one pass over the
test set. No validation, checkpoints, logs or
plots. `benchmarks/time_to_accuracy.py --plain` times it from process start to its printed result,
interleaved with `brickyard train`, so both meet the same machine.

    python benchmarks/plain_reference.py [--epochs 1.5] [--precision auto|fp32|bf16] [--device cpu|cuda]
"""
import argparse
import gzip
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def load(split: str, root: Path, cache: Path):
    arrays = []
    for name in FILES[split]:
        npy = cache / (name + ".npy")
        if not npy.exists():
            raw = gzip.decompress((root / name).read_bytes())
            offset = 16 if "images" in name else 8
            a = np.frombuffer(raw, np.uint8, offset=offset)
            a = a.reshape(-1, 28, 28) if "images" in name else a
            cache.mkdir(parents=True, exist_ok=True)
            np.save(npy, a)
        arrays.append(torch.from_numpy(np.load(npy)))
    return arrays


def net():
    return nn.Sequential(
        nn.Conv2d(1, 16, 5, stride=2, padding=2), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(576, 10))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=float, default=1.5)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    home = Path(os.environ.get("BRICKYARD_CACHE", Path.home() / ".cache" / "brickyard"))  # where brickyard downloads
    data = os.environ.get("BRICKYARD_DATA")
    root = Path(data) / "mnist" if data and (Path(data) / "mnist").is_dir() else home / "mnist"
    if not all((root / f).is_file() for names in FILES.values() for f in names):
        raise SystemExit(f"error: no MNIST files in {root}; run `brickyard data fetch mnist` first.")
    cache = home / "plain-reference"
    device = torch.device(a.device)
    if a.precision == "auto":
        native = torch.cuda.is_bf16_supported() if device.type == "cuda" else torch.ops.mkldnn._is_mkldnn_bf16_supported()
        a.precision = "bf16" if native else "fp32"
    torch.manual_seed(a.seed)

    (x_train, y_train), (x_test, y_test) = load("train", root, cache), load("test", root, cache)
    x_train, y_train, x_test, y_test = (t.to(device) for t in (x_train, y_train, x_test, y_test))
    model = net().to(device, memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, betas=(0.7, 0.9))
    steps_per_epoch = len(y_train) // a.batch
    total = int(a.epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, a.lr, total_steps=total, pct_start=0.25,
                                                anneal_strategy="cos", cycle_momentum=False)

    def prep(x):
        x = (x.float().unsqueeze(1) / 255 - 0.1307) / 0.3081
        return x.contiguous(memory_format=torch.channels_last)

    start = time.perf_counter()
    step = 0
    while step < total:
        perm = torch.randperm(len(y_train), device=device)
        for i in range(steps_per_epoch):
            if step == total:
                break
            idx = perm[i * a.batch:(i + 1) * a.batch]
            with torch.autocast(device.type, torch.bfloat16, enabled=a.precision == "bf16"):
                loss = F.cross_entropy(model(prep(x_train[idx])).float(), y_train[idx], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
    loss.item()
    train_seconds = time.perf_counter() - start

    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=a.precision == "bf16"):
        for i in range(0, len(y_test), 1000):
            correct += (model(prep(x_test[i:i + 1000])).argmax(1) == y_test[i:i + 1000]).sum()
    print(f"test accuracy {correct.item() / len(y_test):.4f} after {a.epochs:g} epochs; "
          f"training loop {train_seconds:.1f} s; {device.type} {a.precision}", flush=True)


if __name__ == "__main__":
    main()
