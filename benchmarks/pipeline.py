"""Pipeline stages against one process: throughput, what each rank holds, and each stage's idle time (the bubble).

Each layout is a real `brickyard train` of the same recipe (the global batch, data order and learning rate of one
process), run in turn round after round so that a drift of the machine hits every layout; the figures are the
medians over the rounds. Per layout: images/s of the training loop (the summary's `images_per_second`), the
parameters and optimiser state rank 0 held (measured from its tensors: the summary's `held_per_rank`), and for
pipelines each stage's compute time against its step time (`summary.json`'s `pipeline`: what is left is waiting
for the other stages, the fill and drain of the schedule and the sends). GPipe's and 1F1B's textbook bubble is
(S - 1) / (M + S - 1) of a step for S stages and M microbatches; the measured idle time adds the sends and any
imbalance between the stages.

    python benchmarks/pipeline.py                       # ViT-Tiny (7 px patches) on 28 px MNIST-shaped data, 2 stages
    python benchmarks/pipeline.py --rounds 5 --steps 40 --model vit_tiny --devices cpu:2
    python benchmarks/pipeline.py --wide                # and data parallel, tensor parallel, 2 x 2 (4 processes)
    python benchmarks/pipeline.py --batch-norm --seeds 0 1 --epochs 2   # what microbatch statistics cost
    python benchmarks/pipeline.py --batch-norm --preset fashion-resnet18 --set data.train_per_class=300 --epochs 4

`--batch-norm` measures what a pipeline changes for a model with batch norm, which sees each microbatch's statistics
instead of the device batch's: a preset (`--preset`, default `fashion-lean`: batch norm after each convolution;
`fashion-resnet18`: ResNet-18) for `--epochs` on one process and on 2 stages (4 microbatches of its batch), test
accuracy and training time per seed.

On a machine of 2 cores each process gets one thread (train.threads=1, pinned for every layout), so one process
leaves a core idle: the pipeline's speed-up there is what two cores buy, less the bubble and the sends.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RECIPE = ["data.name=synthetic", "model.patch_size=7", "data.synthetic.num_train=4096", "data.synthetic.num_val=256", "data.synthetic.num_test=256",
          "data.global_batch_size=64", "train.epochs=1", "train.plots=false", "train.threads=1", "train.precision=fp32",
          "train.eval_every=0", "checkpoint.every_epoch=false", "train.tensorboard=false", "train.progress=none"]


def layouts(stages: int, devices: str, wide: bool = False) -> list[tuple[str, list[str], str | None]]:
    """(label, extra settings, --devices) of each layout measured; ``wide`` adds tensor parallel and the 4-process
    layouts (two pipelines, each data parallel, FSDP or tensor parallel inside a stage)."""
    out: list[tuple[str, list[str], str | None]] = [("1 process", [], None)]
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            out.append((f"{stages} stages, {schedule}, {m} microbatches",
                        [f"dist.pipeline.stages={stages}", f"dist.pipeline.schedule={schedule}", f"dist.pipeline.microbatches={m}"],
                        devices))
    if wide:
        staged = [f"dist.pipeline.stages={stages}"]
        out += [("2 data-parallel processes", [], "cpu:2"),
                ("tensor parallel 2", ["dist.tensor_parallel=2"], "cpu:2"),
                (f"{stages} stages x 2 replicas", staged, f"cpu:{2 * stages}"),
                (f"{stages} stages x 2, FSDP in a stage", staged + ["dist.strategy=fsdp"], f"cpu:{2 * stages}"),
                (f"{stages} stages x tensor parallel 2", staged + ["dist.tensor_parallel=2"], f"cpu:{2 * stages}")]
    return out


def run(label: str, extra: list[str], devices: str | None, model: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sets = [a for s in RECIPE + [f"model.name={model}", f"train.max_steps={steps}", *extra] for a in ("--set", s)]
        cmd = [sys.executable, "-m", "brickyard", "train", "mnist", *sets, "--run-dir", tmp] + (["--devices", devices] if devices else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"{label}: {r.stderr[-2000:]}")
        return json.loads((Path(tmp) / "summary.json").read_text())


def batch_norm_cost(seeds: list[int], epochs: int, devices: str, preset: str = "fashion-lean", extra: tuple = ()) -> None:
    """Test accuracy of ``preset`` (with ``extra`` settings) on one process and on 2 stages of 4 microbatches, per seed."""
    print(f"{preset} {' '.join(extra)}, {epochs} epochs, test accuracy: one process (batch-norm statistics of the "
          f"device batch) against 2 stages x 4 microbatches (a quarter of it)")
    for seed in seeds:
        row, seconds = [], []
        for layout, dev in (([], None), (["dist.pipeline.stages=2", "dist.pipeline.microbatches=4"], devices)):
            with tempfile.TemporaryDirectory() as tmp:
                sets = [a for s in [f"train.seed={seed}", f"train.epochs={epochs}", "train.plots=false", "train.threads=1",
                                    "train.precision=fp32", *extra, *layout] for a in ("--set", s)]
                cmd = [sys.executable, "-m", "brickyard", "train", preset, *sets, "--run-dir", tmp]
                r = subprocess.run(cmd + (["--devices", dev] if dev else []), capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(r.stderr[-2000:])
                summary = json.loads((Path(tmp) / "summary.json").read_text())
                row.append(summary["test_accuracy"])
                seconds.append(summary["train_seconds"])
        print(f"seed {seed}: one process {100 * row[0]:.2f}% ({seconds[0]:.0f} s of training), 2 stages "
              f"{100 * row[1]:.2f}% ({seconds[1]:.0f} s) ({100 * (row[1] - row[0]):+.2f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="vit_tiny")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--devices", default="cpu:2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wide", action="store_true", help="add data parallel, tensor parallel and the 4-process layouts")
    ap.add_argument("--batch-norm", action="store_true", help="what microbatch statistics cost a preset's accuracy")
    ap.add_argument("--preset", default="fashion-lean", help="with --batch-norm: the preset trained")
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                    help="with --batch-norm: settings added to the preset's")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    if args.batch_norm:
        batch_norm_cost(args.seeds, args.epochs, args.devices, args.preset, tuple(args.extra))
        return
    cases = layouts(args.stages, args.devices, args.wide)
    got: dict[str, list[dict]] = {label: [] for label, _, _ in cases}
    for _ in range(args.rounds):
        for label, extra, devices in cases:
            got[label].append(run(label, extra, devices, args.model, args.steps))
    base = statistics.median(s["images_per_second"] for s in got[cases[0][0]])
    print(f"{args.model}, global batch 64, {args.steps} steps, {args.rounds} rounds (medians), fp32, one thread a process")
    print(f"{'layout':<36} {'img/s':>8} {'vs 1':>6} {'rank 0 holds':>13} {'stage idle (textbook)':>24}")
    for label, _, _ in cases:
        rows = got[label]
        ips = statistics.median(s["images_per_second"] for s in rows)
        held = rows[-1]["held_per_rank"]
        holds = f"{(held['parameters'] + held['optimizer_state']) / 2**20:.1f} MiB"
        idle = ""
        if "pipeline" in rows[-1]:
            per = [statistics.median(s["pipeline"]["ranks"][r]["idle"] for s in rows) for r in range(len(rows[-1]["pipeline"]["ranks"]))]
            m, n = rows[-1]["pipeline"]["microbatches"], args.stages  # 4 ranks: stage 0, 0, 1, 1 (replicas or shards)
            idle = f"{' / '.join(f'{100 * v:.0f}%' for v in per)} ({100 * (n - 1) / (m + n - 1):.0f}%)"
        print(f"{label:<36} {ips:>8.0f} {ips / base:>5.2f}x {holds:>13} {idle:>24}")


if __name__ == "__main__":
    main()
