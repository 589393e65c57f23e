"""Data sets behind one interface: a ``DataBundle`` of train / val / test ``Split`` objects.

A split holds either whole tensors (uint8 or float images N x C x H x W and int64 labels) that
the in-memory loader moves to the device, or a ``torch.utils.data.Dataset`` for the streaming
loader. Normalisation and augmentation happen on the device, after a batch is loaded.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler,
                              Subset, SubsetRandomSampler, WeightedRandomSampler)

from brickyard.data import augment, cifar, idx, items
from brickyard.data.bundle import DataBundle, Draw, Split, held_out
from brickyard.data.layout import channels_first, model_reads_channels_last
from brickyard.data.imagefolder import auto_transforms, imagefolder_bundle, output_sizes
from brickyard.data.loaders import UserCollate
from brickyard.data.synthetic import synthetic_bundle
from brickyard.errors import DataError, reason

__all__ = ["DataBundle", "Split", "build_data", "from_user"]


MNIST_STATS = {"mnist": ((0.1307,), (0.3081,)), "fashion-mnist": ((0.2860,), (0.3530,))}


def build_data(cfg) -> DataBundle:
    """Load the data set named by ``cfg`` (a ``DataConfig``)."""
    return _subset(_build(cfg), cfg)


def _build(cfg) -> DataBundle:
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
    images are read as pairs: ``brickyard.data.items``).

    Inputs may be N x anything: images (N x C x H x W; N x H x W tensors are taken as one-channel
    images, and N x H x W x C arrays, Keras's layout, as N x C x H x W where ``model`` takes only that:
    ``brickyard.data.layout``), points, signals (as a Dataset when they are 3-D).
    Integer labels are classes: ``num_classes`` is the largest label + 1 for tensors and, for a Dataset
    (whose labels are not all read up front), the width of ``model``'s output on the first sample, as
    Keras and Lightning need nothing either; float labels are regression targets, for a loss of the
    user's (``own_loss``: a ``loss_fn`` or ``train_step``; the default cross-entropy takes class indices).
    ``transforms``: the data config (``train_transforms``, ``eval_transforms``) that datasets of PIL images
    are read through, as image folders are; None reads them as they are."""
    if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0):
        raise DataError(f"num_classes: {num_classes!r} is not a whole number of classes.")
    names = ("train_data", "val_data", "test_data")
    splits = [_user_split(d, name) for d, name in zip((train, val, test), names)]
    first = splits[0]
    if first is None or not len(first):
        raise DataError("train_data is empty.")
    for split, name in zip(splits[1:], names[1:]):  # scored as 0% accuracy otherwise
        if split is not None and not len(split):
            raise DataError(f"{name} is empty; leave it out (None) to train without it.")
    fraction = getattr(transforms, "val_fraction", 0.0) if transforms is not None else 0.0
    if fraction:
        splits[0], splits[1] = _validation_of(first, splits[1], fraction)
        first = splits[0]
    notes, classes = [], []
    for split, name in zip(splits, names):  # Hugging Face's dict items, PIL images: read as (input, label) pairs
        if split is not None and split.dataset is not None and split.collate is None:  # (a collate_fn reads them itself)
            split.dataset, note, found = items.as_pairs(split.dataset, name)
            notes += [note] if note and split is first else []
            classes = classes or found
    image = items.first_image(first.dataset) if transforms is not None and first.dataset is not None and first.collate is None else None
    if image is not None:  # PIL images: the image folders' transforms, so photos of many sizes batch
        chosen = auto_transforms(transforms, image)
        output_sizes(chosen, image)  # one sentence up front where they do not end in a fixed size
        for split, specs in zip(splits, (chosen.train_transforms, chosen.eval_transforms, chosen.eval_transforms)):
            if split is not None and split.dataset is not None and split.collate is None:
                split.dataset = items.with_transforms(split.dataset, specs, transforms.channels or image.shape[0])
        notes.append(f"train_data: PIL images, read through the transforms [{', '.join(chosen.train_transforms)}] "
                     f"(evaluation [{', '.join(chosen.eval_transforms)}]): data.train_transforms, data.eval_transforms")
    width = _one_hot_labels(splits, names, notes, own_loss)
    if num_classes is None and width:
        num_classes = width  # the one-hot width, not the largest label + 1: a class no sample has still counts
    elif width and num_classes != width:
        raise DataError(f"num_classes is {num_classes} but the one-hot labels have {width} columns.")
    notes += _input_dtypes(splits, model)
    if not own_loss and first.labels is not None and first.labels.is_floating_point() and first.labels.dim() == 1:
        raise DataError(f"train_data: labels are floats ({first.labels.dtype}), which the default cross-entropy cannot take; "
                        f"give class indices (labels.long()) or pass loss_fn for a regression.")
    if first.images is not None and model is not None and model_reads_channels_last(model, first.images):
        given = "x".join(map(str, first.images.shape[1:]))
        for split in splits:
            if split is not None and split.images is not None and split.images.dim() == 4:
                split.images = channels_first(split.images)
        notes.append(_read_channels_first(given, first.images.shape[1:]))
    if first.images is not None:
        sample, label = first.images[0], first.labels[0]
    else:
        item = first.dataset[0]
        if first.collate is not None:  # the DataLoader's collate_fn makes the pairs: item 0 as it batches it
            inputs, labels = first.collate([item])
            item = inputs[0], labels[0]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            what = f"a dict of {', '.join(map(str, list(item)[:4]))}" if isinstance(item, dict) else \
                f"a {type(item).__name__}{f' of {len(item)}' if isinstance(item, (tuple, list)) else ''}"
            raise DataError(f"train_data: a Dataset's items must be (input, label) pairs; item 0 is {what}.")
        sample, label = item
        if hasattr(sample, "__array__") and not isinstance(sample, torch.Tensor):
            sample = items.as_input(np.asarray(sample))  # the DataLoader's collate turns arrays into tensors too
        if isinstance(sample, torch.Tensor) and model is not None and first.collate is None \
                and model_reads_channels_last(model, sample[None]):
            given = "x".join(map(str, sample.shape))
            for split in splits:
                if split is not None and split.dataset is not None:
                    split.dataset = items.read_channels_first(split.dataset)
            sample = sample.permute(2, 0, 1)
            notes.append(_read_channels_first(given, sample.shape))
        if not isinstance(label, (int, float, np.number, np.ndarray, torch.Tensor)):
            raise DataError(f"train_data: item 0's label is {type(label).__name__}; labels are class indices (int), "
                            f"numbers, or tensors of class probabilities.")
    if not isinstance(sample, torch.Tensor):
        raise DataError(f"train_data: each input must be a tensor or NumPy array, got {type(sample).__name__}.")
    shape = tuple(sample.shape)
    row = torch.as_tensor(label) if isinstance(label, (np.ndarray, torch.Tensor)) else None
    # labels as rows (a Dataset's; held one-hot rows are indices by now): their width
    width = len(row) if row is not None and row.dim() == 1 and len(row) > 1 else 0
    if width and not row.is_floating_point() and not own_loss and not _one_hot(row[None]):
        raise DataError(f"train_data: item 0's label is a row of {width} integers but not one-hot (a single 1); "
                        f"give class indices or one-hot rows, or pass loss_fn for several labels a sample.")
    classify = not (isinstance(label, torch.Tensor) and label.is_floating_point()) and not isinstance(label, float)
    if num_classes is None:
        if width:
            num_classes = width  # rows of class probabilities (one-hot rows, soft targets)
        elif not classify:
            num_classes = 0
        elif first.labels is None:
            num_classes = _output_width(model, sample)
        else:
            num_classes = int(first.labels.max()) + 1
    if classify and num_classes:
        for split, name in zip(splits, ("train_data", "val_data", "test_data")):
            _check_labels(split, name, num_classes)
    in_channels, size = (shape[0], shape[1:]) if len(shape) == 3 else (0, ())
    if classes and len(classes) != num_classes:
        classes = []  # names for other classes than the model's: say none rather than wrong ones
    bundle = DataBundle("user", splits[0], splits[1], splits[2], num_classes, in_channels, size, classes=classes,
                        sample_shape=shape, notes=notes)
    return _subset(bundle, transforms) if transforms is not None and classify else bundle


