"""Image folders, export, fine-tuning with frozen layers."""
import json
import random

import numpy as np
import pytest
import torch

from brickyard import api
from brickyard.config import load_config
from brickyard.data import build_data
from brickyard.errors import CheckpointError, ConfigError, DataError
from brickyard.training import checkpoint
from conftest import SYNTH, run_cli, sets

IF = ["data.name=imagefolder", "data.train_transforms=[resize:28x28]", "data.eval_transforms=[resize:28x28]",
      "data.normalize=mnist", "model.name=mnist_cnn", "train.device=cpu", "train.progress=none", "data.num_workers=1",
      "train.precision=fp32", "optim.name=nesterov", "optim.weight_decay=0.0005", "optim.label_smoothing=0"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    if not __import__("conftest").have_mnist():
        pytest.skip("MNIST files not found")
    out = tmp_path_factory.mktemp("digits")
    r = run_cli("data", "export", "mnist", str(out), "--limit", "150")  # per class: 1,500 images a split
    assert r.returncode == 0, r.stderr
    return out


def _png(path, arr):
    from PIL import Image
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_export_is_pixel_exact_and_trains(digits, tmp_path):
    from brickyard.data import idx
    arrays = idx.load_idx("mnist", None, False)
    d = build_data(load_config("mnist", IF + [f"data.root={digits}"]).data)
    assert d.classes == [str(i) for i in range(10)] and d.in_channels == 1 and d.image_size == (28, 28)
    ds = d.test.dataset
    for k in (0, 17, 333):
        i = int(ds.files[k].stem)
        img, label = ds[k]
        assert torch.equal(img[0], torch.from_numpy(np.array(arrays["t10k-images-idx3-ubyte"][i])))
        assert label == int(arrays["t10k-labels-idx1-ubyte"][i])
    s = api.train_config(load_config("mnist", IF + [f"data.root={digits}", "train.epochs=3", "data.batch_size=32", "optim.lr=0.05"]), tmp_path / "r")
    assert s["test_accuracy"] > 0.9
    state = checkpoint.load(tmp_path / "r" / "checkpoints" / "best.pt")
    assert state["meta"]["classes"] == [str(i) for i in range(10)]


def test_imagefolder_bad_inputs(tmp_path):
    root = tmp_path / "pics"
    for c in ("cat", "dog"):
        for i in range(3):
            _png(root / "train" / c / f"{i}.png", (np.random.rand(12, 10, 3) * 255).astype(np.uint8))
            _png(root / "test" / c / f"{i}.png", (np.random.rand(12, 10, 3) * 255).astype(np.uint8))
    base = load_config("mnist", IF + [f"data.root={root}", "data.eval_transforms=[resize:8x8]", "data.train_transforms=[random_resized_crop:8, hflip]"])
    d = build_data(base.data)
    assert d.in_channels == 3 and d.classes == ["cat", "dog"] and d.train.dataset[0][0].shape == (3, 8, 8)
    (root / "train" / "dog" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(DataError, match=r"dog/1.png is unreadable or truncated"):
        api.train_config(base.replace(**{"train.epochs": 1}), tmp_path / "r")
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        d = build_data(base.replace(**{"data.skip_bad_images": True}).data)
    assert len(d.train) == 5
    (root / "train" / "dog" / "notes.txt").write_text("hi")
    with pytest.raises(DataError, match="notes.txt is not an image file"):
        build_data(base.data)
    (root / "train" / "dog" / "notes.txt").unlink()
    (root / "train" / "bird").mkdir()
    with pytest.raises(DataError, match="class folder .*bird is empty"):
        build_data(base.data)
    (root / "train" / "bird").rmdir()
    _png(root / "test" / "fox" / "0.png", np.zeros((12, 10, 3), np.uint8))
    with pytest.raises(DataError, match="class folder 'fox' that the training split lacks"):
        build_data(base.data)
    with pytest.raises(ConfigError, match="transform 'blur:3' is not one of"):
        build_data(base.replace(**{"data.train_transforms": ["blur:3"]}).data)
    r = run_cli("train", *sets(*IF, f"data.root={root}", "data.eval_transforms=[resize:8x8]", "data.train_transforms=[resize:8x8]"),
                "--run-dir", str(tmp_path / "cli"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "error:" in r.stderr


@pytest.mark.fast
def test_random_crop_pads_and_draws_as_torchvisions_random_crop():
    """``random_crop:S:P`` is torchvision's ``RandomCrop(S, padding=P, pad_if_needed=True)`` with black
    padding: P pixels on every border, then a crop whose top (drawn first) and left are uniform over the
    places it fits; an image smaller than S is padded by what it lacks on both sides."""
    import random

    from brickyard.data.transforms import Pipeline
    img = (torch.arange(2 * 6 * 5) % 200 + 50).to(torch.uint8).view(2, 6, 5)  # no pixel is black
    pipe = Pipeline(["random_crop:6x5:2"], 2)
    seen = set()
    for seed in range(200):
        rng, twin = random.Random(seed), random.Random(seed)
        out = pipe(img, rng)
        top, left = twin.randint(0, 6 + 4 - 6), twin.randint(0, 5 + 4 - 5)
        padded = torch.nn.functional.pad(img, (2, 2, 2, 2))
        assert out.shape == (2, 6, 5) and torch.equal(out, padded[:, top:top + 6, left:left + 5])
        seen.add((top, left))
    assert len(seen) == 5 * 5  # every place, each drawn
    small = Pipeline(["random_crop:8"], 2)(img, random.Random(0))  # 6 x 5 to 8 x 8: padded by 2 and 3 a side
    assert small.shape == (2, 8, 8) and (small > 0).sum() == img.numel()
    for bad in ("random_crop:0", "random_crop:32:x", "random_crop:32:-1", "random_crop", "random_crop:32:99999"):
        with pytest.raises(ConfigError, match="is not one of"):
            load_config("mnist", IF + [f"data.train_transforms=[{bad}]"])


@pytest.mark.fast
def test_linked_folders_are_read_once_and_hidden_ones_not_at_all(tmp_path):
    """A class folder that is a link, a folder linked inside one (torchvision's ImageFolder follows them), a link
    back up the tree (read once, not a loop), a dangling link, and Jupyter's hidden checkpoint copies."""
    from brickyard.data.imagefolder import scan
    store, root = tmp_path / "store", tmp_path / "pics" / "train"
    for i in range(3):
        _png(store / "cats" / f"{i}.png", np.zeros((4, 4), np.uint8))
        _png(store / "more_dogs" / f"{i}.png", np.zeros((4, 4), np.uint8))
        _png(root / "dog" / f"{i}.png", np.zeros((4, 4), np.uint8))
    (root / "cat").symlink_to(store / "cats")
    (root / "dog" / "batch2").symlink_to(store / "more_dogs")
    (root / "dog" / "batch2_again").symlink_to(store / "more_dogs")  # the same real folder: read once
    (root / "dog" / "up").symlink_to(root / "dog")
    (root / "dog" / "gone.png").symlink_to(tmp_path / "nothing.png")
    _png(root / "dog" / ".ipynb_checkpoints" / "0-checkpoint.png", np.zeros((4, 4), np.uint8))
    (root / "dog" / ".DS_Store").write_bytes(b"\0")
    files, labels, classes = scan(root)
    assert classes == ["cat", "dog"] and labels.count(0) == 3 and labels.count(1) == 6, files
    assert not any("checkpoint" in str(f) or "/up/" in str(f) for f in files), files


@pytest.mark.fast
def test_what_windows_and_macos_leave_in_a_photo_folder_is_left_out_and_other_files_are_still_named(tmp_path):
    """Windows Explorer's Thumbs.db and desktop.ini (hidden by attribute there, not by a dot) and the __MACOSX folder
    of a zip made on a Mac are left out, as .DS_Store is; any other file that is not an image is still an error."""
    from brickyard.data.imagefolder import scan
    root = tmp_path / "train"
    for c in ("cat", "dog"):
        for i in range(2):
            _png(root / c / f"IMG_{i}.PNG", np.zeros((4, 4), np.uint8))
    (root / "cat" / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (root / "dog" / "desktop.ini").write_text("[.ShellClassInfo]")
    (root / "dog" / "sub").mkdir()
    (root / "dog" / "sub" / "THUMBS.DB").write_bytes(b"\0")
    (root / "__MACOSX" / "cat").mkdir(parents=True)
    (root / "__MACOSX" / "cat" / "._IMG_0.PNG").write_bytes(b"\0\5\26\7")
    (root / "dog" / "__MACOSX").mkdir()
    (root / "dog" / "__MACOSX" / "._IMG_1.PNG").write_bytes(b"\0\5\26\7")
    files, labels, classes = scan(root)
    assert classes == ["cat", "dog"] and labels == [0, 0, 1, 1], files
    (root / "dog" / "sub" / "notes.txt").write_text("taken in May")
    with pytest.raises(DataError, match=r"notes.txt is not an image file \(extension .txt\)"):
        scan(root)


def test_train_on_all_on_an_image_folder_leaves_val_unread_and_refuses_a_val_fraction(tmp_path):
    root = tmp_path / "pics"
    for split, n in (("train", 4), ("val", 2)):
        for c in ("cat", "dog"):
            for i in range(n):
                _png(root / split / c / f"{i}.png", (np.random.rand(12, 10, 3) * 255).astype(np.uint8))
    base = load_config("mnist", IF + [f"data.root={root}", "data.eval_transforms=[resize:8x8]", "data.train_transforms=[resize:8x8]"])
    d = build_data(base.data)
    assert len(d.train) == 8 and len(d.val) == 4
    d = build_data(base.replace(**{"data.train_on_all": True}).data)
    assert len(d.train) == 8 and d.val is None
    (root / "val").rename(root / "held")
    assert len(build_data(base.replace(**{"data.val_fraction": 0.25}).data).train) == 6
    with pytest.raises(ConfigError, match=r"data.train_on_all trains on every training image, so nothing is left for data.val_fraction"):
        base.replace(**{"data.train_on_all": True, "data.val_fraction": 0.25})
    r = run_cli("train", *sets(*IF, f"data.root={root}", "data.train_on_all=true", "data.val_fraction=0.25"), "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and "error: data.train_on_all" in r.stderr
    assert not (tmp_path / "r").exists()


def test_finetune_frozen_layers_stay_bit_identical_and_head_gets_its_rate(tmp_path):
    pre = tmp_path / "pre"
    api.train_config(load_config("mnist", SYNTH + ["model.name=mnist_cnn", "train.epochs=1", "data.classes=[0, 1, 2, 3, 4]"]), pre)
    src = checkpoint.step_checkpoints(pre / "checkpoints")[-1]
    before = checkpoint.load(src)["model"]
    run = tmp_path / "ft"
    r = run_cli("train", *sets(*SYNTH, "model.name=mnist_cnn", "train.epochs=2", "data.classes=[5, 6, 7, 8, 9]",
                               f"finetune.init_from={src}", "finetune.reset_head=true", "finetune.freeze=[conv1.*]",
                               "finetune.head_lr_mult=10", "optim.lr=0.01"), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert "param group head fc" in r.stdout and "lr 0.1 (x10)" in r.stdout and "frozen: 2 parameter tensors" in r.stdout
    after = checkpoint.load(checkpoint.step_checkpoints(run / "checkpoints")[-1])["model"]
    assert torch.equal(after["conv1.weight"], before["conv1.weight"]) and torch.equal(after["conv1.bias"], before["conv1.bias"])
    assert not torch.equal(after["conv2.weight"], before["conv2.weight"])
    assert json.loads((run / "summary.json").read_text())["test_accuracy"] > 0.5


def test_finetune_loads_plain_state_dicts_and_reports_mismatches(tmp_path):
    from brickyard.models import create
    tv = create("resnet18_imagenet", 1000, 3, (224, 224)).state_dict()
    path = tmp_path / "resnet18.pth"
    torch.save({f"module.{k}": v for k, v in tv.items()}, path)
    from brickyard.models.finetune import prepare
    from brickyard.observe.logs import Logger
    cfg = load_config("mnist", [f"finetune.init_from={path}", "finetune.reset_head=true", "finetune.freeze=[conv1.*, layer1.*]"]).finetune
    model = prepare(create("resnet18_imagenet", 7, 3, (224, 224)), cfg, 7, Logger(console=False))
    assert model.fc.out_features == 7 and torch.equal(model.conv1.weight, tv["conv1.weight"])
    assert not model.layer1[0].conv1.weight.requires_grad and model.layer2[0].conv1.weight.requires_grad
    model.train()
    model(torch.randn(2, 3, 64, 64))
    assert not model.layer1[0].bn1.training and model.layer2[0].bn1.training  # frozen batch norm stays in eval mode
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \(1000, 512\) in .* the model expects \(7, 512\) \(set finetune.reset_head"):
        prepare(create("resnet18_imagenet", 7, 3, (224, 224)), load_config("mnist", [f"finetune.init_from={path}"]).finetune, 7, Logger(console=False))
    with pytest.raises(ConfigError, match="pattern 'stem.\\*' matches no parameter"):
        prepare(create("resnet18_imagenet", 7, 3, (224, 224)), load_config("mnist", ["finetune.freeze=[stem.*]"]).finetune, 7, Logger(console=False))
    from safetensors.torch import save_file
    save_file(tv, str(tmp_path / "w.safetensors"))
    m = prepare(create("resnet18_imagenet", 1000, 3, (224, 224)),
                load_config("mnist", [f"finetune.init_from={tmp_path / 'w.safetensors'}"]).finetune, 1000, Logger(console=False))
    assert torch.equal(m.fc.weight, tv["fc.weight"])


def test_finetune_refuses_weights_of_another_model_or_not_finite_and_reads_a_wrapped_module(tmp_path):
    """A file none of whose names is the model's used to load nothing and train from scratch behind two warnings."""
    from brickyard.models import create
    from brickyard.models.finetune import prepare
    from brickyard.observe.logs import Logger
    own = create("mnist_cnn", 10, 1, (28, 28)).state_dict()
    cfg = lambda path: load_config("mnist", [f"finetune.init_from={path}"]).finetune  # noqa: E731
    other = tmp_path / "other.pth"
    torch.save({"encoder.0.weight": torch.ones(4, 4), "encoder.0.bias": torch.ones(4), "head.weight": torch.ones(2, 4)}, other)
    with pytest.raises(CheckpointError, match=r"none of the 3 tensors in .*other.pth is one of the model's \(the file's "
                                              r"names look like encoder.0.weight, encoder.0.bias, head.weight; the model's like conv1.weight"):
        prepare(create("mnist_cnn", 10, 1, (28, 28)), cfg(other), 10, Logger(console=False))
    lightning = tmp_path / "lightning.pt"  # a LightningModule whose network is its attribute `model`
    torch.save({"state_dict": {f"model.{k}": v for k, v in own.items()}}, lightning)
    m = prepare(create("mnist_cnn", 10, 1, (28, 28)), cfg(lightning), 10, Logger(console=False))
    assert all(torch.equal(m.state_dict()[k], v) for k, v in own.items())
    with pytest.raises(CheckpointError, match=r"holds a 'state_dict' \(as Lightning's do\), not a brickyard run's; to "
                                              r"train from its weights, set finetune.init_from=.*lightning.pt\.$"):
        checkpoint.load(lightning)  # what eval and predict read
    # a Lightning .ckpt whose save_hyperparameters() kept a Path: never unpickled, and the way to its weights said
    from pathlib import PosixPath
    objects = tmp_path / "epoch=0-step=9.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in own.items()}, "hyper_parameters": {"root": PosixPath("/data")}},
               objects)
    with pytest.raises(CheckpointError, match=r"epoch=0-step=9.ckpt holds Python objects besides tensors \(such as "
                                              r"pathlib.PosixPath\), and unpickling them can run code.*\['state_dict'\]"):
        prepare(create("mnist_cnn", 10, 1, (28, 28)), cfg(objects), 10, Logger(console=False))
    with pytest.raises(CheckpointError, match=r"holds Python objects besides tensors \(such as pathlib.PosixPath\), "
                                              r"which brickyard does not unpickle"):
        checkpoint.load(objects)
    bad = dict(own)
    bad["conv2.weight"] = bad["conv2.weight"].clone()
    bad["conv2.weight"][0, 0, 0, 0] = float("nan")
    torch.save(bad, tmp_path / "nan.pth")
    with pytest.raises(CheckpointError, match=r"conv2.weight in .*nan.pth holds NaN or infinite values"):
        prepare(create("mnist_cnn", 10, 1, (28, 28)), cfg(tmp_path / "nan.pth"), 10, Logger(console=False))
    r = run_cli("train", *sets(*SYNTH, "model.name=mnist_cnn", f"finetune.init_from={other}"), "--run-dir", str(tmp_path / "r"))
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: finetune.init_from: none of the 3 tensors")
    assert not (tmp_path / "r" / "checkpoints").exists() or not any((tmp_path / "r" / "checkpoints").iterdir())


def test_memory_cache_means_no_decoding_after_the_first_epoch(tmp_path):
    root = tmp_path / "pics"
    for c in ("a", "b"):
        for i in range(6):
            _png(root / "train" / c / f"{i}.png", (np.random.rand(10, 10) * 255).astype(np.uint8))
    cfg = load_config("mnist", IF + [f"data.root={root}", "data.train_transforms=[resize:8x8, hflip]",
                                     "data.eval_transforms=[resize:8x8]", "data.cache=memory"])
    with pytest.raises(ConfigError, match="data.cache: memory needs transforms that reach a fixed size"):
        build_data(cfg.replace(**{"data.train_transforms": ["random_resized_crop:8"]}).data)
    ds = build_data(cfg.data).train.dataset
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    first = sorted(tuple(x.shape) for x, _ in loader)
    assert bool(ds.filled.all())  # the workers filled the shared cache
    for f in (root / "train").rglob("*.png"):
        f.unlink()  # a second epoch that decoded anything would fail now
    second = sorted(tuple(x.shape) for x, _ in loader)
    assert first == second and len(second) == 3


def test_inspect_takes_an_image_folder_config(digits):
    r = run_cli("inspect", "mnist", *sets(*IF, f"data.root={digits}"), "--batch", "8")
    assert r.returncode == 0, r.stderr
    assert "conv1" in r.stdout and "8x20x28x28" in r.stdout


def test_a_small_export_keeps_every_class_and_trains(tmp_path):
    out = tmp_path / "few"
    r = run_cli("data", "export", "mnist", str(out), "--limit", "3")
    assert r.returncode == 0 and "30 train, 30 val, 30 test" in r.stdout, r.stderr
    assert all(len(list((out / s / str(c)).iterdir())) == 3 for s in ("train", "val", "test") for c in range(10))
    t = run_cli("train", *sets(*IF, f"data.root={out}", "train.epochs=1", "data.batch_size=10"), "--run-dir", str(tmp_path / "r"))
    assert t.returncode == 0, t.stderr


@pytest.mark.fast
def test_default_transforms_follow_the_images_own_size(digits, tmp_path):
    small = build_data(load_config("mnist", ["data.name=imagefolder", f"data.root={digits}", "data.normalize=mnist"]).data)
    assert small.image_size == (28, 28) and small.train.dataset[0][0].shape == (1, 28, 28)
    photos = tmp_path / "photos"
    for c in ("cat", "dog"):
        for i in range(2):
            _png(photos / "train" / c / f"{i}.png", (np.random.rand(300, 400, 3) * 255).astype(np.uint8))
    big = build_data(load_config("mnist", ["data.name=imagefolder", f"data.root={photos}"]).data)
    assert big.image_size == (224, 224) and big.train.dataset[0][0].shape == (3, 224, 224)


def test_random_crops_are_the_same_on_any_number_of_processes_and_after_a_resume(tmp_path):
    """An image's random crop and flip are drawn from (seed, epoch, image): 1 process, 3 processes and a run
    stopped at step 4 and resumed on 2 processes with loader workers end with the same weights (they drew
    from each worker's own stream before, 8e-3 apart after 5 steps)."""
    from brickyard.data.imagefolder import ImageFolderDataset, scan
    from brickyard.data.photos import make_photo_folder
    from brickyard.data.transforms import Pipeline
    make_photo_folder(tmp_path / "photos", classes=3, per_class={"train": 6, "test": 2}, seed=3, min_size=40, max_size=72)
    files, labels, _ = scan(tmp_path / "photos" / "train")
    ds = ImageFolderDataset(files, labels, Pipeline(["random_resized_crop:24", "hflip"], 3))
    before = torch.get_rng_state(), random.getstate()
    assert torch.equal(ds[(4, 11)][0], ds[(4, 11)][0]) and not torch.equal(ds[(4, 11)][0], ds[(4, 12)][0])
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]  # the callers' streams untouched
    base = sets("data.name=imagefolder", f"data.root={tmp_path / 'photos'}", "model.name=mlp",
                "data.train_transforms=[random_resized_crop:24, hflip]", "data.eval_transforms=[resize:24x24]",
                "data.global_batch_size=6", "train.epochs=2", "train.progress=none", "train.threads=1",
                "train.plots=false", "train.tensorboard=false", "train.precision=fp32", "optim.name=sgd", "optim.lr=0.1",
                "data.num_workers=0")
    runs = {"one": [], "three": ["--devices", "cpu:3"]}
    for name, extra in runs.items():
        r = run_cli("train", *base, *extra, "--run-dir", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("train", *base, "--set", "train.max_steps=4", "--run-dir", str(tmp_path / "resumed"))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("train", *base, "--set", "train.max_steps=0", "--set", "data.num_workers=2", "--devices", "cpu:2",
                "--run-dir", str(tmp_path / "resumed"), "--resume", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    final = {n: checkpoint.load(sorted((tmp_path / n / "checkpoints").glob("step-*.pt"))[-1]) for n in ("one", "three", "resumed")}
    assert {s["step"] for s in final.values()} == {6}
    for other in ("three", "resumed"):
        assert max((final["one"]["model"][k] - final[other]["model"][k]).abs().max().item() for k in final["one"]["model"]) < 1e-6


def test_eval_of_a_split_the_folder_lacks_names_the_folder_and_the_splits_it_has(tmp_path):
    root = tmp_path / "pics"
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            for i in range(2):
                _png(root / split / c / f"{i}.png", (np.random.rand(12, 10) * 255).astype(np.uint8))
    api.train_config(load_config("mnist", IF + [f"data.root={root}", "train.max_steps=1", "train.threads=1",
                                                "train.plots=false", "train.tensorboard=false"]), tmp_path / "r")
    r = run_cli("eval", str(tmp_path / "r"), "--split", "test")
    assert r.returncode == 2 and r.stderr.strip() == \
        f"error: --split test: this run's data has no test split ({root} has no test/ folder); it has train, val.", r.stderr
    assert json.loads(run_cli("eval", str(tmp_path / "r"), "--split", "val").stdout)["accuracy"] is not None
