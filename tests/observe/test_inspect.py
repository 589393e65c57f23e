"""Metrics, TensorBoard, plots, inspection, watching, the NaN guard, parameter groups, predict."""
import json
import logging
import os

import numpy as np
import pytest
import torch
from torch import nn

from brickyard import api
from brickyard.config import load_config
from brickyard.errors import BrickyardError, ConfigError
from brickyard.observe.metrics import EvalAccumulator, fit_hint
from brickyard.optim import param_groups
from brickyard.training import checkpoint
from conftest import SYNTH, run_cli, run_cli_many, sets

CNN = SYNTH + ["model.name=mnist_cnn"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "cnn"
    api.train_config(load_config("mnist", CNN + ["train.epochs=2", "train.watch=[conv*, fc]", "train.watch_every=5",
                                                 "train.histograms_every=10"]), run)
    return run


@pytest.mark.fast
def test_accumulator_matches_a_direct_computation():
    torch.manual_seed(0)
    logits, y = torch.randn(50, 7), torch.randint(0, 7, (50,))
    acc = EvalAccumulator(7, torch.device("cpu"))
    acc.update(logits[:20], y[:20])
    acc.update(logits[20:], y[20:])
    r = acc.result()
    pred = logits.argmax(1)
    assert r["accuracy"] == pytest.approx((pred == y).float().mean().item())
    assert r["top5"] == pytest.approx((logits.topk(5, 1).indices == y[:, None]).any(1).float().mean().item())
    conf = np.array(r["confusion"])
    assert conf.sum() == 50 and conf[3, 5] == int(((y == 3) & (pred == 5)).sum())
    assert r["loss"] == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-5)
    assert "over-fitting" in fit_hint(0.99, 0.80) and "under-fitting" in fit_hint(0.5, 0.49)


