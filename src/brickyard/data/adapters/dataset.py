"""A map-style Dataset of ``(input, label)`` pairs: a ``torch.utils.data.Dataset``, a list of pairs, anything with
``len()`` and ``data[i]`` (``items.is_dataset``), possibly with a DataLoader's ``collate_fn`` (``loader.py``).

Its items are read one by one as the run goes, so item 0 tells what every item is (``first``), and each later
item is read as item 0 was and checked against it (``Checked``): labels of any integer width as int64 class
indices and images of another integer type than uint8 cast by item 0's values, as held tensors are
(``arrays.IntegerImages``); an item of another kind or size is one sentence naming its index, where torch's
collate met it as a crash report or, for integers, as "expected scalar type Long" in the loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brickyard.data import augment, items
from brickyard.data.adapters.arrays import IntegerImages
from brickyard.data.adapters.base import Adapter, Reading, as_label, channels_note
from brickyard.data.layout import model_reads_channels_last
from brickyard.errors import DataError

LABELS = (int, float, np.number, np.ndarray, torch.Tensor)  # what a label may be (bool is an int)


class DatasetAdapter(Adapter):
    """A split read from ``split.dataset`` item by item (``split.collate``: a DataLoader's own collate_fn)."""

    images: IntegerImages | None = None  # how integer images are read (item 0 decides), None where they are not

    def first(self, reading: Reading, adapters: list[Adapter | None]):
        """Item 0 (through the collate_fn where there is one) as an ``(input tensor, label)`` pair; H x W x C inputs
        the model takes only channels-first are read so in every split that is a Dataset."""
        sample, label = self._item0()
        collate = self.split.collate
        if isinstance(sample, torch.Tensor) and reading.model is not None and collate is None \
                and model_reads_channels_last(reading.model, sample[None]):
            given = "x".join(map(str, sample.shape))
            for split in (a.split for a in adapters if a is not None):
                if split.dataset is not None:
                    split.dataset = items.read_channels_first(split.dataset)
            sample = sample.permute(2, 0, 1)
            reading.notes.append(channels_note(given, sample.shape))
        if not isinstance(label, LABELS):
            raise DataError(f"train_data: item 0's label is {type(label).__name__}; labels are class indices (int), "
                            f"numbers, or tensors of class probabilities.")
        if not isinstance(sample, torch.Tensor):
            raise DataError(f"train_data: each input must be a tensor or NumPy array, got {type(sample).__name__}.")
        self.images = _integer_images(sample, reading, None)
        if self.images is not None:
            lo, hi = int(sample.min()), int(sample.max())
            reading.notes.append(f"{self.name}: {self.images.note(str(sample.dtype).replace('torch.', ''), lo, hi)} "
                                 f"(by item 0's values)")
            sample = self.images(sample)
        return sample, as_label(label)

    def _item0(self):
        """Item 0 as a pair, its input a tensor where it is an array; anything but a pair is one sentence."""
        item = self.split.dataset[0]
        if self.split.collate is not None:  # the DataLoader's collate_fn makes the pairs: item 0 as it batches it
            inputs, labels = self.split.collate([item])
            item = inputs[0], labels[0]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise DataError(f"{self.name}: a Dataset's items must be (input, label) pairs; item 0 is {what(item)}.")
        sample, label = item
        if hasattr(sample, "__array__") and not isinstance(sample, torch.Tensor):
            sample = items.as_input(np.asarray(sample))  # the DataLoader's collate turns arrays into tensors too
        return sample, label

    def count_classes(self, reading: Reading, sample: torch.Tensor) -> int:
        """Classes from the model: its output width for one sample (eval mode, no gradient, then put back)."""
        model = reading.model
        if model is None:
            raise DataError("pass num_classes (or the model) when train_data is a Dataset of class labels.")
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(sample.unsqueeze(0).float())
        except Exception as e:  # the model's own error on its input, in one sentence
            raise DataError(f"train_data: the model could not take the first sample {tuple(sample.shape)} to tell the "
                            f"number of classes ({type(e).__name__}: {str(e).strip()[:150]}); pass num_classes to fit().") from e
        finally:
            model.train(was_training)
        if not isinstance(out, torch.Tensor) or out.dim() != 2:
            raise DataError(f"train_data: a Dataset of class labels needs class logits (N x C) from the model, which gave "
                            f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}; pass num_classes to fit().")
        return out.shape[1]

    def finish(self, reading: Reading, train: Adapter) -> None:
        """Every later item read as item 0 is: through ``Checked``, or where a collate_fn makes the batches, by it
        (``loader.UserCollate`` casts its labels and integer images by the same rules)."""
        if not len(self.split):
            return
        sample, label = self._item0()
        if not isinstance(sample, torch.Tensor):
            raise DataError(f"{self.name}: each input must be a tensor or NumPy array, got {type(sample).__name__}.")
        if not isinstance(label, LABELS):
            raise DataError(f"{self.name}: item 0's label is {type(label).__name__}; labels are class indices (int), "
                            f"numbers, or tensors of class probabilities.")
        rule = self.images if self is train else _integer_images(sample, reading, getattr(train, "images", None))
        if self.split.collate is not None:
            self.split.collate.images = rule
            return
        form = Form.of(rule(sample) if rule is not None and _is_integer_image(sample) else sample, as_label(label))
        self.split.dataset = Checked(self.split.dataset, self.name, form, rule, one_at_a_time(reading.config),
                                     reading.own_loss)


def what(item) -> str:
    """An item that is not a pair, in a few words."""
    if isinstance(item, dict):
        return f"a dict of {', '.join(map(str, list(item)[:4]))}"
    return f"a {type(item).__name__}{f' of {len(item)}' if isinstance(item, (tuple, list)) else ''}"


def _is_integer_image(x: torch.Tensor) -> bool:
    """A C x H x W image of another integer type than uint8 (booleans are cast as floats are, by ``DevicePrep``)."""
    return x.dim() == 3 and not x.is_floating_point() and x.dtype not in (torch.uint8, torch.bool)


def _integer_images(sample: torch.Tensor, reading: Reading, given: IntegerImages | None) -> IntegerImages | None:
    """How a split whose item 0 is ``sample`` reads integer images: ``given`` (the training split's rule), else
    decided by ``sample``'s values; None where ``sample`` is no integer image."""
    if not _is_integer_image(sample):
        return None
    want = augment.float_dtype(reading.model) if reading.model is not None else torch.float32
    return given or IntegerImages.of(int(sample.min()), int(sample.max()), want)


def one_at_a_time(config) -> bool:
    """Every batch holds one item (``data.batch_size`` 1 or a global batch of 1, and ``data.eval_batch_size`` 1), so
    inputs of different sizes never meet in one batch and may differ."""
    if config is None:
        return False
    whole = getattr(config, "global_batch_size", 0)
    train = whole == 1 or (whole == 0 and getattr(config, "batch_size", 0) == 1)
    return train and getattr(config, "eval_batch_size", 0) == 1


def _kind(x: torch.Tensor) -> str:
    return ("bytes" if x.dtype == torch.uint8 else "booleans" if x.dtype == torch.bool
            else "floats" if x.is_floating_point() else "integers")


def _label_form(y) -> tuple[str, tuple]:
    """A label's kind and shape: a class index, a number, or a row of integers or numbers."""
    y = torch.as_tensor(y) if isinstance(y, (np.ndarray, torch.Tensor)) else y
    if isinstance(y, torch.Tensor) and y.dim():
        return f"a row of {'numbers' if y.is_floating_point() else 'integers'}", tuple(y.shape)
    number = y.is_floating_point() if isinstance(y, torch.Tensor) else isinstance(y, (float, np.floating))
    return ("a number" if number else "a class index"), ()


@dataclass(frozen=True)
class Form:
    """What an item is: its input's kind (``_kind``) and shape, its label's kind and shape (``_label_form``)."""
    input: str
    shape: tuple
    label: str = ""
    label_shape: tuple = ()

    @classmethod
    def of(cls, x: torch.Tensor, y) -> Form:
        return cls(_kind(x), tuple(x.shape), *_label_form(y))

    def inputs(self) -> str:
        return f"{'x'.join(map(str, self.shape)) or 'a scalar'} {self.input}"

    def labels(self) -> str:
        return self.label + (f" of {'x'.join(map(str, self.label_shape))}" if self.label_shape else "")


class Checked(torch.utils.data.Dataset):
    """``data``'s items as the run reads them: each an ``(input, label)`` pair of item 0's ``form`` (its size may
    differ where ``sizes_vary``), NumPy inputs as tensors, integer images through ``images``, labels through
    ``as_label``, whole numbers among numbers as floats (and numbers after a class index where ``numbers``: a loss
    of the user's takes them); anything else is one sentence naming the item. ``seeded`` and ``labels`` are
    ``data``'s."""

    def __init__(self, data, name: str, form: Form, images: IntegerImages | None, sizes_vary: bool,
                 numbers: bool = False):
        self.data, self.name, self.form, self.images, self.sizes_vary = data, name, form, images, sizes_vary
        self.numbers = numbers  # a loss of the user's takes the labels: numbers may follow a class index
        self.seeded = getattr(data, "seeded", False)  # keys (index, seed): items.Pairs' through random transforms

    @property
    def labels(self):
        """The wrapped dataset's labels where it holds them up front (``data.balance`` reads them)."""
        return getattr(self.data, "labels", None)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key):
        item = self.data[key]
        i = key[0] if isinstance(key, tuple) else key
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise DataError(f"{self.name}: item {i:,} is {what(item)}; a Dataset's items must be (input, label) pairs, "
                            f"as item 0 is.")
        return self._input(item[0], i), self._label(item[1], i)

    def _input(self, x, i: int) -> torch.Tensor:
        if hasattr(x, "__array__") and not isinstance(x, torch.Tensor):
            x = items.as_input(np.asarray(x))
        if not isinstance(x, torch.Tensor):
            raise DataError(f"{self.name}: item {i:,}'s input is a {type(x).__name__}; every input must be a tensor or "
                            f"NumPy array, as item 0's ({self.form.inputs()}) is.")
        if self.images is not None and _is_integer_image(x):
            x = self._bytes(x, i) if self.images.bytes else self.images(x)
        if _kind(x) == self.form.input and tuple(x.shape) == self.form.shape:
            return x  # the usual case, without building a Form
        now = Form(_kind(x), tuple(x.shape))
        if now.input != self.form.input or len(now.shape) != len(self.form.shape):
            raise DataError(f"{self.name}: item {i:,}'s input is {now.inputs()} and item 0's {self.form.inputs()}; every "
                            f"input must be of item 0's kind and number of dimensions.")
        if now.shape != self.form.shape and not self.sizes_vary:
            a, b = ("x".join(map(str, shape)) for shape in (self.form.shape, now.shape))
            raise DataError(f"inputs of different sizes meet in one batch ({', '.join(sorted((a, b)))}): end "
                            f"data.train_transforms and data.eval_transforms with a fixed size (resize:HxW, center_crop:S, "
                            f"random_resized_crop:S), or give inputs of one size ({self.name}'s item {i:,} is {b}, its "
                            f"item 0 {a}).")
        return x

    def _bytes(self, x: torch.Tensor, i: int) -> torch.Tensor:
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or hi > 255:
            raise DataError(f"{self.name}: item {i:,}'s image has values {lo}..{hi}, and the images are read as bytes "
                            f"(uint8, scaled to [0, 1]) because train_data's item 0 has values in 0..255; give every "
                            f"image in one range, as uint8 or as floats.")
        return self.images(x)

    def _label(self, y, i: int):
        if not isinstance(y, LABELS):
            raise DataError(f"{self.name}: item {i:,}'s label is {'None' if y is None else type(y).__name__}; every label "
                            f"must be {self.form.labels()}, as item 0's is.")
        y = as_label(y)
        now = _label_form(y)
        if now == (self.form.label, self.form.label_shape):
            return y
        scalar = not now[1] and not self.form.label_shape
        if scalar and now[0] == "a class index" and self.form.label == "a number":
            return float(y)  # a whole number among numbers (targets 0.5, 1, ...): read as one of them
        if scalar and now[0] == "a number" and self.numbers:
            return y  # after a class index, for a loss of the user's
        raise DataError(f"{self.name}: item {i:,}'s label is {Form('', (), *now).labels()} and item 0's "
                        f"{self.form.labels()}; every label must be of one kind and size.")
