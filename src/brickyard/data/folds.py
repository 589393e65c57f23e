"""``data.folds`` and ``data.fold``: k-fold cross-validation over a data set's training and validation images.

The two splits are pooled and cut into ``folds`` folds: each class's images (where the labels are one class an
image) in a seeded random order dealt in turn to the folds, one class after another, so that every fold holds each
class in proportion, as scikit-learn's ``StratifiedKFold(shuffle=True)``; images tagged with several labels are
shuffled and dealt without regard to their tags. The seed is fixed (0), so every run, every trial of a sweep and every
process of a run cuts the same folds; fold ``fold`` validates, the others train, and the folds' validation splits
are disjoint and together the whole pool. The test split is never touched.
"""
from __future__ import annotations

import torch

from brickyard.data.bundle import DataBundle, Split
from brickyard.errors import DataError


def fold_indices(n: int, folds: int, fold: int, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(training, validation)`` indices of ``fold`` among ``folds`` over ``n`` samples, each sorted."""
    if n < folds:
        raise DataError(f"data.folds {folds}: the training and validation splits hold {n} sample(s), fewer than the folds.")
    g = torch.Generator().manual_seed(0)
    if labels is not None and labels.dim() == 1 and not labels.is_floating_point():
        order = torch.cat([(labels == c).nonzero().flatten()[torch.randperm(int((labels == c).sum()), generator=g)]
                           for c in labels.unique()])
    else:
        order = torch.randperm(n, generator=g)
    which = torch.empty(n, dtype=torch.long)
    which[order] = torch.arange(n) % folds
    return (which != fold).nonzero().flatten(), (which == fold).nonzero().flatten()


def folded(bundle: DataBundle, folds: int, fold: int) -> DataBundle:
    """``bundle`` with its training and validation tensors pooled and cut (module docstring)."""
    if not bundle.in_memory:
        raise DataError("data.folds cuts data sets held as tensors here (mnist, fashion-mnist, cifar, synthetic, the "
                        "mosaics, fit's tensors); an image folder is cut where it is read.")
    if bundle.val is not None and bundle.val.images is None:
        raise DataError("data.folds pools the training and validation tensors, and the validation data is a Dataset or "
                        "a DataLoader; pass both as tensors, or the training data alone.")
    parts = [(s.images, s.labels) for s in (bundle.train, bundle.val) if s is not None]
    images = torch.cat([x for x, _ in parts if x is not None])
    labels = torch.cat([y for _, y in parts if y is not None])
    train, val = fold_indices(len(labels), folds, fold, labels)
    bundle.train, bundle.val = Split(images[train], labels[train]), Split(images[val], labels[val])
    bundle.notes.append(f"fold {fold} of {folds}: {len(train):,} training and {len(val):,} validation images "
                        f"(the data set's training and validation splits pooled, stratified)")
    return bundle
