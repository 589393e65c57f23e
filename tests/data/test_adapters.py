"""``fit``'s inputs read by one adapter per kind (``brickyard.data.adapters``), and a Dataset's items read as held
tensors of the same kinds are: integer labels of any width as int64 class indices, integer images cast by item 0's
values as held integer images are; an item of another kind or size than item 0 is one sentence naming it. The
trainings: fp32, one thread, a few steps, a 1 x 4 x 4 input."""
import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from brickyard import fit
from brickyard.data import from_loaders, from_user
from brickyard.data.adapters import ArrayAdapter, DatasetAdapter, HuggingFaceAdapter, LoaderAdapter, UserCollate, adapter_for
from brickyard.data.bundle import Split
from brickyard.errors import DataError

OV = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.plots=false", "train.tensorboard=false",
      "train.seed=3", "train.max_steps=6", "train.epochs=2", "schedule.name=constant", "optim.name=momentum",
      "optim.lr=0.05", "data.num_workers=0", "data.batch_size=8"]


class Items(torch.utils.data.Dataset):
    """32 items made by ``make(i)``."""

    def __init__(self, make, n=32):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(i)


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 1, 4, 4), generator=g)  # int64 pixel values, as np.array of pixels gives them
    y = (x.flatten(1).float() @ torch.randn(16, 3, generator=g)).argmax(1)
    return x, y


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.fast
def test_the_dispatcher_picks_one_adapter_per_kind():
    x, y = _data(4)
    assert type(adapter_for((x, y), "train_data")) is ArrayAdapter
    assert type(adapter_for((x.numpy(), y.tolist()), "train_data")) is ArrayAdapter  # Keras's y as a list
    assert type(adapter_for(TensorDataset(x, y), "train_data")) is DatasetAdapter
    assert type(adapter_for([(x[i], int(y[i])) for i in range(4)], "train_data")) is DatasetAdapter  # a list of pairs
    assert type(adapter_for(Items(lambda i: {"image": x[i], "label": 0}, 4), "train_data")) is HuggingFaceAdapter
    assert type(adapter_for(Split(dataset=Items(lambda i: {"image": x[i]}, 4), collate=len), "val_data")) is DatasetAdapter
    assert adapter_for(None, "test_data") is None
    with pytest.raises(DataError, match=re.escape("val_data: expected an (inputs, labels) pair of tensors or NumPy arrays, "
                                                  "or a torch Dataset; got a tuple of 3: Tensor, Tensor, Tensor.")):
        adapter_for((x, y, y), "val_data")
    (split, _, _), sets, notes = from_loaders(DataLoader(TensorDataset(x, y), batch_size=2, drop_last=True))
    assert isinstance(LoaderAdapter(DataLoader(TensorDataset(x, y)), "train_data", "data.batch_size"), LoaderAdapter)
    assert isinstance(split, TensorDataset) and sets == ["data.batch_size=2", "data.drop_last=true"] and len(notes) == 1


@pytest.mark.fast
@pytest.mark.parametrize("label", [np.int32, np.int16, np.uint8, torch.int32, torch.int8, torch.uint8, bool], ids=str)
def test_a_datasets_integer_labels_of_any_width_are_read_as_int64(label):
    """As held labels are (``labels.long()``); torch's collate kept their width, and cross-entropy said "expected
    scalar type Long"."""
    x, y = _data(8)
    make = (lambda v: torch.tensor(v, dtype=label)) if isinstance(label, torch.dtype) else label
    data = from_user(Items(lambda i: (x[i].to(torch.uint8), make(int(y[i]) % 2)), 8), num_classes=3)
    batch = torch.utils.data.default_collate([data.train.dataset[i] for i in range(8)])
    assert batch[1].dtype == torch.int64 and batch[1].tolist() == [int(v) % 2 for v in y]


@pytest.mark.fast
def test_a_collate_fns_integer_labels_are_read_as_int64():
    x, y = _data(8)
    collate = UserCollate(lambda items: (torch.stack([a for a, _ in items]), torch.tensor([b for _, b in items],
                                                                                          dtype=torch.int32)), "train_data")
    assert collate([(x[i], int(y[i])) for i in range(8)])[1].dtype == torch.int64


@pytest.mark.fast
def test_a_datasets_integer_images_are_cast_as_held_ones_are():
    """int64 images of values 0..255 read as bytes (scaled to [0, 1] on the device), others as floats as they are,
    decided by item 0 as held images are by all of theirs; a later image out of the bytes' range is one sentence."""
    x, y = _data(8)
    data = from_user(Items(lambda i: (x[i], y[i]), 8), num_classes=3)
    assert data.train.dataset[3][0].dtype == torch.uint8 and torch.equal(data.train.dataset[3][0], x[3].to(torch.uint8))
    assert any("images of int64 with values 0..255 read as bytes (uint8)" in n for n in data.notes)
    wide = from_user(Items(lambda i: ((x[i] * 4).to(torch.int16), y[i]), 8), num_classes=3)
    assert wide.train.dataset[2][0].dtype == torch.float32 and torch.equal(wide.train.dataset[2][0], x[2].float() * 4)
    assert wide.sample_shape == (1, 4, 4)
    later = from_user(Items(lambda i: (x[i] * (1 if i < 5 else 300), y[i]), 8), num_classes=3)
    with pytest.raises(DataError, match=r"^train_data: item 5's image has values \d+\.\.\d+, and the images are read as "
                                        r"bytes \(uint8, scaled to \[0, 1\]\) because train_data's item 0 has values in "
                                        r"0\.\.255; give every image in one range"):
        later.train.dataset[5]


