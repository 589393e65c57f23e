"""Time to accuracy: `brickyard train` (default preset) from process start to the
printed result — import time, data loading, training, evaluation, plots, all counted.

Each run is interleaved with `benchmarks/plain_reference.py`, a tuned plain PyTorch script of the
same recipe (no validation, checkpoints, logs or plots), timed the same way, so the figures say
both what the machine allows and what brickyard adds.

    python benchmarks/time_to_accuracy.py [--runs 5] [--no-plain] [-- extra brickyard train arguments]

Run i trains with seed i (both commands), so 5 runs are seeds 0-4.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN = Path(__file__).with_name("plain_reference.py")


def timed(cmd):
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        sys.exit(r.stderr)
    return wall, r.stdout


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--no-plain", action="store_true", help="skip the plain PyTorch reference")
    p.add_argument("extra", nargs="*", help="extra arguments for brickyard train")
    a = p.parse_args(argv)
    walls, accs, trains, plain_walls, plain_accs = [], [], [], [], []
    for i in range(a.runs):
        with tempfile.TemporaryDirectory() as d:
            wall, _ = timed([sys.executable, "-m", "brickyard", "train", "--run-dir", d, "--set", f"train.seed={i}", *a.extra])
            s = json.loads((Path(d) / "summary.json").read_text())
        walls.append(wall)
        accs.append(s["test_accuracy"])
        trains.append(s["train_seconds"])
        plots = s.get("plot_seconds", 0.0)
        start_up = wall - s["wall_seconds"] - plots  # interpreter, imports, config, data before the trainer; exit after it
        rest = s["wall_seconds"] - s["train_seconds"]  # model and optimiser set-up, evaluations, checkpoints
        print(f"run {i} (seed {i}): test accuracy {s['test_accuracy']:.4f}, whole command {wall:.1f} s = start-up and exit {start_up:.1f} s "
              f"+ training loop {s['train_seconds']:.1f} s + set-up/evaluation/checkpoints {rest:.1f} s + plots {plots:.1f} s; "
              f"{s['images_per_second']:,.0f} img/s on {s['device']} ({s['precision']})", flush=True)
        if not a.no_plain:
            wall, out = timed([sys.executable, str(PLAIN), "--seed", str(i)])
            plain_walls.append(wall)
            plain_accs.append(float(re.search(r"test accuracy ([0-9.]+)", out).group(1)))
            print(f"       plain PyTorch reference: whole command {wall:.1f} s; {out.strip()}", flush=True)
    print(f"median: whole command {statistics.median(walls):.1f} s (training {statistics.median(trains):.1f} s), "
          f"test accuracy min {min(accs):.4f} (target: median <= 5 s and every run >= 0.990, one process on a 2-core CPU with native bf16)")
    if plain_walls:
        print(f"plain PyTorch reference, same recipe: median whole command {statistics.median(plain_walls):.1f} s, "
              f"test accuracy min {min(plain_accs):.4f}; brickyard / plain = "
              f"{statistics.median(walls) / statistics.median(plain_walls):.2f}")


if __name__ == "__main__":
    main()
