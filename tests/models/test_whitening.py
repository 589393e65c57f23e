"""``model.whiten``: the first convolution set from the training images' patches and frozen. fp32, one
thread per process, synthetic data unless a test says otherwise."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import brickyard
import brickyard.errors
from brickyard.config import load_config
from brickyard.data import build_data
from brickyard.models import whitening
from brickyard.training import checkpoint
from conftest import ACROSS_ORDERS, SYNTH, run_cli, sets

WHITE = SYNTH + ["model.name=mnist_fast", "model.whiten=true", "train.deterministic=true", "train.max_steps=8",
                 "train.epochs=10", "schedule.name=constant", "data.augment=shift", "train.plots=false",
                 "data.global_batch_size=32"]


def _smooth(n, c, size, seed=0):
    """Images whose neighbouring pixels correlate, as in photos (noise blurred), so whitening has work to do."""
    g = torch.Generator().manual_seed(seed)
    return F.avg_pool2d(torch.randn(n, c, size + 2, size + 2, generator=g), 3, stride=1)


@pytest.mark.parametrize("channels, kernel, out", [(1, 3, 16), (3, 3, 64), (3, 5, 20)])
@pytest.mark.fast
def test_the_filters_give_the_convolution_uncorrelated_unit_variance_outputs(channels, kernel, out):
    """Convolving with the filters (the weight's own C x kh x kw layout) decorrelates what they read: the
    first half's outputs have the identity as covariance (up to eps), the second half is their negative."""
    x = _smooth(200, channels, 20)
    d = channels * kernel * kernel
    w = whitening.whitening_filters(whitening.patch_covariance(x, (kernel, kernel)), out)
    pairs = min(out // 2, d)
    assert w.shape == (2 * pairs, d)
    assert torch.equal(w[pairs:], -w[:pairs])
    y = F.conv2d(x, w.view(-1, channels, kernel, kernel)[:pairs]).permute(0, 2, 3, 1).reshape(-1, pairs).double()
    cov = y.T @ y / len(y)
    eig = torch.linalg.eigvalsh(whitening.patch_covariance(x, (kernel, kernel))).flip(0)[:pairs]
    assert torch.allclose(cov, torch.diag(eig / (eig + whitening.EPS)), atol=2e-3)  # whitened, less eps's share


@pytest.mark.fast
def test_on_large_images_patches_are_strided_and_the_estimate_holds(monkeypatch):
    x = _smooth(8, 3, 64, seed=1)
    full = whitening.patch_covariance(x, (7, 7))
    monkeypatch.setattr(whitening, "_WORK", 1e8)  # 8 x 58 x 58 patches x 147^2 is 5.8e9: every 8th pixel or so
    strided = whitening.patch_covariance(x, (7, 7))
    assert (strided - full).norm() / full.norm() < 0.1


def _conv1(run):
    return checkpoint.load(checkpoint.step_checkpoints(run / "checkpoints")[-1])["model"]


def test_training_keeps_the_whitened_filters_on_one_and_two_processes_and_resumes_exactly(tmp_path):
    cfg = load_config("mnist", WHITE)
    data = build_data(cfg.data)
    want = whitening.whitening_filters(
        whitening.patch_covariance(whitening._images(data, whitening.IMAGES), (5, 5)), 16).view(16, 1, 5, 5)
    one = tmp_path / "one"
    r = run_cli("train", "mnist", *sets(*WHITE), "--run-dir", str(one))
    assert r.returncode == 0, r.stderr
    assert ("model.whiten: conv1's 16 filters whiten its 1x5x5 patches (8 principal directions of 512 training images, "
            "and their negatives), frozen") in r.stdout
    last = _conv1(one)
    assert torch.allclose(last["conv1.weight"], want, atol=1e-6)
    two = tmp_path / "two"
    r = run_cli("train", "mnist", *sets(*WHITE), "--devices", "cpu:2", "--run-dir", str(two))
    assert r.returncode == 0, r.stderr
    b = _conv1(two)
    assert torch.equal(b["conv1.weight"], last["conv1.weight"])
    assert max((last[k] - b[k]).abs().max().item() for k in last) < ACROSS_ORDERS
    cut = tmp_path / "cut"
    r = run_cli("train", "mnist", *sets(*WHITE, "train.max_steps=3"), "--run-dir", str(cut))
    assert r.returncode == 0, r.stderr
    early = _conv1(cut)
    assert torch.equal(early["conv1.weight"], last["conv1.weight"])
    assert not torch.equal(early["conv1.bias"], last["conv1.bias"])  # the bias trains
    r = run_cli("train", "--run-dir", str(cut), "--resume", "auto", "--set", "train.max_steps=8")
    assert r.returncode == 0, r.stderr
    c = _conv1(cut)
    assert all(torch.equal(c[k], last[k]) for k in last)


def test_what_cannot_be_whitened_is_one_sentence_and_writes_nothing(tmp_path):
    r = run_cli("train", "mnist", *sets(*SYNTH, "model.whiten=true"), "--run-dir", str(tmp_path / "mlp"))
    assert r.returncode != 0
    assert r.stderr.strip() == "error: model.whiten sets a model's first convolution from the data, and mlp has none; turn it off."
    assert not (tmp_path / "mlp" / "checkpoints").exists()
    src = tmp_path / "src"
    assert run_cli("train", "mnist", *sets(*WHITE), "--run-dir", str(src)).returncode == 0
    r = run_cli("train", "mnist", *sets(*WHITE, f"finetune.init_from={src}/checkpoints/last.pt"), "--run-dir", str(tmp_path / "ft"))
    assert r.returncode != 0 and r.stderr.strip().startswith("error: model.whiten sets the first convolution from the data and "
                                                              "finetune.init_from loads it from"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.fast
def test_fit_whitens_a_users_model_on_float_tensors(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 2))
    x, y = _smooth(64, 3, 12), torch.arange(64) % 2
    brickyard.fit(model, (x, y), run_dir=tmp_path / "r",
                  overrides=["model.whiten=true", "train.max_steps=4", "train.device=cpu", "train.precision=fp32",
                             "train.progress=none", "train.plots=false", "data.batch_size=16"])
    want = whitening.whitening_filters(whitening.patch_covariance(x, (3, 3)), 8).view(8, 3, 3, 3)
    assert not model[0].weight.requires_grad and torch.allclose(model[0].weight, want, atol=1e-6)
    assert model[0].bias.requires_grad


def test_an_image_folder_is_whitened_from_its_first_images_with_the_same_draws_everywhere(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for c in ("a", "b"):
            (tmp_path / "pics" / split / c).mkdir(parents=True)
            for i in range(6):
                Image.fromarray((rng.random((20, 24, 3)) * 255).astype(np.uint8)).save(tmp_path / "pics" / split / c / f"{i}.png")
    items = ["data.name=imagefolder", f"data.root={tmp_path / 'pics'}", "data.train_transforms=[random_resized_crop:16, hflip]",
             "data.eval_transforms=[resize:16x16]", "model.name=mnist_cnn", "model.whiten=true", "train.device=cpu",
             "train.precision=fp32", "train.progress=none", "train.plots=false", "train.max_steps=2", "data.batch_size=4",
             "data.num_workers=0"]
    cfg = load_config("mnist", items)
    data = build_data(cfg.data)
    assert torch.equal(whitening._images(data, 100), whitening._images(data, 100))  # the crops' draws are the image's own
    r = run_cli("train", "mnist", *sets(*items), "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert "model.whiten: conv1's 20 filters whiten its 3x5x5 patches (10 principal directions of 12 training images" in r.stdout
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 2


@pytest.mark.fast
def test_stranger_floats_are_one_sentence_and_big_images_are_read_in_part(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    x, y = torch.rand(16, 1, 8, 8), torch.arange(16) % 2
    x[3, 0, 4, 4] = float("nan")
    with pytest.raises(brickyard.errors.DataError, match=r"^model.whiten: the first 16 training images hold NaN or infinite values"):
        brickyard.fit(model, (x, y), run_dir=tmp_path / "r", overrides=["model.whiten=true", "train.device=cpu",
                                                                        "train.precision=fp32", "train.progress=none"])
    assert not (tmp_path / "r" / "checkpoints").exists()
    from brickyard.data import from_user
    big = from_user((torch.zeros(400, 3, 224, 224, dtype=torch.uint8), torch.arange(400) % 2))
    assert whitening.images_used(big) == 332  # 5e7 values of 150,528 each, not 400 (nor airbench's 5,000)
