"""A Hugging Face dataset, and any Dataset whose items are dicts or ``(PIL image, label)`` pairs: read as
``(input, label)`` pairs by ``items.Pairs`` (its keys, class names and uint8 columns: ``brickyard.data.items``), PIL
images through the image folders' transforms where ``fit`` has a data config."""
from __future__ import annotations

from collections.abc import Mapping

from PIL import Image

from brickyard.data import items
from brickyard.data.adapters.base import Adapter
from brickyard.data.adapters.dataset import DatasetAdapter
from brickyard.data.imagefolder import auto_transforms, output_sizes
from brickyard.errors import DataError


def can_read(data) -> bool:
    """A dataset (``items.is_dataset``) whose item 0 is a dict, or a pair whose input is a PIL image."""
    if not len(data):
        return False
    item = data[0]
    return isinstance(item, Mapping) or (isinstance(item, (tuple, list)) and len(item) == 2
                                         and isinstance(item[0], Image.Image))


def refuse_split_mapping(data, name: str) -> None:
    """A mapping of splits, as ``load_dataset`` returns, is one sentence naming the split to pass."""
    if isinstance(data, Mapping) and any(k in data for k in ("train", "test", "validation")):
        splits = ", ".join(map(repr, list(data)[:4]))
        raise DataError(f"{name}: a mapping of splits ({splits}), as Hugging Face's load_dataset returns; pass one split, "
                        f"e.g. fit(model, ds['train'], test_data=ds['test']).")


class HuggingFaceAdapter(DatasetAdapter):
    """Dict items (the input from the first of ``items.INPUT_KEYS``, the label from the first of
    ``items.LABEL_KEYS``) or PIL images, read as pairs; then as any Dataset."""

    def read_items(self) -> tuple[str | None, list[str]]:
        self.split.dataset, note, classes = items.as_pairs(self.split.dataset, self.name)
        return note, classes

    def first_image(self):
        return items.first_image(self.split.dataset)

    def with_transforms(self, specs, channels: int) -> None:
        self.split.dataset = items.with_transforms(self.split.dataset, specs, channels)


def photo_transforms(adapters: list[Adapter | None], config) -> str | None:
    """PIL images read through the image folders' transforms (``config``: the data config's ``train_transforms``,
    ``eval_transforms``; ``auto`` from the first image), so photos of many sizes batch: the log's note, or None
    where the training split holds no PIL images."""
    image = adapters[0].first_image()
    if image is None:
        return None
    chosen = auto_transforms(config, image)
    output_sizes(chosen, image)  # one sentence up front where they do not end in a fixed size
    for adapter, specs in zip(adapters, (chosen.train_transforms, chosen.eval_transforms, chosen.eval_transforms)):
        if adapter is not None:
            adapter.with_transforms(specs, config.channels or image.shape[0])
    return (f"train_data: PIL images, read through the transforms [{', '.join(chosen.train_transforms)}] "
            f"(evaluation [{', '.join(chosen.eval_transforms)}]): data.train_transforms, data.eval_transforms")
