"""``fit``'s data read by one adapter per input kind, each with its own checks and sentences, as Keras's
``get_data_adapter`` picks one class per kind (keras/src/trainers/data_adapters/__init__.py):

- ``arrays.ArrayAdapter``: held tensors and NumPy arrays ``(inputs, labels)``;
- ``dataset.DatasetAdapter``: a map-style Dataset of ``(input, label)`` pairs (a list of pairs, anything with
  ``len()`` and ``[i]``), its items read as item 0 is;
- ``huggingface.HuggingFaceAdapter``: a Hugging Face dataset, or any Dataset of dicts or PIL images;
- ``loader.LoaderAdapter``: a DataLoader, read before the others as the Dataset it loads (its sampler,
  ``collate_fn``, ``worker_init_fn``, batch and ``drop_last`` as brickyard's settings).

A new input kind is one module here with its adapter (``base.Adapter``) and one line in ``adapter_for``.
"""
from __future__ import annotations

from brickyard.data import items
from brickyard.data.adapters import arrays, huggingface
from brickyard.data.adapters.arrays import ArrayAdapter
from brickyard.data.adapters.base import NAMES, Adapter, Reading
from brickyard.data.adapters.dataset import DatasetAdapter
from brickyard.data.adapters.huggingface import HuggingFaceAdapter
from brickyard.data.adapters.loader import LoaderAdapter, UserCollate
from brickyard.data.bundle import Split
from brickyard.errors import DataError

__all__ = ["NAMES", "Adapter", "ArrayAdapter", "DatasetAdapter", "HuggingFaceAdapter", "LoaderAdapter", "Reading",
           "UserCollate", "adapter_for"]


def adapter_for(data, name: str) -> Adapter | None:
    """The adapter that reads ``data``, given to ``fit`` as ``name`` (None for None); what no adapter reads is one
    sentence. A ``Split`` is what ``from_loaders`` made of a DataLoader (or tensors already read)."""
    if data is None:
        return None
    if isinstance(data, Split):
        if data.images is not None:
            return ArrayAdapter(data, name)
        dicts = data.collate is None and huggingface.can_read(data.dataset)  # a collate_fn reads the items itself
        return (HuggingFaceAdapter if dicts else DatasetAdapter)(data, name)
    if arrays.can_read(data):
        return ArrayAdapter.read(data, name)
    if items.is_dataset(data):
        return (HuggingFaceAdapter if huggingface.can_read(data) else DatasetAdapter)(Split(dataset=data), name)
    huggingface.refuse_split_mapping(data, name)
    arrays.refuse_names(data, name)
    got = type(data).__name__
    if isinstance(data, (tuple, list)):
        got = f"a {got} of {len(data)}: {', '.join(type(t).__name__ for t in data[:3])}{', ...' if len(data) > 3 else ''}"
    raise DataError(f"{name}: expected an (inputs, labels) pair of tensors or NumPy arrays, or a torch Dataset; got {got}.")
