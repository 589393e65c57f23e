"""What scoring an evaluation batch costs: brickyard's ``EvalAccumulator`` against torchmetrics' metrics for the same
numbers (top-1 and top-5 accuracy, the confusion matrix, macro F1 and the calibration error), beside the model's
own forward pass on the batch, which any evaluation pays.

    python benchmarks/metrics_cost.py [--batch 1024] [--classes 10] [--rounds 30] [--device cpu] [--model mnist_fast]

Both sides are timed interleaved (ours, theirs, ours, ...) over ``--rounds`` rounds of 20 batches each; the median
per-batch time of each is printed, with the forward pass's. torchmetrics is an optional install
(``pip install torchmetrics``); the figures say whether a run would notice the difference.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from brickyard import models
from brickyard.observe.metrics import EvalAccumulator


def _timed(fn, batches) -> float:
    start = time.perf_counter()
    for out, y in batches:
        fn(out, y)
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="mnist_fast")
    a = p.parse_args()
    import torchmetrics.classification as tm  # optional: pip install torchmetrics
    d, c = torch.device(a.device), a.classes
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(a.batch, c, generator=g).to(d), torch.randint(0, c, (a.batch,), generator=g).to(d))
               for _ in range(20)]
    model = models.create(a.model, c, 1, (28, 28)).to(d).eval()
    x = torch.rand(a.batch, 1, 28, 28, generator=g).to(d)
    ours_t, theirs_t, forward_t = [], [], []
    for _ in range(a.rounds):
        acc = EvalAccumulator(c, d)
        ours_t.append(_timed(acc.update, batches))
        acc.result()
        metrics = [tm.MulticlassAccuracy(c, average="micro").to(d), tm.MulticlassAccuracy(c, top_k=min(5, c), average="micro").to(d),
                   tm.MulticlassConfusionMatrix(c).to(d), tm.MulticlassF1Score(c, average="macro").to(d),
                   tm.MulticlassCalibrationError(c, n_bins=15).to(d)]
        theirs_t.append(_timed(lambda out, y, ms=metrics: [m.update(out, y) for m in ms], batches))
        [m.compute() for m in metrics]
        with torch.no_grad():
            forward_t.append(_timed(lambda out, y: model(x), batches[:5]))
    med = {k: statistics.median(v) * 1e3 for k, v in (("brickyard", ours_t), ("torchmetrics", theirs_t), ("forward", forward_t))}
    print(f"per batch of {a.batch} x {c} classes on {d} ({torch.get_num_threads()} threads), median of {a.rounds} rounds:")
    print(f"  brickyard EvalAccumulator.update   {med['brickyard']:.3f} ms")
    print(f"  torchmetrics (5 metrics) update    {med['torchmetrics']:.3f} ms  ({med['torchmetrics'] / med['brickyard']:.1f}x)")
    print(f"  {a.model} forward pass             {med['forward']:.3f} ms")


if __name__ == "__main__":
    main()
