"""Data sets behind one interface: a ``DataBundle`` of train / val / test ``Split`` objects.

A split holds either whole tensors (uint8 or float images N x C x H x W and int64 labels) that
the in-memory loader moves to the device, or a ``torch.utils.data.Dataset`` for the streaming
loader. Normalisation and augmentation happen on the device, after a batch is loaded.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.utils.data import DataLoader

from brickyard.data import cifar, idx
from brickyard.data.adapters import (
    NAMES,
    Adapter,
    LoaderAdapter,
    Reading,
    adapter_for,
    arrays,
    huggingface,
)
from brickyard.data.adapters.arrays import input_dtypes as _input_dtypes  # noqa: F401  tools/predict.py reads as fit does
from brickyard.data.bundle import DataBundle, Draw, Split
from brickyard.data.folds import folded
from brickyard.data.imagefolder import imagefolder_bundle
from brickyard.data.synthetic import synthetic_bundle
from brickyard.errors import DataError

__all__ = ["DataBundle", "Split", "balance", "build_data", "from_loaders", "from_user"]


MNIST_STATS = {"mnist": ((0.1307,), (0.3081,)), "fashion-mnist": ((0.2860,), (0.3530,))}


def build_data(cfg) -> DataBundle:
    """Load the data set named by ``cfg`` (a ``DataConfig``)."""
    bundle = _subset(_build(cfg), cfg)
    if cfg.folds and cfg.name != "imagefolder":  # an image folder cuts its file lists (imagefolder_bundle)
        bundle = folded(bundle, cfg.folds, cfg.fold)
    return bundle


def _build(cfg) -> DataBundle:
    if cfg.name.endswith("-mosaic"):  # several labels an image, made from the single-label set (data/mosaic.py)
        from brickyard.data.mosaic import mosaic_bundle  # only runs of these data sets need it
        return mosaic_bundle(cfg.name, _build(dataclasses.replace(cfg, name=cfg.name.removesuffix("-mosaic"))))
    if cfg.name == "synthetic":
        return synthetic_bundle(cfg.synthetic, seed=1234)
    if cfg.name == "imagefolder":
        return imagefolder_bundle(cfg, cfg.channels)  # 0: the first readable training image's

    if cfg.name in cifar.SPECS:
        return _cifar(cfg)
    arrays = idx.load_idx(cfg.name, cfg.root, cfg.download)
    x_train = torch.from_numpy(arrays["train-images-idx3-ubyte"].copy()).unsqueeze(1)
    y_train = torch.from_numpy(arrays["train-labels-idx1-ubyte"].astype("int64"))
    x_test = torch.from_numpy(arrays["t10k-images-idx3-ubyte"].copy()).unsqueeze(1)
    y_test = torch.from_numpy(arrays["t10k-labels-idx1-ubyte"].astype("int64"))
    if cfg.train_on_all:
        train, val = Split(x_train, y_train), None
    else:  # the classic split: first 50,000 for training, last 10,000 for validation
        train, val = Split(x_train[:50000], y_train[:50000]), Split(x_train[50000:], y_train[50000:])
    mean, std = MNIST_STATS[cfg.name]
    return DataBundle(cfg.name, train, val, Split(x_test, y_test), 10, 1, (28, 28), mean, std, list(idx.classes(cfg.name)))


def _cifar(cfg) -> DataBundle:
    """CIFAR-10/100: the 50,000 training images less the last 10% for validation (45,000 / 5,000), and the
    10,000 test images; ``data.train_on_all`` trains on all 50,000."""
    arrays = cifar.load(cfg.name, cfg.root, cfg.download)
    (xtr, ytr), (xte, yte) = arrays["train"], arrays["test"]
    x, y = torch.from_numpy(np.ascontiguousarray(xtr)), torch.from_numpy(ytr.astype("int64"))
    if cfg.train_on_all:
        train, val = Split(x, y), None
    else:
        n = len(x) - len(x) // 10
        train, val = Split(x[:n], y[:n]), Split(x[n:], y[n:])
    test = Split(torch.from_numpy(np.ascontiguousarray(xte)), torch.from_numpy(yte.astype("int64")))
    mean, std = cifar.STATS[cfg.name]
    classes = [str(c) for c in arrays["classes"]]
    return DataBundle(cfg.name, train, val, test, len(classes), 3, (32, 32), mean, std, classes)


def _subset(bundle: DataBundle, cfg) -> DataBundle:
    """Apply ``data.classes`` (relabelled 0..k-1) and ``data.train_per_class`` to tensor splits."""
    if not cfg.classes and not cfg.train_per_class:
        return bundle
    if bundle.multilabel:
        raise DataError("data.classes and data.train_per_class choose classes of one label an image; this data set "
                        "tags several an image.")
    if not bundle.in_memory:
        raise DataError("data.classes and data.train_per_class work on data sets held as tensors (mnist, fashion-mnist, "
                        "synthetic, fit's (inputs, labels)).")
    keep = list(cfg.classes) or list(range(bundle.num_classes))
    bad = [c for c in keep if not isinstance(c, int) or not 0 <= c < bundle.num_classes]
    if bad:
        raise DataError(f"data.classes: {bad[0]!r} is not a class index 0..{bundle.num_classes - 1}.")
    remap = torch.full((bundle.num_classes,), -1, dtype=torch.long)
    remap[torch.tensor(keep)] = torch.arange(len(keep))

    def cut(split: Split | None, per_class: int) -> Split | None:
        if split is None:
            return None
        mask = remap[split.labels] >= 0
        idx = mask.nonzero().flatten()
        if per_class:
            labels = split.labels[idx]
            idx = torch.cat([idx[labels == c][:per_class] for c in keep])
            idx = idx.sort().values
        return Split(split.images[idx], remap[split.labels[idx]])

    return DataBundle(bundle.name, cut(bundle.train, cfg.train_per_class), cut(bundle.val, 0), cut(bundle.test, 0),
                      len(keep), bundle.in_channels, bundle.image_size, bundle.mean, bundle.std,
                      [bundle.classes[c] for c in keep] if bundle.classes else [], sample_shape=bundle.sample_shape,
                      train_size=bundle.train_size,
                      notes=bundle.notes)


def from_user(train, val=None, test=None, num_classes: int | None = None, model=None, own_loss: bool = False,
              transforms=None) -> DataBundle:
    """Wrap user data for ``brickyard.fit``: ``(inputs, labels)`` tensors or NumPy arrays (Keras's
    ``fit(x, y)``), or a Dataset of pairs (any ``len()`` and ``data[i]``; Hugging Face's dict items and PIL
    images are read as pairs: ``brickyard.data.items``). Each kind is read by its adapter
    (``brickyard.data.adapters``); this function runs them in one order over the three splits.

    Inputs may be N x anything: images (N x C x H x W; N x H x W tensors are taken as one-channel
    images, and N x H x W x C arrays, Keras's layout, as N x C x H x W where ``model`` takes only that:
    ``brickyard.data.layout``), points, signals (as a Dataset when they are 3-D).
    Integer labels are classes: ``num_classes`` is the largest label + 1 for tensors and, for a Dataset
    (whose labels are not all read up front), the width of ``model``'s output on the first sample, as
    Keras and Lightning need nothing either; float labels are regression targets, for a loss of the
    user's (``own_loss``: a ``loss_fn`` or ``train_step``; the default cross-entropy takes class indices).
    A Dataset's later items are read as its item 0 is (integer labels of any width as int64, integer images
    cast as held ones are); an item of another kind or size is one sentence naming it.
    ``transforms``: the data config (``train_transforms``, ``eval_transforms``) that datasets of PIL images
    are read through, as image folders are; None reads them as they are."""
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0):
        raise DataError(f"num_classes: {num_classes!r} is not a whole number of classes.")
    adapters = [adapter_for(d, name) for d, name in zip((train, val, test), NAMES)]
    _refuse_empty(adapters)
    fraction = getattr(transforms, "val_fraction", 0.0) if transforms is not None else 0.0
    if fraction:
        adapters[0], adapters[1] = arrays.validation_of(adapters[0], adapters[1], fraction)
    reading = Reading(model, own_loss, transforms)
    classes = _read_items(adapters, reading.notes)
    note = huggingface.photo_transforms(adapters, transforms) if transforms is not None else None
    reading.notes += [note] if note else []
    splits = [a.split if a is not None else None for a in adapters]
    width = arrays.one_hot_labels(splits, NAMES, reading.notes, own_loss)
    if num_classes is None and width:
        num_classes = width  # the one-hot width, not the largest label + 1: a class no sample has still counts
    elif width and num_classes != width:
        raise DataError(f"num_classes is {num_classes} but the one-hot labels have {width} columns.")
    reading.notes += arrays.input_dtypes(splits, model)
    first = adapters[0]
    sample, label = first.first(reading, adapters)
    num_classes, classify = _classes(first, reading, sample, label, num_classes)
    for adapter in adapters:
        if adapter is not None:
            if classify and num_classes:
                adapter.check_labels(num_classes)
            adapter.finish(reading, first)
    shape = tuple(sample.shape)
    in_channels, size = (shape[0], shape[1:]) if len(shape) == 3 else (0, ())
    if classes and len(classes) != num_classes:
        classes = []  # names for other classes than the model's: say none rather than wrong ones
    held = splits[0].labels
    bundle = DataBundle("user", *splits, num_classes, in_channels, size, classes=classes, sample_shape=shape,
                        notes=reading.notes, multilabel=held is not None and arrays.multi_hot(held))
    return _subset(bundle, transforms) if transforms is not None and classify else bundle


def _refuse_empty(adapters: list[Adapter | None]) -> None:
    """An empty training split, or an empty evaluation split (scored as 0% accuracy otherwise), is one sentence."""
    if adapters[0] is None or not len(adapters[0]):
        raise DataError("train_data is empty.")
    for adapter, name in zip(adapters[1:], NAMES[1:]):
        if adapter is not None and not len(adapter):
            raise DataError(f"{name} is empty; leave it out (None) to train without it.")


def _read_items(adapters: list[Adapter | None], notes: list[str]) -> list[str]:
    """Items that are not pairs (Hugging Face's dicts, PIL images) read as pairs: the class names found, if any;
    the training split's note added to ``notes``."""
    classes = []
    for adapter in adapters:
        if adapter is not None:
            note, found = adapter.read_items()
            notes += [note] if note and adapter is adapters[0] else []
            classes = classes or found
    return classes


def _classes(first: Adapter, reading: Reading, sample, label, num_classes: int | None) -> tuple[int, bool]:
    """``(num_classes, classify)`` from the training split's item 0 (``sample``, ``label``): rows of class
    probabilities give their width, float labels no classes (a regression), class indices the largest + 1 (held)
    or the model's output width (a Dataset); a row of integers that is not one-hot is one sentence."""
    row = torch.as_tensor(label) if isinstance(label, (np.ndarray, torch.Tensor)) else None
    # labels as rows (a Dataset's; held one-hot rows are indices by now): their width
    width = len(row) if row is not None and row.dim() == 1 and len(row) > 1 else 0
    if width and not row.is_floating_point() and not reading.own_loss and not arrays.one_hot(row[None]):
        raise DataError(f"train_data: item 0's label is a row of {width} integers but not one-hot (a single 1); "
                        f"give class indices or one-hot rows, or pass loss_fn for several labels a sample.")
    classify = not (isinstance(label, torch.Tensor) and label.is_floating_point()) and not isinstance(label, float)
    if num_classes is None:
        if width:
            num_classes = width  # rows of class probabilities (one-hot rows, soft targets)
        elif not classify:
            num_classes = 0
        else:
            num_classes = first.count_classes(reading, sample)
    return num_classes, classify


def from_loaders(train, val=None, test=None) -> tuple[list, list[str], list[str]]:
    """DataLoaders given to ``fit`` read as the Datasets they load (``adapters.LoaderAdapter``): returns the three
    splits (a loader's ``dataset`` in its place), the overrides the loaders ask for and notes for the run's log. The
    training loader's ``batch_size`` is the per-device batch (``data.batch_size``) and an evaluation loader's the
    evaluation batch, as Accelerate's ``prepare_data_loader`` keeps a loader's batch for each process
    (``split_batches=False``: src/accelerate/data_loader.py at commit 000e52b); ``num_workers`` above 0 is
    kept. brickyard shuffles and shards the data itself (its ``BatchPlan``); the samplers torch gives are read
    into that plan (``adapters.loader.plan``): a ``SubsetRandomSampler``'s indices, a ``WeightedRandomSampler``'s or
    replacement sampler's draws, a ``DistributedSampler`` as the sharding brickyard does anyway. A ``collate_fn`` of
    the user's batches the split's items, in training and evaluation, as it would in the loader
    (``adapters.UserCollate``: it returns ``(inputs, labels)`` or a dict of them, one for each item); a
    ``worker_init_fn`` runs in each of brickyard's loader workers; ``drop_last`` sets ``data.drop_last``. A loader
    that samples or batches in another way (a sampler or batch sampler of its own class, an IterableDataset, no
    batching) is one sentence rather than a run that silently drops what it does."""
    out, sets, notes = [], {}, []
    for data, name, batch_key in zip((train, val, test), NAMES, ("data.batch_size", "data.eval_batch_size",
                                                                  "data.eval_batch_size")):
        if not isinstance(data, DataLoader):
            out.append(data)
            continue
        split, asks, note = LoaderAdapter(data, name, batch_key).read()
        out.append(split)
        notes.append(note)
        for key, value in asks.items():
            if key == batch_key:
                sets.setdefault(key, value)  # val_data's evaluation batch before test_data's
            else:
                sets[key] = value
    return out, [f"{k}={v}" for k, v in sets.items()], notes


def balance(data: DataBundle, on: bool = True) -> None:
    """``data.balance`` (``on``): the training split's epoch drawn with replacement, each class equally likely
    (weights 1 / the class's count, as a ``WeightedRandomSampler`` users build for rare classes), as many draws
    as it holds images. Needs the labels up front: held tensors' or an image folder's. A bundle an earlier run
    balanced keeps its draw, or loses it when this run does not balance."""
    split = data.train
    if split.draw is not None and split.draw.by_class:
        if not on:
            split.draw = None
        return
    if not on:
        return
    if split.draw is not None:
        raise DataError("data.balance draws the epoch by class and the DataLoader's sampler draws it too: use one of them.")
    labels = split.labels if split.labels is not None else getattr(split.dataset, "labels", None)
    if labels is None:
        raise DataError("data.balance needs the training labels up front (tensors or an image folder); for a Dataset, "
                        "pass a DataLoader with a WeightedRandomSampler of your weights.")
    labels = torch.as_tensor(labels)
    if labels.dim() != 1 or labels.is_floating_point():
        raise DataError(f"data.balance draws by class and the training labels are not class indices "
                        f"({tuple(labels.shape)} of {str(labels.dtype).replace('torch.', '')}).")
    counts = torch.bincount(labels)
    weights = (1.0 / counts.double())[labels]
    split.draw = Draw(len(labels), weights, replacement=True, by_class=True)
    present = counts[counts > 0]
    data.notes.append(f"data.balance: each epoch draws {len(labels):,} training images with replacement, each of the "
                      f"{len(present)} classes equally likely (their images: {int(present.min()):,} to {int(present.max()):,})")
