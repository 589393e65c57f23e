"""Strong augmentation and regularisation with timm's semantics: RandAugment, random erasing, mixup,
cutmix, drop path; and the model options the courses need (model.init, VGG's one-linear head,
finetune.freeze all_but_last:N).

Every run pins fp32, one thread per process and deterministic kernels."""
import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from brickyard import api, models
from brickyard.config import load_config
from brickyard.config.checks import rand_augment_policy
from brickyard.data import augment, randaugment
from brickyard.errors import ConfigError
from brickyard.models import droppath
from brickyard.models.finetune import all_but_last, layers
from brickyard.training import checkpoint
from conftest import ACROSS_ORDERS, SYNTH, run_cli, sets


def _images(n=6, c=3, h=12, w=10, seed=0):
    return torch.randint(0, 256, (n, c, h, w), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _one(name, img: torch.Tensor, level=9.0, sign=1.0):
    fn = randaugment.FUNCTIONS[name]
    out = fn(img[None].float() / 255, torch.tensor([level]), torch.tensor([sign]), torch.tensor([0.5, 0.5, 0.5]))
    return (out[0] * 255).round().to(torch.uint8)


def _pil(img: torch.Tensor) -> Image.Image:
    return Image.fromarray(img.permute(1, 2, 0).numpy(), "RGB")


def _back(im: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("name, pil", [
    ("Equalize", ImageOps.equalize), ("AutoContrast", ImageOps.autocontrast), ("Invert", ImageOps.invert),
    ("Solarize", lambda im: ImageOps.solarize(im, int(9 / 10 * 256))),
    ("Posterize", lambda im: ImageOps.posterize(im, int(9 / 10 * 4))),
])
@pytest.mark.fast
def test_pointwise_operations_are_pils_at_timms_magnitudes(name, pil):
    img = _images(1, h=16, w=16, seed=3)[0]
    img[:, 0, 0] = 0  # a full range, so autocontrast has something to stretch but not everything
    img[:, 1, 1] = 250
    assert torch.equal(_one(name, img), _back(pil(_pil(img))))


@pytest.mark.fast
def test_translate_by_a_whole_number_of_pixels_moves_the_image_and_fills_with_the_mean():
    img = _images(1, c=1, h=20, w=20, seed=4)[0]
    # TranslateXRel at magnitude m moves by 0.45 * m / 10 of the width: m = 10/0.45*0.1 -> 2 pixels
    level = 2 / 20 / 0.45 * 10
    out = randaugment.FUNCTIONS["TranslateXRel"](img[None].float() / 255, torch.tensor([level]), torch.tensor([1.0]),
                                                 torch.tensor([0.25]))[0]
    assert torch.allclose(out[:, :, :-2], img[:, :, 2:].float() / 255, atol=1e-5)  # PIL: output x samples input x + 2
    assert torch.allclose(out[:, :, -2:], torch.full_like(out[:, :, -2:], 0.25))


@pytest.mark.fast
def test_rand_augment_policies_parse_as_timm_and_bad_ones_say_which_part():
    assert rand_augment_policy("n2-m9") == (2, 9.0, 0.0)
    assert rand_augment_policy("rand-m9-mstd0.5") == (2, 9.0, 0.5)
    assert rand_augment_policy("rand-n3-m7-mstd101")[2] == math.inf
    for bad, says in [("n2-x9", "'x9' is not one of nN"), ("n0-m9", "1 to 16"), ("m99", "at most 30")]:
        with pytest.raises(ConfigError, match=says):
            rand_augment_policy(bad)
    with pytest.raises(ConfigError, match="data.rand_augment: 'n2-q9'"):
        load_config("mnist", ["data.rand_augment=n2-q9"])  # said when the config is read, before any run starts


def _prep(**strong):
    s = augment.Strong(**strong)
    if "rand_augment" in strong:
        s.rand_augment = randaugment.RandAugment(strong["rand_augment"], (0.5, 0.5, 0.5))
    return augment.DevicePrep((0.5,), (0.25,), "crop-flip", 2, seed=7, strong=s)


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("name", randaugment.OPS)
@pytest.mark.fast
def test_every_operation_keeps_shape_and_range_grey_and_colour(name, channels):
    x = _images(4, c=channels, seed=9).float() / 255
    out = randaugment.FUNCTIONS[name](x.clone(), torch.tensor([9.0, 3.0, 10.0, 0.0]), torch.tensor([1.0, -1.0, 1.0, -1.0]),
                                      torch.full((channels,), 0.5))
    assert out.shape == x.shape and out.dtype == x.dtype and out.min() >= -1e-6 and out.max() <= 1 + 1e-6


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("strong", [dict(rand_augment="n2-m9"), dict(erasing=0.5), dict(rand_augment="rand-m9-mstd0.5", erasing=0.5)])
@pytest.mark.fast
def test_per_image_augmentation_draws_for_the_global_batch(strong, channels):
    """Two ranks' halves, prepared apart, are the whole batch prepared at once; the same step draws the same."""
    x = _images(9, c=channels, seed=5)
    prep = _prep(**strong)
    whole = prep(x, step=3, n_global=9)
    halves = torch.cat([prep(x[:5], step=3, n_global=9, offset=0), prep(x[5:], step=3, n_global=9, offset=5)])
    assert whole.shape == (9, channels, 12, 10) and whole.dtype == torch.float32 and torch.isfinite(whole).all()
    assert torch.equal(whole, halves) and torch.equal(whole, prep(x, step=3, n_global=9))
    assert not torch.equal(whole, prep(x, step=4, n_global=9))
    plain = augment.DevicePrep((0.5,), (0.25,), "crop-flip", 2, seed=7)(x, step=3, n_global=9)
    assert not torch.equal(whole, plain)  # it did something


@pytest.mark.fast
def test_random_erasing_puts_one_noise_rectangle_of_2_to_33_percent_in_each_chosen_image():
    x = torch.zeros(64, 1, 28, 28)
    gen = torch.Generator()
    gen.manual_seed(1)
    out = augment.random_erasing(x, 1.0, gen, 64, 0, 123)
    changed = out != 0
    for img in changed[:, 0]:
        rows, cols = img.any(1).nonzero().squeeze(1), img.any(0).nonzero().squeeze(1)
        h, w = int(rows[-1] - rows[0] + 1), int(cols[-1] - cols[0] + 1)
        assert img.sum() == h * w  # one filled rectangle (normal noise is never exactly 0)
        assert 0.3 <= (h * w) / (0.02 * 784) and h * w <= 784 / 3 * 1.2 and h < 28 and w < 28
    assert torch.equal(augment.random_erasing(x, 0.0, gen, 64, 0, 123), x)
    gen.manual_seed(1)
    assert torch.equal(augment.random_erasing(x, 1.0, gen, 64, 0, 123), out)
    gen.manual_seed(1)  # the same noise in the same places whatever the memory layout, colour too
    rgb = torch.zeros(64, 3, 12, 10)
    plain = augment.random_erasing(rgb, 1.0, gen, 64, 0, 5)
    gen.manual_seed(1)
    assert torch.equal(augment.random_erasing(rgb.contiguous(memory_format=torch.channels_last), 1.0, gen, 64, 0, 5), plain)
    assert ((plain != 0).sum((1, 2, 3)) % 3 == 0).all() and torch.equal(plain[:, 0] != 0, plain[:, 2] != 0)


def _mixed(mixup, cutmix, n=8, seed=0):
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 8, 8).contiguous()
    y = torch.arange(n) % 5
    return x, y, augment.mix(x, y, augment.Strong(mixup=mixup, cutmix=cutmix, num_classes=5), random.Random(seed), n, 0)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.fast
def test_mixup_blends_each_image_with_its_mirror_in_the_batch_and_the_targets_with_it(seed):
    x, y, (mx, my) = _mixed(0.4, 0.0, seed=seed)
    lam = float(mx[0, 0, 0, 0] - 7) / (0 - 7)  # image 0 mixed with image 7
    assert 0 <= lam <= 1
    assert torch.allclose(mx, x * lam + x.flip(0) * (1 - lam))
    assert torch.allclose(my.sum(1), torch.ones(8))  # label mass
    assert torch.allclose(my, F.one_hot(y, 5) * lam + F.one_hot(y.flip(0), 5) * (1 - lam))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.fast
def test_cutmix_pastes_one_box_and_the_label_share_is_the_pixel_share(seed):
    x, y, (mx, my) = _mixed(0.0, 1.0, seed=seed)
    pasted = (mx != x).float().mean((1, 2, 3))  # images 0..7 take pixels of 7..0, which differ
    assert torch.allclose(my.sum(1), torch.ones(8))
    share = pasted.view(8, 1)
    assert torch.allclose(my, F.one_hot(y, 5) * (1 - share) + F.one_hot(y.flip(0), 5) * share, atol=1e-6)
    assert len(set(pasted.tolist())) == 1 and 0 < pasted[0] < 1  # one box for the batch (timm's batch mode)


@pytest.mark.fast
def test_both_switch_between_mixup_and_cutmix_and_smoothing_is_timms():
    kinds = set()
    for seed in range(20):
        x, _, (mx, _) = _mixed(0.4, 1.0, seed=seed)
        kinds.add("cutmix" if ((mx == x) | (mx == x.flip(0))).all() else "mixup")
    assert kinds == {"mixup", "cutmix"}
    # timm's mixup_target with smoothing then SoftTargetCrossEntropy = torch's cross-entropy on the mixed
    # probabilities with label_smoothing
    logits, lam, eps = torch.randn(8, 5), 0.3, 0.1
    y = torch.arange(8) % 5
    off, on = eps / 5, 1 - eps + eps / 5
    timm_target = (F.one_hot(y, 5) * (on - off) + off) * lam + (F.one_hot(y.flip(0), 5) * (on - off) + off) * (1 - lam)
    timm_loss = (-timm_target * logits.log_softmax(-1)).sum(-1).mean()
    mixed = F.one_hot(y, 5).float() * lam + F.one_hot(y.flip(0), 5).float() * (1 - lam)
    assert torch.allclose(F.cross_entropy(logits, mixed, label_smoothing=eps), timm_loss, atol=1e-6)


@pytest.mark.fast
def test_drop_path_drops_whole_samples_draws_for_the_global_batch_and_is_off_in_evaluation():
    layer = droppath.DropPath(0.5, index=3).train()
    x = torch.ones(10, 4)
    with droppath.batch(99, 10, 0):
        whole = layer(x)
    with droppath.batch(99, 10, 0):
        first = layer(x[:6])
    with droppath.batch(99, 10, 6):
        second = layer(x[6:])
    assert torch.equal(whole, torch.cat([first, second]))
    assert set(whole.unique().tolist()) <= {0.0, 2.0} and (whole == 0).any() and (whole == 2).any()
    assert torch.equal(layer.eval()(x), x)
    assert droppath.rates(0.2, 8)[0] == 0 and droppath.rates(0.2, 8)[-1] == pytest.approx(0.2)
    net = models.create("resnet18", 10, 1, (16, 16), drop_path=0.1)
    ps = [m.p for m in net.modules() if isinstance(m, droppath.DropPath)]
    assert len(ps) == 7 and ps[-1] == pytest.approx(0.1)  # 8 blocks, the first at rate 0 has none
    vit = models.create("vit_tiny", 10, 1, (8, 8), patch_size=4, drop_path=0.2)
    assert sum(isinstance(m, droppath.DropPath) for m in vit.modules()) == 22  # 2 per block, 11 blocks above rate 0
    torch.manual_seed(0)
    plain = models.create("resnet18", 10, 1, (16, 16))
    torch.manual_seed(0)
    assert list(plain.state_dict()) == list(models.create("resnet18", 10, 1, (16, 16), drop_path=0.1).state_dict())


STRONG = [s for s in SYNTH if not s.startswith(("data.batch_size", "model.name"))] + [
    "data.global_batch_size=50", "train.deterministic=true", "train.max_steps=6", "train.epochs=10",
    "data.augment=crop-flip", "data.synthetic.channels=3", "data.synthetic.height=8", "data.synthetic.width=8",
    "data.rand_augment=n2-m9", "data.random_erasing=0.5", "data.mixup=0.4", "data.cutmix=1.0",
    "optim.label_smoothing=0.1", "model.name=vit_tiny", "model.patch_size=4", "model.drop_path=0.2",
    "checkpoint.every_steps=3", "checkpoint.keep_last=10"]


def _weights(run, step=None):
    files = checkpoint.step_checkpoints(run / "checkpoints")
    pick = files[-1] if step is None else [f for f in files if f.name == f"step-{step:07d}.pt"][0]
    return checkpoint.load(pick)["model"]


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_every_strong_augmentation_trains_the_same_on_one_and_two_processes_and_resumes_exactly(tmp_path):
    """50 images a step split 25-25; every draw is the global batch's; mixing gathers the other rank's images."""
    one = tmp_path / "one"
    api.train_config(load_config("mnist", STRONG), one)
    r = run_cli("train", "mnist", *sets(*STRONG), "--devices", "cpu:2", "--run-dir", str(tmp_path / "two"))
    assert r.returncode == 0, r.stderr
    assert _diff(_weights(one), _weights(tmp_path / "two")) < ACROSS_ORDERS
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    (resumed / "checkpoints" / "step-0000003.pt").write_bytes((one / "checkpoints" / "step-0000003.pt").read_bytes())
    api.train_config(load_config("mnist", STRONG), resumed, resume="auto")
    assert all(torch.equal(a, b) for a, b in zip(_weights(one).values(), _weights(resumed).values()))
    summary = json.loads((one / "summary.json").read_text())
    assert summary["steps"] == 6 and 0 <= summary["test_accuracy"] <= 1


@pytest.mark.fast
def test_model_init_sets_every_conv_and_linear_layer():
    torch.manual_seed(0)
    net = models.initialise(models.create("lenet", 10, 1, (28, 28)), "normal:0.01")
    weights = torch.cat([m.weight.flatten() for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))])
    assert abs(weights.std().item() - 0.01) < 0.001 and abs(weights.mean().item()) < 0.001
    assert all((m.bias == 0).all() for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))
    fc = models.initialise(models.create("mlp", 10, 1, (28, 28)), "xavier").fc1
    bound = math.sqrt(6 / (fc.in_features + fc.out_features))
    assert fc.weight.abs().max() <= bound and fc.weight.abs().max() > 0.9 * bound
    for bad in ["normal", "normal:-1", "gaussian", "xavier:2"]:
        with pytest.raises(ConfigError, match="model.init"):
            models.initialise(models.create("mlp", 10, 1, (28, 28)), bad)


