"""Held tensors and NumPy arrays, ``fit(model, (inputs, labels))`` as Keras's ``fit(x, y)``: read whole, up front.

Labels are int64 class indices (any integer width, N x 1 columns and one-hot rows read so) or float targets;
inputs N x H x W are one-channel images; images of another integer type than uint8 are read as bytes where all
their values lie in 0..255 (``IntegerImages``: a Dataset's are read by the same rule, decided by its item 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brickyard.data import augment
from brickyard.data.adapters.base import Adapter, Reading, channels_note
from brickyard.data.bundle import Split, held_out
from brickyard.data.layout import channels_first, model_reads_channels_last
from brickyard.errors import DataError, reason


def can_read(data) -> bool:
    """An ``(inputs, labels)`` pair of tensors or arrays (``__array__``), the labels possibly a list of numbers."""
    return isinstance(data, (tuple, list)) and len(data) == 2 and hasattr(data[0], "__array__") and (
        hasattr(data[1], "__array__") or _numbers(data[0], data[1]))


def _numbers(inputs, labels) -> bool:
    """Labels gathered in a Python list, as Keras's y may be: one number an input."""
    return (isinstance(labels, list) and len(labels) == len(inputs)
            and all(isinstance(v, (int, float, np.number)) for v in labels))


def refuse_names(data, name: str) -> None:
    """Labels given as class names are one sentence showing how to make indices of them."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[1], (list, tuple)) and data[1] \
            and all(isinstance(v, str) for v in data[1]):
        raise DataError(f"{name}: the labels are names ({data[1][0]!r}, ...); give class indices 0..K-1, e.g. "
                        f"`names, labels = np.unique(labels, return_inverse=True)`.")


class ArrayAdapter(Adapter):
    """A split held as tensors: ``split.images`` and ``split.labels``."""

    @classmethod
    def read(cls, data, name: str) -> ArrayAdapter:
        """``data`` (``can_read``) as tensors: N x 1 integer labels as N labels, N x H x W inputs as one-channel
        images, integer labels as int64."""
        if _numbers(data[0], data[1]):
            data = (data[0], np.asarray(data[1]))
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
        return cls(Split(inputs, labels if labels.is_floating_point() else labels.long()), name)

    def first(self, reading: Reading, adapters: list[Adapter | None]):
        """Float labels for the default cross-entropy are one sentence; N x H x W x C images the model takes only
        channels-first are read so, in every held split."""
        labels, images = self.split.labels, self.split.images
        if not reading.own_loss and labels.is_floating_point() and labels.dim() == 1:
            raise DataError(f"train_data: labels are floats ({labels.dtype}), which the default cross-entropy cannot take; "
                            f"give class indices (labels.long()) or pass loss_fn for a regression.")
        if reading.model is not None and model_reads_channels_last(reading.model, images):
            given = "x".join(map(str, images.shape[1:]))
            for split in (a.split for a in adapters if a is not None):
                if split.images is not None and split.images.dim() == 4:
                    split.images = channels_first(split.images)
            reading.notes.append(channels_note(given, self.split.images.shape[1:]))
        return self.split.images[0], self.split.labels[0]

    def count_classes(self, reading: Reading, sample: torch.Tensor) -> int:
        """The largest label + 1."""
        return int(self.split.labels.max()) + 1

    def check_labels(self, num_classes: int) -> None:
        """Class labels held as a tensor lie in [0, num_classes): checked before training, not met as torch's
        IndexError after an epoch (a Dataset's labels are read as it is read)."""
        labels = self.split.labels
        if not len(labels):
            return
        if labels.is_floating_point():
            raise DataError(f"{self.name}: labels are floats ({labels.dtype}) but train_data's are class indices; give "
                            f"integer labels.")
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= num_classes:
            bad = lo if lo < 0 else hi
            raise DataError(f"{self.name}: label {bad} is outside the classes 0..{num_classes - 1}; pass num_classes to "
                            f"fit() (it is {num_classes}) or fix the labels.")


def validation_of(train: Adapter, val: Adapter | None, fraction: float) -> tuple[Adapter, Adapter]:
    """``data.val_fraction`` for ``fit``'s tensors: ``(train, validation)``, the validation split a fraction of
    the training samples drawn at random (seed 0) and kept in their order, as an image folder's is. Keras's
    ``validation_split`` takes the last samples instead (``train_validation_split`` in
    keras/src/trainers/data_adapters/array_slicing.py: ``split_at = floor(n * (1 - validation_split))``), which
    holds out one class alone where the samples are sorted by class; like Keras, tensors only."""
    if val is not None:
        raise DataError(f"data.val_fraction holds out {fraction:g} of train_data, and val_data is given too: pass one of them.")
    if not isinstance(train, ArrayAdapter):
        raise DataError("data.val_fraction holds out part of tensors; for a Dataset pass val_data "
                        "(torch.utils.data.random_split makes one).")
    vidx, tidx = held_out(len(train), fraction)
    if not tidx:
        raise DataError(f"data.val_fraction {fraction:g} of {len(train)} training samples leaves none to train on.")
    vidx, tidx = torch.tensor(sorted(vidx)), torch.tensor(sorted(tidx))
    x, y = train.split.images, train.split.labels
    return ArrayAdapter(Split(x[tidx], y[tidx]), train.name), ArrayAdapter(Split(x[vidx], y[vidx]), "val_data")


def one_hot(rows: torch.Tensor) -> bool:
    """Every row of N x C ``rows`` holds a single 1 and zeros."""
    return bool(((rows == 0) | (rows == 1)).all() and (rows.sum(1) == 1).all())


def multi_hot(rows: torch.Tensor) -> bool:
    """N x C ``rows`` (C >= 2) of 0s and 1s, some row not one-hot: several labels a sample (``data.task: multilabel``)."""
    if rows.dim() != 2 or rows.shape[1] < 2 or not len(rows) or rows.is_complex():
        return False
    return bool(((rows == 0) | (rows == 1)).all()) and bool((rows.sum(1) != 1).any())


def one_hot_labels(splits, names, notes: list[str], own_loss: bool = False) -> int:
    """Labels held as N x C one-hot rows (one 1 a row, the rest 0: Keras's ``to_categorical`` gives floats, pandas'
    ``get_dummies`` booleans) read as the class indices they encode, so label smoothing applies and the data's
    classes are counted. Float rows of other probabilities (soft targets, smoothed labels) are left as they are,
    for the loss, and scored by their largest share (``metrics.class_targets``, as Keras's ``categorical_accuracy``);
    multi-hot rows (0s and 1s, some row with several 1s or none) are several labels a sample: kept as float rows, for
    binary cross-entropy (``data.task`` auto reads them as multilabel); other integer rows are one sentence, unless
    the user's own loss (``own_loss``) takes them. Returns C, or 0 when no split's labels were one-hot or multi-hot;
    splits of different widths are one sentence."""
    widths: dict = {}
    several = None  # the training split's labels decide: several labels a sample, or one
    for split, name in zip(splits, names):
        labels = None if split is None else split.labels
        if labels is None or labels.dim() != 2 or labels.shape[1] < 2 or not len(labels):
            continue
        several = multi_hot(labels) if several is None else several
        if not several and multi_hot(labels):
            raise DataError(f"{name}: labels are multi-hot rows (several a sample) and train_data's are one a sample; "
                            f"give every split the same kind.")
        if several and (multi_hot(labels) or one_hot(labels)):  # a later split of single tags is read as several too
            widths[name], split.labels = labels.shape[1], labels.float()
            notes.append(f"{name}: multi-hot labels ({len(labels)} x {labels.shape[1]}): several labels a sample")
            continue
        if not one_hot(labels):
            if not labels.is_floating_point() and not own_loss:
                raise DataError(f"{name}: labels are {len(labels)} x {labels.shape[1]} integers but not one-hot (a single 1 "
                                f"a row) nor multi-hot (0s and 1s); give class indices (N labels), one-hot or multi-hot "
                                f"rows, or pass loss_fn for other targets.")
            continue
        widths[name] = labels.shape[1]
        split.labels = labels.argmax(1)
        notes.append(f"{name}: one-hot labels ({len(labels)} x {labels.shape[1]}) read as class indices")
    if len(set(widths.values())) > 1:
        raise DataError("the one-hot labels differ in width: " + ", ".join(f"{n} {w}" for n, w in widths.items()) + ".")
    return next(iter(widths.values()), 0)


@dataclass(frozen=True)
class IntegerImages:
    """How images of another integer type than uint8 are read: as the bytes they are (``bytes``: every value in
    0..255, so scaled to [0, 1] as uint8 images are), else as floats of ``dtype`` (the model's) as they are."""
    bytes: bool
    dtype: torch.dtype

    @classmethod
    def of(cls, lo: int, hi: int, dtype: torch.dtype) -> IntegerImages:
        return cls(0 <= lo and hi <= 255, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.uint8 if self.bytes else self.dtype)

    def note(self, kinds: str, lo: int, hi: int) -> str:
        if self.bytes:
            return f"images of {kinds} with values 0..255 read as bytes (uint8), scaled to [0, 1]"
        return (f"images of {kinds} with values {lo}..{hi} read as {str(self.dtype).replace('torch.', '')} as they are "
                f"(only bytes, 0..255, are scaled to [0, 1]: scale them yourself, or give uint8)")


def input_dtypes(splits, model) -> list[str]:
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
        rule = IntegerImages.of(lo, hi, want)
        for s in held:
            s.images = rule(s.images)
        return [rule.note(", ".join(kinds), lo, hi)]
    return []
