"""Two processes on a CPU against one process with all its threads, measured in paired blocks.

`brickyard bench --devices cpu cpu:2` runs the two set-ups one after the other; on a shared or
virtual machine the host's speed drifts by +-20% between them, more than the effects to measure.
Here one torchrun job of 2 processes does both, in alternating blocks of ``--block`` steps:

- ``one``: rank 0 trains the whole global batch on all the CPUs' threads while rank 1 sleeps;
- each gradient sync (``flat``, ``ddp``; ``-pinned``: each process on its own CPU; ``flat-sleep``: the
  flat all-reduce waited for asleep): both ranks train half the batch on one thread each and sync
  their gradients.

Every block of a round sees the same host, so the ratio of paired blocks is what the set-ups
differ by. Models, optimiser, precision, channels_last and the glibc heap setting are brickyard's;
batches are random tensors of MNIST's shape (the data step, 0.3 ms on either side, is left out).

    torchrun --nproc-per-node 2 benchmarks/cpu_scaling.py            # 40 rounds of 20-step blocks
    torchrun --nproc-per-node 2 benchmarks/cpu_scaling.py --rounds 10 --precision fp32
"""
import argparse
import copy
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from brickyard.config import load_config
from brickyard.distributed.gradsync import GradSync
from brickyard.models import create
from brickyard.optim import build_optimizer, param_groups
from brickyard.training import device as dev
from brickyard.training.ways.collective import grad_sync


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--block", type=int, default=20, help="steps per block")
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--syncs", default="flat-pinned,flat-sleep-pinned,ddp-pinned,flat")
    args = ap.parse_args()
    tdist.init_process_group("gloo")
    cfg = load_config("mnist", [f"train.precision={args.precision}"])
    dev.tune_allocator()
    precision = dev.resolve_precision(cfg.train.precision, torch.device("cpu"))
    syncs, cpus = ["one"] + args.syncs.split(","), dev.usable_cpus()
    times = measure(cfg, precision, syncs, args.rounds, args.block)
    if tdist.get_rank() == 0:
        one = times["one"]
        print(f"{torch.backends.cpu.get_cpu_capability()}, {len(cpus)} CPUs, precision {precision}, global batch "
              f"{cfg.data.global_batch_size}, {args.rounds} rounds of {args.block}-step blocks; one process: "
              f"{1e3 * statistics.median(one):.2f} ms/step")
        for s in syncs[1:]:
            ratios = [a / b for a, b in zip(one, times[s])]
            q = statistics.quantiles(ratios, n=4)
            print(f"{tdist.get_world_size()} processes, {s:18} {1e3 * statistics.median(times[s]):6.2f} ms/step, throughput "
                  f"vs one process: median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
    tdist.destroy_process_group()


def measure(cfg, precision: str, syncs: list[str], rounds: int, steps: int) -> dict:
    """Seconds per step of each set-up, one figure per round (rank 0's; the others return empty lists)."""
    rank, world, cpus = tdist.get_rank(), tdist.get_world_size(), dev.usable_cpus()
    torch.manual_seed(0)
    base = create(cfg.model.name, 10, 1, (28, 28)).to(memory_format=torch.channels_last)
    g = cfg.data.global_batch_size
    x = torch.randn(g, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (g,))
    part = slice(rank * g // world, (rank + 1) * g // world)
    parts = {s: setup(cfg, base, s) for s in syncs}
    times = {s: [] for s in syncs}
    for r in range(rounds + 1):  # round 0 warms up
        for s in syncs[r % len(syncs):] + syncs[:r % len(syncs)]:  # each set-up takes each place in turn
            tdist.barrier()
            if s == "one":
                if rank == 0:
                    os.sched_setaffinity(0, cpus)
                    torch.set_num_threads(len(cpus))
                    dt = block(*parts[s], x, y, precision, steps)
                tdist.barrier()
            else:
                os.sched_setaffinity(0, {cpus[rank]} if s.endswith("pinned") else cpus)
                torch.set_num_threads(max(1, len(cpus) // world))
                dt = block(*parts[s], x[part], y[part], precision, steps)
            if r and rank == 0:
                times[s].append(dt / steps)
    return times


def setup(cfg, base, sync: str):
    """(the model to call, its optimiser, its gradient sync), all from the same start."""
    model = copy.deepcopy(base)
    opt = build_optimizer(cfg.optim, param_groups(model, cfg.optim))
    if sync == "one":
        return model, opt, GradSync()  # nothing to sync
    fwd, gs = grad_sync(dataclasses.replace(cfg.dist, grad_sync=sync.split("-")[0]), model, torch.device("cpu"))
    if "sleep" in sync:  # flat, waiting for the all-reduce asleep as DDP does
        gs.spin_s = 0.0
    return fwd, opt, gs


def block(fwd, opt, gs, x, y, precision: str, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        with dev.autocast(torch.device("cpu"), precision):
            loss = F.cross_entropy(fwd(x).float(), y)
        loss.backward()
        gs()
        opt.step()
        gs.zero_grad(opt)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