def _validation_of(train: Split, val: Split | None, fraction: float) -> tuple[Split, Split]:
    """``data.val_fraction`` for ``fit``'s tensors: ``(train, validation)``, the validation split a fraction of
    the training samples drawn at random (seed 0) and kept in their order, as an image folder's is. Keras's
    ``validation_split`` takes the last samples instead (``train_validation_split`` in
    keras/src/trainers/data_adapters/array_slicing.py: ``split_at = floor(n * (1 - validation_split))``), which
    holds out one class alone where the samples are sorted by class; like Keras, tensors only."""
    if val is not None:
        raise DataError(f"data.val_fraction holds out {fraction:g} of train_data, and val_data is given too: pass one of them.")
    if train.images is None:
        raise DataError(f"data.val_fraction holds out part of tensors; for a Dataset pass val_data "
                        f"(torch.utils.data.random_split makes one).")
    vidx, tidx = held_out(len(train), fraction)
    if not tidx:
        raise DataError(f"data.val_fraction {fraction:g} of {len(train)} training samples leaves none to train on.")
    vidx, tidx = torch.tensor(sorted(vidx)), torch.tensor(sorted(tidx))
    return Split(train.images[tidx], train.labels[tidx]), Split(train.images[vidx], train.labels[vidx])


def _one_hot(rows: torch.Tensor) -> bool:
    """Every row of N x C ``rows`` holds a single 1 and zeros."""
    return bool(((rows == 0) | (rows == 1)).all() and (rows.sum(1) == 1).all())


