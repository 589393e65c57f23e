"""Test-time augmentation (data.tta): the views, their mean, and that training, `brickyard eval` and every
world size score the same images the same way. fp32, one thread a process."""
import json
import math

import pytest
import torch

from brickyard import api
from brickyard.config import load_config
from brickyard.data import Split
from brickyard.data.augment import DevicePrep
from brickyard.errors import BrickyardError
from brickyard.training.evaluation import evaluate, tta_logits
from conftest import SYNTH, run_cli, sets


class Columns(torch.nn.Module):
    """Logits that are the image's column sums: a mirror image reverses them, a shift moves them."""
    def forward(self, x):
        return x.sum(dim=(1, 2))


COLUMNS = Columns()


def _mean_probs(views, model=COLUMNS):
    return torch.log(torch.stack([torch.softmax(model(v), 1) for v in views]).mean(0))


@pytest.mark.fast
def test_flip_averages_the_probabilities_of_the_image_and_its_mirror():
    x = torch.randn(3, 1, 5, 6, generator=torch.Generator().manual_seed(0))
    got = tta_logits(Columns(), x, "flip", 1)
    assert torch.allclose(got, _mean_probs([x, x.flip(3)]), atol=1e-6)
    assert torch.allclose(got.exp().sum(1), torch.ones(3))  # probabilities: the cross-entropy reads them as logits


@pytest.mark.fast
def test_flip_shift_adds_both_moved_each_way_with_zeros_filled_in():
    x = torch.randn(2, 1, 5, 6, generator=torch.Generator().manual_seed(1))
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    moved = [padded[:, :, 2 + dy:7 + dy, 2 + dx:8 + dx] for dy, dx in ((-2, 0), (2, 0), (0, -2), (0, 2))]
    views = [x, x.flip(3)] + [w for v in moved for w in (v, v.flip(3))]
    assert torch.allclose(tta_logits(Columns(), x, "flip-shift", 2), _mean_probs(views), atol=1e-6)
    assert torch.allclose(tta_logits(Columns(), x, "flip-shift", 0), _mean_probs([x, x.flip(3)]), atol=1e-6)


@pytest.mark.fast
def test_a_channels_last_batch_stays_channels_last_in_every_view():
    seen = []

    class Record(torch.nn.Module):
        def forward(self, x):
            seen.append(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous())
            return x.mean(dim=(2, 3))
    x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
    tta_logits(Record(), x, "flip-shift", 1)
    assert len(seen) == 10 and all(seen[2:])  # the moved views are copied in the batch's own layout


