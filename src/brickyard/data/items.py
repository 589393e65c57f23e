"""Datasets whose items are not ``(input, label)`` pairs of tensors, read as such pairs.

- **Hugging Face ``datasets``** give dicts: ``load_dataset("cifar10")["train"][0]`` is ``{"img": <PIL
  image>, "label": 0}``, ``with_format("torch")`` makes the image a uint8 C x H x W tensor, and an image
  processor adds ``pixel_values``. The input is read from the first of ``INPUT_KEYS`` an item has and the
  label from the first of ``LABEL_KEYS``; the class names come from the label column's ``ClassLabel``
  (``dataset.features[key].names``), so ``predict`` and the plots name classes. An input column stored as
  uint8 arrays (``Array3D(..., "uint8")``, lists of ``Value("uint8")``) is read as uint8, and so scaled to
  [0, 1] as images are: the torch and NumPy formats widen every integer to int64
  (``datasets/formatting/torch_formatter.py`` lines 59-65 and ``np_formatter.py`` lines 59-60,
  ``_tensorize``, datasets 5.2.0 as installed by the ``[hf]`` extra), which
  a float model cannot take. Image columns stay uint8 there (the PIL image is converted before that rule).
- **PIL images** (such a dataset without a format, or a ``(PIL image, label)`` Dataset of the user's) are
  read as uint8 C x H x W: one channel for grey and 16-bit images, three for the others, as image folders
  read them (``imagefolder.as_uint8``), then through ``data.train_transforms`` / ``data.eval_transforms``
  as an image folder's files are (``auto``: small images at the first one's size, photos cropped to 224),
  so photos of many sizes batch; the random ones draw from the loader's per-item seed, so a resumed run
  reads the same crops.

Any object with ``__len__`` and integer ``__getitem__`` is a dataset here, as it is for torch's
``DataLoader``: a Hugging Face ``Dataset`` is not a ``torch.utils.data.Dataset``, and a list of pairs is a
dataset too.
"""
from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from brickyard.data.imagefolder import GREY, as_uint8, why_bad
from brickyard.data.transforms import Pipeline
from brickyard.errors import DataError

INPUT_KEYS = ("pixel_values", "image", "img", "images", "input", "inputs", "x")
LABEL_KEYS = ("label", "labels", "fine_label", "target", "targets", "y")


def is_dataset(data) -> bool:
    """A map-style dataset: ``len()`` and ``data[i]``; not a string, a mapping, or arrays."""
    if isinstance(data, torch.utils.data.Dataset):
        return True
    if isinstance(data, (str, bytes, Mapping)) or hasattr(data, "__array__"):
        return False
    if isinstance(data, (list, tuple)):  # a list of pairs (or dicts), not a pair of arrays or of nested lists
        first = data[0] if len(data) else None
        return isinstance(first, Mapping) or (isinstance(first, (tuple, list)) and len(first) == 2
                                              and not isinstance(first[0], (list, tuple)))
    return hasattr(data, "__len__") and hasattr(data, "__getitem__")


class Pairs(torch.utils.data.Dataset):
    """``data``'s items as ``(input, label)``: ``item[input_key]``, ``item[label_key]`` (keys or indices),
    PIL images and NumPy arrays as tensors; with ``channels_first``, H x W x C inputs as C x H x W; with
    ``uint8``, integer inputs as uint8 (for a column the data set stores as uint8); with ``pipeline``, PIL
    images through it. A key is an index or, with a pipeline, ``(index, seed)`` (``seeded``, as the image
    folders' keys are): its random transforms draw from ``random.Random(seed)``."""

    def __init__(self, data, input_key=0, label_key=1, channels_first: bool = False, uint8: bool = False,
                 pipeline: Pipeline | None = None):
        self.data, self.input_key, self.label_key = data, input_key, label_key
        self.channels_first, self.uint8, self.pipeline = channels_first, uint8, pipeline
        self.seeded = pipeline is not None

    def but(self, **changes) -> Pairs:
        """The same reading with ``changes`` (``channels_first``, ``uint8``, ``pipeline``), the rest kept."""
        kept = dict(channels_first=self.channels_first, uint8=self.uint8, pipeline=self.pipeline)
        return Pairs(self.data, self.input_key, self.label_key, **{**kept, **changes})

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key):
        i, rng = (key[0], random.Random(key[1])) if isinstance(key, tuple) else (key, random)
        try:  # a Hugging Face Image column decodes here, a lazily loaded PIL image in as_input
            item = self.data[i]
            raw = item[self.input_key]
            x = as_input(raw)
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as e:
            if isinstance(e, OSError) and not isinstance(e, UnidentifiedImageError) and "truncated" not in str(e):
                raise  # not a decode failure (a file the data set itself reads): the loader says it
            raise DataError(f"item {i:,}'s image is unreadable or truncated ({why_bad(e)}); fix or drop it (a Hugging "
                            f"Face data set: ds.filter) before training.") from None
        if self.pipeline is not None and isinstance(raw, Image.Image):
            return self.pipeline(x, rng), item[self.label_key]
        if self.channels_first and isinstance(x, torch.Tensor) and x.dim() == 3:
            x = x.permute(2, 0, 1)
        if self.uint8 and isinstance(x, torch.Tensor) and x.dtype != torch.uint8 and not x.is_floating_point():
            x = x.to(torch.uint8)  # stored as uint8: every value fits
        return x, item[self.label_key]