def _one_hot_labels(splits, names, notes: list[str], own_loss: bool = False) -> int:
    """Labels held as N x C one-hot rows (one 1 a row, the rest 0: Keras's ``to_categorical`` gives floats, pandas'
    ``get_dummies`` booleans) read as the class indices they encode, so label smoothing applies and the data's
    classes are counted. Float rows of other probabilities (soft targets, smoothed labels) are left as they are,
    for the loss, and scored by their largest share (``metrics.class_targets``, as Keras's ``categorical_accuracy``);
    integer rows that are not one-hot (multi-hot) are one sentence, unless the user's own loss (``own_loss``) takes
    them, as a multi-label loss does. Returns C, or 0 when no split's
    labels were one-hot; splits of different widths are one sentence."""
    widths = {}
    for split, name in zip(splits, names):
        labels = None if split is None else split.labels
        if labels is None or labels.dim() != 2 or labels.shape[1] < 2 or not len(labels):
            continue
        if not _one_hot(labels):
            if not labels.is_floating_point() and not own_loss:
                raise DataError(f"{name}: labels are {len(labels)} x {labels.shape[1]} integers but not one-hot (a single 1 "
                                f"a row); give class indices (N labels) or one-hot rows, or pass loss_fn for several "
                                f"labels a sample.")
            continue
        widths[name] = labels.shape[1]
        split.labels = labels.argmax(1)
        notes.append(f"{name}: one-hot labels ({len(labels)} x {labels.shape[1]}) read as class indices")
    if len(set(widths.values())) > 1:
        raise DataError("the one-hot labels differ in width: " + ", ".join(f"{n} {w}" for n, w in widths.items()) + ".")
    return next(iter(widths.values()), 0)


