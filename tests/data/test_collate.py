"""A DataLoader's own ``collate_fn`` given to ``fit``: the split's items batched as it batches them, in training
and in evaluation, read as ``(inputs, labels)`` or a dict of them (``loaders.UserCollate``). fp32, one thread,
one process (3 processes: tests/launch/test_launch.py), loader workers pinned in each test."""
import re

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from brickyard import fit
from brickyard.errors import DataError

OV = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.plots=false", "train.tensorboard=false",
      "train.seed=3", "train.epochs=2", "schedule.name=constant", "optim.name=momentum", "optim.lr=0.05"]


class Raw(torch.utils.data.Dataset):
    """Items torch's default collate cannot batch into what the model takes: an H x W uint8 array (no channel) and
    an int, or a dict of them (``as_dict``), as a data set read from files often gives them."""

    def __init__(self, x, y, as_dict=False):
        self.x, self.y, self.as_dict = x.numpy(), y.tolist(), as_dict

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"image": self.x[i], "label": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


def stack(items):
    """(N x 1 x H x W uint8, N labels) from (H x W array, int) items."""
    return torch.from_numpy(np.stack([x for x, _ in items]))[:, None], torch.tensor([y for _, y in items])


def processor(items):
    """A Hugging Face data collator's shape: a dict of ``pixel_values`` (floats in [0, 1]) and ``labels``."""
    return {"pixel_values": torch.from_numpy(np.stack([it["image"] for it in items]))[:, None].float() / 255,
            "labels": [it["label"] for it in items]}


def _data(n=140):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 6, 6), generator=g, dtype=torch.uint8)
    y = (x.flatten(1).float() @ torch.randn(36, 3, generator=g)).argmax(1)
    return x, y


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 3))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_collate_fn_trains_and_evaluates_as_the_tensors_it_makes(tmp_path, workers):
    """Items a Conv2d cannot take as torch's default collate stacks them (no channel axis), batched by the
    loaders' collate_fn in training and in the test pass: the same weights and test accuracy as ``fit`` on the
    tensors it makes, in loader worker processes too; the run's log says so."""
    x, y = _data()
    ov = OV + [f"data.num_workers={workers}"]
    model = _model()
    held = fit(model, (x[:100, None], y[:100]), test_data=(x[100:, None], y[100:]), batch_size=16,
               run_dir=tmp_path / "held", overrides=ov)
    want = model.state_dict()
    model = _model()
    s = fit(model, DataLoader(Raw(x[:100], y[:100]), batch_size=16, shuffle=True, collate_fn=stack),
            test_data=DataLoader(Raw(x[100:], y[100:]), batch_size=7, collate_fn=stack), run_dir=tmp_path / "loader",
            overrides=ov)
    assert s["steps"] == held["steps"] == 14 and s["test_accuracy"] == held["test_accuracy"] is not None
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    log = (tmp_path / "loader" / "train.log").read_text()
    assert "train_data: a DataLoader, read as its Dataset and its collate_fn (stack) with its batch of 16 per device" in log
    assert "test_data: a DataLoader, read as its Dataset and its collate_fn (stack) with its batch of 7" in log


@pytest.mark.fast
def test_a_collate_fn_that_returns_a_dict_as_hugging_face_collators_do(tmp_path):
    """``pixel_values`` and ``labels`` (a list) from dict items, with a sampler brickyard reads (a
    SubsetRandomSampler's indices): trained and validated, the same weights as the floats it makes; the first
    convolution whitened (``model.whiten``) from the images it makes."""
    x, y = _data()
    model = _model()
    fit(model, ((x[:90, None].float() / 255), y[:90]), val_data=((x[90:, None].float() / 255), y[90:]), batch_size=10,
        run_dir=tmp_path / "held", overrides=OV + ["data.num_workers=0", "model.whiten=true"])
    want = model.state_dict()
    ds = Raw(x, y, as_dict=True)
    model = _model()
    s = fit(model, DataLoader(ds, batch_size=10, sampler=torch.utils.data.SubsetRandomSampler(range(90)), collate_fn=processor),
            DataLoader(torch.utils.data.Subset(ds, range(90, 140)), batch_size=25, collate_fn=processor),
            run_dir=tmp_path / "loader", overrides=OV + ["data.num_workers=0", "model.whiten=true"])
    assert s["steps"] == 18 and s["val_accuracy"] is not None
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())