def as_input(x):
    """A PIL image as uint8 C x H x W, a NumPy array as a tensor (a copy where the array is read-only, as
    Hugging Face's NumPy format gives them); anything else as it is."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x if x.flags.writeable else x.copy())
    if not isinstance(x, Image.Image):
        return x
    pixels = as_uint8(x, "L" if x.mode in GREY else "RGB")
    pixels = np.ascontiguousarray(pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1))
    return torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy())  # Pillow's own buffer is read-only


def read_channels_first(data) -> torch.utils.data.Dataset:
    """``data`` (a dataset of pairs) with its H x W x C inputs read as C x H x W."""
    if isinstance(data, Pairs):
        return data.but(channels_first=True)
    return Pairs(data, channels_first=True)


def as_pairs(data, name: str) -> tuple[torch.utils.data.Dataset, str | None, list[str]]:
    """``(dataset of pairs, a note for the run's log or None, class names or [])`` for a map-style dataset
    whose items are dicts, or pairs whose input is a PIL image; other datasets are returned as they are."""
    if not len(data):
        return data, None, []
    item = data[0]
    if isinstance(item, Mapping):
        keys = list(item)
        x_key = next((k for k in INPUT_KEYS if k in item), None)
        y_key = next((k for k in LABEL_KEYS if k in item), None)
        if x_key is None or y_key is None:
            shown = ", ".join(map(repr, keys[:8])) + (", ..." if len(keys) > 8 else "")
            raise DataError(f"{name}: items are dicts of {shown}; brickyard reads the input from the first of "
                            f"{', '.join(INPUT_KEYS)} and the label from the first of {', '.join(LABEL_KEYS)} (as Hugging "
                            f"Face data sets name them): rename the columns, or give (input, label) pairs.")
        _refuse_unlabelled(data, y_key, name)
        note = f"{name}: items are dicts; read {x_key!r} as the input and {y_key!r} as the label"
        uint8 = _stored_dtype(data, x_key) == "uint8"
        if uint8:
            note += f" ({x_key!r} is stored as uint8: read as uint8 images, scaled to [0, 1])"
        return Pairs(data, x_key, y_key, uint8=uint8), note, _class_names(data, y_key)
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], Image.Image):
        return Pairs(data, 0, 1), f"{name}: PIL images, read as uint8 tensors", []
    return data, None, []


def with_transforms(data, specs, channels: int):
    """``data`` (what ``as_pairs`` gave) with its PIL images read through the transforms ``specs``; other
    datasets as they are."""
    if not (isinstance(data, Pairs) and len(data) and isinstance(data.data[0][data.input_key], Image.Image)):
        return data
    return data.but(pipeline=Pipeline(specs, channels))


def first_image(data) -> torch.Tensor | None:
    """The first item's input as uint8 C x H x W where ``data`` (what ``as_pairs`` gave) holds PIL images."""
    if isinstance(data, Pairs) and len(data):
        raw = data.data[0][data.input_key]
        if isinstance(raw, Image.Image):
            return as_input(raw)
    return None


def _refuse_unlabelled(data, key, name: str) -> None:
    """A Hugging Face data set's label column, read whole (Arrow, milliseconds for 60,000 rows): a
    negative label is one sentence before training. Hugging Face marks unlabelled items -1 (test splits
    published without their answers), which cross-entropy would meet as "Target -1 is out of bounds" at
    the first batch that holds one. Other datasets' labels are met item by item, as torch's loader does."""
    if not (hasattr(data, "select_columns") and hasattr(data, "with_format")):
        return
    try:
        labels = np.asarray(data.select_columns([key]).with_format("numpy")[:][key])
    except Exception:  # noqa: BLE001 - a column that is not an array of numbers: left to the loader
        return
    if labels.dtype.kind not in "iu" or labels.ndim != 1:
        return
    bad = np.flatnonzero(labels < 0)
    if bad.size:
        raise DataError(f"{name}: {bad.size:,} of {labels.size:,} items have a negative {key!r} ({labels[bad[0]]} at "
                        f"item {bad[0]:,}); Hugging Face marks unlabelled items so: keep the labelled ones "
                        f"(`ds.filter(lambda item: item[{key!r}] >= 0)`) or leave this split out.")


def _stored_dtype(data, key) -> str | None:
    """The element type a Hugging Face column is stored as (``Array2D``-``Array5D``, ``Value``, and lists of
    them), or None."""
    features = getattr(data, "features", None)
    feature = features.get(key) if isinstance(features, Mapping) else None
    for _ in range(8):  # List(List(Value)): a few levels of lists
        if feature is None or isinstance(getattr(feature, "dtype", None), str):
            break
        feature = getattr(feature, "feature", None)
    dtype = getattr(feature, "dtype", None)
    return dtype if isinstance(dtype, str) else None


def _class_names(data, key) -> list[str]:
    """The names of a Hugging Face ``ClassLabel`` column (``data.features[key].names``), or []."""
    features = getattr(data, "features", None)
    names = getattr(features.get(key), "names", None) if isinstance(features, Mapping) else None
    return [str(n) for n in names] if isinstance(names, (list, tuple)) and names else []
