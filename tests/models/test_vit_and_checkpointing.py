"""The vision transformer at the sizes users bring, and activation checkpointing: the same gradients
and batch-norm statistics as without it, fewer activations kept. CPU, fp32, one thread."""
import copy

import pytest
import torch
from torch import nn

from brickyard import api, models
from brickyard.config import load_config
from brickyard.errors import ConfigError
from brickyard.models.vit import auto_patch
from brickyard.training import activation_checkpointing as ac
from brickyard.training import memory


@pytest.mark.parametrize("size, patch", [((28, 28), 4), ((32, 32), 4), ((64, 64), 8), ((224, 224), 16)])
def test_vit_takes_images_from_28_to_224_px(size, patch):
    assert auto_patch(size) == patch
    torch.manual_seed(0)
    m = models.create("vit_tiny", 10, 1 if size == (28, 28) else 3, size)
    assert m.patch_size == patch and m.pos_embed.shape[1] == (size[0] // patch) * (size[1] // patch) + 1
    out = m(torch.randn(2, 1 if size == (28, 28) else 3, *size))
    assert out.shape == (2, 10)


def test_patch_size_is_a_model_key_and_a_wrong_one_is_one_sentence():
    assert models.create("vit_small", 10, 1, (28, 28), patch_size=7).patch_size == 7
    with pytest.raises(ConfigError, match="model.patch_size: 5 does not divide the image size 28x28"):
        models.create("vit_tiny", 10, 1, (28, 28), patch_size=5)
    with pytest.raises(ConfigError, match="model.patch_size: mnist_cnn does not take it \\(it applies to vit_tiny, vit_small\\)"):
        models.create("mnist_cnn", 10, 1, (28, 28), patch_size=4)
    with pytest.raises(ConfigError, match="no patch size in"):
        auto_patch((29, 29))


def _grads(model, x, y):
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name, size, channels", [("vit_tiny", (28, 28), 1), ("resnet18", (32, 32), 3)])
def test_checkpointing_keeps_the_gradients_and_statistics_and_saves_activations(name, size, channels):
    torch.manual_seed(0)
    plain = models.create(name, 10, channels, size).train()
    wrapped = copy.deepcopy(plain)
    names = ac.apply(wrapped, "auto")
    assert names and all(n.startswith(("blocks.", "layer")) for n in names)
    x, y = torch.randn(4, channels, *size), torch.randint(0, 10, (4,))
    want, got = _grads(plain, x, y), _grads(wrapped, x, y)
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-5  # measured 0 to 1e-7
    for k, v in plain.state_dict().items():  # batch norm ran once per forward, not twice
        assert torch.allclose(v.float(), wrapped.state_dict()[k].float(), atol=1e-6), k
    modules = dict(wrapped.named_modules())
    kept = memory.activation_bytes(wrapped, x, y, torch.device("cpu"), "fp32", [modules[n] for n in names])
    full = memory.activation_bytes(plain, x, y, torch.device("cpu"), "fp32")
    assert kept < full / 2, (kept, full)


@pytest.mark.fast
def test_patterns_name_modules_and_a_pattern_that_matches_nothing_is_one_sentence():
    m = models.create("vit_tiny", 10, 1, (28, 28))
    assert ac.apply(copy.deepcopy(m), ["blocks.1", "blocks.1.*"]) == ["blocks.1"]  # the inner ones are inside it
    assert ac.apply(copy.deepcopy(models.create("mnist_cnn")), "auto") == []
    with pytest.raises(ConfigError, match="train.activation_checkpointing: 'layers.\\*' matches no module of ViT"):
        ac.apply(m, ["layers.*"])


def test_a_vit_trains_with_checkpointing_from_the_config(tmp_path):
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 3, (64,))
    cfg = {"train": {"device": "cpu", "precision": "fp32", "threads": 1, "progress": "none", "plots": False,
                     "tensorboard": False, "epochs": 1, "activation_checkpointing": "blocks.*"},
           "data": {"batch_size": 16}}
    torch.manual_seed(0)
    s = api.fit(models.create("vit_tiny", 3, 1, (28, 28)), (x, y), config=cfg, run_dir=tmp_path / "r")
    assert s["steps"] == 4
    assert "activation checkpointing: 12 blocks (blocks.0, blocks.1" in (tmp_path / "r" / "train.log").read_text()
    assert load_config("mnist", ["train.activation_checkpointing=blocks.*"]).train.activation_checkpointing == ("blocks.*",)


def test_a_pattern_that_matches_nothing_writes_nothing(tmp_path):
    from conftest import SYNTH, run_cli, sets
    r = run_cli("train", *sets(*SYNTH, "train.activation_checkpointing=blocks.*"), "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stderr.startswith("error: train.activation_checkpointing: 'blocks.*' matches no module")
    assert not (tmp_path / "r").exists()
