"""Datasets of other items than (tensor, label) pairs: Hugging Face ``datasets`` (a real ``datasets.Dataset``,
made offline from PIL images, with and without ``with_format("torch")``), dict items of other names, PIL
images, a list of pairs. Pinned: fp32, one thread, a few steps."""
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from brickyard import api, predict
from brickyard.data import from_user
from brickyard.errors import ConfigError, DataError
from brickyard.training import checkpoint

RUN = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.plots=false", "train.tensorboard=false",
       "data.batch_size=8"]


def _photos(n, seed=0):
    """n 12 x 10 RGB images whose class (0-2) is the bright channel, and their labels."""
    rng = np.random.default_rng(seed)
    labels = [i % 3 for i in range(n)]
    images = []
    for c in labels:
        pixels = rng.integers(0, 60, (12, 10, 3), dtype=np.uint8)
        pixels[..., c] += 150
        images.append(Image.fromarray(pixels))
    return images, labels


def _net():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("form", [None, "torch", "numpy"])
def test_a_hugging_face_dataset_trains_and_names_its_classes(form, tmp_path):
    """As ``load_dataset`` gives it (PIL images), and in torch's and NumPy's formats (C x H x W tensors; H x W x C
    read-only arrays, read channels-first because the model takes only that)."""
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets not installed (the [hf] extra)")
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["red", "green", "blue"])})

    def split(n, seed):
        images, labels = _photos(n, seed)
        ds = datasets.Dataset.from_dict({"img": images, "label": labels}, features=features)
        return ds.with_format(form) if form else ds

    train, test = split(48, 0), split(12, 1)
    torch.manual_seed(0)
    model = _net()
    summary = api.fit(model, train, test_data=test, run_dir=tmp_path / "r",
                      overrides=RUN + ["train.epochs=30", "optim.lr=0.01", "data.num_workers=1"])
    assert summary["test_accuracy"] == 1.0, summary  # the bright channel is learnt
    log = (tmp_path / "r" / "train.log").read_text()
    assert "train_data: items are dicts; read 'img' as the input and 'label' as the label" in log
    assert ("the inputs are 12x10x3 (channels last" in log) == (form == "numpy")
    saved = checkpoint.load(checkpoint.step_checkpoints(tmp_path / "r" / "checkpoints")[-1])
    assert saved["meta"]["classes"] == ["red", "green", "blue"]  # the ClassLabel's names: predict and plots name classes
    pixels = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1) for im in _photos(3, 2)[0]])
    assert predict(model, pixels)["predicted"].tolist() == [0, 1, 2]


def test_dict_items_of_other_names_pil_pairs_and_lists(tmp_path):
    images, labels = _photos(6)

    class Items(torch.utils.data.Dataset):
        def __init__(self, make):
            self.make = make

        def __len__(self):
            return 6

        def __getitem__(self, i):
            return self.make(i)

    data = from_user(Items(lambda i: {"pixel_values": torch.zeros(3, 4, 4), "image": images[i], "labels": labels[i]}), num_classes=3)
    x, y = data.train.dataset[1]
    assert x.shape == (3, 4, 4) and y == 1  # pixel_values (an image processor's) before image
    data = from_user(Items(lambda i: (images[i], labels[i])), num_classes=3)
    x, y = data.train.dataset[0]
    assert x.dtype == torch.uint8 and x.shape == (3, 12, 10) and torch.equal(x.permute(1, 2, 0), torch.from_numpy(np.array(images[0])))
    grey = from_user([(images[i].convert("L"), labels[i]) for i in range(6)], num_classes=3)  # a list of pairs
    assert grey.train.dataset[0][0].shape == (1, 12, 10) and grey.in_channels == 1
    with pytest.raises(DataError, match=r"train_data: items are dicts of 'pic', 'class'; brickyard reads the input "
                                        r"from the first of pixel_values, image, img"):
        from_user(Items(lambda i: {"pic": images[i], "class": labels[i]}), num_classes=3)
    with pytest.raises(DataError, match=r"train_data: a mapping of splits \('train', 'test'\), as Hugging Face's "
                                        r"load_dataset returns; pass one split, e.g. fit\(model, ds\['train'\]"):
        from_user({"train": Items(lambda i: (images[i], labels[i])), "test": []})
    summary = api.fit(_net(), [(images[i], labels[i]) for i in range(6)], num_classes=3, run_dir=tmp_path / "r",
                      overrides=RUN + ["train.max_steps=2"])
    assert summary["steps"] == 2
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize("form", ["torch", "numpy"])
def test_a_column_stored_as_uint8_arrays_trains_as_images(form, tmp_path):
    """``Array3D(..., "uint8")`` comes out of the torch and NumPy formats as int64 (they widen every integer);
    brickyard reads it back as uint8, so a float model takes it, scaled to [0, 1] as images are."""
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets not installed (the [hf] extra)")
    images, labels = _photos(48)
    pixels = [np.array(im).transpose(2, 0, 1) for im in images]  # C x H x W, as a user who stacked arrays stores them
    features = datasets.Features({"image": datasets.Array3D((3, 12, 10), "uint8"), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"image": pixels, "label": labels}, features=features).with_format(form)
    assert ds[0]["image"].dtype in (torch.int64, np.int64)  # what the format gives: the reason for the cast
    torch.manual_seed(0)
    summary = api.fit(_net(), ds, test_data=ds, run_dir=tmp_path / "r",
                      overrides=RUN + ["train.epochs=30", "optim.lr=0.01", "data.num_workers=1"])
    assert summary["test_accuracy"] == 1.0, summary
    log = (tmp_path / "r" / "train.log").read_text()
    assert "'image' is stored as uint8: read as uint8 images, scaled to [0, 1]" in log