def test_vgg_one_linear_head_trains_saves_and_reloads(tmp_path):
    net = models.create("vgg16", 10, 3, (32, 32), head="linear")
    assert [type(m).__name__ for m in net.classifier] == ["Linear"] and net(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert models.count_parameters(net) < 15_000_000 < models.count_parameters(models.create("vgg16", 10, 3, (32, 32)))
    with pytest.raises(ConfigError, match="model.head: mlp does not take it"):
        models.create("mlp", 10, 1, (28, 28), head="linear")
    run = tmp_path / "r"
    cfg = [s for s in SYNTH if not s.startswith("model.name")] + [
        "model.name=vgg16", "model.head=linear", "data.synthetic.channels=3", "data.synthetic.height=32",
        "data.synthetic.width=32", "data.synthetic.num_train=64", "train.max_steps=1", "train.plots=false"]
    api.train_config(load_config("mnist", cfg), run)
    model, _, _ = checkpoint.load_model(run)
    assert [type(m).__name__ for m in model.classifier] == ["Linear"]


def test_freeze_all_but_the_last_n_layers(tmp_path):
    net = models.create("resnet18", 10, 3, (32, 32))
    assert layers(net)[-1] == "fc" and layers(net)[-2] == "layer4.1.bn2"
    assert set(n for n, _ in net.named_parameters()) - set(all_but_last(net, "all_but_last:1")) == {"fc.weight", "fc.bias"}
    for bad in ["all_but_last:0", "all_but_last:x", "all_but_last:999", "all_but_lastx:1"]:
        with pytest.raises(ConfigError, match="all_but_last:N"):
            all_but_last(net, bad)
    run = tmp_path / "r"
    r = run_cli("train", "mnist", *sets(*SYNTH, "train.max_steps=2", "finetune.freeze=[all_but_last:2]"),
                "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert "frozen: 2 parameter tensors (200,960 values) by all_but_last:2" in r.stdout  # mlp: fc1 | fc2, fc
    r = run_cli("train", "mnist", *sets(*SYNTH, "finetune.freeze=[all_but_last:9]"), "--run-dir", str(tmp_path / "bad"))
    assert r.returncode == 2 and r.stderr.startswith("error: finetune.freeze: 'all_but_last:9'") and not (tmp_path / "bad").exists()


@pytest.mark.fast
def test_mixup_works_on_any_inputs_and_the_image_augmentations_say_they_need_images(tmp_path):
    from brickyard.errors import BrickyardError
    g = torch.Generator().manual_seed(0)
    points, labels = torch.randn(256, 2, generator=g), torch.randint(0, 2, (256,), generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    base = {"train": {"device": "cpu", "precision": "fp32", "threads": 1, "progress": "none", "plots": False,
                      "tensorboard": False, "epochs": 1}, "data": {"batch_size": 32}}
    summary = api.fit(model, (points, labels), config={**base, "data": {"batch_size": 32, "mixup": 0.2}}, run_dir=tmp_path / "a")
    assert summary["steps"] == 8
    for key, value in [("cutmix", 1.0), ("random_erasing", 0.5), ("rand_augment", "n2-m9")]:
        with pytest.raises(BrickyardError, match=f"data.{key}: .* works on images \\(N x C x H x W\\); these inputs are N x 2"):
            api.fit(model, (points, labels), config={**base, "data": {"batch_size": 32, key: value}}, run_dir=tmp_path / key)
        assert not (tmp_path / key / "checkpoints").exists()


def test_the_strong_augmentations_train_on_an_image_folder_of_jpeg_photos(tmp_path):
    """The streaming loader's batches (decoded by workers, uint8) go through the same device-side path."""
    from brickyard.data.photos import make_photo_folder
    make_photo_folder(tmp_path / "photos", classes=3, per_class={"train": 6, "test": 3}, seed=2, min_size=64, max_size=96)
    r = run_cli("train", "mnist", *sets(
        "data.name=imagefolder", f"data.root={tmp_path / 'photos'}", "data.train_transforms=[random_resized_crop:32, hflip]",
        "data.eval_transforms=[resize:36, center_crop:32]", "data.global_batch_size=6", "data.num_workers=1",
        "model.name=resnet18", "model.drop_path=0.1", "data.rand_augment=n2-m9", "data.random_erasing=0.5",
        "data.mixup=0.2", "data.cutmix=1.0", "train.max_steps=3", "train.precision=fp32", "train.threads=2",
        "train.progress=none", "train.plots=false", "train.tensorboard=false"), "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 3
