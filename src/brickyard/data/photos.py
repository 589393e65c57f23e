"""A photo-like image folder for tests and benchmarks: ``brickyard data make-photos DIR``.

Not a data set to train for its own sake: a workload with what photo folders have and MNIST has not.
Every image is a full-colour JPEG of its own size (``min_size`` to ``max_size`` pixels a side, aspect
3:4 to 4:3) with a textured background (a colour gradient, soft blobs and pixel noise, all drawn at
random) and one object of its class: a shape per class (disc, square, triangle, ring, cross, star,
diamond, hexagon, bars, crescent, and again with a hole for more than 10 classes) in a colour near the
class's hue, at a random place, scale and angle, partly hidden by clutter of the other shapes.
Deterministic: the same ``seed`` gives the same files, byte for byte (one ``numpy`` generator per
image, seeded with the seed, split, class and index).

Layout: ``DIR/train/<class>/<i>.jpg``, ``DIR/val/...``, ``DIR/test/...`` (``data.name: imagefolder``,
``data.root: DIR``).
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from brickyard.files import write_atomic

SHAPES = ("disc", "square", "triangle", "ring", "cross", "star", "diamond", "hexagon", "bars", "crescent")


def _polygon(cx, cy, r, n, angle, inner=None):
    """A regular n-gon, or (``inner``) an n-pointed star whose inner vertices lie at radius ``inner``."""
    if inner is None:
        return [(cx + r * math.cos(angle + 2 * math.pi * k / n), cy + r * math.sin(angle + 2 * math.pi * k / n)) for k in range(n)]
    return [(cx + (inner if k % 2 else r) * math.cos(angle + math.pi * k / n),
             cy + (inner if k % 2 else r) * math.sin(angle + math.pi * k / n)) for k in range(2 * n)]


def _bar(cx, cy, half_length, half_width, angle):
    """The corners of a rectangle centred at (cx, cy), its long side along ``angle``."""
    dx, dy = math.cos(angle), math.sin(angle)
    return [(cx + sl * half_length * dx - sw * half_width * dy, cy + sl * half_length * dy + sw * half_width * dx)
            for sl, sw in ((-1, -1), (1, -1), (1, 1), (-1, 1))]


def _shape(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, angle: float, fill, bg) -> None:
    if kind == "disc":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        draw.polygon(_polygon(cx, cy, r, 4, angle), fill=fill)
    elif kind == "triangle":
        draw.polygon(_polygon(cx, cy, r, 3, angle), fill=fill)
    elif kind == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        draw.ellipse([cx - r / 2, cy - r / 2, cx + r / 2, cy + r / 2], fill=bg)
    elif kind == "cross":
        for a in (angle, angle + math.pi / 2):
            draw.polygon(_bar(cx, cy, r, r / 4, a), fill=fill)
    elif kind == "star":
        draw.polygon(_polygon(cx, cy, r, 5, angle, inner=r * 0.45), fill=fill)
    elif kind == "diamond":
        c, n = math.cos(angle), math.sin(angle)
        draw.polygon([(cx + r * c, cy + r * n), (cx - 0.55 * r * n, cy + 0.55 * r * c),
                      (cx - r * c, cy - r * n), (cx + 0.55 * r * n, cy - 0.55 * r * c)], fill=fill)
    elif kind == "hexagon":
        draw.polygon(_polygon(cx, cy, r, 6, angle), fill=fill)
    elif kind == "bars":
        for off in (-0.6, 0.0, 0.6):
            draw.polygon(_bar(cx - off * r * math.sin(angle), cy + off * r * math.cos(angle), r, r * 0.15, angle), fill=fill)
    else:  # crescent
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        ox, oy = r * 0.5 * math.cos(angle), r * 0.5 * math.sin(angle)
        draw.ellipse([cx + ox - r * 0.85, cy + oy - r * 0.85, cx + ox + r * 0.85, cy + oy + r * 0.85], fill=bg)


def _hsv(h: float, s: float, v: float) -> tuple[int, int, int]:
    i = int(h * 6) % 6
    f = h * 6 - int(h * 6)
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    r, g, b = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][i]
    return int(r * 255), int(g * 255), int(b * 255)


def photo(label: int, classes: int, rng: np.random.Generator, min_size: int = 64, max_size: int = 512) -> Image.Image:
    """One image of class ``label``."""
    side = int(rng.integers(min_size, max_size + 1))
    aspect = float(np.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3))))
    w, h = max(min_size, min(max_size, round(side * math.sqrt(aspect)))), max(min_size, min(max_size, round(side / math.sqrt(aspect))))
    # background: a gradient between two random colours, soft blobs, noise
    c0, c1 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    t = np.linspace(0, 1, w)[None, :, None] * rng.uniform(0, 1) + np.linspace(0, 1, h)[:, None, None] * rng.uniform(0, 1)
    bg = (c0 * (1 - t / max(t.max(), 1e-6)) + c1 * (t / max(t.max(), 1e-6))).astype(np.float32)
    img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        r = rng.uniform(0.05, 0.3) * min(w, h)
        x, y = rng.uniform(0, w), rng.uniform(0, h)
        draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    img = img.filter(ImageFilter.GaussianBlur(radius=min(w, h) / 30))
    draw = ImageDraw.Draw(img)
    mean_bg = tuple(int(v) for v in np.asarray(img).reshape(-1, 3).mean(0))
    # clutter: small shapes of other classes in grey-ish colours
    for _ in range(int(rng.integers(0, 4))):
        other = SHAPES[int(rng.integers(0, len(SHAPES)))]
        r = rng.uniform(0.05, 0.12) * min(w, h)
        _shape(draw, other, rng.uniform(0, w), rng.uniform(0, h), r, rng.uniform(0, 2 * math.pi),
               _hsv(rng.uniform(0, 1), rng.uniform(0, 0.3), rng.uniform(0.3, 0.9)), mean_bg)
    # the object: its class's shape, near its class's hue
    kind = SHAPES[label % len(SHAPES)]
    hue = (label / classes + rng.normal(0, 0.04)) % 1.0
    r = rng.uniform(0.15, 0.38) * min(w, h)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    fill = _hsv(hue, rng.uniform(0.5, 1.0), rng.uniform(0.5, 1.0))
    _shape(draw, kind, cx, cy, r, rng.uniform(0, 2 * math.pi), fill, mean_bg)
    if label >= len(SHAPES):  # more classes than shapes: the second round has a hole
        hole = r * 0.25
        draw.ellipse([cx - hole, cy - hole, cx + hole, cy + hole], fill=mean_bg)
    arr = np.asarray(img).astype(np.int16) + rng.normal(0, rng.uniform(4, 16), (h, w, 3)).astype(np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def make_photo_folder(out: Path, classes: int = 10, per_class: dict | None = None, seed: int = 0,
                      min_size: int = 64, max_size: int = 512, quality: int = 90) -> dict[str, int]:
    """Write the folder; returns images per split. Existing files are kept (a second call completes
    an interrupted one); each file is written under a temporary name and renamed."""
    per_class = per_class or {"train": 100, "val": 20, "test": 20}
    names = [f"{i:02d}-{SHAPES[i % len(SHAPES)]}{'-holed' if i >= len(SHAPES) else ''}" for i in range(classes)]
    counts = {}
    for s, (split, n) in enumerate(per_class.items()):
        for c, name in enumerate(names):
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                path = folder / f"{i:05d}.jpg"
                if path.exists():
                    continue
                rng = np.random.default_rng([seed, s, c, i])
                im = photo(c, classes, rng, min_size, max_size)
                write_atomic(path, functools.partial(im.save, format="JPEG", quality=quality))
        counts[split] = n * classes
    return counts
