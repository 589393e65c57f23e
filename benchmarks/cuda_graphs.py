"""A small network's training step on a GPU, five ways: what CUDA graphs buy and which way of getting them
is faster (``train.cuda_graphs``, docs/training.md).

    python benchmarks/cuda_graphs.py [--model mnist_fast] [--batch 128] [--steps 300] [--rounds 3] [--precision bf16]

Rows, each the median of ``--rounds`` timed passes of ``--steps`` steps after a warm-up pass, on the same
synthetic MNIST-shaped batches already on the device, Nesterov SGD (lr 0.05, momentum 0.9, weight decay 5e-4):
- hand, eager: the loop a user writes (``torch.optim.SGD``, its default foreach update);
- hand, eager, fused update: the same with ``fused=True`` (what brickyard's step uses on CUDA);
- hand, torch.compile(mode="reduce-overhead"): the model compiled into CUDA graphs by Inductor, the fused
  update eager (the compile time is printed apart);
- hand, one CUDA graph: PyTorch's whole-network capture (docs/source/notes/cuda.rst, "Whole-network capture"):
  forward, backward and the fused update with its rate in a tensor, replayed;
- brickyard, ``train.cuda_graphs: false`` and ``true``: ``trainer.train`` on the same data (its
  ``images_per_second``: the loop alone).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import brickyard_loop  # noqa: E402  (the benchmarks' own helpers)

from brickyard import models  # noqa: E402
from brickyard.training import device as dev  # noqa: E402


def _setup(model_name, batch, precision):
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = models.create(model_name, 10, 1, (28, 28)).to(device)
    images = torch.randn(64, batch, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (64, batch), device=device)
    return model, images, labels, device


def _timed(step, steps, n_batches) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(i % n_batches)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def hand(model_name, batch, steps, rounds, precision, how) -> list[float]:
    model, images, labels, device = _setup(model_name, batch, precision)
    fused = how != "eager"
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05, device=device) if how == "graph" else 0.05,
                          momentum=0.9, nesterov=True, weight_decay=5e-4, fused=fused or None)
    forward = model
    if how == "reduce-overhead":
        forward = torch.compile(model, mode="reduce-overhead")

    def eager_step(i):
        with dev.autocast(device, precision):
            loss = F.cross_entropy(forward(images[i]).float(), labels[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step = eager_step
    if how == "reduce-overhead":
        start = time.perf_counter()
        for i in range(3):
            eager_step(i)
        torch.cuda.synchronize()
        print(f"  torch.compile(mode='reduce-overhead'): {time.perf_counter() - start:.1f} s to compile and warm up", flush=True)
    if how == "graph":
        sx, sy = images[0].clone(), labels[0].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                eager_step(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            with dev.autocast(device, precision):
                loss = F.cross_entropy(model(sx).float(), sy)
            loss.backward()
            opt.step()

        def step(i):
            sx.copy_(images[i])
            sy.copy_(labels[i])
            graph.replay()
    _timed(step, steps, len(images))  # warm-up pass
    return [steps * batch / _timed(step, steps, len(images)) for _ in range(rounds)]


def ours(model_name, batch, steps, rounds, graphs: bool) -> list[float]:
    n = max(batch * steps, 4096)
    return [brickyard_loop(model_name, batch, steps, "cuda", n, extra=[f"train.cuda_graphs={str(graphs).lower()}"])[0]
            for _ in range(rounds + 1)][1:]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mnist_fast")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--skip", default="", help="comma-separated rows to leave out: reduce-overhead, brickyard")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: benchmarks/cuda_graphs.py measures CUDA graphs and needs a CUDA device.")
    skip = set(filter(None, a.skip.split(",")))
    rows = {}
    for how in ("eager", "eager-fused", "graph", "reduce-overhead"):
        if how not in skip:
            rows[f"hand, {how}"] = hand(a.model, a.batch, a.steps, a.rounds, a.precision, how)
            print(f"hand, {how}: {statistics.median(rows[f'hand, {how}']):,.0f} img/s", flush=True)
    if "brickyard" not in skip:
        for graphs in (False, True):
            name = f"brickyard, train.cuda_graphs: {str(graphs).lower()}"
            rows[name] = ours(a.model, a.batch, a.steps, a.rounds, graphs)
            print(f"{name}: {statistics.median(rows[name]):,.0f} img/s", flush=True)
    base = statistics.median(rows["hand, eager"]) if "hand, eager" in rows else None
    print(f"\nhardware: {dev.describe(torch.device('cuda'))}; torch {torch.__version__}")
    print(f"settings: {a.model}, batch {a.batch}, {a.precision}, {a.steps} steps x {a.rounds} passes after a warm-up pass")
    print("| step | img/s (median) | ms a step | x hand eager |")
    print("| --- | --- | --- | --- |")
    for name, got in rows.items():
        m = statistics.median(got)
        print(f"| {name} | {m:,.0f} | {1000 * a.batch / m:.3f} | {m / base:.2f} |" if base else f"| {name} | {m:,.0f} | "
              f"{1000 * a.batch / m:.3f} | |")


if __name__ == "__main__":
    main()