def _input_dtypes(splits, model) -> list[str]:
    """Inputs held as tensors, read as the model can take them (the log's notes say how): floats of another
    dtype than the model's (NumPy's float64, from ``x / 255.0``; float16) and boolean images cast to it once, up
    front (``DevicePrep`` does the same batch by batch for a Dataset's); images (N x C x H x W) of another
    integer type whose values all lie in 0..255 (``np.array`` of pixel values gives int64) read as the bytes
    they are, so scaled to [0, 1] as uint8 images are (brickyard's own reading: Keras casts floats alone, to
    ``floatx``, in ``convert_to_sliceable`` of keras/src/trainers/data_adapters/array_slicing.py). Other integer
    inputs (token ids, counts) are left as they are: a model of embeddings takes them so."""
    want = augment.float_dtype(model) if model is not None else torch.float32
    held = [s for s in splits if s is not None and s.images is not None]
    if not held or all(s.images.dtype in (torch.uint8, want) for s in held):
        return []
    kinds = sorted({str(s.images.dtype).replace("torch.", "") for s in held if s.images.dtype not in (torch.uint8, want)})
    x = held[0].images
    if x.is_floating_point() or (x.dtype == torch.bool and x.dim() == 4):
        for s in held:
            if s.images.is_floating_point() or s.images.dtype == torch.bool:
                s.images = s.images.to(want)
        return [f"inputs of {', '.join(kinds)} read as {str(want).replace('torch.', '')}, the model's dtype"] if kinds else []
    if x.dim() == 4 and all(not s.images.is_floating_point() for s in held):
        lo, hi = min(int(s.images.min()) for s in held), max(int(s.images.max()) for s in held)
        if 0 <= lo and hi <= 255:
            for s in held:
                s.images = s.images.to(torch.uint8)
            return [f"images of {', '.join(kinds)} with values 0..255 read as bytes (uint8), scaled to [0, 1]"]
        for s in held:
            s.images = s.images.to(want)
        return [f"images of {', '.join(kinds)} with values {lo}..{hi} read as {str(want).replace('torch.', '')} as they are "
                f"(only bytes, 0..255, are scaled to [0, 1]: scale them yourself, or give uint8)"]
    return []


def _read_channels_first(given: str, shape) -> str:
    """The log's note for inputs given channels-last (``given``: "32x32x3") and read as ``shape``."""
    return (f"the inputs are {given} (channels last, as Keras keeps images) and the model takes channels first: "
            f"read as {'x'.join(map(str, shape))}")


def _check_labels(split, name: str, num_classes: int) -> None:
    """Class labels held as a tensor lie in [0, num_classes): checked before training, not met as torch's
    IndexError after an epoch (a Dataset's labels are read as it is read)."""
    if split is None or split.labels is None or not len(split.labels):
        return
    labels = split.labels
    if labels.is_floating_point():
        raise DataError(f"{name}: labels are floats ({labels.dtype}) but train_data's are class indices; give integer labels.")
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= num_classes:
        bad = lo if lo < 0 else hi
        raise DataError(f"{name}: label {bad} is outside the classes 0..{num_classes - 1}; pass num_classes to fit() "
                        f"(it is {num_classes}) or fix the labels.")


def _output_width(model, sample: torch.Tensor) -> int:
    """Classes from the model: its output width for one sample (eval mode, no gradient, then put back)."""
    if model is None:
        raise DataError("pass num_classes (or the model) when train_data is a Dataset of class labels.")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(sample.unsqueeze(0).float())
    except Exception as e:  # noqa: BLE001  the model's own error on its input, in one sentence
        raise DataError(f"train_data: the model could not take the first sample {tuple(sample.shape)} to tell the "
                        f"number of classes ({type(e).__name__}: {str(e).strip()[:150]}); pass num_classes to fit().") from e
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise DataError(f"train_data: a Dataset of class labels needs class logits (N x C) from the model, which gave "
                        f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}; pass num_classes to fit().")
    return out.shape[1]


