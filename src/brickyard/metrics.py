"""Classification metrics accumulated on the device and combined across ranks.

``EvalAccumulator`` keeps sums (loss, top-1, top-5, count) and a confusion matrix as device
tensors; nothing is read back until ``result()``, after one all-reduce.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from brickyard import dist


class EvalAccumulator:
    def __init__(self, num_classes: int, device: torch.device):
        self.c = num_classes
        self.sums = torch.zeros(4, device=device, dtype=torch.float64)  # loss, top1, top5, count
        self.confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.int64)

    def update(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        pred = logits.argmax(1)
        k = min(5, logits.shape[1])
        top5 = (logits.topk(k, 1).indices == y[:, None]).any(1)
        self.sums += torch.stack([F.cross_entropy(logits, y, reduction="sum").double(), (pred == y).sum().double(),
                                  top5.sum().double(), torch.tensor(float(len(y)), device=y.device, dtype=torch.float64)])
        self.confusion += torch.bincount(y * self.c + pred, minlength=self.c * self.c)
        return pred

    def result(self, group=None) -> dict:
        dist.all_reduce_sum(self.sums, group)
        dist.all_reduce_sum(self.confusion, group)
        loss, top1, top5, count = self.sums.tolist()
        confusion = self.confusion.view(self.c, self.c).cpu()
        per_class = (confusion.diag().double() / confusion.sum(1).clamp(min=1).double()).tolist()
        n = max(count, 1)
        return {"loss": loss / n, "accuracy": top1 / n, "top5": top5 / n, "count": int(count),
                "per_class_accuracy": per_class, "confusion": confusion.tolist()}


def fit_hint(train_acc: float, val_acc: float) -> str:
    """A one-line reading of the train/validation gap (thresholds are rules of thumb, stated)."""
    gap = train_acc - val_acc
    if gap > 0.05:
        return f"train-val gap {gap:+.3f} > 0.05: over-fitting? more data, augmentation or weight decay may help"
    if train_acc < 0.9 and gap < 0.02:
        return f"train-val gap {gap:+.3f} and train accuracy {train_acc:.3f} < 0.90: under-fitting? train longer, a larger model or a higher rate"
    return f"train-val gap {gap:+.3f}"
