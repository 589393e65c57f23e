"""`brickyard export` and `predict` on what it writes: the same predictions from every format."""
import json

import numpy as np
import pytest

from conftest import SYNTH, run_cli, run_cli_many, sets


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("exp") / "run"
    r = run_cli("train", *sets(*SYNTH, "model.name=mnist_fast", "train.epochs=1", "train.plots=false"), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    return run


def _have(*modules) -> bool:
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in modules)


ONNX = pytest.mark.skipif(not _have("onnx", "onnxscript", "onnxruntime"),
                          reason="the [onnx] extra is not installed (pip install 'brickyard[onnx]')")


@pytest.mark.parametrize("fmt, name", [("safetensors", "m.safetensors"), ("torchscript", "m.torchscript.pt"),
                                       ("torch-export", "m.pt2"), pytest.param("onnx", "m.onnx", marks=ONNX)])
def test_every_format_predicts_what_the_checkpoint_predicts(trained, tmp_path, fmt, name):
    x = tmp_path / "x.npy"
    np.save(x, (np.random.default_rng(0).random((4, 1, 28, 28)) * 255).astype(np.uint8))
    # the export and the checkpoint's predictions in one process; the exported file's in a fresh one, as a user's
    r, checkpoint = run_cli_many(["export", trained, "--format", fmt, "--out", tmp_path / name], ["predict", trained, x])
    assert r.returncode == 0 and f"wrote {tmp_path / name}" in r.stdout, r.stderr
    want = json.loads(checkpoint.stdout)
    trust = [] if fmt in ("safetensors", "onnx") else ["--trust-code"]  # a program can carry code: refused without it
    got = run_cli("predict", str(tmp_path / name), str(x), *trust)
    assert got.returncode == 0, got.stderr
    got = json.loads(got.stdout)
    assert got["predicted"] == want["predicted"]
    assert np.allclose(got["probabilities"], want["probabilities"], atol=1e-4)


def test_safetensors_rebuilds_a_model_with_options_that_change_its_layers(tmp_path):
    """A ViT trained at patch size 7 (the mnist-vit preset's; auto picks 4 at 28 px): the exported weights
    carry the option, so predict rebuilds the same model and predicts what the checkpoint predicts."""
    run = tmp_path / "run"
    x = tmp_path / "x.npy"
    np.save(x, (np.random.default_rng(0).random((3, 1, 28, 28)) * 255).astype(np.uint8))
    out = tmp_path / "vit.safetensors"
    # one process (torch imported once); 32 validation and test images: the ViT's evaluation is most of its run
    trained, exported, predicted, got = run_cli_many(
        ["train", *sets(*SYNTH, "model.name=vit_tiny", "model.patch_size=7", "train.max_steps=2", "train.plots=false",
                        "train.tensorboard=false", "data.synthetic.num_val=32", "data.synthetic.num_test=32"), "--run-dir", run],
        ["export", run, "--format", "safetensors", "--out", out],
        ["predict", run, x],
        ["predict", out, x])
    assert trained.returncode == 0 and exported.returncode == 0 and predicted.returncode == 0, trained.stderr + exported.stderr
    want = json.loads(predicted.stdout)
    assert got.returncode == 0, got.stderr
    assert np.allclose(json.loads(got.stdout)["probabilities"], want["probabilities"], atol=1e-5)
    # a file whose options were lost (as written before they were recorded) names the layer that differs
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(out), framework="pt") as f:
        meta, tensors = json.loads(f.metadata()["brickyard.json"]), {k: f.get_tensor(k) for k in f.keys()}
    del meta["options"]
    bare = tmp_path / "bare.safetensors"
    save_file(tensors, str(bare), metadata={"brickyard.json": json.dumps(meta)})
    r = run_cli("predict", str(bare), str(x))
    assert r.returncode == 2 and r.stderr.strip() == f"error: {bare}: pos_embed has shape (1, 17, 192), the model expects (1, 50, 192).", r.stderr


