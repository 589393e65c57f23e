"""Image folders tagged by a CSV of image,tags (data/tagged.py): what they read, and a stranger's CSV."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from brickyard.config import DataConfig
from brickyard.data import build_data
from brickyard.errors import DataError


def _folder(root, splits, ext=".png"):
    """``splits``: {split: [(file name, tags), ...]}; writes 8 x 8 grey images (each a different shade) and the CSVs
    (a header first) of the given lines, verbatim where a line is a string."""
    shade = 0
    for split, rows in splits.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        lines = ["image,tags"]
        for row in rows:
            if isinstance(row, str):
                lines.append(row)
                continue
            name, tags = row
            shade += 7
            file = name.removeprefix("./")
            file = file if "." in file else file + ext
            Image.fromarray(np.full((8, 8), shade % 256, np.uint8)).save(root / split / file)
            lines.append(f"{name},{tags}")
        (root / f"{split}.csv").write_text("\n".join(lines) + "\n")
    return root


def _read(root, **kw):
    return build_data(DataConfig(name="imagefolder", root=str(root), **kw))


def _caught(root, **kw):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        data = _read(root, **kw)
    return data, [str(w.message) for w in got]


@pytest.mark.fast
def test_a_tagged_folder_reads_multi_hot_rows_over_the_training_tags(tmp_path):
    """Sorted training tags; names with and without extension and with ./; a BOM; the validation and test CSVs."""
    root = _folder(tmp_path, {"train": [("a", "river cloudy"), ("b.png", "clear"), ("./c", "cloudy  river  primary")],
                              "val": [("v1", "clear river")], "test": [("t1", "primary")]})
    (root / "train.csv").write_bytes(b"\xef\xbb\xbf" + (root / "train.csv").read_bytes())
    data, said = _caught(root)
    assert said == [] and data.multilabel and data.classes == ["clear", "cloudy", "primary", "river"]
    assert torch.stack([data.train.dataset[i][1] for i in range(3)]).tolist() == [[0, 1, 0, 1], [1, 0, 0, 0], [0, 1, 1, 1]]
    assert data.val.dataset[0][1].tolist() == [1, 0, 0, 1] and data.test.dataset[0][1].tolist() == [0, 0, 1, 0]
    assert [f.name for f in data.train.dataset.files] == ["a.png", "b.png", "c.png"] and data.image_size == (8, 8)


@pytest.mark.fast
def test_one_tag_an_image_reads_as_classes_unless_the_task_says_several(tmp_path):
    """id,breed as Kaggle's dog breeds: class indices (data.task auto); multilabel keeps rows; single refuses two tags."""
    root = _folder(tmp_path / "one", {"train": [("a", "pug"), ("b", "collie"), ("c", "pug")], "val": [("d", "collie")]})
    data = _read(root)
    assert not data.multilabel and data.classes == ["collie", "pug"] and [data.train.dataset[i][1] for i in range(3)] == [1, 0, 1]
    assert _read(root, task="multilabel").multilabel
    two = _folder(tmp_path / "two", {"train": [("a", "pug"), ("b", "collie pug")]})
    with pytest.raises(DataError, match=r"data.task: single takes one tag an image, and image 2 of .*train.csv has 2"):
        _read(two, task="single")


@pytest.mark.fast
def test_a_strangers_csv_is_one_sentence(tmp_path):
    """An image the folder lacks (counted), a missing header, a line of one column, one image twice, a name two files
    match, an empty CSV: each a DataError naming the file and line."""
    cases = {
        "unknown": ([("a", "x"), "nope.png,x", "gone,y"], r"train.csv names 2 image\(s\) that .* does not hold \(first: line 3, 'nope.png'\)"),
        "header": ([("a", "x")], r"the first line names an image \('a'\).*add the line image,tags above it"),
        "column": ([("a", "x"), "b"], r"line 3 has one column \('b'\)"),
        "twice": ([("a", "x"), "a.png,y"], r"lines 2 and 3 both name 'a.png'"),
        "empty": ([], r"train.csv is empty"),
        "one-column header": ([], r"the header 'image' has one column"),
    }
    for case, (rows, message) in cases.items():
        root = _folder(tmp_path / case.replace(" ", "-"), {"train": rows})
        csv = root / "train.csv"
        if case == "header":
            csv.write_text(csv.read_text().split("\n", 1)[1])
        elif case == "empty":
            csv.write_text("\n")
        elif case == "one-column header":
            csv.write_text("image\na.png\n")
        with pytest.raises(DataError, match=message):
            _read(root)
    root = _folder(tmp_path / "both", {"train": [("a", "x")]})
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / "train" / "a.jpg")
    (root / "train.csv").write_text("image,tags\na,x\n")
    with pytest.raises(DataError, match=r"line 2: 'a' matches 2 files .*name it with its extension"):
        _read(root)