def from_loaders(train, val=None, test=None) -> tuple[list, list[str], list[str]]:
    """DataLoaders given to ``fit`` read as the Datasets they load: returns the three splits (a loader's
    ``dataset`` in its place), the overrides the loaders ask for and notes for the run's log. The training
    loader's ``batch_size`` is the per-device batch (``data.batch_size``) and an evaluation loader's the
    evaluation batch, as Accelerate's ``prepare_data_loader`` keeps a loader's batch for each process
    (``split_batches=False``: src/accelerate/data_loader.py at commit 000e52b); ``num_workers`` above 0 is
    kept. brickyard shuffles and shards the data itself (its ``BatchPlan``); the samplers torch gives are read
    into that plan (``_sampler``): a ``SubsetRandomSampler``'s indices, a ``WeightedRandomSampler``'s or
    replacement sampler's draws, a ``DistributedSampler`` as the sharding brickyard does anyway. A ``collate_fn`` of
    the user's batches the split's items, in training and evaluation, as it would in the loader (``loaders.UserCollate``:
    it returns ``(inputs, labels)`` or a dict of them, one for each item); a ``worker_init_fn`` runs in each of
    brickyard's loader workers; ``drop_last`` sets ``data.drop_last``. A loader that samples or batches in another
    way (a sampler or batch sampler of its own class, an IterableDataset, no batching) is one sentence rather than a
    run that silently drops what it does."""
    out, sets, notes = [], {}, []
    for data, name, batch_key in ((train, "train_data", "data.batch_size"), (val, "val_data", "data.eval_batch_size"),
                                  (test, "test_data", "data.eval_batch_size")):
        if not isinstance(data, DataLoader):
            out.append(data)
            continue
        if isinstance(data.dataset, IterableDataset):
            raise DataError(f"{name}: the DataLoader streams an IterableDataset ({type(data.dataset).__name__}); brickyard "
                            f"shuffles and shards a Dataset that has len() and [i], so give one of those.")
        batches = data.batch_sampler
        own = None
        if batches is None:
            own = "batches nothing (batch_size=None)"
        elif type(batches) is not BatchSampler:
            own = f"batches with its own {type(batches).__name__}"
        if own:
            raise DataError(f"{name}: the DataLoader {own}; brickyard shuffles, shards and batches a Dataset itself, so "
                            f"pass its Dataset (loader.dataset), items as (input, label) pairs, and data.batch_size.")
        dataset, draw, how = _sampler(batches.sampler, data.dataset, name)
        fn = data.collate_fn if data.collate_fn is not torch.utils.data.default_collate else None
        if fn is not None:
            how += f" and its collate_fn ({getattr(fn, '__name__', type(fn).__name__)})"
        init = data.worker_init_fn
        out.append(Split(dataset=dataset, draw=draw, collate=UserCollate(fn, name) if fn else None, worker_init=init)
                   if draw is not None or fn is not None or init is not None else dataset)
        sets.setdefault(batch_key, batches.batch_size)  # val_data's evaluation batch before test_data's
        if name != "train_data":
            unused = "; its drop_last is not applied: an evaluation reads every sample once" if batches.drop_last else ""
            notes.append(f"{name}: a DataLoader, read as its Dataset{how} with its batch of {batches.batch_size} "
                         f"({batch_key}){unused}")
            continue
        dropped = ""
        if batches.drop_last:
            sets["data.drop_last"] = "true"
            dropped = ", its last partial batch left out (data.drop_last)"
        workers = ""
        if data.num_workers:
            sets["data.num_workers"] = data.num_workers
            workers = f" and {data.num_workers} loader workers"
        notes.append(f"{name}: a DataLoader, read as its Dataset{how} with its batch of {batches.batch_size} per device "
                     f"({batch_key}){workers}{dropped}; brickyard {'draws' if draw else 'shuffles'} and shards it")
    return out, [f"{k}={v}" for k, v in sets.items()], notes


