"""What every input kind's adapter does, in the order ``brickyard.data.from_user`` asks it, and the readings the
kinds share (labels as class indices, the log's note for channels-last inputs)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from brickyard.data.bundle import Split

NAMES = ("train_data", "val_data", "test_data")


@dataclass
class Reading:
    """What ``fit`` knows while it reads its data: the ``model`` (None outside ``fit``), whether a loss of the
    user's takes the labels (``own_loss``), the data config (``config``, None outside a run) and the notes for
    the run's log that reading makes."""
    model: torch.nn.Module | None = None
    own_loss: bool = False
    config: object = None
    notes: list[str] = field(default_factory=list)


class Adapter:
    """One split of ``fit``'s data (``name``: train_data, val_data or test_data) read as a ``Split`` (``split``).

    ``from_user`` asks every split's adapter, in this order: ``read_items`` (items that are not pairs read as
    pairs), ``first_image`` and ``with_transforms`` (PIL images), then the training split's ``first`` (item 0 as
    the model takes it, and the layout every split is read in), ``check_labels`` and ``finish`` (how every later
    item is read and checked). Each kind does what applies to it; the rest are no-ops here."""

    def __init__(self, split: Split, name: str):
        self.split, self.name = split, name

    def __len__(self) -> int:
        return len(self.split)

    def read_items(self) -> tuple[str | None, list[str]]:
        """Read items that are not ``(input, label)`` pairs as pairs: ``(a note for the log or None, class names)``."""
        return None, []

    def first_image(self) -> torch.Tensor | None:
        """Item 0's input as uint8 C x H x W where the items are PIL images, else None."""
        return None

    def with_transforms(self, specs, channels: int) -> None:
        """Read PIL images through the transforms ``specs``."""

    def first(self, reading: Reading, adapters: list[Adapter | None]):
        """``(input, label)`` of item 0 as the model takes it; reads every split of ``adapters`` channels-first
        where the model takes only that (a note in ``reading``)."""
        raise NotImplementedError

    def count_classes(self, reading: Reading, sample: torch.Tensor) -> int:
        """The number of classes where item 0's label (of ``sample``) is a class index and none was given."""
        raise NotImplementedError

    def check_labels(self, num_classes: int) -> None:
        """Class labels known up front lie in [0, num_classes)."""

    def finish(self, reading: Reading, train: Adapter) -> None:
        """Read every later item as item 0 was (``train``: the training split's adapter, whose reading of integer
        images the others follow)."""


def as_label(y):
    """A label as the default cross-entropy takes class indices: integers of any width and booleans, NumPy's or
    torch's, as int64, as held labels are (``labels.long()``); floats and int64 as they are, so what trained
    before is read bit for bit the same."""
    if isinstance(y, torch.Tensor):
        return y if y.is_floating_point() or y.dtype == torch.int64 else y.long()
    if isinstance(y, np.ndarray):
        return y if y.dtype.kind not in "iub" or y.dtype == np.int64 else torch.from_numpy(y.astype(np.int64))
    if isinstance(y, (np.integer, bool)):
        return int(y)
    return y


def channels_note(given: str, shape) -> str:
    """The log's note for inputs given channels-last (``given``: "32x32x3") and read as ``shape``."""
    return (f"the inputs are {given} (channels last, as Keras keeps images) and the model takes channels first: "
            f"read as {'x'.join(map(str, shape))}")