@pytest.mark.fast
def test_no_tags_a_tag_only_validation_has_and_unlisted_images_are_counted_warnings(tmp_path):
    root = _folder(tmp_path, {"train": [("a", "x"), ("b", ""), ("c", "x y"), ("d", "")],
                              "val": [("v1", "x z"), ("v2", "z w"), ("v3", "y")]})
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / "train" / "stray.png")
    data, said = _caught(root)
    assert len(said) == 3, said
    assert "2 image(s) have no tags (first: b.png)" in said[0]
    assert "1 image(s) that train.csv does not list are left out (first: stray.png)" in said[1]
    assert "2 tag(s) only the val split has (w, z), on 2 image(s)" in said[2]
    assert data.classes == ["x", "y"] and data.train.dataset[1][1].tolist() == [0, 0]
    assert [data.val.dataset[i][1].tolist() for i in range(3)] == [[1, 0], [0, 0], [0, 1]]


def test_a_tagged_folder_exported_from_the_mosaics_trains_and_predicts_its_tags(tmp_path):
    """`data export mnist-mosaic` writes PNGs and image,tags CSVs; a run on them learns the digits (mAP), its
    checkpoint keeps the tags and the threshold, and predict gives each image's tag names; a CSV missing its header
    is one error: line before anything is written."""
    from conftest import run_cli, sets
    folder, run = tmp_path / "mosaics", tmp_path / "run"
    r = run_cli("data", "export", "mnist-mosaic", str(folder), "--limit", "1200")
    assert r.returncode == 0 and "1,200 train, 1,200 val, 1,200 test PNG images" in r.stdout, r.stderr[-2000:]
    assert (folder / "train.csv").read_text().startswith("image,tags\n00000.png,")
    common = ["data.name=imagefolder", f"data.root={folder}", "data.normalize=mnist", "train.precision=fp32",
              "train.threads=1", "train.progress=none", "train.plots=false", "data.num_workers=0"]
    r = run_cli("train", "mnist-mosaic", *sets(*common, "train.epochs=8", "data.batch_size=32", "data.global_batch_size=32",
                                               "optim.lr=0.003", "data.eval_limit=400"), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run / "summary.json").read_text())
    assert "data.task multilabel" in (run / "train.log").read_text()
    assert s["test_map"] > 0.85, s["test_map"]  # measured 0.913; tags at chance score about 0.3
    files = [str(folder / "test" / f"{i:05d}.png") for i in range(20)]
    p = json.loads(run_cli("predict", str(run), *files).stdout)
    truth = [line.split(",")[1].split() for line in (folder / "test.csv").read_text().split("\n")[1:21]]
    right = sum(set(names) == set(t) for names, t in zip(p["predicted_names"], truth))
    assert right >= 10 and all(set(n) <= set("0123456789") for n in p["predicted_names"]), (p["predicted_names"], truth)
    (folder / "val.csv").write_text("\n".join((folder / "val.csv").read_text().split("\n")[1:]))
    before = sorted(p.name for p in run.rglob("*"))
    r = run_cli("train", "mnist-mosaic", *sets(*common, "train.epochs=1"), "--run-dir", str(tmp_path / "bad"))
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: ") and "val.csv" in r.stderr
    assert not (tmp_path / "bad").exists() and sorted(p.name for p in run.rglob("*")) == before
