"""The battery: what strangers hand brickyard, one line each: the input, the exit code, the words
the user reads. None may end in a traceback, a hang, a signal death or code execution, and none may
change a byte of a run written before it (logs may only grow). Add a row for every case found later.

Every case runs the real command line (fp32, one thread, synthetic data or small files made here)."""
import json
import os
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import SYNTH, run_cli, sets


def _png_header_only(w: int, h: int) -> bytes:
    """A 69-byte PNG whose header claims a w x h image: a decompression bomb."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def _folder(root: Path, bad: dict) -> Path:
    """A small image folder (two classes, 20 px PNGs) with ``bad``: {relative path: bytes} added."""
    rng = np.random.default_rng(0)
    for split in ("train", "val", "test"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(4):
                Image.fromarray((rng.random((20, 20, 3)) * 255).astype(np.uint8)).save(root / split / c / f"{i}.png")
    for rel, data in bad.items():
        path = os.path.join(os.fsencode(root), rel if isinstance(rel, bytes) else os.fsencode(rel))
        with open(path, "wb") as f:
            f.write(data)
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = tmp_path_factory.mktemp("hostile")
    run = w / "run"
    r = run_cli("train", *sets(*SYNTH, "train.epochs=1", "checkpoint.keep_last=2"), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    good = run / "checkpoints" / "best.pt"
    state = torch.load(good, weights_only=True)
    (w / "bomb.yaml").write_text("a: &a [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcdef", "bcdefg")) + "data:\n  classes: [*g, *g]\n")
    (w / "deep.yaml").write_text("[" * 20000 + "]" * 20000)
    (w / "self.yaml").write_text("base: self.yaml\n")
    (w / "ping.yaml").write_text("base: pong.yaml\n")
    (w / "pong.yaml").write_text("base: ping.yaml\n")
    (w / "list.yaml").write_text("- 1\n- 2\n")
    (w / "syntax.yaml").write_text("optim: {lr: [\n")
    (w / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (w / "huge.yaml").write_text("# " + "x" * (2 << 20) + "\n")
    (w / "base-number.yaml").write_text("base: 5\n")
    (w / "twice.yaml").write_text("optim:\n  lr: 0.1\n  name: sgd\n  lr: 5\n")

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {w / 'pwned'}",))
    torch.save({"model": {}, "x": Evil()}, w / "evil.pt")
    (w / "m.pt2").write_bytes(b"PK\x03\x04 anything: never opened without --trust-code")
    (w / "m.torchscript.pt").write_bytes(b"PK\x03\x04 likewise")
    (w / "junk.safetensors").write_bytes(b"not a safetensors file")
    raw = bytearray(good.read_bytes())
    big = max(state["model"].values(), key=lambda t: t.numel()).numpy().tobytes()
    raw[bytes(raw).index(big[:64]) + 100] ^= 0x01
    (w / "flipped.pt").write_bytes(bytes(raw))
    (w / "cut.pt").write_bytes(good.read_bytes()[:3000])
    torch.save({k: v for k, v in state.items() if k != "config"}, w / "noconfig.pt")
    torch.save({**state, "meta": [1, 2, 3]}, w / "badmeta.pt")
    torch.save({**state, "meta": {**state["meta"], "num_classes": "ten"}}, w / "badmeta2.pt")
    torch.save({**state, "model": [1, 2]}, w / "badmodel.pt")
    torch.save({k: v for k, v in state.items() if k not in ("step", "rng")}, w / "nostep.pt")
    torch.save({**state, "step": -5}, w / "negstep.pt")
    (w / "text.png").write_text("this is not an image")
    (w / "bomb.png").write_bytes(_png_header_only(20000, 20000))
    Image.fromarray((np.arange(784).reshape(28, 28) * 80).astype(np.uint16)).save(w / "sixteen.png")
    Image.fromarray(np.zeros((28, 28), np.uint8)).save(w / "digit.png")
    _folder(w / "bombfolder", {"train/a/0.png": _png_header_only(20000, 20000)})
    _folder(w / "badprobe", {"train/a/0.png": b"not a png"})
    _folder(w / "badval", {"val/b/9.png": b"\x89PNG\r\n\x1a\n cut short"})
    _folder(w / "notutf8", {b"train/a/caf\xe9-\xff.png": (w / "digit.png").read_bytes()})
    _folder(w / "clean", {})
    (w / "oddrows").mkdir()  # rows that are objects, with values of every wrong type
    (w / "oddrows" / "metrics.jsonl").write_text("\n".join([
        '{"kind": "train", "step": "x", "loss": "abc", "accuracy": null, "epoch": {"a": 1}}',
        '{"kind": "train", "step": 1, "loss": Infinity, "accuracy": NaN, "epoch": true}',
        '{"kind": "val", "loss": 1e308, "accuracy": [1, 2], "epoch": 1}',
        '{"kind": "train", "step": 2, "loss": 0.5, "accuracy": 0.5, "epoch": 0.5}',
        '{"kind": "test", "step": 3, "loss": 0.4, "accuracy": 0.9, "epoch": 1.0, "confusion": [[1, 2], [3]]}']) + "\n")
    weird = run / "weird"  # a second run whose metrics.jsonl holds rows that are not objects
    r = run_cli("train", *sets(*SYNTH, "train.epochs=1", "train.plots=false"), "--run-dir", str(weird))
    assert r.returncode == 0, r.stderr
    with open(weird / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n\"text\"\n42\n{\"kind\": \"train\", \"st")
    return w


IMG = ["data.name=imagefolder", "model.name=mlp", "train.epochs=1", "train.precision=fp32", "train.threads=1",
       "train.progress=none", "data.batch_size=4", "train.plots=false"]

# (name, command (W: the world folder), exit code, words the user reads)
CASES = [
    # configs
    ("alias bomb", ["train", "W/bomb.yaml"], 2, "more than 100,000 values"),
    ("a key written twice", ["train", "W/twice.yaml"], 2, "twice.yaml: lr is written twice (lines 2 and 4)"),
    ("20,000 nested brackets", ["train", "W/deep.yaml"], 2, "nested more than 32 levels deep"),
    ("base: names itself", ["train", "W/self.yaml"], 2, "leads back to itself"),
    ("base: a cycle of two", ["train", "W/ping.yaml"], 2, "leads back to itself"),
    ("base: a number", ["train", "W/base-number.yaml"], 2, "is not a preset name or a YAML file"),
    ("top level a list", ["train", "W/list.yaml"], 2, "the top level must be a mapping"),
    ("YAML syntax error", ["train", "W/syntax.yaml"], 2, "not valid YAML"),
    ("binary bytes as YAML", ["train", "W/binary.yaml"], 2, "W/binary.yaml"),
    ("a 2 MB config", ["train", "W/huge.yaml"], 2, "a config is a few kilobytes"),
    ("a missing config", ["train", "W/nope.yaml"], 2, "does not exist"),
    ("3,000-deep --set list", ["train", "--set", "data.classes=" + "[" * 3000 + "]" * 3000], 2, "nested too deeply"),
    ("one class kept", ["train", "--set", "data.classes=5"], 2, "data.classes: [5] keeps one class; a classifier needs at least 2."),
    ("a class kept twice", ["train", "--set", "data.classes=[3, 4, 3]"], 2, "data.classes: 3 is listed twice"),
    ("optim.name a list", ["train", "--set", "optim.name=[1]"], 2, "optim.name: [1] is not a string."),
    # 1.7 PB: past any host's address space, so refused even where the kernel overcommits without limit
    ("a model past the host's memory", ["train", *sets(*SYNTH, "model.in_channels=2147483647")], 1,
     " GB asked for at once; try a smaller model, data set or data.batch_size."),
    ("a 100 kB --set value", ["train", "--set", "model.name=" + "x" * 100_000], 2, "a setting is a few"),
    ("--set without =", ["train", "--set", "optim.lr"], 2, "expected KEY=VALUE"),
    ("an unknown key", ["train", "--set", "optim.lrr=1"], 2, "optim.lrr: unknown key"),
    ("threads=100000", ["train", "--set", "train.threads=100000"], 2, "train.threads: 100000 is above the maximum 1024"),
    ("seed=1e23", ["train", "--set", "train.seed=1e23"], 2, "train.seed: '1e23' is above the maximum"),
    ("seed=1e16", ["train", "--set", "train.seed=1e16"], 2, "train.seed: '1e16' is above the maximum"),
    ("seed=-1", ["train", "--set", "train.seed=-1"], 2, "train.seed: -1 is below the minimum 0"),
    ("epochs=1e308", ["train", "--set", "train.epochs=1e308"], 2, "train.epochs: '1e308' is above the maximum"),
    ("timeout_s=1e14", ["train", "--set", "dist.timeout_s=1e14"], 2, "dist.timeout_s: '1e14' is above the maximum"),
    ("max_steps=1e12", ["train", "--set", "train.max_steps=1e12"], 2, "train.max_steps: '1e12' is above the maximum"),
    ("lr=nan", ["train", "--set", "optim.lr=.nan"], 2, "give a finite number"),
    ("lr=inf", ["train", "--set", "optim.lr=.inf"], 2, "give a finite number"),
    ("num_workers=100000", ["train", "--set", "data.num_workers=100000"], 2, "data.num_workers: 100000 is above the maximum 256"),
    ("batch_size=-3", ["train", "--set", "data.batch_size=-3"], 2, "data.batch_size: -3 is below the minimum 1"),
    # model files and checkpoints
    ("a pickle that runs code", ["predict", "W/evil.pt", "W/digit.png"], 2,
     "holds Python objects besides tensors (such as posix.system), which brickyard does not unpickle"),
    ("a .pt2 program", ["predict", "W/m.pt2", "W/digit.png"], 2, "can run code it brings with it"),
    ("a TorchScript program", ["predict", "W/m.torchscript.pt", "W/digit.png"], 2, "--trust-code"),
    ("junk named .safetensors", ["predict", "W/junk.safetensors", "W/digit.png"], 2, "cannot be read as an exported"),
    ("a flipped byte", ["eval", "W/flipped.pt"], 2, "is damaged"),
    ("a cut checkpoint", ["eval", "W/cut.pt"], 2, "cannot be read"),
    ("no config entry", ["eval", "W/noconfig.pt"], 2, "no 'config' entry"),
    ("meta a list", ["eval", "W/badmeta.pt"], 2, "damaged 'meta' entry"),
    ("meta with a bad number", ["predict", "W/badmeta2.pt", "W/digit.png"], 2, "damaged 'meta' entry"),
    ("model a list", ["eval", "W/badmodel.pt"], 2, "not a dict of tensors"),
    ("resume without a step", ["train", *sets(*SYNTH), "--run-dir", "W/r-nostep", "--resume", "W/nostep.pt"], 2,
     "cannot be resumed from"),
    ("resume at step -5", ["train", *sets(*SYNTH), "--run-dir", "W/r-negstep", "--resume", "W/negstep.pt"], 2,
     "cannot be resumed from (step -5)"),
    ("a missing checkpoint", ["eval", "W/none.pt"], 2, "does not exist"),
    # images
    ("text named .png", ["predict", "W/run", "W/text.png"], 2, "is not a readable image"),
    ("a decompression bomb to predict", ["predict", "W/run", "W/bomb.png"], 2, "decompression bomb"),
    ("a 16-bit image to predict", ["predict", "W/run", "W/sixteen.png"], 0, ""),
    ("a decompression bomb in train/", ["train", *sets(*IMG, "data.root=W/bombfolder"), "--run-dir", "W/r-bomb"], 2,
     "decompression bomb"),
    ("the bomb skipped", ["train", *sets(*IMG, "data.root=W/bombfolder", "data.skip_bad_images=true"), "--run-dir",
                          "W/r-bomb-skip"], 0, ""),
    ("a bad probe image skipped", ["train", *sets(*IMG, "data.root=W/badprobe", "data.skip_bad_images=true"), "--run-dir",
                                   "W/r-probe"], 0, ""),
    ("a bad val/ image skipped", ["train", *sets(*IMG, "data.root=W/badval", "data.skip_bad_images=true"), "--run-dir",
                                 "W/r-val-skip"], 0, ""),
    ("a bad val/ image keeps the epoch", ["train", *sets(*IMG, "data.root=W/badval"), "--run-dir", "W/r-val"], 2,
     "The epoch trained before it is kept in"),
    ("a name that is not UTF-8, disk cache", ["train", *sets(*IMG, "data.root=W/notutf8", "data.cache=disk"),
                                             "--run-dir", "W/r-utf8"], 0, ""),
    ("train transforms of no fixed size", ["train", *sets(*IMG, "data.root=W/clean", "data.train_transforms=[grayscale, rgb]"),
                                           "--run-dir", "W/r-nofixed"], 2, "e.g. resize:20x20 (the first image's size)"),
    ("a train size the model cannot read", ["train", *sets(*IMG, "data.root=W/clean", "data.train_transforms=[center_crop:16]",
                                                           "data.eval_transforms=[resize:20x20]"), "--devices", "cpu:2",
                                            "--run-dir", "W/r-sizes"], 2, "mlp built for 20x20 cannot read 16x16"),
    ("a train size a pooling model reads", ["train", *sets(*IMG, "data.root=W/clean", "data.train_transforms=[center_crop:16]",
                                                           "data.eval_transforms=[resize:20x20]", "model.name=resnet18",
                                                           "train.max_steps=1"), "--run-dir", "W/r-sizes-ok"], 0, ""),
    ("a model of other channels", ["train", *sets(*IMG, "data.root=W/clean", "model.in_channels=1"), "--run-dir", "W/r-c1"], 2,
     "model.in_channels: 1, but the data's images have 3; leave it 0 to follow the data or convert the folder"),
    ("fewer outputs than classes", ["train", *sets(*SYNTH, "model.num_classes=2"), "--run-dir", "W/r-classes"],
     2, "model.num_classes: 2 outputs cannot score the data's 10 classes"),
    ("four channels", ["train", *sets(*IMG, "data.root=W/clean", "data.channels=4"), "--run-dir", "W/r-4"], 2,
     "data.channels: 4 is not one of 0, 1, 3"),
    # run directories and their files
    ("train over a finished run", ["train", *sets(*SYNTH), "--run-dir", "W/run"], 2, "already holds a run"),
    ("resume another run's file", ["train", *sets(*SYNTH), "--run-dir", "W/run", "--resume", "W/run/weird/checkpoints/best.pt"],
     2, "holds another run"),
    ("an output in a folder that takes no file", ["predict", "W/run", "W/digit.png", "--out", "/proc/brickyard-out.json"], 1,
     "error: /proc/brickyard-out.json: "),
    ("a negative export limit", ["data", "export", "mnist", "W/exported", "--limit", "-1"], 2,
     "data export: --limit and --jpeg are 0"),
    ("a folder as the script", ["run", "--devices", "cpu:2", "W/clean"], 2, "script W/clean is a folder, not a Python file"),
    ("rows that are not objects", ["plot", "W/run/weird", "--out", "W/plots"], 0, ""),
    ("values of the wrong types", ["plot", "W/oddrows", "--out", "W/oddplots"], 0, ""),
    # settings the device cannot honour (2 processes on CPUs)
    ("nccl on CPUs", ["train", *sets(*SYNTH, "dist.backend=nccl"), "--devices", "cpu:2", "--run-dir", "W/run",
                      "--resume", "auto"], 2, "dist.backend: nccl runs on CUDA GPUs only"),
    ("SyncBatchNorm on CPUs", ["train", *sets(*SYNTH, "dist.sync_bn=true", "model.name=fashion_fast"), "--devices", "cpu:2",
                               "--run-dir", "W/r-syncbn"], 2, "dist.sync_bn: torch's SyncBatchNorm runs on GPUs only"),
    ("a preset that is a path", ["train", *sets(*SYNTH, "preset=../../escape", "train.max_steps=1")], 0, ""),
]


@pytest.mark.parametrize("name, args, code, words", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_input_is_one_sentence_and_changes_nothing(world, name, args, code, words, tmp_path):
    before = {p: p.read_bytes() for p in (world / "run").rglob("*") if p.is_file()}
    args = [re.sub(r"(^|=)W/", lambda m: f"{m.group(1)}{world}/", a) for a in args]
    r = run_cli(*args, cwd=tmp_path, timeout=300)
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    if code:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
        assert words.replace("W/", f"{world}/") in lines[0], lines[0]
    assert not (world / "pwned").exists()
    for p, content in before.items():
        if p.name in ("train.log", "workerlog.0"):
            assert p.read_bytes().startswith(content), p
        else:
            assert p.read_bytes() == content, p
    if name == "a preset that is a path":
        made = list((tmp_path / "runs").iterdir())
        assert len(made) == 1 and made[0].name.startswith("____escape-"), made
        assert not (tmp_path.parent / "escape").exists()


@pytest.mark.fast
def test_fit_checks_labels_before_training(tmp_path):
    from brickyard import fit
    from brickyard.errors import DataError
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    model = torch.nn.Linear(4, 3)
    with pytest.raises(DataError, match=r"val_data: label 7 is outside the classes 0..2"):
        fit(model, (x, y), (x[:8], torch.full((8,), 7)), num_classes=3, run_dir=tmp_path / "a",
            overrides=["train.progress=none", "train.precision=fp32"])
    with pytest.raises(DataError, match=r"train_data: label -1 is outside the classes 0..2"):
        fit(model, (x, y - 1), num_classes=3, run_dir=tmp_path / "b", overrides=["train.progress=none"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything was written


@pytest.mark.parametrize("call, error", [
    (lambda x, y, m: dict(model=lambda t: t), (TypeError, "fit: model must be a torch.nn.Module, got function")),
    (lambda x, y, m: dict(train_data=(x[:0], y[:0])), ("DataError", "train_data is empty")),
    (lambda x, y, m: dict(val_data=(x[:0], y[:0])), ("DataError", "val_data is empty; leave it out")),
    (lambda x, y, m: dict(test_data=torch.utils.data.Subset(torch.utils.data.TensorDataset(x, y), [])),
     ("DataError", "test_data is empty; leave it out")),
    (lambda x, y, m: dict(train_data=(x, y.float())), ("DataError", "labels are floats .* pass loss_fn for a regression")),
    (lambda x, y, m: dict(num_classes="3"), ("DataError", "num_classes: '3' is not a whole number of classes")),
    (lambda x, y, m: dict(train_data=(x.tolist(), y.tolist())), ("DataError", "got a tuple of 2: list, list")),
    (lambda x, y, m: dict(train_data=(np.array([object()] * 64), y.numpy())), ("DataError", "cannot be read as tensors"))],
    ids=["not a module", "empty", "empty val", "empty test", "float labels", "num_classes a string", "lists", "objects"])
@pytest.mark.fast
def test_fit_refuses_what_it_cannot_train_in_one_sentence(call, error, tmp_path):
    """Each of these crashed inside torch (IndexError, a dtype error in the loss, TypeError on '>='); an empty
    validation or test split was scored as 0% accuracy."""
    from brickyard import errors, fit
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    kwargs = dict(model=torch.nn.Linear(4, 3), train_data=(x, y), run_dir=tmp_path / "r",
                  overrides=["train.progress=none", "train.precision=fp32", "train.threads=1", "train.max_steps=2"])
    kwargs.update(call(x, y, kwargs["model"]))
    kind, words = error
    with pytest.raises(getattr(errors, kind) if isinstance(kind, str) else kind, match=words):
        fit(**kwargs)
    assert not (tmp_path / "r").exists()


class _Items(torch.utils.data.Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return self.item()


@pytest.mark.parametrize("item, words", [
    (lambda: {"features": torch.randn(4), "class": 1}, "items are dicts of 'features', 'class'; brickyard reads the input from"),
    (lambda: (torch.randn(4), 1, "extra"), "items must be (input, label) pairs; item 0 is a tuple of 3"),
    (lambda: (torch.randn(4), "cat"), "item 0's label is str")])
@pytest.mark.fast
def test_a_dataset_of_other_items_is_one_sentence(item, words, tmp_path):
    """A dict of names brickyard does not read (Hugging Face's are read: tests/data/test_items.py), a triple, a name
    for a label: each failed inside the loop (unpacking, .to())."""
    from brickyard import fit
    from brickyard.errors import DataError
    with pytest.raises(DataError, match=re.escape(words)):
        fit(torch.nn.Linear(4, 3), _Items(item), num_classes=3, run_dir=tmp_path / "r", overrides=["train.progress=none"])
    assert not (tmp_path / "r").exists()


def test_a_dataset_of_numpy_items_trains(tmp_path):
    from brickyard import fit
    ds = _Items(lambda: (np.random.rand(4).astype(np.float32), 1))
    s = fit(torch.nn.Linear(4, 3), ds, num_classes=3, run_dir=tmp_path / "r",
            overrides=["train.progress=none", "train.precision=fp32", "train.threads=1", "train.max_steps=2",
                       "data.batch_size=4", "train.plots=false"])
    assert s["steps"] == 2


@pytest.mark.fast
def test_fit_takes_numpy_as_keras_gives_it(tmp_path):
    """keras.datasets' arrays as they come: uint8 N x H x W images and N x 1 uint8 labels (CIFAR's shape);
    float labels train with a loss of the user's; one KEY=VALUE string is one override."""
    from brickyard import fit
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (64, 6, 6), dtype=np.uint8), rng.integers(0, 3, (64, 1), dtype=np.uint8)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 3))
    ov = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.max_steps=3", "train.plots=false",
          "data.batch_size=16"]
    s = fit(model, (images, labels), (images[:16], labels[:16]), run_dir=tmp_path / "a", overrides=ov)
    assert s["steps"] == 3 and s["val_accuracy"] is not None
    reg = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 1), torch.nn.Flatten(0))
    s = fit(reg, (images, labels[:, 0].astype(np.float32)), run_dir=tmp_path / "b", overrides=ov,
            loss_fn=torch.nn.functional.mse_loss)
    assert s["steps"] == 3 and s["val_accuracy"] is None
    s = fit(model, (images, labels), run_dir=tmp_path / "c", overrides="train.max_steps=1")  # one string: one override
    assert s["steps"] == 1