def test_export_mistakes_are_one_sentence(trained, tmp_path):
    bad = tmp_path / "junk.safetensors"
    bad.write_bytes(b"not a safetensors file")
    empty = tmp_path / "empty"
    empty.mkdir()
    r, junk, nothing = run_cli_many(["export", trained, "--format", "torch-export", "--out", tmp_path / "m.pt"],
                                    ["predict", bad, tmp_path / "x.npy"], ["export", empty])  # one process: three refusals
    assert r.returncode == 2 and r.stderr.strip() == f"error: --out {tmp_path / 'm.pt'}: a torch-export file's name ends in .pt2 (that is how predict knows it)."
    assert junk.returncode == 2 and junk.stderr.startswith(f"error: {bad} cannot be read as an exported brickyard model")
    assert nothing.returncode == 2 and "no checkpoint" in nothing.stderr


@ONNX
def test_onnx_export_states_its_check_and_opset_and_keeps_a_dynamic_batch(trained, tmp_path):
    import onnxruntime as ort
    out = tmp_path / "m.onnx"
    r = run_cli("export", str(trained), "--format", "onnx", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "checked: onnxruntime" in r.stdout and "on a batch of 3 matches PyTorch within rtol 0.001, atol 0.0001" in r.stdout
    assert "opset 18" in r.stdout
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].name == "images" and session.get_outputs()[0].name == "logits"
    for n in (1, 7):  # any batch size, not the exported example's
        assert session.run(["logits"], {"images": np.zeros((n, 1, 28, 28), np.float32)})[0].shape == (n, 10)
    meta = json.loads(session.get_modelmeta().custom_metadata_map["brickyard.json"])
    assert meta["opset"] == 18 and meta["name"] == "mnist_fast" and meta["normalises"]


def _python(code, cwd):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300)


@ONNX
def test_onnx_without_onnxruntime_is_written_unchecked_and_without_onnx_is_one_sentence(trained, tmp_path):
    """The packages' absence is made real in a fresh interpreter (an import of them fails there)."""
    run = ("import sys; sys.modules[{mod!r}] = None\n"
           "from brickyard.cli.main import main\n"
           "sys.exit(main(['export', {src!r}, '--format', 'onnx', '--out', {out!r}]))")
    r = _python(run.format(mod="onnxruntime", src=str(trained), out=str(tmp_path / "a.onnx")), tmp_path)
    assert r.returncode == 0, r.stderr
    assert "not checked: onnxruntime is not installed (pip install 'brickyard[onnx]')" in r.stdout and (tmp_path / "a.onnx").is_file()
    r = _python(run.format(mod="onnx", src=str(trained), out=str(tmp_path / "b.onnx")), tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == ("error: --format onnx needs the onnx and onnxscript packages: "
                                                      "pip install 'brickyard[onnx]'.")
    assert not (tmp_path / "b.onnx").exists()


@ONNX
@pytest.mark.parametrize("name, size", [("mnist_cnn", 28), ("mnist_fast", 28), ("lenet", 28), ("mlp", 28), ("convnet", 28),
                                        ("fashion_fast", 28), ("resnet18", 32), ("vgg16", 32), ("vit_tiny", 28)])
def test_registry_models_export_to_onnx_and_run_in_onnxruntime(name, size):
    """Every registry model exports (resnet18_imagenet, resnet50, vit_small and fashion_wide share these
    code paths and were checked once by hand: docs/training.md); vgg16 with its one-linear head here
    (its 4096-unit classifier is 500 MB of ONNX); vit_tiny's class with 2 of its 12 blocks (the same block 12
    times: the export traces each, 20 s on 2 cores for the whole model)."""
    import torch

    from brickyard import models
    from brickyard.tools.export import Normalised, _check_onnx, _onnx_bytes
    channels = models.natural_input(name)[0]
    torch.manual_seed(0)
    if name == "vit_tiny":
        from brickyard.models.vit import ViT
        model = ViT(10, channels, (size, size), dim=192, depth=2, heads=3).eval()
    else:
        model = models.create(name, 10, channels, (size, size), **({"head": "linear"} if name == "vgg16" else {})).eval()
    meta = {"in_channels": channels, "image_size": [size, size], "name": name}
    program = Normalised(model, [0.5] * channels, [0.25] * channels).eval()
    assert _check_onnx(_onnx_bytes(program, torch.rand(2, channels, size, size), meta), program, meta).startswith("checked:")
