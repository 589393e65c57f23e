"""Metrics accumulated on the device and combined across ranks.

``EvalAccumulator`` keeps sums (loss, top-1, top-5, count) and, for class logits, a confusion matrix
as device tensors; nothing is read back until ``result()``, after one all-reduce, but whether rows of
float targets are class probabilities, checked once on the first batch. Precision, recall, F1 and
balanced accuracy come from the summed confusion matrix (``class_scores``), and the calibration error from binned
sums (``observe.calibration``), so they are exact on any number of processes. Outputs that are not class logits (a regression, a user's loss on other targets)
get the loss alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brickyard.distributed import process as dist
from brickyard.observe.calibration import Bins
from brickyard.observe.loggers import SCORES  # noqa: F401  (re-exported: the scores class_scores computes)


def is_classification(out: torch.Tensor, y: torch.Tensor) -> bool:
    """Outputs are class logits (N x C) for class targets: integer labels (N, or N x 1), or rows of class
    probabilities shaped as the outputs (non-negative, each summing to 1: the one-hot rows a Dataset gives,
    float or ``F.one_hot``'s integers, mixed targets), so accuracy and the confusion matrix apply. Other float
    targets (a regression's, several values a sample) are not classes. Rows are checked on the batch given
    (one host sync), which callers do once."""
    if out.dim() != 2 or out.shape[1] < 2:
        return False
    if y.dim() == 1 or (y.dim() == 2 and y.shape[1] == 1):  # N x 1 indices, as Keras's sparse accuracy squeezes
        return not y.is_floating_point()
    if y.dim() != 2 or y.shape != out.shape:
        return False
    rows = y.detach().float()
    return bool(((rows >= 0).all() & ((rows.sum(1) - 1).abs() <= 1e-2).all()).item())


def class_targets(y: torch.Tensor) -> torch.Tensor:
    """The classes accuracy is scored against, once ``is_classification`` has said the targets are classes: rows
    of class probabilities read as the class of their largest share, as Keras's ``categorical_accuracy`` and
    ``top_k_categorical_accuracy`` read ``y_true`` (``ops.argmax(y_true, axis=-1)``;
    keras/src/metrics/accuracy_metrics.py at commit 040582f); class indices as they are. The loss still reads
    the rows themselves; N x 1 indices as N."""
    if y.dim() == 2 and y.shape[1] == 1:
        return y[:, 0]
    return (y.byte() if y.dtype == torch.bool else y).argmax(1) if y.dim() == 2 else y


def cross_entropy_targets(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Targets as ``F.cross_entropy`` takes them: integer or boolean rows shaped as the outputs (``F.one_hot``
    gives int64, pandas' ``get_dummies`` booleans) as the float class probabilities they are; N x 1 class
    indices (a Dataset's labels as 1-element tensors) as N; others as given."""
    if y.dim() == 2 and not y.is_floating_point():
        if y.shape[1] == 1 and out.dim() == 2 and out.shape[1] > 1:
            return y[:, 0]
        if y.shape == out.shape:
            return y.float()
    return y


def _cross_entropy_sum(logits, y):
    return F.cross_entropy(logits.float(), cross_entropy_targets(logits, y), reduction="sum")


class EvalAccumulator:
    """A split's sums. ``temperature``: the class logits are divided by it before anything is scored (temperature
    scaling: the loss, the calibration error and the probabilities change, the predictions do not), and the
    calibration error of the raw logits is kept beside (``ece_uncalibrated``). ``keep``: a list this rank's
    ``(raw logits, classes)`` batches are appended to (for ``observe.calibration.fit_temperature``)."""

    def __init__(self, num_classes: int, device: torch.device, loss_sum=None, temperature: float = 1.0,
                 keep: list | None = None):
        self.c, self.loss_sum = max(num_classes, 1), loss_sum or _cross_entropy_sum
        self.sums = torch.zeros(3, device=device, dtype=torch.float64)  # loss, top1, top5
        self.count = 0  # samples: a host number (a tensor made from it each batch would wait for the GPU)
        self.confusion = torch.zeros(self.c * self.c, device=device, dtype=torch.int64)
        self.classify, self.with_confusion = None, False
        self.temperature, self.keep = temperature, keep
        self.bins = Bins(device)
        self.raw_bins = Bins(device) if temperature != 1.0 else None

    def update(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Add a batch; returns the predicted classes (None when the outputs are not class logits)."""
        if self.classify is None:
            self.classify = is_classification(out, y)
            self.with_confusion = self.classify and out.shape[1] == self.c
        raw = out
        if self.classify and self.temperature != 1.0:
            out = out.float() / self.temperature
        loss = self.loss_sum(out, y).double()
        self.count += len(y)
        y = class_targets(y) if self.classify else y
        if not self.classify:
            self.sums[0] += loss
            return None
        self.bins.update(out, y)
        if self.raw_bins is not None:
            self.raw_bins.update(raw, y)
        if self.keep is not None:
            self.keep.append((raw.detach().float(), y))
        logits = out.float()
        pred = logits.argmax(1)
        k = min(5, logits.shape[1])
        top5 = (logits.topk(k, 1).indices == y[:, None]).any(1)
        self.sums += torch.stack([loss, (pred == y).sum().double(), top5.sum().double()])
        if self.with_confusion:
            self.confusion += torch.bincount(y * self.c + pred, minlength=self.c * self.c)
        return pred

    def result(self, group=None) -> dict:
        sums = torch.cat([self.sums, self.sums.new_tensor([float(self.count)])])
        dist.all_reduce_sum(sums, group)
        dist.all_reduce_sum(self.confusion, group)  # on every rank, also one whose share was empty
        (ece, table), raw = self.bins.result(group), self.raw_bins.result(group) if self.raw_bins else None  # every rank
        loss, top1, top5, count = sums.tolist()
        n = max(count, 1)
        if self.classify is False:
            return {"loss": loss / n, "accuracy": None, "top5": None, "count": int(count)}
        out = {"loss": loss / n, "accuracy": top1 / n, "top5": top5 / n, "count": int(count), "ece": ece,
               "reliability": table}
        if raw is not None:
            out.update(ece_uncalibrated=raw[0], temperature=self.temperature)
        if not self.with_confusion and self.classify:  # an empty share (None) scores the summed confusion too
            return out
        confusion = self.confusion.view(self.c, self.c).cpu()
        per_class = (confusion.diag().double() / confusion.sum(1).clamp(min=1).double()).tolist()
        return {**out, "per_class_accuracy": per_class, "confusion": confusion.tolist(), **class_scores(confusion)}


def class_scores(confusion: torch.Tensor) -> dict:
    """Precision, recall and F1 of each class, their macro and support-weighted means, and balanced accuracy, from a
    C x C confusion matrix (rows: true class, columns: predicted), as scikit-learn computes them from the same
    predictions (``sklearn/metrics/_classification.py``, 1.9.1: ``precision_recall_fscore_support`` averages over
    the labels present in the targets or the predictions, with 0 where a ratio divides by zero; ``average="weighted"``
    weighs by support, l. 2205; ``balanced_accuracy_score`` is the mean recall over the classes the targets hold,
    l. 2924-2941). The per-class lists cover every class, 0 where a class is neither present nor predicted."""
    cm = confusion.double()
    tp, support, predicted = cm.diag(), cm.sum(1), cm.sum(0)
    precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), torch.zeros_like(tp))
    recall = torch.where(support > 0, tp / support.clamp(min=1), torch.zeros_like(tp))
    both = precision + recall
    f1 = torch.where(both > 0, 2 * precision * recall / both.clamp(min=1e-300), torch.zeros_like(tp))
    present = (support > 0) | (predicted > 0)
    true = support > 0
    total = support.sum().clamp(min=1)

    def mean(v, where):
        return (v[where].mean().item() if where.any() else 0.0)
    return {"precision_macro": mean(precision, present), "recall_macro": mean(recall, present),
            "f1_macro": mean(f1, present), "f1_weighted": ((f1 * support).sum() / total).item(),
            "balanced_accuracy": mean(recall, true), "precision": precision.tolist(), "recall": recall.tolist(),
            "f1": f1.tolist(), "support": support.long().tolist()}


def fit_hint(train_acc: float, val_acc: float) -> str:
    """A one-line reading of the train/validation gap (thresholds are rules of thumb, stated)."""
    gap = train_acc - val_acc
    if gap > 0.05:
        return f"train-val gap {gap:+.3f} > 0.05: over-fitting? more data, augmentation or weight decay may help"
    if train_acc < 0.9 and gap < 0.02:
        return f"train-val gap {gap:+.3f} and train accuracy {train_acc:.3f} < 0.90: under-fitting? train longer, a larger model or a higher rate"
    return f"train-val gap {gap:+.3f}"


def fmt(n: float) -> str:
    """A number of bytes as people read it: 1.50 GiB, 12.00 MiB, 512 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
