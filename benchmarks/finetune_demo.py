"""Fine-tuning demo (offline): pretrain the course network on digits 0-4, then learn digits 5-9
from only 50 images per class — fine-tuned (new head, conv1 frozen, head lr x10) against the same
network trained from scratch on the same images with the same number of steps. Three seeds.

    python benchmarks/finetune_demo.py [--seeds 3] [--pretrain-epochs 1]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from brickyard.api import train_config
from brickyard.config import load_config

QUIET = ["train.progress=none", "train.plots=false", "train.tensorboard=false", "train.device=cpu"]
SMALL = ["data.classes=[5, 6, 7, 8, 9]", "data.train_per_class=50", "data.batch_size=50", "train.epochs=20",
         "optim.name=momentum", "schedule.name=constant", "checkpoint.keep_best=false"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--pretrain-epochs", type=float, default=1.0)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        t0 = time.perf_counter()
        pre = train_config(load_config("mnist", QUIET + ["data.classes=[0, 1, 2, 3, 4]", f"train.epochs={a.pretrain_epochs}"]), d / "pre")
        print(f"pretrained on digits 0-4: test accuracy {pre['test_accuracy']:.4f} ({time.perf_counter() - t0:.0f} s)")
        ckpt = sorted((d / "pre" / "checkpoints").glob("step-*.pt"))[-1]
        fine, scratch = [], []
        for seed in range(a.seeds):
            f = train_config(load_config("mnist", QUIET + SMALL + [
                f"train.seed={seed}", f"finetune.init_from={ckpt}", "finetune.reset_head=true",
                "finetune.freeze=[conv1.*]", "finetune.head_lr_mult=10", "optim.lr=0.01"]), d / f"ft{seed}")
            s = train_config(load_config("mnist", QUIET + SMALL + [f"train.seed={seed}", "optim.lr=0.05"]), d / f"sc{seed}")
            fine.append(f["test_accuracy"])
            scratch.append(s["test_accuracy"])
            print(f"seed {seed}: fine-tuned {f['test_accuracy']:.4f}, from scratch {s['test_accuracy']:.4f} ({f['steps']} steps each)")
    spread = lambda v: statistics.pstdev(v)  # noqa: E731
    print(f"digits 5-9 from 50 images/class, test accuracy over {a.seeds} seeds: fine-tuned {statistics.mean(fine):.4f} "
          f"+- {spread(fine):.4f}, from scratch {statistics.mean(scratch):.4f} +- {spread(scratch):.4f}")
    print(f"hardware: {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
