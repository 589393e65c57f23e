"""`brickyard export` and `predict` on what it writes: the same predictions from every format."""
import json

import numpy as np
import pytest

from conftest import SYNTH, run_cli, sets


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("exp") / "run"
    r = run_cli("train", *sets(*SYNTH, "model.name=mnist_fast", "train.epochs=1", "train.plots=false"), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    return run


@pytest.mark.parametrize("fmt, name", [("safetensors", "m.safetensors"), ("torchscript", "m.torchscript.pt"),
                                       ("torch-export", "m.pt2")])
def test_every_format_predicts_what_the_checkpoint_predicts(trained, tmp_path, fmt, name):
    x = tmp_path / "x.npy"
    np.save(x, (np.random.default_rng(0).random((4, 1, 28, 28)) * 255).astype(np.uint8))
    r = run_cli("export", str(trained), "--format", fmt, "--out", str(tmp_path / name))
    assert r.returncode == 0 and f"wrote {tmp_path / name}" in r.stdout, r.stderr
    want = json.loads(run_cli("predict", str(trained), str(x)).stdout)
    trust = [] if fmt == "safetensors" else ["--trust-code"]  # a program can carry code: refused without it
    got = run_cli("predict", str(tmp_path / name), str(x), *trust)
    assert got.returncode == 0, got.stderr
    got = json.loads(got.stdout)
    assert got["predicted"] == want["predicted"]
    assert np.allclose(got["probabilities"], want["probabilities"], atol=1e-4)


def test_export_mistakes_are_one_sentence(trained, tmp_path):
    r = run_cli("export", str(trained), "--format", "torch-export", "--out", str(tmp_path / "m.pt"))
    assert r.returncode == 2 and r.stderr.strip() == f"error: --out {tmp_path / 'm.pt'}: a torch-export file's name ends in .pt2 (that is how predict knows it)."
    bad = tmp_path / "junk.safetensors"
    bad.write_bytes(b"not a safetensors file")
    r = run_cli("predict", str(bad), str(tmp_path / "x.npy"))
    assert r.returncode == 2 and r.stderr.startswith(f"error: {bad} cannot be read as an exported brickyard model")
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_cli("export", str(empty))
    assert r.returncode == 2 and "no checkpoint" in r.stderr