def _sampler(sampler, dataset, name: str):
    """A DataLoader's sampler read as brickyard's plan: ``(dataset, draw, note)``. Sequential and plain random
    samplers and a ``DistributedSampler`` (brickyard shuffles and shards every epoch itself, from the run's seed)
    leave the dataset as it is; a ``SubsetRandomSampler`` makes it the Subset of its indices; a
    ``WeightedRandomSampler``, or a ``RandomSampler`` with ``replacement`` or ``num_samples``, becomes a
    ``bundle.Draw`` of as many samples an epoch, drawn from the run's seed and the epoch (the sampler's own
    generator is not used). An evaluation reads every sample once, so it takes no draw."""
    kind, n = type(sampler), len(dataset)
    if kind is SequentialSampler or (kind is RandomSampler and not sampler.replacement and sampler._num_samples is None):
        return dataset, None, ""
    if kind is DistributedSampler:
        return dataset, None, " (its DistributedSampler's sharding is brickyard's own)"
    if kind is SubsetRandomSampler:
        try:
            idx = torch.as_tensor(list(sampler.indices))
        except (TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"{name}: the DataLoader's SubsetRandomSampler indices cannot be read ({reason(e)}).") from None
        if len(idx) and (idx.dim() != 1 or idx.is_floating_point() or idx.dtype == torch.bool or int(idx.min()) < 0
                         or int(idx.max()) >= n):
            raise DataError(f"{name}: the DataLoader's SubsetRandomSampler takes indices outside its Dataset's 0..{n - 1}.")
        return Subset(dataset, idx.tolist()), None, f" (the {len(idx):,} samples of its SubsetRandomSampler)"
    if kind not in (WeightedRandomSampler, RandomSampler):
        raise DataError(f"{name}: the DataLoader samples with its own {kind.__name__}; brickyard shuffles, shards and "
                        f"batches a Dataset itself, so pass its Dataset (loader.dataset), items as (input, label) pairs, "
                        f"and data.batch_size.")
    if name != "train_data":
        raise DataError(f"{name}: the DataLoader draws samples at random ({kind.__name__}); an evaluation reads every "
                        f"sample once, so give it a loader without that sampler.")
    count, weights = sampler.num_samples, None
    if count > 100 * n:  # the epoch's indices are held in memory: 10**12 draws ran out of it
        raise DataError(f"{name}: the DataLoader's {kind.__name__} draws {count:,} samples an epoch from {n:,}; an epoch "
                        f"draws at most 100 times its Dataset's samples ({100 * n:,}): train more epochs instead.")
    if kind is WeightedRandomSampler:
        weights = sampler.weights
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
    how = f"{'by its weights' if weights is not None else 'uniformly'}, {'with' if sampler.replacement else 'without'} replacement"
    return dataset, Draw(count, weights, sampler.replacement), f" (its {kind.__name__}: {count:,} samples an epoch, {how})"


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


def _user_split(data, name: str) -> Split | None:
    if data is None:
        return None
    if isinstance(data, Split):
        return data
    if (isinstance(data, (tuple, list)) and len(data) == 2 and hasattr(data[0], "__array__") and isinstance(data[1], list)
            and len(data[1]) == len(data[0]) and all(isinstance(v, (int, float, np.number)) for v in data[1])):
        data = (data[0], np.asarray(data[1]))  # labels gathered in a Python list, as Keras's y may be
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(hasattr(t, "__array__") for t in data):
        try:
            inputs, labels = (t if isinstance(t, torch.Tensor) else torch.as_tensor(np.asarray(t)) for t in data)
        except (TypeError, ValueError, RuntimeError) as e:
            raise DataError(f"{name}: the arrays cannot be read as tensors ({reason(e)}).") from None
        if labels.dim() == 2 and labels.shape[1] == 1 and not labels.is_floating_point():
            labels = labels[:, 0]  # N x 1 class indices, as keras.datasets gives CIFAR's
        if inputs.dim() == 3:
            inputs = inputs.unsqueeze(1)  # N x H x W: one-channel images (a Dataset keeps other 3-D inputs as they are)
        if inputs.dim() < 1 or len(inputs) != len(labels):
            raise DataError(f"{name}: expected N inputs and N labels, got {tuple(inputs.shape)} and {tuple(labels.shape)}.")
        return Split(inputs, labels if labels.is_floating_point() else labels.long())
    if items.is_dataset(data):
        return Split(dataset=data)
    if isinstance(data, Mapping) and any(k in data for k in ("train", "test", "validation")):
        splits = ", ".join(map(repr, list(data)[:4]))
        raise DataError(f"{name}: a mapping of splits ({splits}), as Hugging Face's load_dataset returns; pass one split, "
                        f"e.g. fit(model, ds['train'], test_data=ds['test']).")
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], (list, tuple)) and data[1] \
            and all(isinstance(v, str) for v in data[1]):
        raise DataError(f"{name}: the labels are names ({data[1][0]!r}, ...); give class indices 0..K-1, e.g. "
                        f"`names, labels = np.unique(labels, return_inverse=True)`.")
    got = type(data).__name__
    if isinstance(data, (tuple, list)):
        got = f"a {got} of {len(data)}: {', '.join(type(t).__name__ for t in data[:3])}{', ...' if len(data) > 3 else ''}"
    raise DataError(f"{name}: expected an (inputs, labels) pair of tensors or NumPy arrays, or a torch Dataset; got {got}.")