@pytest.mark.fast
def test_a_collate_fn_that_does_not_give_a_pair_a_sample_is_one_sentence(tmp_path):
    """What a collate_fn returns is checked on the first item, before anything is written; a batch whose size
    differs from its items' count is refused too, in the middle of an epoch (the shares of a batch among
    processes are counted in samples)."""
    x, y = _data()
    ds = Raw(x, y)
    bad = {
        "one": (lambda items: stack(items)[0], "train_data: the DataLoader's collate_fn (<lambda>) returned a Tensor; "
                                               "brickyard trains on (inputs, labels)"),
        "keys": (lambda items: {"x0": stack(items)[0], "y0": stack(items)[1]},
                 "train_data: the DataLoader's collate_fn (<lambda>) returned a dict of x0, y0; brickyard reads the inputs"),
        "more": (lambda items: stack(items + items[:1]), "train_data: the DataLoader's collate_fn (<lambda>) returned inputs "
                                                         "(2, 1, 6, 6) and labels (2,) for 1 items"),
        "names": (lambda items: (stack(items)[0], ["cat"] * len(items)),
                  "train_data: the DataLoader's collate_fn (<lambda>) returned labels of list that cannot be read as a tensor"),
    }
    for name, (fn, said) in bad.items():
        with pytest.raises(DataError, match=re.escape(said)):
            fit(_model(), DataLoader(ds, batch_size=16, collate_fn=fn), run_dir=tmp_path / name,
                overrides=OV + ["data.num_workers=0"])
        assert not (tmp_path / name).exists()

    def short_later(items):  # right for the first item, one short for a batch of 16
        return stack(items[:-1] if len(items) == 16 else items)
    with pytest.raises(DataError, match=re.escape("returned inputs (15, 1, 6, 6) and labels (15,) for 16 items; brickyard "
                                                  "shares each batch among the processes by sample")):
        fit(_model(), DataLoader(ds, batch_size=16, collate_fn=short_later), run_dir=tmp_path / "later",
            overrides=OV + ["data.num_workers=0"])

    def broken(items):
        raise KeyError("the user's own bug")
    with pytest.raises(KeyError, match="the user's own bug") as caught:  # the user's exception, with its traceback
        fit(_model(), DataLoader(ds, batch_size=16, collate_fn=broken), run_dir=tmp_path / "broken",
            overrides=OV + ["data.num_workers=0"])
    assert caught.traceback[-1].name == "broken"


class NeedsOpening(torch.utils.data.Dataset):
    """A Dataset whose file each loader worker opens in the loader's worker_init_fn (as h5py and LMDB readers are
    used): an item read in a worker that did not run it raises."""
    opened_in = None

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None and NeedsOpening.opened_in != torch.utils.data.get_worker_info().id:
            raise RuntimeError("the worker did not open the file")
        return self.x[i, None], self.y[i]


def open_file(worker_id):
    NeedsOpening.opened_in = worker_id


def test_a_worker_init_fn_runs_in_each_of_brickyards_loader_workers(tmp_path):
    """The loaders' worker_init_fn, in training and evaluation workers (2 each)."""
    x, y = _data()
    ds = NeedsOpening(x, y)
    s = fit(_model(), DataLoader(ds, batch_size=16, num_workers=2, worker_init_fn=open_file),
            DataLoader(ds, batch_size=20, num_workers=2, worker_init_fn=open_file), run_dir=tmp_path / "r",
            overrides=OV + ["data.num_workers=2"])
    assert s["steps"] == 18 and s["val_accuracy"] is not None
