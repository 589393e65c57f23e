"""What a sweep trial costs besides its training: ``brickyard sweep`` of K short MNIST trials against the same K runs as
``brickyard train`` commands, in turn (sweep, commands, sweep, ...), on this machine.

    python benchmarks/sweep_cost.py [--trials 4] [--steps 60] [--rounds 3]

For each round it prints the wall time of the sweep and of the K commands, and per trial: the time Optuna recorded
for the trial, the run's own ``wall_seconds`` (``summary.json``: from ``train()``'s start to its end) and its
``train_seconds`` (the loop and its evaluations). What a trial costs outside its run is the first less the second;
what a command costs besides its run (the interpreter, ``import torch``, the config) is its wall time less the run's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = ["optim.lr=0.005", "data.eval_limit=500", "train.progress=none", "train.plots=false", "train.tensorboard=false",
          "train.precision=fp32"]


def _sets(items):
    return [a for item in items for a in ("--set", item)]


def _sweep(tmp: Path, k: int, steps: int) -> tuple[float, list[dict]]:
    space = tmp / "space.yaml"
    space.write_text(f"optim.weight_decay: {[round(1e-5 * (i + 1), 6) for i in range(k)]}\n")
    d = tmp / f"sweep-{time.time_ns()}"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "brickyard", "sweep", "mnist", "--space", str(space), "--sampler", "grid",
                    "--trials", str(k), "--pruner", "none", "--dir", str(d), *_sets([*COMMON, f"train.max_steps={steps}"])],
                   check=True, capture_output=True)
    wall = time.perf_counter() - start
    rows = []
    import csv
    with open(d / "trials.csv") as f:
        for row in csv.DictReader(f):
            s = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
            rows.append({"trial": float(row["seconds"]), "run": s["wall_seconds"], "train": s["train_seconds"]})
    return wall, rows


def _commands(tmp: Path, k: int, steps: int) -> tuple[float, list[dict]]:
    start, rows = time.perf_counter(), []
    for i in range(k):
        d = tmp / f"run-{time.time_ns()}"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "brickyard", "train", "mnist", "--run-dir", str(d),
                        *_sets([*COMMON, f"train.max_steps={steps}", f"optim.weight_decay={1e-5 * (i + 1):g}"])],
                       check=True, capture_output=True)
        s = json.loads((d / "summary.json").read_text())
        rows.append({"command": time.perf_counter() - t, "run": s["wall_seconds"], "train": s["train_seconds"]})
    return time.perf_counter() - start, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    outside, besides, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            sw, trials = _sweep(Path(tmp), a.trials, a.steps)
            cm, runs = _commands(Path(tmp), a.trials, a.steps)
            outside += [t["trial"] - t["run"] for t in trials]
            besides += [c["command"] - c["run"] for c in runs]
            ratios.append(sw / cm)
            print(f"round {r}: sweep of {a.trials} trials {sw:.1f} s, {a.trials} train commands {cm:.1f} s "
                  f"(ratio {sw / cm:.3f}); runs' own time {statistics.mean(t['run'] for t in trials):.2f} s in the "
                  f"sweep, {statistics.mean(c['run'] for c in runs):.2f} s as commands", flush=True)
    print(f"a trial outside its run: median {statistics.median(outside):.2f} s; a command besides its run: median "
          f"{statistics.median(besides):.2f} s; sweep / commands: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
