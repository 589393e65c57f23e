"""Does dimension-reduction training pay? Both stage-2 methods against fair baselines, per model and seed.

Stage 1 is the course recipe (SGD lr 0.01, batch 100) on a cosine schedule planned for E + k epochs and
stopped after E (a run cut short before its schedule ended, as MindSpore's tutorial describes), with
snapshots (the initial weights among them). Then:

  (a) the MindSpore claim: k epochs of stage 2 from stage 1's end, for each method (dldr, mindspore)
      (b) SGD that anneals over the same E + k epochs (stage 1 run to its schedule's end)
      (c) SGD for (a)'s whole wall time (stage 1 + stage 2), annealed over the epochs that time buys
      (d) the default `mnist` preset's tuned recipe (Adam, one-cycle, label smoothing) for E + k epochs
  (e) the authors' claim: k epochs of stage 2 from the *initial* weights in stage 1's subspace, for
      each method, against stage 1 itself (E epochs of SGD, which the subspace cost)

Prints test accuracy mean and standard deviation over the seeds, the training seconds, and stage 2's
own report (share of steps that passed the Armijo test). fp32 throughout.

    python benchmarks/dim_reduce.py [--models mnist_cnn lenet] [--seeds 3] [--stage1 2] [--stage2 1]
    python benchmarks/dim_reduce.py --default-check [--seeds 5]    # `brickyard boost dim-reduce mnist-course
                                                                   #  --stage1-epochs 1 --stage2-epochs 1`, per seed
"""
from __future__ import annotations

import argparse
import logging
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import brickyard
from brickyard import models
from brickyard.api import train_config
from brickyard.config import load_config
from brickyard.data import build_data
from brickyard.errors import BrickyardError
from brickyard.training.checkpoint import step_checkpoints
from brickyard.training.loop import train

QUIET = ["train.progress=none", "train.plots=false", "train.tensorboard=false", "train.device=cpu", "train.eval_every=0",
         "train.precision=fp32"]
METHODS = ("dldr", "mindspore")


def run(preset: str, sets: list[str], run_dir: Path, resume=None) -> dict | None:
    try:
        return train_config(load_config(preset, QUIET + sets), run_dir, resume=resume)
    except BrickyardError as err:  # a stage 2 that diverges is stopped by the NaN guard with one sentence
        print(f"  {run_dir.name}: {err}", flush=True)
        return None


class StopAt(brickyard.Callback):
    """Ends a run at a step, its schedule planned for longer (what `train.max_steps` would shorten)."""

    def __init__(self, step: int):
        self.at = step

    def on_step_end(self, run, loss):
        if run.step >= self.at:
            run.stop(f"stage 1 ends at step {self.at}")


def stopped_early(sets: list[str], steps: int, run_dir: Path) -> dict:
    """``train_config`` with ``StopAt``: the registry model and data set, as `brickyard train` builds them."""
    cfg = load_config("mnist-course", QUIET + sets)
    data = build_data(cfg.data)
    torch.manual_seed(cfg.train.seed)
    model = models.build(cfg, data)
    return train(cfg, model, data, run_dir, None, {"name": cfg.model.name, "registry": True}, callbacks=[StopAt(steps)])


