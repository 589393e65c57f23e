"""``brickyard data export mnist DIR``: an IDX data set as a PNG image folder.

Writes ``DIR/train/<class>/<index>.png`` (the first 50,000 training images), ``DIR/val/...`` (the
last 10,000) and ``DIR/test/...``, so the image-folder path sees the same split as the IDX path.
Each file is written to a temporary name and renamed, so an interrupted export leaves no
half-written PNG. ``limit`` keeps the first N images *of each class* in each split, so a small
export still has every class (an empty class folder is an error for the image-folder loader).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from brickyard.data import idx
from brickyard.files import write_atomic


def export_idx(name: str, out: Path, root: str | None = None, limit: int = 0, jpeg_size: int = 0) -> dict[str, int]:
    """``jpeg_size``: write RGB JPEGs upscaled to that many pixels a side (bicubic, quality 90), a
    benchmark workload of photo-sized files with MNIST's labels; 0 writes the images as they are (PNG)."""
    arrays = idx.load_idx(name, root, allow_download=True)
    x, y = arrays["train-images-idx3-ubyte"], arrays["train-labels-idx1-ubyte"]
    splits = {"train": (x[:50000], y[:50000]), "val": (x[50000:], y[50000:]),
              "test": (arrays["t10k-images-idx3-ubyte"], arrays["t10k-labels-idx1-ubyte"])}
    classes = [c.replace("/", "-") for c in idx.classes(name)]
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
            write_atomic(path, lambda f: im.save(f, format="JPEG", quality=90) if jpeg_size else im.save(f, format="PNG"))
        counts[split] = len(keep)
    return counts