def test_unlabelled_items_are_one_sentence_before_training(tmp_path):
    """A Hugging Face split with -1 labels (published without answers) is refused before anything is written,
    for the training split and for the test split; another dataset's -1 is one sentence at its batch."""
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets not installed (the [hf] extra)")
    images, labels = _photos(24)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")})
    good = datasets.Dataset.from_dict({"img": images, "label": labels}, features=features)
    unlabelled = datasets.Dataset.from_dict({"img": images, "label": [-1] * 3 + labels[3:]}, features=features)
    for train, test, name in ((unlabelled, None, "train_data"), (good, unlabelled.shuffle(seed=1), "test_data")):
        with pytest.raises(DataError, match=rf"^{name}: 3 of 24 items have a negative 'label' \(-1 at item \d+\); Hugging "
                                            r"Face marks unlabelled items so: keep the labelled ones \(`ds.filter"):
            api.fit(_net(), train, test_data=test, run_dir=tmp_path / name, overrides=RUN + ["train.max_steps=2"])
        assert not (tmp_path / name).exists()

    class Items(torch.utils.data.Dataset):  # not Hugging Face's: its labels are met batch by batch
        def __len__(self):
            return 24

        def __getitem__(self, i):
            return torch.from_numpy(np.array(images[i]).transpose(2, 0, 1).copy()), -1 if i == 5 else labels[i]

    with pytest.raises(DataError, match=r"^a batch holds label -1, outside the model's 3 classes 0\.\.2: fix the labels"):
        api.fit(_net(), Items(), run_dir=tmp_path / "items", overrides=RUN + ["train.epochs=1"])


def test_pil_images_of_many_sizes_go_through_the_image_folders_transforms(tmp_path):
    """Photos of many sizes and modes (a grey one among colour ones) batch: ``auto`` resizes small images to the
    first one's size, as image folders do, and ``data.train_transforms`` applies as written. The random ones
    draw from the loader's per-item seeds: the same weights with 0 and 1 loader workers."""
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets not installed (the [hf] extra)")
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (20 + i % 5, 24 + i % 3, 3), dtype=np.uint8)) for i in range(32)]
    images[3] = images[3].convert("L")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    ds = datasets.Dataset.from_dict({"image": images, "label": [i % 2 for i in range(32)]}, features=features)

    def run(name, *extra):
        torch.manual_seed(0)
        model = _net()
        api.fit(model, ds, test_data=ds, run_dir=tmp_path / name, overrides=RUN + ["train.max_steps=4", "train.epochs=0", *extra])
        return model, (tmp_path / name / "train.log").read_text()

    _, log = run("auto")
    assert "train_data: PIL images, read through the transforms [resize:20x24] (evaluation [resize:20x24])" in log
    crops = ["data.train_transforms=[random_resized_crop:16, hflip]", "data.eval_transforms=[resize:16x16]"]
    a, log = run("w0", *crops, "data.num_workers=0")
    b, _ = run("w1", *crops, "data.num_workers=1")
    assert "[random_resized_crop:16, hflip] (evaluation [resize:16x16])" in log
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ConfigError, match=r"^data.train_transforms must end in a fixed size .* e.g. resize:20x24 \(the first"):
        api.fit(_net(), ds, run_dir=tmp_path / "x", overrides=RUN + ["train.max_steps=1", "data.train_transforms=[hflip]"])
    assert not (tmp_path / "x").exists()

    class Sized(torch.utils.data.Dataset):  # tensors of many sizes, which brickyard does not transform
        def __len__(self):
            return len(images)

        def __getitem__(self, i):
            return torch.from_numpy(np.array(images[i].convert("RGB")).transpose(2, 0, 1).copy()), i % 2

    with pytest.raises(DataError, match=r"^inputs of different sizes meet in one batch \(3x2\d+x2\d+, 3x2\d+x2\d+.*\): end "
                                        r"data.train_transforms"):  # in a worker torch said "Trying to resize storage ..."
        api.fit(_net(), Sized(), run_dir=tmp_path / "y", overrides=RUN + ["train.max_steps=1", "data.num_workers=1"])


def test_an_image_that_does_not_decode_is_one_sentence(tmp_path):
    """A Hugging Face Image column holding bytes that are no image: the item is named, in a loader worker too
    (it was PIL's UnidentifiedImageError with the worker's traceback)."""
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets not installed (the [hf] extra)")
    images, labels = _photos(16)
    stored = []
    for im in images:
        out = io.BytesIO()
        im.save(out, "PNG")
        stored.append({"bytes": out.getvalue(), "path": None})
    stored[5] = {"bytes": b"not a PNG, whatever the name says", "path": "cat.png"}
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")})
    ds = datasets.Dataset.from_dict({"img": stored, "label": labels}, features=features)
    with pytest.raises(DataError, match=r"^item 5's image is unreadable or truncated \(UnidentifiedImageError: cannot identify "
                                        r"image file .*\); fix or drop it"):
        api.fit(_net(), ds, run_dir=tmp_path / "r", overrides=RUN + ["train.epochs=1", "data.num_workers=1"])
