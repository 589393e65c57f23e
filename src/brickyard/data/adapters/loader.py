"""A ``torch.utils.data.DataLoader`` given to ``fit``, read as the Dataset it loads (``LoaderAdapter``): its batch, its
sampler (``plan``), ``collate_fn`` (``UserCollate``), ``worker_init_fn`` and ``drop_last`` become brickyard's own
settings and plan, since brickyard shuffles, shards and batches a Dataset itself."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from brickyard.data.adapters.arrays import IntegerImages
from brickyard.data.adapters.base import as_label
from brickyard.data.bundle import Draw, Split
from brickyard.data.items import INPUT_KEYS, LABEL_KEYS
from brickyard.errors import DataError, reason

OWN = ("brickyard shuffles, shards and batches a Dataset itself, so pass its Dataset (loader.dataset), items as (input, label) pairs, "
       "and data.batch_size.")


class LoaderAdapter:
    """The DataLoader ``loader`` given as ``name`` (train_data, val_data, test_data), whose batch sets ``batch_key``
    (``data.batch_size``, ``data.eval_batch_size``). ``read()`` gives what ``from_user`` reads in its place."""

    def __init__(self, loader: DataLoader, name: str, batch_key: str):
        self.loader, self.name, self.batch_key = loader, name, batch_key
        if isinstance(loader.dataset, IterableDataset):
            raise DataError(f"{name}: the DataLoader streams an IterableDataset ({type(loader.dataset).__name__}); brickyard "
                            f"shuffles and shards a Dataset that has len() and [i], so give one of those.")
        batches = loader.batch_sampler
        own = None
        if batches is None:
            own = "batches nothing (batch_size=None)"
        elif type(batches) is not BatchSampler:
            own = f"batches with its own {type(batches).__name__}"
        if own:
            raise DataError(f"{name}: the DataLoader {own}; {OWN}")
        self.batches = batches

    def read(self) -> tuple[Split | torch.utils.data.Dataset, dict, str]:
        """``(the Dataset, or a Split of it with its draw, collate_fn and worker_init_fn; the settings the loader
        asks for, its batch first; the note for the run's log)``."""
        data, batches, name = self.loader, self.batches, self.name
        dataset, draw, how = plan(batches.sampler, data.dataset, name)
        fn = data.collate_fn if data.collate_fn is not torch.utils.data.default_collate else None
        if fn is not None:
            how += f" and its collate_fn ({getattr(fn, '__name__', type(fn).__name__)})"
        init = data.worker_init_fn
        out = (Split(dataset=dataset, draw=draw, collate=UserCollate(fn, name) if fn else None, worker_init=init)
               if draw is not None or fn is not None or init is not None else dataset)
        sets = {self.batch_key: batches.batch_size}
        if name != "train_data":
            unused = "; its drop_last is not applied: an evaluation reads every sample once" if batches.drop_last else ""
            return out, sets, (f"{name}: a DataLoader, read as its Dataset{how} with its batch of {batches.batch_size} "
                               f"({self.batch_key}){unused}")
        dropped = ""
        if batches.drop_last:
            sets["data.drop_last"] = "true"
            dropped = ", its last partial batch left out (data.drop_last)"
        workers = ""
        if data.num_workers:
            sets["data.num_workers"] = data.num_workers
            workers = f" and {data.num_workers} loader workers"
        return out, sets, (f"{name}: a DataLoader, read as its Dataset{how} with its batch of {batches.batch_size} per "
                           f"device ({self.batch_key}){workers}{dropped}; brickyard {'draws' if draw else 'shuffles'} and "
                           f"shards it")


def plan(sampler, dataset, name: str):
    """A DataLoader's sampler read as brickyard's plan: ``(dataset, draw, note)``. Sequential and plain random
    samplers and a ``DistributedSampler`` (brickyard shuffles and shards every epoch itself, from the run's seed)
    leave the dataset as it is; a ``SubsetRandomSampler`` makes it the Subset of its indices; a
    ``WeightedRandomSampler``, or a ``RandomSampler`` with ``replacement`` or ``num_samples``, becomes a
    ``bundle.Draw`` of as many samples an epoch, drawn from the run's seed and the epoch (the sampler's own
    generator is not used). An evaluation reads every sample once, so it takes no draw."""
    kind = type(sampler)
    if kind is SequentialSampler or (kind is RandomSampler and not sampler.replacement and sampler._num_samples is None):
        return dataset, None, ""
    if kind is DistributedSampler:
        return dataset, None, " (its DistributedSampler's sharding is brickyard's own)"
    if kind is SubsetRandomSampler:
        return _subset(sampler, dataset, name)
    if kind not in (WeightedRandomSampler, RandomSampler):
        raise DataError(f"{name}: the DataLoader samples with its own {kind.__name__}; {OWN}")
    if name != "train_data":
        raise DataError(f"{name}: the DataLoader draws samples at random ({kind.__name__}); an evaluation reads every "
                        f"sample once, so give it a loader without that sampler.")
    count, n = sampler.num_samples, len(dataset)
    if count > 100 * n:  # the epoch's indices are held in memory: 10**12 draws ran out of it
        raise DataError(f"{name}: the DataLoader's {kind.__name__} draws {count:,} samples an epoch from {n:,}; an epoch "
                        f"draws at most 100 times its Dataset's samples ({100 * n:,}): train more epochs instead.")
    weights = _weights(sampler, n, name) if kind is WeightedRandomSampler else None
    how = f"{'by its weights' if weights is not None else 'uniformly'}, {'with' if sampler.replacement else 'without'} replacement"
    return dataset, Draw(count, weights, sampler.replacement), f" (its {kind.__name__}: {count:,} samples an epoch, {how})"


def _subset(sampler: SubsetRandomSampler, dataset, name: str):
    """A ``SubsetRandomSampler`` as the Subset of its indices, which must lie in the Dataset."""
    n = len(dataset)
    try:
        idx = torch.as_tensor(list(sampler.indices))
    except (TypeError, ValueError, RuntimeError) as e:
        raise DataError(f"{name}: the DataLoader's SubsetRandomSampler indices cannot be read ({reason(e)}).") from None
    if len(idx) and (idx.dim() != 1 or idx.is_floating_point() or idx.dtype == torch.bool or int(idx.min()) < 0
                     or int(idx.max()) >= n):
        raise DataError(f"{name}: the DataLoader's SubsetRandomSampler takes indices outside its Dataset's 0..{n - 1}.")
    return Subset(dataset, idx.tolist()), None, f" (the {len(idx):,} samples of its SubsetRandomSampler)"


def _weights(sampler: WeightedRandomSampler, n: int, name: str) -> torch.Tensor:
    """A ``WeightedRandomSampler``'s weights, checked: one finite weight of 0 or more a sample, not all 0, as many as
    torch draws from, enough above 0 for a draw without replacement."""
    weights, count = sampler.weights, sampler.num_samples
    bad = (f"it has {len(weights):,}" if len(weights) != n else "some are not finite"
           if not bool(torch.isfinite(weights).all()) else "some are negative" if bool((weights < 0).any())
           else "all are 0" if not float(weights.sum()) > 0 else "")
    if bad:
        raise DataError(f"{name}: the DataLoader's WeightedRandomSampler needs one finite weight of 0 or more for each "
                        f"of its Dataset's {n:,} samples, not all 0; {bad}.")
    if n > 2 ** 24:
        raise DataError(f"{name}: the DataLoader's WeightedRandomSampler weighs {n:,} samples and torch draws from at "
                        f"most {2 ** 24:,}.")
    if not sampler.replacement and count > int((weights > 0).sum()):
        raise DataError(f"{name}: the DataLoader's WeightedRandomSampler draws {count:,} samples without replacement "
                        f"and only {int((weights > 0).sum()):,} have a weight above 0.")
    return weights


class UserCollate:
    """A DataLoader's own ``collate_fn`` (``fn``), for the split ``name``: the batch it makes from a list of the
    dataset's items, read as ``(inputs, labels)``. It may return a pair (as ``default_collate`` does) or a dict
    with an input key and a label key (``items.INPUT_KEYS``, ``items.LABEL_KEYS``: a Hugging Face data collator's
    ``pixel_values`` and ``labels``); NumPy arrays and lists of numbers are read as tensors, integer labels of any
    width as int64 and integer images through ``images`` (set by the adapter from the first batch), as a Dataset's
    items are. brickyard shares each global batch among the processes by sample and scales the loss by its count,
    so the batch must keep one input and one label for each item it was given; anything else is one sentence. An
    exception raised in ``fn`` is the user's, as one raised in a Dataset's ``__getitem__`` is: it reaches the
    caller with its traceback."""

    def __init__(self, fn, name: str):
        self.fn = fn
        self.label = f"{name}: the DataLoader's collate_fn ({getattr(fn, '__name__', type(fn).__name__)})"
        self.images: IntegerImages | None = None

    def __call__(self, batch):
        out = self.fn(batch)
        if isinstance(out, Mapping):
            x = next((out[k] for k in INPUT_KEYS if k in out), None)
            y = next((out[k] for k in LABEL_KEYS if k in out), None)
            if x is None or y is None:
                raise DataError(f"{self.label} returned a dict of {', '.join(map(str, list(out)[:5]))}; brickyard reads "
                                f"the inputs from one of {', '.join(INPUT_KEYS[:4])}, ... and the labels from one of "
                                f"{', '.join(LABEL_KEYS[:4])}, ...")
        elif isinstance(out, (tuple, list)) and len(out) == 2:
            x, y = out
        else:
            what = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
            raise DataError(f"{self.label} returned {what}; brickyard trains on (inputs, labels): return that pair of "
                            f"tensors, or a dict with 'pixel_values' and 'labels'.")
        x, y = self._tensor(x, "inputs"), as_label(self._tensor(y, "labels"))
        if x.dim() == 0 or y.dim() == 0 or len(x) != len(batch) or len(y) != len(batch):
            shapes = f"inputs {tuple(x.shape)} and labels {tuple(y.shape)}"
            raise DataError(f"{self.label} returned {shapes} for {len(batch)} items; brickyard shares each batch among "
                            f"the processes by sample, so return one input and one label for each item.")
        return self._images(x), y

    def _images(self, x: torch.Tensor) -> torch.Tensor:
        """N x C x H x W images of another integer type than uint8 through ``images``; values outside 0..255 where
        the first batch's were bytes are one sentence."""
        if self.images is None or x.dim() != 4 or x.is_floating_point() or x.dtype in (torch.uint8, torch.bool):
            return x
        lo, hi = int(x.min()), int(x.max())
        if self.images.bytes and (lo < 0 or hi > 255):
            raise DataError(f"{self.label} returned images of values {lo}..{hi}, and the images are read as bytes (uint8, "
                            f"scaled to [0, 1]) because train_data's first has values in 0..255; give every image in one "
                            f"range, as uint8 or as floats.")
        return self.images(x)

    def _tensor(self, value, what: str) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        try:
            return torch.as_tensor(value if not hasattr(value, "__array__") else np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"{self.label} returned {what} of {type(value).__name__} that cannot be read as a tensor "
                            f"({reason(e)}).") from None
