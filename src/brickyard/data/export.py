"""``brickyard data export mnist DIR``: an IDX data set as a PNG image folder.

Writes ``DIR/train/<class>/<index>.png`` (the first 50,000 training images), ``DIR/val/...`` (the
last 10,000) and ``DIR/test/...``, so the image-folder path sees the same split as the IDX path.
Each file is written to a temporary name and renamed, so an interrupted export leaves no
half-written PNG. ``limit`` keeps the first N images *of each class* in each split, so a small
export still has every class (an empty class folder is an error for the image-folder loader).

A folder brickyard writes images into remembers how (``.brickyard-images.json``: the command and its
settings; ``prepare_folder``, also for ``data make-photos``): the same command again completes an
interrupted one (files already there are kept), other settings replace the earlier output (its files are
removed first, so none of another size, format or limit stays behind), and images named as brickyard's
that no such record claims are refused in one sentence, never silently kept.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import numpy as np
from PIL import Image

from brickyard.data import idx
from brickyard.errors import BrickyardError
from brickyard.files import write_atomic, write_json

RECORD = ".brickyard-images.json"
SPLITS = ("train", "val", "test")
_OURS = re.compile(r"^\d{5}\.(png|jpg)$")  # the names export and make-photos write


def _our_files(out: Path) -> list[Path]:
    """The images export and make-photos write: ``split/class/NNNNN.ext``, and a tagged folder's ``split/NNNNN.png``
    and ``split.csv``."""
    folders = [c for split in SPLITS if (out / split).is_dir() for c in [out / split, *(out / split).iterdir()] if c.is_dir()]
    csvs = [out / f"{split}.csv" for split in SPLITS if (out / f"{split}.csv").is_file()]
    return [f for c in folders for f in c.iterdir() if _OURS.match(f.name) and f.is_file()] + csvs


def _recorded(out: Path) -> dict | None:
    try:
        return json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return None


def prepare_folder(out: Path, settings: dict) -> None:
    """Make ``out`` ready for images written with ``settings`` (module docstring): keep the files of an
    interrupted run of the same settings, remove those of other settings, refuse images of no record."""
    earlier, files = _recorded(out), _our_files(out)
    if earlier == settings:
        return
    if earlier is None and files:
        raise BrickyardError(f"{out} already holds images named as brickyard writes them ({files[0].relative_to(out)}), "
                             "with no record of what wrote them; write into an empty folder, or remove its "
                             "train/, val/ and test/ first.")
    for f in files:
        f.unlink()
    for c in {f.parent for f in files} - {out}:
        if not any(c.iterdir()):
            c.rmdir()
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / RECORD, settings)


def export_idx(name: str, out: Path, root: str | None = None, limit: int = 0, jpeg_size: int = 0) -> dict[str, int]:
    """``jpeg_size``: write RGB JPEGs upscaled to that many pixels a side (bicubic, quality 90), a
    benchmark workload of photo-sized files with MNIST's labels; 0 writes the images as they are (PNG)."""
    arrays = idx.load_idx(name, root, allow_download=True)
    x, y = arrays["train-images-idx3-ubyte"], arrays["train-labels-idx1-ubyte"]
    splits = {"train": (x[:50000], y[:50000]), "val": (x[50000:], y[50000:]),
              "test": (arrays["t10k-images-idx3-ubyte"], arrays["t10k-labels-idx1-ubyte"])}
    classes = [c.replace("/", "-") for c in idx.classes(name)]
    prepare_folder(out, {"command": "data export", "name": name, "limit": limit, "jpeg": jpeg_size})
    counts = {}
    for split, (images, labels) in splits.items():
        keep = range(len(labels))
        if limit:
            keep = sorted(i for c in range(len(classes)) for i in np.flatnonzero(labels == c)[:limit])
        for c in classes:
            (out / split / c).mkdir(parents=True, exist_ok=True)
        for i in keep:
            path = out / split / classes[int(labels[i])] / f"{i:05d}.{'jpg' if jpeg_size else 'png'}"
            if path.exists():
                continue
            im = Image.fromarray(np.asarray(images[i]))
            if jpeg_size:
                im = im.convert("RGB").resize((jpeg_size, jpeg_size), Image.BICUBIC)
            write_atomic(path, functools.partial(im.save, format="JPEG", quality=90) if jpeg_size else functools.partial(im.save, format="PNG"))
        counts[split] = len(keep)
    return counts


def export_mosaic(name: str, out: Path, root: str | None = None, limit: int = 0) -> dict[str, int]:
    """The mosaic data set ``name`` (``data.mosaic``) as a folder tagged by CSV files (``data.tagged``):
    ``out/<split>/NNNNN.png`` and ``out/<split>.csv`` of ``image,tags``, each image's tags the class names present
    (spaces in a name written as ``_``: tags are separated by spaces). ``limit``: the first N images of each split."""
    # the mosaics are built as a run builds them; data/__init__ is the package this module belongs to
    from brickyard.config import DataConfig
    from brickyard.data import build_data
    data = build_data(DataConfig(name=name, root=root))
    tags = [c.replace(" ", "_") for c in data.classes]
    prepare_folder(out, {"command": "data export", "name": name, "limit": limit})
    counts = {}
    for split in SPLITS:
        part = getattr(data, split)
        n = min(limit or len(part), len(part))
        (out / split).mkdir(parents=True, exist_ok=True)
        lines = ["image,tags"]
        for i in range(n):
            path = out / split / f"{i:05d}.png"
            if not path.exists():
                write_atomic(path, functools.partial(Image.fromarray(part.images[i, 0].numpy()).save, format="PNG"))
            lines.append(f"{path.name},{' '.join(t for t, on in zip(tags, part.labels[i].tolist()) if on)}")
        write_atomic(out / f"{split}.csv", "\n".join(lines) + "\n")
        counts[split] = n
    return counts
