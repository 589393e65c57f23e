"""Keras's ``fit`` keywords of odd values are one sentence before anything is written: ``class_weight={1.7: 2}``
weighed class 1, a regression's class_weight said "classes 0..-1", a 2-D array or a tensor value were raw
ValueError / RuntimeError, and ``batch_size=0`` trained at 256 a device."""
import re

import numpy as np
import pytest
import torch

from brickyard import fit
from brickyard.api import _class_weights
from brickyard.errors import ConfigError

pytestmark = pytest.mark.fast

OV = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.epochs=1", "train.plots=false",
      "train.tensorboard=false", "train.seed=3"]


def _data(regression=False):
    torch.manual_seed(0)
    x = torch.randn(48, 4)
    return x, (x.sum(1) if regression else (x @ torch.randn(4, 3)).argmax(1))


def _model(out=3):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, out))


@pytest.mark.parametrize("weights, said", [
    ({1.7: 2}, "class_weight: the key 1.7 is not a whole number, so not a class index."),
    ({True: 2}, "class_weight: the key True is not a class index."),
    (np.ones((3, 2)), "class_weight: expected {class: weight} or one weight a class, got an array of shape (3, 2)."),
    ({1: torch.tensor([2.0, 3.0])}, "class_weight: class 1's weight is an array of shape (2,), not one number."),
    ([1, [2, 3], 1], "class_weight: weight 1 is a list of 2, not one number."),
    ({1, 2}, "class_weight: expected {class: weight} or one weight a class, got set."),
])
def test_class_weight_of_an_odd_kind_is_one_sentence(tmp_path, weights, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        fit(_model(), _data(), run_dir=tmp_path / "r", overrides=OV, class_weight=weights)
    assert not (tmp_path / "r").exists()


def test_class_weight_of_kinds_that_name_one_number_reads_the_number():
    assert _class_weights({np.int64(1): np.float32(2), 2.0: torch.tensor(3.0)}, 3) == (1.0, 2.0, 3.0)
    assert _class_weights({torch.tensor(0): 4, "1": 2}, 2) == (4, 2)
    assert _class_weights(torch.tensor([1.0, 2.0]), 2) == (1.0, 2.0)


def test_class_weight_on_a_regression_says_there_are_no_classes(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("class_weight weighs classes, and these labels are floats (a "
                                                    "regression) with no classes")):
        fit(_model(1), _data(regression=True), run_dir=tmp_path / "r", overrides=OV, class_weight={0: 2},
            loss_fn=lambda out, y: ((out.squeeze(1) - y) ** 2).mean())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("size", [0, -4, 2.5, True, "64"])
def test_a_batch_size_that_is_not_a_batch_is_one_sentence(tmp_path, size):
    with pytest.raises(ConfigError, match=re.escape(f"batch_size: {size!r} is not a batch; Keras's batch_size is the "
                                                    "global batch, a whole number of 1 or more.")):
        fit(_model(), _data(), run_dir=tmp_path / "r", overrides=OV, batch_size=size)
    assert not (tmp_path / "r").exists()


def test_a_numpy_batch_size_is_a_batch(tmp_path):
    summary = fit(_model(), _data(), run_dir=tmp_path / "r", overrides=OV, batch_size=np.int64(16))
    assert summary["steps"] == 3  # 48 samples, 16 a step
