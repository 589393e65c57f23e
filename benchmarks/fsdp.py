"""What sharding costs and saves: DDP against FSDP (and FSDP with activation checkpointing), on the CPU.

Each case is a real `brickyard train` of a vision transformer on synthetic 3x64x64 images with AdamW,
2 processes (`--devices cpu:2`), run in turn (A B C A B C ...). Printed per case: images/s of the
training loop, what rank 0 holds of parameters and optimiser state (measured from its tensors,
`summary.json`'s `held_per_rank`), its peak resident memory above what it had when training began
(ru_maxrss minus the resident memory at `train()`'s start: the model, its gradients, optimiser state,
activations, and what the allocator keeps), and `brickyard memory`'s per-rank estimate for the same
settings (which counts the in-memory data set too: subtract it to compare).

    python benchmarks/fsdp.py [--model vit_small] [--rounds 2] [--steps 12]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {"ddp": ["dist.grad_sync=ddp"], "fsdp": ["dist.strategy=fsdp"],
         "fsdp + checkpointing": ["dist.strategy=fsdp", "train.activation_checkpointing=auto"]}


def settings(model: str, steps: int, batch: int) -> list[str]:
    return ["data.name=synthetic", "data.synthetic.num_train=2048", "data.synthetic.num_val=0",
            "data.synthetic.num_test=64", "data.synthetic.height=64", "data.synthetic.width=64",
            "data.synthetic.channels=3",
            f"model.name={model}", "optim.name=adamw", "optim.lr=0.0005", "train.precision=fp32",
            f"data.global_batch_size={batch}", f"train.max_steps={steps}", "train.epochs=100",
            "train.progress=none", "train.plots=false", "checkpoint.every_epoch=false", "train.log_every=1000"]


def sets(items):
    return [a for s in items for a in ("--set", s)]


def run(case: str, model: str, steps: int, batch: int, where: Path) -> dict:
    run_dir = where / f"{case.replace(' ', '')}-{len(list(where.iterdir()))}"
    cmd = [sys.executable, "-m", "brickyard", "train", *sets(settings(model, steps, batch) + CASES[case]),
           "--devices", "cpu:2", "--run-dir", str(run_dir)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())


def estimate(case: str, model: str, steps: int, batch: int) -> str:
    cmd = [sys.executable, "-m", "brickyard", "memory", *sets(settings(model, steps, batch) + CASES[case]), "--devices", "cpu:2"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return next((l.split()[-2] + " " + l.split()[-1] for l in out.splitlines() if l.strip().startswith("total")), "?")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_small")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=32, help="global batch")
    a = p.parse_args(argv)
    import torch
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, 2 processes, {a.model}, "
          f"3x64x64, global batch {a.batch}, AdamW, fp32, {a.steps} steps")
    results: dict = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            for case in CASES:
                results[case].append(run(case, a.model, a.steps, a.batch, Path(tmp)))
    for case, rs in results.items():
        held = rs[-1]["held_per_rank"]
        ips = statistics.median(r["images_per_second"] for r in rs)
        rss = statistics.median(r["peak_host_rss_mb"] - r["host_rss_at_start_mb"] for r in rs)
        print(f"{case:<22} {ips:7.1f} img/s; rank 0 holds parameters {held['parameters'] / 2**20:6.1f} MiB, "
              f"optimiser state {held['optimizer_state'] / 2**20:6.1f} MiB; peak RSS above the start {rss:6.0f} MiB; "
              f"estimate {estimate(case, a.model, a.steps, a.batch)}")


if __name__ == "__main__":
    main()