@pytest.mark.fast
def test_fit_reads_one_hot_labels_as_the_classes_they_encode(tmp_path):
    """Keras's ``to_categorical`` labels (N x C floats): the same weights and accuracy as the class indices, the
    classes counted from the width (the last one no sample has), label smoothing applied; rows of other
    probabilities stay soft targets (no accuracy), multi-hot rows are several labels a sample; integer rows that are neither and one-hot splits of different
    widths are one sentence. Before, float one-hot labels trained as a regression with no accuracy at all, silently,
    and integer ones crashed in the loss."""
    from brickyard import fit
    from brickyard.errors import DataError
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (64, 6, 6), dtype=np.uint8), rng.integers(0, 3, 64)
    one_hot = np.eye(4, dtype=np.float32)[labels]  # 4 columns: class 3 has no sample
    ov = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.max_steps=3", "train.plots=false",
          "data.batch_size=16", "optim.label_smoothing=0.1", "train.seed=3"]
    runs = {}
    for kind, y in (("indices", labels), ("one-hot", one_hot)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 4))
        s = fit(model, (images, y), (images[:16], y[:16]), run_dir=tmp_path / kind, overrides=ov)
        runs[kind] = s, model.state_dict()
    (s_i, w_i), (s_o, w_o) = runs["indices"], runs["one-hot"]
    assert s_o["val_accuracy"] is not None and s_o["val_accuracy"] == s_i["val_accuracy"]
    assert all(torch.equal(w_i[k], w_o[k]) for k in w_i)
    assert "train_data: one-hot labels (64 x 4) read as class indices" in (tmp_path / "one-hot" / "train.log").read_text()
    s = fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 4)), (images, one_hot.astype(bool)),
            run_dir=tmp_path / "dummies", overrides=ov)  # pandas' get_dummies: booleans (a crash in the loss before)
    assert s["steps"] == 3 and "one-hot labels (64 x 4) read as class indices" in (tmp_path / "dummies" / "train.log").read_text()
    with pytest.raises(DataError, match=re.escape("train_data: labels are 64 x 4 integers but not one-hot")):
        fit(torch.nn.Linear(36, 4), (images, np.full((64, 4), 2, dtype=np.int64)), run_dir=tmp_path / "counts", overrides=ov)
    multi = (rng.random((64, 4)) < 0.4).astype(np.int64)  # several labels a sample (here a multi-label loss of the user's)
    s = fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 4)), (images, multi), (images[:16], multi[:16]),
            run_dir=tmp_path / "multi-label", overrides=ov,
            loss_fn=lambda out, y: torch.nn.functional.binary_cross_entropy_with_logits(out, y.float()))
    assert s["steps"] == 3 and s["val_accuracy"] is None and s["val_loss"] is not None  # kept as rows, not scored as classes
    assert s["val_map"] is not None  # scored as several labels a sample (data.task auto: multilabel)
    soft = np.full((64, 4), 0.25, dtype=np.float32)
    s = fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(36, 4)), (images, soft), run_dir=tmp_path / "soft",
            overrides=ov)
    assert s["steps"] == 3 and s["val_accuracy"] is None
    with pytest.raises(DataError, match=re.escape("the one-hot labels differ in width: train_data 4, val_data 3.")):
        fit(torch.nn.Linear(36, 4), (images, one_hot), (images[:8], np.eye(3, dtype=np.float32)[labels[:8]]),
            run_dir=tmp_path / "widths", overrides=ov)
    with pytest.raises(DataError, match=re.escape("num_classes is 5 but the one-hot labels have 4 columns.")):
        fit(torch.nn.Linear(36, 5), (images, one_hot), num_classes=5, run_dir=tmp_path / "n", overrides=ov)
    assert not any((tmp_path / name).exists() for name in ("widths", "n", "multi"))


