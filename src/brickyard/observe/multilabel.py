"""Metrics of several labels an image (``data.task: multilabel``): each tag is a yes/no question the model answers
with its own sigmoid.

- ``average_precision``: scikit-learn's ``average_precision_score`` (``sklearn/metrics/_ranking.py``, 1.9.1:
  ``-np.sum(np.diff(recall) * np.array(precision)[:-1])`` over ``precision_recall_curve``, whose thresholds are the
  distinct scores, ties taken together), per tag (None in ``ap`` for a tag with no positive image: undefined);
  ``map`` is their mean over every tag, a tag with no positive counted 0, as both references count it
  (scikit-learn's ``average="macro"`` warns and scores it 0; torchmetrics 1.9.0's ``MultilabelAveragePrecision``
  sets its recall to one, so its AP is 0, ``functional/classification/average_precision.py``
  ``_reduce_average_precision`` l. 55-65: the nan it skips never arises on this path), and ``map_micro`` the AP of
  every (image, tag) pair at once (scikit-learn's ``average="micro"``).
- At a threshold: precision, recall and F1 per tag and over every pair (``*_micro``), and F1's mean over the tags
  (``f1_macro``; a tag neither present nor predicted counts 0, as scikit-learn's ``zero_division=0`` and
  torchmetrics' ``MultilabelF1Score`` count it). The
  threshold is chosen on the validation split, the one of 0.05, 0.10, ..., 0.95 with the best micro F1, kept in
  the checkpoints and used by the test, ``brickyard eval`` and ``predict``.

Average precision needs every score, so the accumulator keeps this rank's sigmoid outputs and targets and the ranks
gather them once at the end (a validation set, not a training set: 10,000 images of 20 tags are 800 kB).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from brickyard.distributed import process as dist

THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(1, 20))


def bce_sum(out: torch.Tensor, y: torch.Tensor, pos_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Binary cross-entropy on the logits, the mean over the tags summed over the batch (the step divides by the
    batch: Keras's ``binary_crossentropy``, a mean over the last axis, then over the batch). ``pos_weight``: a weight
    of each tag's positives (``optim.class_weights``)."""
    each = F.binary_cross_entropy_with_logits(out.float(), y.float(), pos_weight=pos_weight, reduction="none")
    return each.mean(1).sum()


def average_precision(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """AP of each column (N x C scores and 0/1 targets), as scikit-learn computes it; NaN for a column without a
    positive."""
    n, c = scores.shape
    s, order = scores.double().sort(0, descending=True)
    t = targets.double().gather(0, order)
    tp, fp = t.cumsum(0), (1 - t).cumsum(0)
    last = torch.ones_like(s, dtype=torch.bool)  # the end of each group of tied scores: one threshold each
    last[:-1] = s[1:] != s[:-1]
    positives = t.sum(0)
    precision = tp / (tp + fp)
    recall = tp / positives.clamp(min=1)
    out = torch.empty(c, dtype=torch.float64)
    for j in range(c):
        keep = last[:, j]
        r, p = recall[keep, j], precision[keep, j]
        out[j] = ((r - torch.cat([r.new_zeros(1), r[:-1]])) * p).sum() if positives[j] > 0 else float("nan")
    return out


def at_threshold(scores: torch.Tensor, targets: torch.Tensor, threshold: float) -> dict:
    """Precision, recall, F1 per tag and micro, F1's macro mean, at ``threshold``."""
    pred, t = scores >= threshold, targets > 0.5
    tp, fp, fn = (pred & t).sum(0).double(), (pred & ~t).sum(0).double(), (~pred & t).sum(0).double()

    def ratio(a, b):
        return torch.where(b > 0, a / b.clamp(min=1), torch.zeros_like(a))
    precision, recall, f1 = ratio(tp, tp + fp), ratio(tp, tp + fn), ratio(2 * tp, 2 * tp + fp + fn)
    T, P, N = tp.sum(), fp.sum(), fn.sum()
    return {"f1_micro": (2 * T / (2 * T + P + N)).item() if T + P + N > 0 else 0.0,
            "precision_micro": (T / (T + P)).item() if T + P > 0 else 0.0,
            "recall_micro": (T / (T + N)).item() if T + N > 0 else 0.0,
            "f1_macro": f1.mean().item(),
            "precision": precision.tolist(), "recall": recall.tolist(), "f1": f1.tolist(),
            "support": (tp + fn).long().tolist()}


def best_threshold(scores: torch.Tensor, targets: torch.Tensor) -> float:
    """The threshold of ``THRESHOLDS`` with the best micro F1 (the lower one on a tie)."""
    return max(THRESHOLDS, key=lambda th: (at_threshold(scores, targets, th)["f1_micro"], -th))


class MultiLabelAccumulator:
    """A split's loss sum, and its sigmoid scores and targets (this rank's, on the host); ``result`` gathers the
    ranks' and scores them. ``threshold``: the one to score at, or None to choose it here (a validation)."""

    def __init__(self, num_classes: int, device: torch.device, loss_sum=None, threshold: float | None = 0.5):
        self.c, self.device, self.loss_sum = num_classes, device, loss_sum or bce_sum
        self.threshold = threshold
        self.loss = torch.zeros((), device=device, dtype=torch.float64)
        self.count, self.scores, self.targets = 0, [], []

    def update(self, out: torch.Tensor, y: torch.Tensor) -> None:
        self.loss += self.loss_sum(out, y).double()
        self.count += len(y)
        self.scores.append(out.detach().float().sigmoid().cpu())
        self.targets.append(y.detach().float().cpu())

    def result(self, group=None) -> dict:
        sums = torch.stack([self.loss, torch.tensor(float(self.count), dtype=torch.float64, device=self.device)])
        dist.all_reduce_sum(sums, group)
        scores = _gathered(torch.cat(self.scores) if self.scores else torch.zeros(0, self.c), self.device, group)
        targets = _gathered(torch.cat(self.targets) if self.targets else torch.zeros(0, self.c), self.device, group)
        loss, count = sums.tolist()
        ap = average_precision(scores, targets)
        threshold = self.threshold if self.threshold is not None else best_threshold(scores, targets)
        micro = average_precision(scores.reshape(-1, 1), targets.reshape(-1, 1))[0].item()
        return {"loss": loss / max(count, 1), "accuracy": None, "top5": None, "count": int(count),
                "map": ap.nan_to_num(0.0).mean().item() if len(ap) else 0.0, "map_micro": 0.0 if math.isnan(micro) else micro,
                "threshold": threshold, "ap": [None if math.isnan(v) else v for v in ap.tolist()],
                **at_threshold(scores, targets, threshold)}


def _gathered(local: torch.Tensor, device: torch.device, group) -> torch.Tensor:
    """Every rank's rows of ``local`` (on the host), in rank order: one all-gather of the counts, one of the rows
    padded to the largest count (on the device the group's backend uses)."""
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size(group) == 1:
        return local
    world = tdist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    tdist.all_gather(counts, torch.tensor([len(local)], device=device), group=group)
    most = max(int(n) for n in counts)
    padded = torch.zeros(most, local.shape[1], device=device)
    padded[:len(local)] = local.to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    tdist.all_gather(parts, padded, group=group)
    return torch.cat([p[:int(n)] for p, n in zip(parts, counts)]).cpu()
