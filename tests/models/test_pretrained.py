"""Published weights by name (``finetune.init_from: torchvision:resnet18``): torch.hub's download with its
hash check, against a loopback HTTP server; brickyard's cache; one sentence for each bad case.

The served file is a state dict made here (the model's own initial weights, changed), named as torchvision
names its files: the start of its SHA-256 after the last '-'. Pinned: fp32, one thread, 2 steps.
"""
import hashlib

import pytest
import torch

from brickyard import api, models
from brickyard.config import load_config
from brickyard.errors import CheckpointError, ConfigError
from brickyard.models import pretrained
from conftest import SYNTH, run_cli, sets


def _publish(www, monkeypatch, url, state: dict, corrupt: bool = False) -> str:
    """Serve ``state`` as torchvision names its resnet18 file; returns the file name."""
    tmp = www / "tmp.pth"
    torch.save(state, tmp)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()[:8]
    name = f"resnet18-{digest}.pth"
    data = tmp.read_bytes()
    (www / name).write_bytes(data[: len(data) // 2] if corrupt else data)
    monkeypatch.setenv("BRICKYARD_WEIGHTS_URL", url)
    monkeypatch.setitem(pretrained.PUBLISHED, "resnet18", ("resnet18_imagenet", name))
    return name


def test_weights_by_name_are_fetched_checked_cached_and_trained_from(http_folder, cache_dir, monkeypatch, tmp_path):
    www, url = http_folder
    torch.manual_seed(1)
    state = {k: v + 0.5 if v.is_floating_point() else v for k, v in models.create("resnet18_imagenet", 1000, 3, (32, 32)).state_dict().items()}
    name = _publish(www, monkeypatch, url, state)
    path = pretrained.fetch("torchvision:resnet18")
    assert path == cache_dir / "weights" / name and path.is_file()
    (www / name).unlink()  # cached now: no server needed
    cfg = load_config("mnist", SYNTH + ["data.synthetic.channels=3", "data.synthetic.height=32", "data.synthetic.width=32",
                                        "model.name=resnet18_imagenet", "finetune.init_from=torchvision:resnet18",
                                        "finetune.reset_head=true", "finetune.freeze=[conv1.*, bn1.*, layer1.*]",
                                        "train.max_steps=2", "train.plots=false", "optim.lr=0.0"])
    api.train_config(cfg, tmp_path / "run")
    from brickyard.training import checkpoint
    trained = checkpoint.load(checkpoint.step_checkpoints(tmp_path / "run" / "checkpoints")[-1])["model"]
    assert torch.equal(trained["layer2.0.conv1.weight"], state["layer2.0.conv1.weight"])  # lr 0: the published weights
    assert trained["fc.weight"].shape == (10, 512)  # a new head for 10 classes
    r = run_cli("train", *sets(*SYNTH, "data.synthetic.channels=3", "data.synthetic.height=32", "data.synthetic.width=32",
                               "model.name=resnet18_imagenet", "finetune.init_from=torchvision:resnet18",
                               "finetune.reset_head=true", "train.max_steps=1"),
                "--devices", "cpu:2", "--run-dir", str(tmp_path / "cli"), env={"BRICKYARD_CACHE": str(cache_dir)})
    assert r.returncode != 0  # torchvision's own file name: not in this cache, not on this server
    assert f"error: cannot download torchvision:resnet18 weights from {url}resnet18-f37072fd.pth (HTTP 404 File not found)" in r.stderr, r.stderr
    assert f"place it as {cache_dir / 'weights' / 'resnet18-f37072fd.pth'}" in r.stderr and not (tmp_path / "cli").exists()


@pytest.mark.fast
def test_a_file_that_fails_the_hash_check_is_one_sentence_and_not_kept(http_folder, cache_dir, monkeypatch):
    www, url = http_folder
    name = _publish(www, monkeypatch, url, {"w": torch.ones(1000)}, corrupt=True)
    with pytest.raises(CheckpointError, match=r"is not torchvision:resnet18's published weights \(invalid hash value"):
        pretrained.fetch("torchvision:resnet18")
    assert not (cache_dir / "weights" / name).exists()


@pytest.mark.fast
def test_an_unknown_name_or_the_wrong_model_is_one_sentence(tmp_path):
    with pytest.raises(CheckpointError, match="names no published weights; known: torchvision:resnet18, torchvision:resnet50, torchvision:vgg16"):
        pretrained.fetch("torchvision:resnet1000")
    cfg = load_config("mnist", SYNTH + ["finetune.init_from=torchvision:resnet50"])
    with pytest.raises(ConfigError, match="torchvision:resnet50 holds the weights of resnet50; set model.name: resnet50"):
        api.train_config(cfg, tmp_path / "r")
    assert not (tmp_path / "r").exists()