class _Pairs(torch.utils.data.Dataset):
    """A Dataset of (input, target) pairs, targets as given: one-hot rows, class indices or a regression's values."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_a_datasets_one_hot_rows_are_scored_as_classes_and_a_regressions_rows_are_not(tmp_path):
    """A Dataset whose items carry one-hot float rows (its labels are read batch by batch, so ``fit`` cannot turn
    them into indices up front): validation and test accuracy, the confusion matrix and the error gallery are
    those of the same run on class indices, the rows read by their largest share as Keras's
    ``categorical_accuracy`` reads them. Before, the training accuracy was scored this way and validation and test
    had none. Float rows that are not class probabilities (a regression of several values) get no accuracy,
    in training either: before, training scored them as classes. Mixup and cutmix take the rows as they are.
    Before, they failed on them. ``F.one_hot``'s int64 rows, boolean rows and N x 1 indices train and score as the
    indices do (each was torch's RuntimeError from the loss); rows of another width are one sentence."""
    from brickyard import fit
    torch.manual_seed(0)
    x = torch.randn(96, 1, 4, 4)  # images, so the test pass keeps its errors for the gallery
    labels = (x.flatten(1) @ torch.randn(16, 4)).argmax(1)
    rows = torch.nn.functional.one_hot(labels, 4).float()
    ov = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.epochs=2", "train.tensorboard=false",
          "data.batch_size=16", "train.seed=3", "data.num_workers=0", "optim.lr=0.05"]
    runs = {}
    kinds = {"indices": labels, "rows": rows, "F.one_hot": torch.nn.functional.one_hot(labels, 4), "booleans": rows.bool(),
             "N x 1": labels[:, None]}
    for kind, y in kinds.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        s = fit(model, _Pairs(x[:64], y[:64]), _Pairs(x[64:80], y[64:80]), _Pairs(x[80:], y[80:]),
                run_dir=tmp_path / kind, overrides=ov + ["train.plots=" + str(kind in ("indices", "rows")).lower()])
        runs[kind] = s, model.state_dict()
    s_i, w_i = runs["indices"]
    for kind in kinds:  # F.one_hot's int64 and booleans crashed in the loss; N x 1 indices too
        s_r, w_r = runs[kind]
        assert s_r["val_accuracy"] is not None and s_r["test_accuracy"] is not None, kind
        assert (s_r["val_accuracy"], s_r["test_accuracy"]) == (s_i["val_accuracy"], s_i["test_accuracy"]), kind
        assert all(torch.allclose(w_i[k], w_r[k], atol=1e-6) for k in w_i), kind
    s_r, w_r = runs["rows"]
    read = [json.loads(line) for line in (tmp_path / "rows" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train_accuracy"] is not None for r in read if r["kind"] == "val")
    test_i, test_r = (next(r for r in map(json.loads, (tmp_path / k / "metrics.jsonl").read_text().splitlines())
                           if r["kind"] == "test") for k in ("indices", "rows"))
    assert test_r["confusion"] == test_i["confusion"] and sum(map(sum, test_r["confusion"])) == 16
    errors_i, errors_r = (torch.load(tmp_path / k / "test_errors.pt") for k in ("indices", "rows"))
    assert len(errors_r["true"]) and torch.equal(errors_r["true"], errors_i["true"])
    mixed = {}
    for kind, y in (("indices", labels), ("rows", rows), ("N x 1", labels[:, None])):  # mixed as indices' one-hots are
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
        s = fit(model, _Pairs(x[:64], y[:64]), _Pairs(x[64:80], y[64:80]), run_dir=tmp_path / f"mixed-{kind}",
                overrides=ov + ["data.mixup=0.8", "data.cutmix=1.0", "train.plots=false"])
        mixed[kind] = s["val_accuracy"], model.state_dict()
    for kind in ("rows", "N x 1"):
        assert mixed[kind][0] == mixed["indices"][0] is not None, kind
        assert all(torch.allclose(mixed[kind][1][k], mixed["indices"][1][k], atol=1e-6) for k in mixed[kind][1]), kind
    torch.manual_seed(0)
    reg = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    values = x.flatten(1) @ torch.randn(16, 4)  # several values a sample, not probabilities
    s = fit(reg, _Pairs(x[:64], values[:64]), _Pairs(x[64:80], values[64:80]), run_dir=tmp_path / "regression",
            overrides=ov, loss_fn=torch.nn.functional.mse_loss)
    assert s["steps"] == 8 and s["val_accuracy"] is None and s["test_accuracy"] is None
    read = [json.loads(line) for line in (tmp_path / "regression" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("train_accuracy") for r in read if r["kind"] == "val"] == [None, None]
    from brickyard.errors import DataError
    multi = torch.nn.functional.one_hot(labels, 4) + torch.nn.functional.one_hot((labels + 1) % 4, 4)
    with pytest.raises(DataError, match=re.escape("train_data: item 0's label is a row of 4 integers but not one-hot")):
        fit(reg, _Pairs(x, multi), run_dir=tmp_path / "multi-hot", overrides=ov)
    with pytest.raises(DataError, match=re.escape("a batch has outputs (16, 4) and targets (16, 5) of int64")):
        fit(reg, _Pairs(x, torch.nn.functional.one_hot(labels, 5)), run_dir=tmp_path / "wider", overrides=ov)


@pytest.mark.fast
def test_fit_takes_a_dataloader_as_the_dataset_and_batch_it_loads(tmp_path):
    """A DataLoader, as Lightning and Accelerate users hand one over: read as its Dataset, its batch per device
    (Accelerate's reading), the same weights as the Dataset with that ``data.batch_size``; ``batch_size=`` still
    wins. A loader that samples or batches in its own way is one sentence, and no run directory is made: brickyard
    would otherwise drop what it does (the samplers torch gives: tests/data/test_samplers.py; a collate_fn:
    tests/data/test_collate.py).
    Before, any DataLoader was refused."""
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from brickyard import fit
    from brickyard.errors import DataError
    torch.manual_seed(0)
    x = torch.randn(96, 1, 4, 4)
    labels = (x.flatten(1) @ torch.randn(16, 4)).argmax(1)
    ds, val = _Pairs(x[:80], labels[:80]), _Pairs(x[80:], labels[80:])
    ov = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.epochs=1", "train.plots=false",
          "train.tensorboard=false", "train.seed=3", "data.num_workers=0"]
    runs = {}
    for kind, train, test, extra in (("dataset", ds, val, ["data.batch_size=16", "data.eval_batch_size=7"]),
                                     ("loader", DataLoader(ds, batch_size=16, shuffle=True), DataLoader(val, batch_size=7), [])):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
        runs[kind] = fit(model, train, test_data=test, run_dir=tmp_path / kind, overrides=ov + extra), model.state_dict()
    (s_d, w_d), (s_l, w_l) = runs["dataset"], runs["loader"]
    assert s_l["steps"] == s_d["steps"] == 5 and s_l["test_accuracy"] == s_d["test_accuracy"] is not None
    assert all(torch.equal(w_d[k], w_l[k]) for k in w_d)
    log = (tmp_path / "loader" / "train.log").read_text()
    assert "train_data: a DataLoader, read as its Dataset with its batch of 16 per device (data.batch_size)" in log
    assert "test_data: a DataLoader, read as its Dataset with its batch of 7 (data.eval_batch_size)" in log
    s = fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4)), DataLoader(ds, batch_size=16),
            batch_size=40, run_dir=tmp_path / "keyword", overrides=ov)
    assert s["steps"] == 2  # Keras's batch_size= names the global batch and wins over the loader's
    plain = DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 20, drop_last=False))
    assert fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4)), plain, run_dir=tmp_path / "sampler",
               overrides=ov)["steps"] == 4

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(x, labels))

    refused = {"unbatched": (DataLoader(ds, batch_size=None), "the DataLoader batches nothing (batch_size=None)"),
               "stream": (DataLoader(Stream(), batch_size=16), "train_data: the DataLoader streams an IterableDataset (Stream)")}
    for name, (loader, said) in refused.items():
        with pytest.raises(DataError, match=re.escape(said)):
            fit(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4)), loader, run_dir=tmp_path / name, overrides=ov)
        assert not (tmp_path / name).exists()