def one_seed(tmp: Path, model: str, seed: int, e: float, k: float) -> dict:
    common = [f"train.seed={seed}", f"model.name={model}"]
    cosine = common + ["schedule.name=cosine", f"train.epochs={e + k}"]
    s1_dir = tmp / f"{model}-s1-{seed}"
    s1 = stopped_early(cosine + ["boost.snapshots.enabled=true", "boost.snapshots.include_init=true",
                                 f"boost.snapshots.every_steps={math.ceil(e * 500 / 40)}"], math.ceil(e * 500), s1_dir)
    snaps, last = s1_dir / "snapshots", step_checkpoints(s1_dir / "checkpoints")[-1]
    out = {"stage 1 (E epochs)": (s1["test_accuracy"], s1["train_seconds"], None)}
    for method in METHODS:
        for start, key in ((["finetune.init_from=" + str(last)], f"(a) {method} from stage 1's end"),
                           ([], f"(e) {method} from the initial weights")):
            s2 = run("mnist-course", common + [f"train.epochs={k}", "boost.dim_reduce.enabled=true",
                                               f"boost.dim_reduce.method={method}", f"boost.dim_reduce.snapshots_dir={snaps}"]
                     + start, tmp / f"{model}-s2-{method}-{len(start)}-{seed}")
            out[key] = ((s2["test_accuracy"], s1["train_seconds"] + s2["train_seconds"], s2["dim_reduce"]["passed_fraction"])
                        if s2 else (float("nan"), float("nan"), None))
    b = run("mnist-course", cosine, s1_dir, resume="auto")  # stage 1 continued to its schedule's end
    out["(b) SGD annealed over E+k"] = (b["test_accuracy"], b["train_seconds"] + s1["train_seconds"], None)
    a_secs = max(v[1] for key, v in out.items() if key.startswith("(a)") and v[1] == v[1])
    per_epoch = (b["train_seconds"] + s1["train_seconds"]) / (e + k)
    epochs = round(a_secs / per_epoch, 2)
    c = run("mnist-course", common + ["schedule.name=cosine", f"train.epochs={epochs}"], tmp / f"{model}-c-{seed}")
    out["(c) SGD for (a)'s time"] = (c["test_accuracy"], c["train_seconds"], epochs)
    d = run("mnist", common + [f"train.epochs={e + k}"], tmp / f"{model}-d-{seed}")
    out["(d) the mnist preset's recipe, E+k"] = (d["test_accuracy"], d["train_seconds"], None)
    return out


def compare(a):
    e, k = a.stage1, a.stage2
    print(f"stage 1 {e:g} epochs of {e + k:g} planned, stage 2 {k:g}; {a.seeds} seeds; {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            rows: dict[str, list] = {}
            for seed in range(a.seeds):
                for key, v in one_seed(Path(tmp), model, seed, e, k).items():
                    rows.setdefault(key, []).append(v)
                print(f"{model} seed {seed}: " + "; ".join(f"{key} {v[-1][0]:.4f}" for key, v in rows.items()), flush=True)
            for key, v in rows.items():
                done = [x for x in v if x[0] == x[0]]
                if not done:
                    print(f"{model:<10} {key:<42} diverged in every seed")
                    continue
                acc = [x[0] for x in done]
                spread = statistics.stdev(acc) if len(acc) > 1 else 0.0
                note = ""
                if key.startswith("(c)"):
                    note = f"; {', '.join(f'{x[2]:g}' for x in done)} epochs"
                elif done[0][2] is not None:
                    note = f"; {100 * statistics.mean(x[2] for x in done):.0f}% passed"
                note += f"; diverged in {len(v) - len(done)} of {len(v)}" if len(done) < len(v) else ""
                print(f"{model:<10} {key:<42} {100 * statistics.mean(acc):.2f}% +- {100 * spread:.2f} "
                      f"(min {100 * min(acc):.2f}), {statistics.mean(x[1] for x in done):.0f} s{note}", flush=True)


def default_check(a):
    """The command a new user types, on each seed: stage 2 must end finite and above stage 1."""
    for seed in range(a.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run([sys.executable, "-m", "brickyard", "boost", "dim-reduce", "mnist-course", "--stage1-epochs", "1",
                                "--stage2-epochs", "1", "--run-dir", f"{tmp}/r", "--set", "train.progress=none",
                                "--set", f"train.seed={seed}"], capture_output=True, text=True)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("stage 1:", "stage 2:"))]
            print(f"seed {seed}: exit {r.returncode}; " + "; ".join(lines) + (f"; {r.stderr.strip()[-300:]}" if r.returncode else ""),
                  flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["mnist_cnn", "lenet"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--stage1", type=float, default=2.0, help="E: stage-1 epochs (of E + k planned)")
    p.add_argument("--stage2", type=float, default=1.0, help="k: stage-2 epochs")
    p.add_argument("--default-check", action="store_true", help="run the default command on each seed instead")
    a = p.parse_args(argv)
    logging.getLogger("brickyard").setLevel(logging.WARNING)  # the runs' own lines: warnings only
    default_check(a) if a.default_check else compare(a)


if __name__ == "__main__":
    main()
