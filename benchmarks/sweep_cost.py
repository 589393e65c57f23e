"""What a sweep trial costs besides its training: ``brickyard sweep`` of K short MNIST trials against the same K runs as
``brickyard train`` commands, in turn (sweep, commands, sweep, ...), on this machine.

    python benchmarks/sweep_cost.py [--trials 4] [--steps 60] [--rounds 3]

For each round it prints the wall time of the sweep and of the K commands. At the end, the median of each part of a
trial's and of a command's time outside its training loop, from what the run wrote (``summary.json``):

- the loop: ``train_seconds`` (the training steps only);
- validation and checkpoints: the epochs' time (``epoch_seconds``) less the loop's;
- set-up, test and summary: the run's ``wall_seconds`` (``train()``'s start to the summary) less the epochs';
- plots: ``plot_seconds``;
- the rest: for a trial, Optuna's trial time less the run's (the sweep's own share: its trial's config, storage
  writes and reading the metrics back); for a command, its wall time less the run's (the interpreter, ``import
  torch``, the config).

Plots and TensorBoard are on as in a default run (``--lean`` turns them off).
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

COMMON = ["optim.lr=0.005", "data.eval_limit=500", "train.progress=none", "train.precision=fp32"]
LEAN = ["train.plots=false", "train.tensorboard=false"]


def _sets(items):
    return [a for item in items for a in ("--set", item)]


def _parts(s: dict) -> dict:
    epochs = sum(s["epoch_seconds"])
    return {"loop": s["train_seconds"], "validation": epochs - s["train_seconds"], "setup": s["wall_seconds"] - epochs,
            "plots": s.get("plot_seconds", 0.0), "run": s["wall_seconds"] + s.get("plot_seconds", 0.0)}


PARTS = ("setup", "validation", "plots", "rest")


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
            rows.append({"outside": float(row["seconds"]), **_parts(s)})
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
        rows.append({"outside": time.perf_counter() - t, **_parts(s)})
    return time.perf_counter() - start, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lean", action="store_true", help="plots and TensorBoard off")
    a = p.parse_args()
    if a.lean:
        COMMON.extend(LEAN)
    parts: dict[str, list] = {"trial": [], "command": []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            sw, trials = _sweep(Path(tmp), a.trials, a.steps)
            cm, runs = _commands(Path(tmp), a.trials, a.steps)
            for kind, rows in (("trial", trials), ("command", runs)):
                for row in rows:
                    row["rest"] = row["outside"] - row["run"]
                    row["outside"] -= row["loop"]
                    parts[kind].append(row)
            ratios.append(sw / cm)
            print(f"round {r}: sweep of {a.trials} trials {sw:.1f} s, {a.trials} train commands {cm:.1f} s "
                  f"(ratio {sw / cm:.3f})", flush=True)
    print(f"median over {len(parts['trial'])} of each, seconds: outside the loop = " + " + ".join(PARTS))
    for kind, rows in parts.items():
        med = {k: statistics.median(row[k] for row in rows) for k in ("loop", "outside", *PARTS)}
        print(f"a {kind}: loop {med['loop']:.2f}; outside it {med['outside']:.2f} = " +
              " + ".join(f"{k} {med[k]:.2f}" for k in PARTS))
    print(f"sweep / commands: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
