"""How far a run's probabilities can be trusted: the expected calibration error from binned sums, and temperature
scaling fitted on validation logits. Both are exact on any number of processes: every rank adds its own samples
and one all-reduce of a few numbers combines them.

- ``Bins``: the top-label calibration error of torchmetrics' ``multiclass_calibration_error`` (``n_bins=15``,
  ``norm="l1"``; ``src/torchmetrics/functional/classification/calibration_error.py``, ``_binning_bucketize`` and
  ``_ce_compute``): a sample's confidence is its largest softmax probability, it falls in the bin ``(i/15,
  (i+1)/15]`` (``torch.bucketize(confidences, linspace(0, 1, 16)) - 1``), and ECE is the mean over bins of
  ``|accuracy - confidence|`` weighted by the bin's share of the samples. With sums that is
  ``sum_b |correct_b - confidence_sum_b| / N``.
- ``fit_temperature``: Guo et al., *On Calibration of Modern Neural Networks* (ICML 2017), as their code does it
  (gpleiss/temperature_scaling, ``temperature_scaling.py`` ``set_temperature``: one temperature T dividing the
  logits, chosen to minimise the validation NLL, with ``LBFGS(lr=0.01, max_iter=50)`` from T = 1.5; its ECE is the
  same 15 bins). The NLL is convex in ``beta = 1 / T``
  (a log-sum-exp of lines minus a line), so Newton's method on ``beta`` from 1 finds the same minimum in a few
  steps, each one all-reduce of three sums instead of gathering every logit on one rank. ``beta`` is kept within
  [0.01, 100] (T from 0.01 to 100), and the fit stops after 50 steps: a validation set the model separates
  perfectly has no minimum (its loss falls as T does), and gets a sharper T, not a runaway one.
"""
from __future__ import annotations

import torch

from brickyard.distributed import process as dist

N_BINS = 15


class Bins:
    """Per-bin sums of a split's top-label confidences: count, confidence and correct predictions (float64, on the
    device; nothing read back until ``result``)."""

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(3, N_BINS, device=device, dtype=torch.float64)
        self.edges = torch.linspace(0, 1, N_BINS + 1, device=device)

    def update(self, logits: torch.Tensor, y: torch.Tensor) -> None:
        confidence, pred = logits.float().softmax(1).max(1)
        index = (torch.bucketize(confidence, self.edges) - 1).clamp(0, N_BINS - 1)
        values = torch.stack([torch.ones_like(confidence), confidence, (pred == y).float()]).double()
        self.sums.scatter_add_(1, index.expand(3, -1), values)

    def result(self, group=None) -> tuple[float, dict]:
        """(ECE, the reliability table: each bin's count, mean confidence and accuracy), summed over ``group``."""
        dist.all_reduce_sum(self.sums, group)
        count, confidence, correct = self.sums.cpu()
        n = max(count.sum().item(), 1.0)
        ece = (correct - confidence).abs().sum().item() / n
        seen = count.clamp(min=1)
        return ece, {"count": count.long().tolist(), "confidence": (confidence / seen).tolist(),
                     "accuracy": (correct / seen).tolist()}


def fit_temperature(kept: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, group=None,
                    steps: int = 50) -> float:
    """The temperature minimising the NLL of ``kept`` (this rank's ``(logits, classes)`` batches) summed over
    ``group``'s ranks, by Newton's method on ``beta = 1 / T`` (see the module docstring); every rank calls it and
    gets the same value (1 where no rank kept a sample)."""
    def sums(beta: float) -> tuple[float, float, float]:  # NLL, its first and second derivative in beta
        total = torch.zeros(3, dtype=torch.float64, device=device)
        for logits, y in kept:
            z = logits.double()
            p = (beta * z).softmax(1)
            mean = (p * z).sum(1)
            zy = z.gather(1, y[:, None]).squeeze(1)
            total += torch.stack([(torch.logsumexp(beta * z, 1) - beta * zy).sum(), (mean - zy).sum(),
                                  (p * (z - mean[:, None]).square()).sum()])
        dist.all_reduce_sum(total, group)
        nll, g, h = total.tolist()
        return nll, g, h

    beta, (nll, g, h) = 1.0, sums(1.0)
    for _ in range(steps):
        if h <= 0:  # flat: no samples, or probabilities of 0 and 1 only
            break
        step = g / h
        if abs(step) <= 1e-9 * beta:
            break
        for _ in range(30):  # halve a step that does not lower the NLL (convex: one always does)
            new = min(max(beta - step, 0.01), 100.0)
            result = sums(new)
            if result[0] <= nll:
                break
            step /= 2
        else:
            break
        if new == beta:
            break
        beta, (nll, g, h) = new, result
    return 1.0 / beta
