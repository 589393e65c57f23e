"""Transfer learning on photos, as the course does it: a ResNet-18 trained on one set of classes, its
backbone frozen and a new head trained (head learning rate x10) on other classes with few images,
against the same network trained from scratch on those few images.

The network is `resnet18_imagenet` (the ImageNet layout: a stride-2 stem and max-pool, so 64 px images
are cheap). The data is `brickyard data make-photos` (10 classes, JPEGs of 64-160 px, trained at 64x64): the
source task is classes 0-4 (`--source-per-class` images each), the target task classes 5-9 with
`--target-per-class` training images each and 40 test images each. Every run is a whole `brickyard
train` command; the target runs use seeds 0..N-1; printed: test accuracy mean and std, and the time each
took (training and evaluation, from `summary.json`).

    python benchmarks/transfer.py [--seeds 3] [--source-epochs 8] [--target-epochs 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from brickyard.data.photos import make_photo_folder

COMMON = ["model.name=resnet18_imagenet", "data.name=imagefolder", "data.train_transforms=[random_resized_crop:64, hflip]",
          "data.eval_transforms=[resize:72, center_crop:64]", "data.num_workers=1", "train.progress=none",
          "train.plots=false", "optim.name=nesterov", "optim.lr=0.05", "optim.weight_decay=0.0005",
          "optim.label_smoothing=0", "schedule.name=onecycle", "data.global_batch_size=32", "train.precision=fp32"]


def split_by_class(root: Path, out: Path, classes: list[str]) -> Path:
    for split in ("train", "val", "test"):
        (out / split).mkdir(parents=True)
        for c in classes:
            (out / split / c).symlink_to(root / split / c)
    return out


def train(args: list[str], run: Path) -> dict:
    cmd = [sys.executable, "-m", "brickyard", "train", *[x for s in COMMON + args for x in ("--set", s)], "--run-dir", str(run)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stderr)
    return json.loads((run / "summary.json").read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--source-per-class", type=int, default=120)
    p.add_argument("--target-per-class", type=int, default=20)
    p.add_argument("--source-epochs", type=int, default=8)
    p.add_argument("--target-epochs", type=int, default=8)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source_root = tmp / "source-photos"
        make_photo_folder(source_root, classes=10, per_class={"train": a.source_per_class, "val": 20, "test": 20},
                          seed=0, min_size=64, max_size=160)
        target_root = tmp / "target-photos"
        make_photo_folder(target_root, classes=10, per_class={"train": a.target_per_class, "val": 20, "test": 40},
                          seed=1, min_size=64, max_size=160)
        names = sorted(d.name for d in (source_root / "train").iterdir())
        source = split_by_class(source_root, tmp / "source", names[:5])
        target = split_by_class(target_root, tmp / "target", names[5:])
        pre = train([f"data.root={source}", f"train.epochs={a.source_epochs}", "train.seed=0"], tmp / "pretrained")
        print(f"source task (classes {', '.join(names[:5])}, {5 * a.source_per_class} images, {a.source_epochs} epochs): "
              f"test accuracy {pre['test_accuracy']:.4f} in {pre['wall_seconds']:.0f} s", flush=True)
        best = tmp / "pretrained" / "checkpoints" / "best.pt"
        results = {"fine-tuned (frozen backbone, new head, head lr x10)": [], "from scratch": []}
        for seed in range(a.seeds):
            base = [f"data.root={target}", f"train.epochs={a.target_epochs}", f"train.seed={seed}"]
            ft = train(base + [f"finetune.init_from={best}", "finetune.reset_head=true", "finetune.head_lr_mult=10",
                               "finetune.freeze=[conv1.*, bn1.*, layer*]", "optim.lr=0.01"], tmp / f"ft{seed}")
            sc = train(base, tmp / f"sc{seed}")
            results["fine-tuned (frozen backbone, new head, head lr x10)"].append(ft)
            results["from scratch"].append(sc)
            print(f"seed {seed}: fine-tuned {ft['test_accuracy']:.4f} ({ft['wall_seconds']:.0f} s), "
                  f"from scratch {sc['test_accuracy']:.4f} ({sc['wall_seconds']:.0f} s)", flush=True)
        print(f"target task: classes {', '.join(names[5:])}, {a.target_per_class} training images per class, "
              f"{a.target_epochs} epochs, {a.seeds} seeds")
        for name, rs in results.items():
            acc = [r["test_accuracy"] for r in rs]
            wall = [r["wall_seconds"] for r in rs]
            print(f"{name:<52} test accuracy {100 * statistics.mean(acc):5.1f} ± {100 * statistics.pstdev(acc):4.1f}%, "
                  f"{statistics.mean(wall):.0f} s a run")


if __name__ == "__main__":
    main()
