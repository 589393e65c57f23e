"""Does dimension-reduction training pay? Stage 1 is the course recipe (plain SGD lr 0.01, batch 100,
constant rate); per model and seed:

  (a) E epochs of stage 1, snapshots over its second half (the paper's setting: the subspace comes
      from the later part of the trajectory), then k epochs of stage 2 (P-BFGS, 32 dims) from stage
      1's end, as the reference does it (a failed line search still takes the last step size)
  (a') the same with boost.dim_reduce.failed_search: skip (brickyard's option)
  (b) E + k epochs of the stage-1 optimiser             (equal epochs)
  (c) the stage-1 optimiser for as long as (a) trained   (equal wall time: train.max_time_s)

(b) and (c) continue the stage-1 run (the schedule is constant, so this equals training from the
start). Prints test accuracy mean +- standard deviation, training seconds, and stage 2's own
report (share of steps that passed the Armijo test).

    python benchmarks/dim_reduce.py [--models mnist_cnn lenet] [--seeds 3] [--stage1 3] [--stage2 1]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from brickyard.api import train_config
from brickyard.training.checkpoint import step_checkpoints
from brickyard.config import load_config
from brickyard.errors import BrickyardError

QUIET = ["train.progress=none", "train.plots=false", "train.tensorboard=false", "train.device=cpu", "train.eval_every=0",
         "train.precision=fp32"]


def one_seed(tmp: Path, preset: str, model: str, seed: int, e: float, k: float) -> dict:
    common = QUIET + [f"train.seed={seed}", f"model.name={model}"]
    s1_dir = tmp / f"{model}-s1-{seed}"
    s1 = train_config(load_config(preset, common + [f"train.epochs={e}", "boost.snapshots.enabled=true",
                                                    f"boost.snapshots.start_epoch={e / 2}"]), s1_dir)
    out = {}
    for key, policy in (("a", "take"), ("a'", "skip")):
        try:
            s2 = train_config(load_config(preset, common + [
                f"train.epochs={k}", "boost.dim_reduce.enabled=true", f"boost.dim_reduce.snapshots_dir={s1_dir / 'snapshots'}",
                f"boost.dim_reduce.failed_search={policy}", f"finetune.init_from={step_checkpoints(s1_dir / 'checkpoints')[-1]}"]),
                tmp / f"{model}-s2{policy}-{seed}")
            out[key] = (s2["test_accuracy"], s1["train_seconds"] + s2["train_seconds"], s2["dim_reduce"]["passed_fraction"])
        except BrickyardError as err:  # the reference's policy can diverge: the NaN guard says where
            print(f"{model} seed {seed} ({key}): {err}", flush=True)
            out[key] = (float("nan"), float("nan"), float("nan"))
    a_secs = out["a'"][1]
    for key, extra in (("b", [f"train.epochs={e + k}"]),
                       ("c", ["train.epochs=1000", f"train.max_time_s={max(1.0, a_secs - s1['train_seconds']):.1f}"])):
        d = tmp / f"{model}-{key}-{seed}"
        shutil.copytree(s1_dir, d)
        r = train_config(load_config(preset, common + extra), d, resume="auto")
        out[key] = (r["test_accuracy"], s1["train_seconds"] + r["train_seconds"], r["epochs"])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mnist-course")
    p.add_argument("--models", nargs="+", default=["mnist_cnn", "lenet"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--stage1", type=float, default=3.0, help="E: stage-1 epochs")
    p.add_argument("--stage2", type=float, default=1.0, help="k: stage-2 epochs")
    a = p.parse_args(argv)
    e, k = a.stage1, a.stage2
    names = {"a": f"{e:g} SGD + {k:g} P-BFGS (ref.)", "a'": f"{e:g} SGD + {k:g} P-BFGS (skip)",
             "b": f"{e + k:g} SGD (equal epochs)", "c": "SGD for (a')'s time"}
    print(f"{a.preset}, {a.seeds} seeds, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
          f"torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            rows = {key: [] for key in ("a", "a'", "b", "c")}
            for seed in range(a.seeds):
                for key, v in one_seed(Path(tmp), a.preset, model, seed, e, k).items():
                    rows[key].append(v)
                print(f"{model} seed {seed}: " + ", ".join(f"({key}) {v[-1][0]:.4f} in {v[-1][1]:.0f} s" for key, v in rows.items()),
                      flush=True)
            for key, v in rows.items():
                done = [x for x in v if x[0] == x[0]]  # not diverged
                if not done:
                    print(f"{model:<10} ({key}) {names[key]:<28} diverged in every seed")
                    continue
                acc, secs = [x[0] for x in done], [x[1] for x in done]
                spread = statistics.stdev(acc) if len(acc) > 1 else 0.0
                note = (f"; {100 * statistics.mean(x[2] for x in done):.0f}% of subspace steps passed the Armijo test"
                        if key.startswith("a") else f"; {statistics.mean(x[2] for x in done):.2f} epochs")
                note += f"; diverged in {len(v) - len(done)} of {len(v)} seeds" if len(done) < len(v) else ""
                print(f"{model:<10} ({key}) {names[key]:<28} test acc {100 * statistics.mean(acc):.2f}% +- "
                      f"{100 * spread:.2f} (min {100 * min(acc):.2f}); training {statistics.mean(secs):.0f} s{note}")


if __name__ == "__main__":
    main()
