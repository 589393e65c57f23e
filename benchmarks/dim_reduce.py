"""Does dimension-reduction training help? Stage 1 is the course recipe (plain SGD lr 0.01, batch
100, un-annealed), per seed:

  (a) 5 epochs of stage 1 (snapshots every 50 steps, last 40 kept) + 2 epochs of stage 2 (P-BFGS, 32 dims)
  (b) 7 epochs of the stage-1 optimiser        (c) 15 epochs of it
  (d) from initialisation: stage 2 for 2 epochs from the *initial* weights in the same subspace

(b) and (c) continue the stage-1 run (the schedule is constant, so this is the same as training
7 or 15 epochs from the start). Prints test accuracy mean and spread, and training seconds.

    python benchmarks/dim_reduce.py [--preset mnist-course] [--model mnist_cnn] [--seeds 3] [--skip-long]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from brickyard.api import train_config
from brickyard.checkpoint import step_checkpoints
from brickyard.config import load_config

QUIET = ["train.progress=none", "train.plots=false", "train.tensorboard=false", "train.device=cpu", "train.eval_every=0"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mnist-course")
    p.add_argument("--model", default="mnist_cnn")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--skip-long", action="store_true", help="skip (c), the 15-epoch baseline")
    a = p.parse_args(argv)
    rows = {k: [] for k in "abcd"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for seed in range(a.seeds):
            common = QUIET + [f"train.seed={seed}", f"model.name={a.model}"]
            s1_dir = tmp / f"s1-{seed}"
            s1 = train_config(load_config(a.preset, common + ["train.epochs=5", "boost.snapshots.enabled=true"]), s1_dir)
            s2 = train_config(load_config(a.preset, common + [
                "train.epochs=2", "boost.dim_reduce.enabled=true", f"boost.dim_reduce.snapshots_dir={s1_dir / 'snapshots'}",
                f"finetune.init_from={step_checkpoints(s1_dir / 'checkpoints')[-1]}"]), tmp / f"s2-{seed}")
            rows["a"].append((s2["test_accuracy"], s1["train_seconds"] + s2["train_seconds"]))
            for key, epochs in (("b", 7), ("c", 15)):
                if key == "c" and a.skip_long:
                    continue
                d = tmp / f"{key}-{seed}"
                shutil.copytree(s1_dir, d)
                r = train_config(load_config(a.preset, common + [f"train.epochs={epochs}"]), d, resume="auto")
                rows[key].append((r["test_accuracy"], s1["train_seconds"] + r["train_seconds"]))
            d = train_config(load_config(a.preset, common + [
                "train.epochs=2", "boost.dim_reduce.enabled=true", f"boost.dim_reduce.snapshots_dir={s1_dir / 'snapshots'}"]),
                tmp / f"d-{seed}")
            rows["d"].append((d["test_accuracy"], s1["train_seconds"] + d["train_seconds"]))
            print(f"seed {seed}: " + ", ".join(f"({k}) {v[-1][0]:.4f}" for k, v in rows.items() if v), flush=True)
    names = {"a": "5 SGD + 2 P-BFGS", "b": "7 SGD", "c": "15 SGD", "d": "P-BFGS 2 epochs from init (subspace of 5 SGD)"}
    print(f"{a.preset} / {a.model}, {a.seeds} seeds, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}")
    for k, v in rows.items():
        if not v:
            continue
        acc = [x for x, _ in v]
        secs = [s for _, s in v]
        spread = statistics.pstdev(acc) if len(acc) > 1 else 0.0
        print(f"({k}) {names[k]:<46} test acc {statistics.mean(acc):.4f} +- {spread:.4f} "
              f"(min {min(acc):.4f}, max {max(acc):.4f}); training {statistics.mean(secs):.0f} s")


if __name__ == "__main__":
    main()