@pytest.mark.parametrize("gap", [0.0, 0.3])
def test_a_second_ctrl_c_during_shutdown_prints_nothing_more(tmp_path, gap):
    """Ctrl-C saves a checkpoint and exits 130; a second one, at once or a moment later, ends it without a
    traceback, and the run directory resumes."""
    import signal
    import subprocess
    import sys
    import time
    run = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-m", "brickyard", "train", *sets(*SYNTH, "train.epochs=400", "train.log_every=5"),
                          "--run-dir", str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ((run / "metrics.jsonl").is_file() and '"train"' in (run / "metrics.jsonl").read_text()):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    time.sleep(gap)
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert len(err.strip().splitlines()) <= 1, err  # "interrupted", or the checkpoint's sentence
    assert not list(run.rglob("*.tmp"))
    r = run_cli("train", *sets(*SYNTH, "train.epochs=400", "train.max_steps=40"), "--run-dir", str(run), "--resume", "auto")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("error", ["MemoryError('cannot allocate 40 GB')", "torch.OutOfMemoryError('CUDA out of memory')",
                                   "TypeError('a bug')"])
def test_a_failure_while_building_the_model_is_one_line(tmp_path, error):
    """Out of memory while the model is built (before a run can explain it) is one sentence, exit 1; a bug
    there is one line naming the file that holds its traceback."""
    import subprocess
    import sys
    code = ("import sys, torch\nfrom brickyard import models\n"
            f"def build(*a, **k):\n    raise {error}\nmodels.build = build\n"
            "from brickyard.cli.main import main\nsys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", code, "train", *sets(*SYNTH), "--run-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    if "a bug" in error:
        assert lines[0].startswith("error: brickyard crashed (TypeError: a bug); the traceback is in ")
        assert "a bug" in Path(lines[0].split("the traceback is in ")[1].split(";")[0]).read_text()
    else:
        assert lines[0].startswith("error: out of ") and "memory" in lines[0]
