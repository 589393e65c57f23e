"""Does a recipe survive every configuration users run? A preset (`mnist` unless `--preset`), seeds x
devices x precision, test accuracy of each run, then the mean and the minimum (target: every cell
>= `--target`, 0.99 unless given; the `fashion` preset's is 0.93).

    python benchmarks/recipe_table.py [--preset mnist] [--target 0.99] [--seeds 0 1 2 3 4]
                                      [--devices cpu cpu:2 cpu:4] [--precisions fp32 bf16]
                                      [--json out.json] [-- extra brickyard train arguments]

Each cell is a whole `brickyard train PRESET` command; plots and TensorBoard are off (they do not
change the weights). bf16 on a CPU without native bf16 runs emulated: correct, about 10x slower.
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


def cell(seed: int, devices: str, precision: str, extra: list[str], preset: str = "mnist") -> tuple[float, float, float]:
    """Test accuracy, the whole command's seconds, and the training speed in images a second (the machine's
    speed of the moment: a shared machine's drifts, and the wall time with it)."""
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        cmd = [sys.executable, "-m", "brickyard", "train", preset, "--devices", devices, "--run-dir", str(run),
               "--set", f"train.seed={seed}", "--set", f"train.precision={precision}", "--set", "train.plots=false",
               "--set", "train.tensorboard=false", "--set", "train.progress=none", *extra]
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if r.returncode != 0:
            sys.exit(f"{' '.join(cmd)}\n{r.stderr}")
        summary = json.loads((run / "summary.json").read_text())
        return summary["test_accuracy"], wall, summary["images_per_second"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--devices", nargs="+", default=["cpu", "cpu:2", "cpu:4"])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--json", help="also write the cells here")
    p.add_argument("--preset", default="mnist", help="the preset to train (default mnist)")
    p.add_argument("--target", type=float, default=0.99, help="the accuracy every cell should reach (default 0.99)")
    p.add_argument("extra", nargs="*", help="extra arguments for brickyard train")
    a = p.parse_args(argv)
    cells = []
    for precision in a.precisions:
        for devices in a.devices:
            for seed in a.seeds:
                acc, wall, speed = cell(seed, devices, precision, a.extra, a.preset)
                cells.append({"seed": seed, "devices": devices, "precision": precision, "test_accuracy": acc, "wall_s": wall,
                              "images_per_second": speed})
                print(f"{precision:<5} {devices:<6} seed {seed}: {100 * acc:.2f}%  ({wall:.1f} s, {speed:,.0f} img/s)", flush=True)
    print(f"\n{'':<13}" + "".join(f"seed {s:<4}" for s in a.seeds) + "  mean     min")
    for precision in a.precisions:
        for devices in a.devices:
            row = [c["test_accuracy"] for c in cells if c["precision"] == precision and c["devices"] == devices]
            print(f"{precision:<5} {devices:<7}" + "".join(f"{100 * x:>8.2f}  " for x in row)
                  + f"{100 * statistics.mean(row):>6.2f}  {100 * min(row):>6.2f}")
    accs = [c["test_accuracy"] for c in cells]
    print(f"\nall {len(accs)} cells: mean {100 * statistics.mean(accs):.2f}%, min {100 * min(accs):.2f}%, "
          f"cells below {100 * a.target:.1f}%: {sum(x < a.target for x in accs)}; whole command "
          f"{min(c['wall_s'] for c in cells):.1f}-{max(c['wall_s'] for c in cells):.1f} s, training at "
          f"{min(c['images_per_second'] for c in cells):,.0f}-{max(c['images_per_second'] for c in cells):,.0f} img/s")
    if a.json:
        Path(a.json).write_text(json.dumps(cells, indent=2))


if __name__ == "__main__":
    main()