def test_run_writes_events_plots_and_rich_metrics(trained):
    assert list(trained.glob("events.out.tfevents.*"))
    for png in ("curves.png", "confusion.png", "misclassified.png", "reliability.png"):
        assert (trained / png).stat().st_size > 1000, png
    rows = [json.loads(l) for l in (trained / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["kind"] == "val"]
    assert all({"top5", "train_accuracy", "hint"} <= set(r) for r in val)
    test = [r for r in rows if r["kind"] == "test"][0]
    assert np.array(test["confusion"]).sum() == 128 and len(test["per_class_accuracy"]) == 10
    watch = [r for r in rows if r["kind"] == "watch"]
    assert watch and {"conv1", "conv2", "fc"} <= set(watch[0]["layers"])
    assert {"act_mean", "act_std", "grad_std"} <= set(watch[0]["layers"]["conv1"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ev = EventAccumulator(str(trained), size_guidance={"histograms": 0})
    ev.Reload()
    assert {"train/loss", "train/lr", "val/accuracy", "test/accuracy", "val/f1_macro", "val/balanced_accuracy",
            "test/f1_macro", "test/precision_macro", "test/recall_macro", "test/f1_weighted", "val/ece",
            "test/ece"} <= set(ev.Tags()["scalars"])
    assert ev.Tags()["images"] == ["test/reliability"]  # the reliability diagram, once
    assert 0 <= test["ece"] <= 1 and sum(test["reliability"]["count"]) == 128
    assert all(0 <= r["f1_macro"] <= 1 for r in val) and len(test["f1"]) == 10
    assert any(t.startswith("grads/") for t in ev.Tags()["histograms"])


def test_brickyard_plot_redraws_a_runs_pictures_exactly(trained, tmp_path):
    """The pictures a run draws at its end and `brickyard plot` draws later from its files are the
    same bytes; each has content (more than the white background and the frame)."""
    from PIL import Image
    r = run_cli("plot", str(trained), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    for png in ("curves.png", "confusion.png", "misclassified.png"):
        assert (tmp_path / png).read_bytes() == (trained / png).read_bytes(), png
        colours = Image.open(tmp_path / png).convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 20, png


def test_a_damaged_test_errors_file_is_one_error_line_and_nothing_else_changes(trained, tmp_path):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "test_errors.pt").write_text("garbage")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    r = run_cli("plot", str(run))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: test errors {run / 'test_errors.pt'} cannot be read: it is not a file written by torch.save "
        "(another format, or cut short)."], r.stderr
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # curves.png is drawn again, from the same metrics: the same bytes


def test_plot_overlays_several_runs(trained, tmp_path):
    r, bad = run_cli_many(["plot", trained, trained, "--out", tmp_path], ["plot", tmp_path / "nothing"])  # one process
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "compare-curves.png").stat().st_size > 1000
    assert bad.returncode == 2 and "is not a run directory" in bad.stderr


def test_inspect_prints_a_row_per_layer(trained):
    r, saved = run_cli_many(["inspect", "mnist", "--batch", "8", *sets("data.name=synthetic")],
                            ["inspect", trained / "checkpoints" / "best.pt", "--json"])  # one process, torch imported once
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 + 10 and lines[2].split()[:3] == ["conv1", "Conv2d", "8x16x14x14"]  # mnist_fast, stride-2 stem
    assert [line.split()[0] for line in lines[2:]] == ["conv1", "relu1", "conv2", "pool2", "relu2", "conv3", "pool3", "relu3", "flatten", "fc"]
    j = json.loads(saved.stdout)
    assert [r["name"] for r in j] == ["conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "flatten", "fc"]
    assert j[0]["grad_norm"] > 0 and j[0]["params"] == 520 and j[-1]["output_shape"] == [32, 10]


class Boom(nn.Module):
    """Finite for the first ``after`` training calls, then infinite."""

    def __init__(self, after):
        super().__init__()
        self.after, self.calls = after, 0

    def forward(self, x):
        if self.training:
            self.calls += 1
        return x * float("inf") if self.calls > self.after else x


@pytest.mark.fast
def test_nan_guard_names_the_layer_and_keeps_the_last_good_checkpoint(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(256, 1, 4, 4), torch.randint(0, 2, (256,))
    model = nn.Sequential()
    model.add_module("flatten", nn.Flatten())
    model.add_module("fc1", nn.Linear(16, 8))
    model.add_module("boom", Boom(after=10))
    model.add_module("fc", nn.Linear(8, 2))
    cfg = {"train": {"epochs": 3, "device": "cpu", "progress": "none"}, "data": {"batch_size": 32},
           "checkpoint": {"every_steps": 4, "keep_last": 5}}
    with pytest.raises(BrickyardError) as e:
        api.fit(model, (x, y), val_data=(x, y), config=cfg, run_dir=tmp_path / "r")
    assert "non-finite at step 10; first non-finite: output of layer 'boom' (Boom)" in str(e.value)
    files = checkpoint.step_checkpoints(tmp_path / "r" / "checkpoints")
    assert files[-1].name == "step-0000008.pt"
    assert all(torch.isfinite(v).all() for v in checkpoint.load(files[-1])["model"].values())


class Refused(nn.Module):
    """Raises what PyTorch raises on a GPU under deterministic algorithms (CPUs never refuse)."""
    def __init__(self, message):
        super().__init__()
        self.message = message

    def forward(self, x):
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError(self.message)
        return x


@pytest.mark.parametrize("message, sentence", [
    ("adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, but you set "
     "'torch.use_deterministic_algorithms(True)'. You can turn off determinism ...",
     "train.deterministic: adaptive_avg_pool2d_backward_cuda has no deterministic implementation on cpu; "
     "set train.deterministic=false or use a model without that layer."),
    ("Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or ..., but this "
     "operation is not deterministic because it uses CuBLAS and you have CUDA >= 10.2. To enable deterministic "
     "behavior in this case, you must set an environment variable before running your PyTorch application: "
     "CUBLAS_WORKSPACE_CONFIG=:4096:8 or CUBLAS_WORKSPACE_CONFIG=:16:8.",
     "train.deterministic on cpu needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before the process starts "
     "(`brickyard train` sets it; set it yourself when calling brickyard from Python)."),
])
@pytest.mark.fast
def test_deterministic_refusals_are_one_sentence(message, sentence, tmp_path):
    x, y = torch.randn(64, 1, 4, 4), torch.randint(0, 2, (64,))
    model = nn.Sequential(nn.Flatten(), Refused(message), nn.Linear(16, 2))
    cfg = {"train": {"epochs": 1, "device": "cpu", "progress": "none", "deterministic": True}, "data": {"batch_size": 32}}
    try:
        with pytest.raises(BrickyardError) as e:
            api.fit(model, (x, y), config=cfg, run_dir=tmp_path / "r")
    finally:
        torch.use_deterministic_algorithms(False)
    assert str(e.value) == sentence
    assert sentence in (tmp_path / "r" / "train.log").read_text()


@pytest.mark.fast
def test_the_launcher_sets_the_cublas_workspace_for_deterministic_runs(monkeypatch):
    from brickyard.launch import torchrun as launch
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    launch.process_env(load_config("mnist"))
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    launch.process_env(load_config("mnist", ["train.deterministic=true"]))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


@pytest.mark.fast
def test_param_groups_rules():
    from brickyard.models import create
    m = create("mnist_cnn")
    cfg = load_config("mnist", ["optim.param_groups=[{match: 'fc.*', weight_decay: 0.001, lr_mult: 10}]",
                                "optim.decay_bias_norm=false"]).optim
    groups = {g["label"]: g for g in param_groups(m, cfg)}
    assert groups["match 'fc.*'"]["names"] == ["fc.weight", "fc.bias"] and groups["match 'fc.*'"]["lr_mult"] == 10
    assert groups["no-decay (bias/norm)"]["names"] == ["conv1.bias", "conv2.bias"]
    assert groups["default"]["weight_decay"] == cfg.weight_decay
    bn = param_groups(create("resnet18", 10, 3, (32, 32)), load_config("mnist", ["optim.decay_bias_norm=false"]).optim)
    assert any("bn1.weight" in g["names"] for g in bn if g["weight_decay"] == 0)
    with pytest.raises(ConfigError, match="pattern 'head.*' matches no parameter"):
        param_groups(m, load_config("mnist", ["optim.param_groups=[{match: 'head.*'}]"]).optim)


def test_lr_mult_and_l1_act_in_training(tmp_path):
    base = CNN + ["train.epochs=1", "optim.name=sgd", "schedule.name=constant", "optim.weight_decay=0.0001"]
    plain = api.train_config(load_config("mnist", base), tmp_path / "a")
    l1 = api.train_config(load_config("mnist", base + ["optim.l1=0.001"]), tmp_path / "b")
    w = lambda r: checkpoint.load(checkpoint.step_checkpoints(r / "checkpoints")[-1])["model"]  # noqa: E731
    assert w(tmp_path / "b")["conv2.weight"].abs().sum() < w(tmp_path / "a")["conv2.weight"].abs().sum()
    frozen = api.train_config(load_config("mnist", base + ["optim.param_groups=[{match: 'conv*', lr_mult: 0, weight_decay: 0}]"]),
                              tmp_path / "c")
    start = torch.manual_seed(0) and None
    from brickyard.models import create
    torch.manual_seed(0)
    init = create("mnist_cnn").state_dict()
    assert torch.equal(w(tmp_path / "c")["conv1.weight"], init["conv1.weight"])
    assert not torch.equal(w(tmp_path / "c")["fc.weight"], init["fc.weight"])
    assert plain["steps"] == l1["steps"] == frozen["steps"] and start is None


def test_predict_png_with_two_layer_outputs(trained, tmp_path):
    from PIL import Image
    img = tmp_path / "digit.png"
    Image.fromarray((np.random.rand(40, 30) * 255).astype(np.uint8)).save(img)
    ck = str(trained / "checkpoints" / "best.pt")
    np.save(tmp_path / "x.npy", (np.random.rand(3, 28, 28) * 255).astype(np.uint8))
    out = tmp_path / "o.npz"
    notimg = tmp_path / "x.png"
    notimg.write_text("hello")
    r, npz, bad, unreadable = run_cli_many(  # one process: the four commands' outputs and sentences are checked
        ["predict", ck, img, "--outputs", "conv1,pool2"],
        ["predict", ck, img, tmp_path / "x.npy", "--outputs", "fc,conv2", "--format", "npz", "--out", out],
        ["predict", ck, img, "--outputs", "conv9"],
        ["predict", ck, notimg])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["outputs"]["conv1"]["shape"] == [1, 20, 28, 28] and doc["outputs"]["pool2"]["shape"] == [1, 20, 7, 7]
    assert abs(sum(doc["probabilities"][0]) - 1) < 1e-4 and 0 <= doc["predicted"][0] < 10
    assert npz.returncode == 0, npz.stderr
    d = np.load(out)
    assert d["fc"].shape == (4, 10) and d["conv2"].shape == (4, 20, 14, 14) and d["probabilities"].shape == (4, 10)
    assert bad.returncode == 2 and "layer 'conv9' does not exist; valid names: conv1, relu1" in bad.stderr
    assert unreadable.returncode == 2 and "is not a readable image" in unreadable.stderr


def test_predict_from_python(trained, monkeypatch):
    import brickyard
    x = torch.randint(0, 255, (5, 1, 28, 28), dtype=torch.uint8)
    out = brickyard.predict(str(trained / "checkpoints" / "best.pt"), x, outputs=["conv1", "fc"])
    assert out["conv1"].shape == (5, 20, 28, 28) and out["fc"].shape == (5, 10) and out["predicted"].shape == (5,)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    res = brickyard.predict(model, torch.randn(2, 1, 2, 2), outputs=["1"])
    assert res["1"].shape == (2, 3)
    # what Keras's and timm's users hand predict: one path, a list of tensors, "a,b" names, arrays of another size
    from PIL import Image
    img = trained / "one.png"
    Image.fromarray((np.random.rand(40, 30) * 255).astype(np.uint8)).save(img)
    ck = str(trained / "checkpoints" / "best.pt")
    assert brickyard.predict(ck, str(img), outputs="conv1,fc")["conv1"].shape == (1, 20, 28, 28)
    assert brickyard.predict(ck, [x[0], x[1]])["predicted"].shape == (2,)
    with pytest.raises(BrickyardError, match=r"inputs are 1x14x14 images and the model reads 1x28x28"):
        brickyard.predict(ck, torch.zeros(2, 1, 14, 14))
    with pytest.raises(BrickyardError, match=r"inputs: expected a tensor or array .* got NoneType"):
        brickyard.predict(model, None)
    assert brickyard.predict(model, [[[[0.1, 0.2], [0.3, 0.4]]]])["predicted"].shape == (1,)  # nested lists, as before
    # a folder is its image files (hidden ones left out), named by their path inside it; inputs go through in chunks
    from brickyard.tools import predict as pr
    folder = trained / "to_predict"
    for name in ("a/one.png", "b/two.png", "b/.hidden.png"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray((np.random.rand(28, 28) * 255).astype(np.uint8)).save(folder / name)
    assert pr.load_inputs([folder], 1, (28, 28))[1] == ["a/one.png", "b/two.png"]
    with pytest.raises(BrickyardError, match=r"input folder .*a holds no image files \(.bmp"):
        (folder / "a" / "one.png").rename(folder / "one.png")
        pr.load_inputs([folder / "a"], 1, (28, 28))
    whole = brickyard.predict(ck, x, outputs="conv1")
    monkeypatch.setattr(pr, "CHUNK", 2)  # 5 inputs: 2 + 2 + 1
    chunked = brickyard.predict(ck, x, outputs="conv1")
    assert all(torch.allclose(chunked[k], whole[k], atol=1e-6) for k in ("logits", "conv1"))
    nhwc = x.permute(0, 2, 3, 1)  # Keras's layout: the same predictions as the N x C x H x W batch
    assert torch.equal(brickyard.predict(ck, nhwc)["logits"], brickyard.predict(ck, x)["logits"])
    np.save(trained / "nhwc.npy", nhwc.numpy())
    assert torch.allclose(brickyard.predict(ck, str(trained / "nhwc.npy"))["logits"], brickyard.predict(ck, x)["logits"],
                          atol=1e-5)  # read as files are (their own dtype path), not bit for bit


@pytest.mark.fast
def test_plots_survive_what_runs_write_when_they_go_wrong(tmp_path):
    """A diverging loss (huge, inf, NaN), one point, no accuracy (a regression): pictures, no error."""
    from brickyard.observe.plots import _ticks, plot_runs
    rows = [{"kind": "train", "step": 1, "epoch": 0.1, "loss": 2.3, "accuracy": 0.1},
            {"kind": "train", "step": 2, "epoch": 0.2, "loss": 1e30, "accuracy": None},
            {"kind": "train", "step": 3, "epoch": 0.3, "loss": float("inf"), "accuracy": None},
            {"kind": "train", "step": 4, "epoch": 0.4, "loss": float("nan")},
            {"kind": "val", "step": 4, "epoch": 0.4, "loss": 0.0, "accuracy": None},
            {"kind": "test", "step": 4, "confusion": [[3, 1], [0, 4]]}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    written = plot_runs([tmp_path])
    assert [p.name for p in written] == ["curves.png", "confusion.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert _ticks(0.5, 1.2, log=True) == pytest.approx([0.5, 0.7, 1.0])
    assert len(_ticks(1e-3, 1e30, log=True)) <= 7
    assert _ticks(0.0, 1.0, log=False) == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])


@pytest.mark.fast
def test_predict_in_a_callback_leaves_the_model_training():
    """A callback reading a layer's output with brickyard.predict(run.model, ...) mid-training: the
    model comes back in train mode, on its device, with its weights."""
    import brickyard
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Dropout(0.5), torch.nn.Flatten(), torch.nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    out = brickyard.predict(model, torch.randn(4, 1, 4, 4), outputs=["0"])
    assert model.training and all(m.training for m in model.modules())
    assert out["0"].shape == (4, 2, 2, 2) and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.eval()
    brickyard.predict(model, torch.randn(4, 1, 4, 4))
    assert not model.training


@pytest.mark.fast
def test_a_test_split_without_a_mistake_draws_the_other_plots_and_keeps_no_errors_file(tmp_path, caplog):
    """100% test accuracy: no test_errors.pt, no mosaic, and the curves and the confusion matrix are drawn (an empty
    errors file was written, and the plots refused it, dropping the other plots too)."""
    x = torch.zeros(64, 1, 8, 8)
    x[32:] = 1.0
    y = (torch.arange(64) >= 32).long()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 2))
    cfg = {"train": {"epochs": 20, "precision": "fp32", "threads": 1, "progress": "none", "device": "cpu"},
           "data": {"batch_size": 16}, "optim": {"name": "sgd", "lr": 0.5}}
    with caplog.at_level(logging.WARNING, logger="brickyard"):
        s = api.fit(net, (x, y), val_data=(x, y), test_data=(x, y), config=cfg, run_dir=tmp_path / "run")
    assert s["test_accuracy"] == 1.0
    assert not (tmp_path / "run" / "test_errors.pt").exists() and "no plots" not in caplog.text
    assert (tmp_path / "run" / "curves.png").is_file() and (tmp_path / "run" / "confusion.png").is_file()