@pytest.mark.fast
@pytest.mark.parametrize("item, words", [
    (lambda x: (x, 1, "extra"), "train_data: item 5 is a tuple of 3; a Dataset's items must be (input, label) pairs, "
                                "as item 0 is."),
    (lambda x: (x, None), "train_data: item 5's label is None; every label must be a class index, as item 0's is."),
    (lambda x: ("a cat", 1), "train_data: item 5's input is a str; every input must be a tensor or NumPy array, as item "
                             "0's (1x4x4 bytes) is."),
    (lambda x: (x.float(), 1), "train_data: item 5's input is 1x4x4 floats and item 0's 1x4x4 bytes; every input must "
                               "be of item 0's kind and number of dimensions."),
    (lambda x: (x[0], 1), "train_data: item 5's input is 4x4 bytes and item 0's 1x4x4 bytes"),
    (lambda x: (x, 0.5), "train_data: item 5's label is a number and item 0's a class index; every label must be of one "
                         "kind and size."),
    (lambda x: (torch.zeros(2, 5, 5, dtype=torch.uint8), 1), "inputs of different sizes meet in one batch (1x4x4, "
                                                             "2x5x5): end data.train_transforms"),
])
def test_an_item_unlike_item_0_is_one_sentence_naming_it(item, words):
    x = torch.zeros(1, 4, 4, dtype=torch.uint8)
    data = from_user(Items(lambda i: (x, 1) if i != 5 else item(x), 8), num_classes=3)
    with pytest.raises(DataError, match="^" + re.escape(words)):
        data.train.dataset[5]
    assert data.train.dataset[4][1] == 1


@pytest.mark.fast
def test_sizes_may_differ_where_every_batch_is_one_item():
    class One:  # the data config's batches
        global_batch_size, batch_size, eval_batch_size, val_fraction = 0, 1, 1, 0.0
        classes, train_per_class = (), 0
    data = from_user(Items(lambda i: (torch.zeros(1, 4 + i % 2, 4), 1), 4), num_classes=3, transforms=One())
    assert data.train.dataset[1][0].shape == (1, 5, 4)


@pytest.mark.fast
def test_whole_numbers_among_float_labels_are_read_as_numbers():
    """A regression's targets 0.5, 1, ... (a loss of the user's): not refused as a class index among numbers."""
    data = from_user(Items(lambda i: (torch.zeros(1, 4, 4), 0.5 if i != 3 else 1), 4), own_loss=True)
    assert isinstance(data.train.dataset[3][1], float) and data.train.dataset[3][1] == 1.0
    data = from_user(Items(lambda i: (torch.zeros(1, 4, 4), 1 if i != 3 else 0.5), 4), num_classes=3, own_loss=True)
    assert data.train.dataset[3][1] == 0.5


@pytest.mark.parametrize("label", [np.int32, torch.int32], ids=str)
def test_a_dataset_of_int32_labels_trains_as_held_int32_tensors_do(label, tmp_path):
    """The same weights as ``fit`` on held tensors of int32 labels; before, "expected scalar type Long"."""
    x, y = _data()
    x = x.to(torch.uint8)
    model = _model()
    fit(model, (x, y.int()), run_dir=tmp_path / "held", overrides=OV)
    want = _weights(model)
    make = (lambda v: torch.tensor(v, dtype=label)) if isinstance(label, torch.dtype) else label
    model = _model()
    s = fit(model, Items(lambda i: (x[i], make(int(y[i])))), num_classes=3, run_dir=tmp_path / "ds", overrides=OV)
    assert s["steps"] == 6 and all(torch.equal(want[k], v) for k, v in model.state_dict().items())


def test_a_collate_fn_giving_int32_labels_trains(tmp_path):
    x, y = _data()

    def stack(items):
        return torch.stack([a for a, _ in items]).to(torch.uint8), torch.tensor([b for _, b in items], dtype=torch.int32)
    s = fit(_model(), DataLoader(Items(lambda i: (x[i], int(y[i]))), batch_size=8, collate_fn=stack),
            run_dir=tmp_path / "r", overrides=OV)
    assert s["steps"] == 6


@pytest.mark.parametrize("dtype, scale", [(torch.int64, 1), (torch.int16, 4)])
def test_a_datasets_integer_images_train_as_held_integer_images_do(dtype, scale, tmp_path):
    """Bytes of int64 scaled to [0, 1], int16 of 0..1020 read as floats as they are: the same weights as the held
    tensors; before, "mat1 and mat2 must have the same dtype"."""
    x, y = _data()
    x = (x * scale).to(dtype)
    model = _model()
    fit(model, (x, y), run_dir=tmp_path / "held", overrides=OV)
    want = _weights(model)
    model = _model()
    s = fit(model, Items(lambda i: (x[i], y[i])), num_classes=3, run_dir=tmp_path / "ds", overrides=OV)
    assert s["steps"] == 6 and all(torch.equal(want[k], v) for k, v in model.state_dict().items())


def test_a_dataset_whose_later_item_changes_is_one_sentence_naming_it(tmp_path):
    """A triple at item 20, met in training: one DataError naming the item (it was torch's collate RuntimeError)."""
    x, y = _data()
    x = x.to(torch.uint8)
    with pytest.raises(DataError, match=re.escape("train_data: item 20 is a tuple of 3; a Dataset's items must be")):
        fit(_model(), Items(lambda i: (x[i], y[i]) if i != 20 else (x[i], y[i], "extra")), num_classes=3,
            run_dir=tmp_path / "r", overrides=OV + ["train.max_steps=8"])
