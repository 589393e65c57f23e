"""Class weights in the training loss, as Keras's ``fit(class_weight=)`` weighs it: each sample's cross-entropy
(label smoothing included) times its class's weight, summed and divided by the batch; evaluation unweighted.
fp32, one thread, a fixed seed."""
import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from brickyard import fit
from brickyard.errors import ConfigError
from conftest import SYNTH, run_cli, sets

OV = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.epochs=2", "train.plots=false",
      "train.tensorboard=false", "data.batch_size=16", "optim.label_smoothing=0.1", "train.seed=3"]


def _data():
    torch.manual_seed(0)
    x = torch.randn(96, 4)
    return x, (x @ torch.randn(4, 3)).argmax(1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


@pytest.mark.fast
def test_class_weight_is_kerass_weighted_loss_and_leaves_evaluation_unweighted(tmp_path):
    """``class_weight={2: 4.0}`` trains the weights of a loss_fn that writes Keras's formula out by hand
    (class_weight_to_sample_weights, then sum_over_batch_size); torch's own ``weight=`` would not (it divides by
    the weights' sum). The validation loss is the plain cross-entropy of the trained model."""
    x, y = _data()
    weighted = _model()
    s = fit(weighted, (x[:80], y[:80]), (x[80:], y[80:]), run_dir=tmp_path / "weighted", overrides=OV,
            class_weight={2: 4.0})
    w = torch.tensor([1.0, 1.0, 4.0])

    def keras(out, t):
        return (F.cross_entropy(out, t, reduction="none", label_smoothing=0.1) * w[t]).sum() / len(t)

    by_hand = _model()
    fit(by_hand, (x[:80], y[:80]), run_dir=tmp_path / "by-hand", overrides=OV, loss_fn=keras)
    assert all(torch.allclose(weighted.state_dict()[k], by_hand.state_dict()[k], atol=1e-6) for k in by_hand.state_dict())
    plain = _model()
    fit(plain, (x[:80], y[:80]), run_dir=tmp_path / "plain", overrides=OV)
    assert not torch.allclose(plain.state_dict()["2.bias"], weighted.state_dict()["2.bias"], atol=1e-3)
    with torch.no_grad():
        val_loss = F.cross_entropy(weighted(x[80:]), y[80:]).item()
    assert s["val_loss"] == pytest.approx(val_loss, rel=1e-4)
    assert "class_weights:\n  - 1.0\n  - 1.0\n  - 4.0" in (tmp_path / "weighted" / "config.yaml").read_text()
    again = _model()
    fit(again, (x[:80], y[:80]), run_dir=tmp_path / "sequence", overrides=OV, class_weight=np.array([1.0, 1.0, 4.0]))
    assert all(torch.equal(again.state_dict()[k], weighted.state_dict()[k]) for k in again.state_dict())


def test_weights_of_one_change_nothing_from_the_cli_and_bad_ones_are_one_sentence(tmp_path):
    ones = run_cli("train", *sets(*SYNTH, "train.max_steps=6", "optim.class_weights=[1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"),
                   "--run-dir", str(tmp_path / "ones"))
    plain = run_cli("train", *sets(*SYNTH, "train.max_steps=6"), "--run-dir", str(tmp_path / "plain"))
    assert ones.returncode == 0 and plain.returncode == 0, ones.stderr + plain.stderr
    a, b = (json.loads((tmp_path / k / "summary.json").read_text()) for k in ("ones", "plain"))
    assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    mixed = run_cli("train", *sets(*SYNTH, "train.max_steps=6", "data.mixup=0.2", "data.cutmix=1.0",
                                   "optim.class_weights=[1, 1, 1, 1, 1, 1, 1, 1, 1, 5]"), "--run-dir", str(tmp_path / "mixed"))
    assert mixed.returncode == 0, mixed.stderr  # mixed targets weigh by their larger share, as Keras's argmax
    for value, said in (("[1, 2]", "optim.class_weights has 2 weights and the data has 10 classes; give one a class."),
                        ("[1, 1, 1, 1, 1, 1, 1, 1, 1, -1]", "optim.class_weights: -1 is not a weight")):
        r = run_cli("train", *sets(*SYNTH, f"optim.class_weights={value}"), "--run-dir", str(tmp_path / "bad"))
        assert r.returncode == 2 and r.stderr.strip().startswith(f"error: {said}"), r.stderr
        assert not (tmp_path / "bad").exists()
    x, y = _data()
    for kwargs, said in ((dict(class_weight={5: 2.0}), "class_weight: class 5 is outside the data's classes 0..2."),
                         (dict(class_weight={"a": 2.0}), "class_weight: the key 'a' is not a class index."),
                         (dict(class_weight={1: 2.0}, loss_fn=F.cross_entropy),
                          "optim.class_weights weigh the default cross-entropy and this run has its own loss_fn")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            fit(_model(), (x, y), run_dir=tmp_path / "r", overrides=OV, **kwargs)
        assert not (tmp_path / "r").exists()