@pytest.mark.fast
def test_evaluation_scores_each_image_once_with_the_views_mean():
    g = torch.Generator().manual_seed(2)
    images, labels = torch.randint(0, 256, (23, 1, 4, 5), dtype=torch.uint8, generator=g), torch.randint(0, 5, (23,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(20, 5))  # mirror images score differently
    prep = DevicePrep((0.5,), (0.25,))
    r = evaluate(model, Split(images, labels), prep, torch.device("cpu"), "fp32", 10, 5, tta="flip")
    x = prep(images)
    with torch.no_grad():
        logp = _mean_probs([x, x.flip(3)], model)
        plain = evaluate(model, Split(images, labels), prep, torch.device("cpu"), "fp32", 10, 5)
    assert r["accuracy"] == pytest.approx((logp.argmax(1) == labels).float().mean().item())
    assert r["loss"] == pytest.approx(torch.nn.functional.nll_loss(logp, labels).item(), rel=1e-5)
    assert r["loss"] != pytest.approx(plain["loss"]) and sum(map(sum, r["confusion"])) == 23


TTA_RUN = [s for s in SYNTH if not s.startswith(("data.synthetic.num_test", "data.batch_size"))] + [
    "data.synthetic.num_test=101", "data.global_batch_size=32", "data.augment=crop-flip", "data.shift=1",
    "data.tta=flip-shift", "train.max_steps=6", "train.plots=false", "train.tensorboard=false"]


def test_training_eval_and_two_processes_score_the_test_set_alike(tmp_path):
    """101 test images on 2 processes (51 + 50): the same accuracy and loss as on one, and as `brickyard eval`,
    which takes data.tta from the checkpoint's config."""
    one = api.train_config(load_config("mnist", TTA_RUN), tmp_path / "one")
    r = run_cli("train", "mnist", *sets(*TTA_RUN), "--devices", "cpu:2", "--run-dir", str(tmp_path / "two"))
    assert r.returncode == 0, r.stderr
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["test_accuracy"] == one["test_accuracy"] and math.isclose(two["test_loss"], one["test_loss"], rel_tol=1e-5)
    again = api.evaluate_checkpoint(tmp_path / "one", "test", "cpu")
    assert again["accuracy"] == one["test_accuracy"] and math.isclose(again["loss"], one["test_loss"], rel_tol=1e-5)
    plain = api.train_config(load_config("mnist", TTA_RUN + ["data.tta=none"]), tmp_path / "plain")
    assert plain["test_loss"] != pytest.approx(one["test_loss"])  # the same weights scored another way


def test_tta_says_it_needs_images(tmp_path):
    points, labels = torch.randn(64, 2), torch.randint(0, 2, (64,))
    model = torch.nn.Linear(2, 2)
    config = {"train": {"device": "cpu", "precision": "fp32", "threads": 1, "progress": "none", "plots": False,
                        "tensorboard": False, "epochs": 1}, "data": {"batch_size": 32, "tta": "flip"}}
    with pytest.raises(BrickyardError, match=r"data.tta: 'flip' works on images \(N x C x H x W\); these inputs are N x 2"):
        api.fit(model, (points, labels), config=config, run_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "checkpoints").exists()
    r = run_cli("train", "mnist", *sets(*SYNTH, "data.tta=mirror"), "--run-dir", str(tmp_path / "bad"))
    assert r.returncode == 2 and r.stderr.startswith("error: data.tta") and not (tmp_path / "bad").exists()


@pytest.mark.fast
def test_five_crop_takes_the_corners_and_the_centre_scaled_back():
    """On a 16 x 16 image the crops are 14 x 14 at (0, 0), (0, 2), (2, 0), (2, 2) and (1, 1), each scaled back to
    16 x 16 (torchvision's FiveCrop, on the prepared image)."""
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    up = [torch.nn.functional.interpolate(x[:, :, i:i + 14, j:j + 14], size=(16, 16), mode="bilinear", align_corners=False)
          for i, j in ((0, 0), (0, 2), (2, 0), (2, 2), (1, 1))]
    assert torch.allclose(tta_logits(Columns(), x, "five-crop"), _mean_probs(up), atol=1e-6)


@pytest.mark.fast
def test_multi_scale_centres_a_smaller_image_in_zeros_and_crops_a_larger_one_each_with_its_mirror():
    seen = []

    class Record(torch.nn.Module):
        def forward(self, x):
            seen.append(x.clone())
            return x.mean(dim=(2, 3))
    x = torch.rand(1, 1, 16, 16) + 1  # no zeros of its own
    tta_logits(Record(), x, "multi-scale")
    assert len(seen) == 6 and all(v.shape == x.shape for v in seen)
    small, _, same, same_mirror, large, _ = seen
    assert (small[..., 0, :] == 0).all() and (small[..., 1:15, 1:15] > 0).all()  # 14 x 14 in a border of zeros
    assert torch.equal(same, x) and torch.equal(same_mirror, x.flip(3)) and (large > 0).all()


def test_predict_with_tta_gives_the_views_mean_and_refuses_layer_outputs(tmp_path):
    """`brickyard predict --tta five-crop` returns what the views' mean probabilities say (the checkpoint's own
    model, scored in-process against the same input); layer outputs and TTA together are one sentence."""
    import numpy as np

    from brickyard.tools.predict import predict
    run = tmp_path / "run"
    api.train_config(load_config("mnist", [*SYNTH, "train.max_steps=3", "train.plots=false"]), run)
    x = np.random.default_rng(0).integers(0, 256, (5, 28, 28, 1), dtype=np.uint8)
    np.save(tmp_path / "x.npy", x)
    r = run_cli("predict", str(run), str(tmp_path / "x.npy"), "--tta", "five-crop")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = predict(run, torch.from_numpy(x), tta="five-crop")
    plain = predict(run, torch.from_numpy(x))
    assert got["predicted"] == want["predicted"].tolist()
    assert not torch.allclose(want["probabilities"], plain["probabilities"])  # the views change the numbers
    bad = run_cli("predict", str(run), str(tmp_path / "x.npy"), "--tta", "flip", "--outputs", "0")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: tta: flip averages several views of each image, and layer outputs are of one view; predict without it.")
