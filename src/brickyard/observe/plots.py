"""PNG pictures of runs, drawn with Pillow: curves, confusion matrix, reliability diagram, misclassified test images.

``plot_runs([run])`` writes ``curves.png``, ``confusion.png``, ``reliability.png`` and ``misclassified.png`` into
the run directory; several runs overlay their curves in one ``compare-curves.png`` written to ``out``.

Pillow rather than matplotlib: the three pictures take about 0.05 s instead of 0.8 s of every run's
end on a 2-core CPU (matplotlib's import is 0.3 s of that, its text layout most of the rest), and
brickyard already needs Pillow to read image folders.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from PIL import Image, ImageDraw, ImageFont

from brickyard.errors import BrickyardError
from brickyard.files import read_torch, write_atomic
from brickyard.observe.runlog import read_metrics

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
STYLES = {"train": ((), "dot"), "val": ((6, 4), "circle"), "test": ((2, 3), "square")}  # (dash pattern, marker)


def plot_runs(run_dirs, out: Path | None = None) -> list[Path]:
    runs = [Path(r) for r in run_dirs]
    for r in runs:
        if not (r / "metrics.jsonl").is_file():
            raise BrickyardError(f"{r} is not a run directory (no metrics.jsonl).")
    out = Path(out) if out else runs[0]
    out.mkdir(parents=True, exist_ok=True)
    written = [_curves(runs, out / ("curves.png" if len(runs) == 1 else "compare-curves.png"))]
    if len(runs) == 1:
        test = [x for x in read_metrics(runs[0] / "metrics.jsonl") if x.get("kind") == "test" and "confusion" in x]
        if test and _square(test[-1]["confusion"]):
            written.append(_confusion(test[-1]["confusion"], out / "confusion.png"))
        image = reliability_image(test[-1]) if test else None
        if image is not None:
            path = out / "reliability.png"
            write_atomic(path, lambda f: image.save(f, format="PNG"))
            written.append(path)
        if (runs[0] / "test_errors.pt").is_file():
            written.append(_misclassified(runs[0] / "test_errors.pt", out / "misclassified.png"))
    return written


def _font(size: int):
    font = ImageFont.load_default(size=size)  # Pillow >= 10.1: a scalable font where Pillow has FreeType
    if not isinstance(font, ImageFont.FreeTypeFont):
        raise BrickyardError("plots need Pillow built with FreeType (pip install --upgrade Pillow).")
    return font


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    """About five round values in [lo, hi]: 1-2-5 steps, or powers of ten (and 2x, 5x) on a log axis."""
    if log:
        a, b, decades = math.floor(math.log10(lo)), math.ceil(math.log10(hi)), math.log10(hi / lo)
        mults = (1,) if decades > 3 else (1, 2, 5) if decades > 1.2 else (1, 1.5, 2, 3, 5, 7)
        every = max(1, (b - a) // 6)  # a diverging loss spans many decades: about six labels
        return [m * 10 ** e for e in range(a, b + 1, every) for m in mults if lo <= m * 10 ** e <= hi]
    raw = (hi - lo) / 5 or 1.0
    step = min((m * 10 ** math.floor(math.log10(raw)) for m in (1, 2, 5, 10)), key=lambda s: abs(s - raw))
    return [i * step for i in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]


class _Axes:
    """One panel: data limits from its series, a frame, round ticks with grid lines, labels, a legend."""

    def __init__(self, draw, box, xlabel: str, ylabel: str, log: bool = False, legend_low: bool = False):
        self.draw, self.box, self.xlabel, self.ylabel, self.log = draw, box, xlabel, ylabel, log
        self.legend_low = legend_low  # accuracy rises to the top right: its legend goes low
        self.series: list[tuple] = []

    def plot(self, xs, ys, color: str, style: str, label: str) -> None:
        pts = [(x, y) for x, y in zip(xs, ys) if _number(x) and _number(y) and (y > 0 or not self.log)]
        if pts:
            self.series.append((pts, color, style, label))

    def _limits(self):
        xs = [p[0] for s in self.series for p in s[0]] or [0.0, 1.0]
        ys = [p[1] for s in self.series for p in s[0]] or [1.0, 10.0]
        (x0, x1), (y0, y1) = (min(xs), max(xs)), (min(ys), max(ys))
        x0, x1 = (x0 - 0.5, x1 + 0.5) if x0 == x1 else (x0, x1)
        if self.log:
            y0, y1 = y0 / 1.15, y1 * 1.15
        else:
            pad = (y1 - y0) * 0.05 or abs(y0) * 0.05 or 0.05
            y0, y1 = y0 - pad, y1 + pad
        return x0, x1, y0, y1

    def render(self, font, small) -> None:
        (L, T, R, B), d = self.box, self.draw
        x0, x1, y0, y1 = self._limits()
        fy = (lambda v: math.log10(v)) if self.log else (lambda v: v)
        X = lambda v: L + (v - x0) / (x1 - x0) * (R - L)  # noqa: E731
        Y = lambda v: B - (fy(v) - fy(y0)) / (fy(y1) - fy(y0)) * (B - T)  # noqa: E731
        for t in _ticks(x0, x1, False):
            d.line([(X(t), T), (X(t), B)], fill="#e6e6e6")
            d.text((X(t), B + 4), f"{t:g}", fill="black", font=small, anchor="mt")
        for t in _ticks(y0, y1, self.log):
            d.line([(L, Y(t)), (R, Y(t))], fill="#e6e6e6")
            d.text((L - 4, Y(t)), f"{t:g}", fill="black", font=small, anchor="rm")
        d.rectangle([L, T, R, B], outline="black")
        d.text(((L + R) / 2, B + 20), self.xlabel, fill="black", font=font, anchor="mt")
        d.text((L, T - 4), self.ylabel, fill="black", font=font, anchor="ld")
        for pts, color, style, _ in self.series:
            xy = [(X(x), Y(y)) for x, y in pts]
            _line(d, xy, color, STYLES[style][0])
            for x, y in xy if len(xy) < 200 else ():
                _marker(d, x, y, color, STYLES[style][1])
        self._legend(small, R, B if self.legend_low else T)

    def _legend(self, font, right, edge) -> None:
        if len(self.series) < 2:  # one series: the panel's label names it
            return
        width = max(self.draw.textlength(s[3], font=font) for s in self.series) + 34
        height = 14 * len(self.series) + 4
        x, y = right - width - 6, edge - height - 6 if self.legend_low else edge + 6
        self.draw.rectangle([x, y, right - 6, y + height], fill="white", outline="#cccccc")
        for i, (_, color, style, label) in enumerate(self.series):
            cy = y + 9 + 14 * i
            _line(self.draw, [(x + 4, cy), (x + 24, cy)], color, STYLES[style][0])
            _marker(self.draw, x + 14, cy, color, STYLES[style][1])
            self.draw.text((x + 30, cy), label, fill="black", font=font, anchor="lm")


def _number(v) -> bool:
    """A finite int or float: what a point of a curve can be (a row of metrics.jsonl is read as written)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < 1e300


def _line(d, xy, color, dash) -> None:
    if not dash:
        d.line(xy, fill=color, width=2)
        return
    on, off = dash
    for (xa, ya), (xb, yb) in zip(xy, xy[1:]):
        n = math.hypot(xb - xa, yb - ya)
        for s in range(0, int(n), on + off):
            a, b = s / n, min(n, s + on) / n
            d.line([(xa + (xb - xa) * a, ya + (yb - ya) * a), (xa + (xb - xa) * b, ya + (yb - ya) * b)], fill=color, width=2)


def _marker(d, x, y, color, kind) -> None:
    r = 2 if kind == "dot" else 4
    box = [x - r, y - r, x + r, y + r]
    if kind == "square":
        d.rectangle(box, fill=color)
    else:
        d.ellipse(box, fill=color)


def _curves(runs, path: Path) -> Path:
    img = Image.new("RGB", (1000, 640), "white")
    d = ImageDraw.Draw(img)
    font, small = _font(13), _font(11)
    axes = [[_Axes(d, (60 + 500 * c, 28 + 315 * r, 480 + 500 * c, 270 + 315 * r), xl, yl, log=yl == "loss",
                   legend_low=yl == "accuracy")
             for c, xl in enumerate(("step", "epoch"))] for r, yl in enumerate(("loss", "accuracy"))]
    for i, run in enumerate(runs):
        rows = read_metrics(run / "metrics.jsonl")
        for kind in STYLES:
            pts = [x for x in rows if x.get("kind") == kind and "epoch" in x]  # test: train.test_every's points
            label = kind if len(runs) == 1 else f"{run.name}: {kind}"
            for col, key in enumerate(("step", "epoch")):
                xs = [x.get(key) for x in pts]
                axes[0][col].plot(xs, [x.get("loss") for x in pts], COLORS[i % 10], kind, label)
                axes[1][col].plot(xs, [x.get("accuracy") for x in pts], COLORS[i % 10], kind, label)
    for row in axes:
        for ax in row:
            ax.render(font, small)
    write_atomic(path, lambda f: img.save(f, format="PNG"))
    return path


def scaling(world_sizes, images_per_second, efficiency, path: Path) -> Path:
    """``bench``'s scaling.png: images/s and scaling efficiency (%) against the world size."""
    img = Image.new("RGB", (820, 330), "white")
    d = ImageDraw.Draw(img)
    font, small = _font(13), _font(11)
    left = _Axes(d, (70, 28, 390, 270), "world size (processes)", "images/s", legend_low=True)
    right = _Axes(d, (480, 28, 800, 270), "world size (processes)", "scaling efficiency (%)", legend_low=True)
    left.plot(world_sizes, images_per_second, COLORS[0], "train", "images/s")
    right.plot(world_sizes, efficiency, COLORS[1], "test", "efficiency %")
    left.render(font, small)
    right.render(font, small)
    write_atomic(path, lambda f: img.save(f, format="PNG"))
    return path


def lr_finder(lrs, losses, index, path: Path) -> Path:
    """``lr-find``'s plot: the smoothed loss against log10 of the rate, the suggestion marked."""
    img = Image.new("RGB", (640, 360), "white")
    d = ImageDraw.Draw(img)
    font, small = _font(13), _font(11)
    ax = _Axes(d, (70, 28, 610, 300), "learning rate (log10)", "smoothed training loss")
    ax.plot([math.log10(v) for v in lrs], losses, COLORS[0], "train", "smoothed loss")
    if index is not None:
        ax.plot([math.log10(lrs[index])], [losses[index]], COLORS[3], "test", f"suggested {lrs[index]:.3g}")
    ax.render(font, small)
    write_atomic(path, lambda f: img.save(f, format="PNG"))
    return path


def _blue(t: float) -> tuple:
    """White to dark blue, as matplotlib's "Blues" runs."""
    a, b = (247, 251, 255), (8, 48, 107)
    return tuple(round(p + (q - p) * t) for p, q in zip(a, b))


def _square(confusion) -> bool:
    """A confusion matrix as brickyard writes it: n rows of n non-negative counts (n at most 1,000)."""
    return (isinstance(confusion, list) and 0 < len(confusion) <= 1000
            and all(isinstance(r, list) and len(r) == len(confusion) and all(_number(v) and v >= 0 for v in r) for r in confusion))


def _confusion(confusion, path: Path) -> Path:
    n = len(confusion)
    top = max((max(r) for r in confusion), default=0) or 1
    cell = max(8, min(44, 440 // max(n, 1)))
    L, T = 70, 40
    img = Image.new("RGB", (L + n * cell + 110, T + n * cell + 60), "white")
    d = ImageDraw.Draw(img)
    font, small = _font(13), _font(max(7, min(11, cell // 3)))
    d.text((L + n * cell / 2, 12), "test confusion matrix", fill="black", font=font, anchor="mt")
    for i, row in enumerate(confusion):
        for j, v in enumerate(row):
            box = [L + j * cell, T + i * cell, L + (j + 1) * cell, T + (i + 1) * cell]
            d.rectangle(box, fill=_blue(v / top))
            if n <= 20:
                d.text((box[0] + cell / 2, box[1] + cell / 2), str(v), font=small, anchor="mm",
                       fill="white" if v > top / 2 else "black")
        if n <= 30:
            d.text((L - 6, T + i * cell + cell / 2), str(i), fill="black", font=small, anchor="rm")
            d.text((L + i * cell + cell / 2, T + n * cell + 4), str(i), fill="black", font=small, anchor="mt")
    d.text((L + n * cell / 2, T + n * cell + 24), "predicted", fill="black", font=font, anchor="mt")
    d.text((L - 24, T + n * cell / 2), "true", fill="black", font=font, anchor="rm")
    bx = L + n * cell + 30  # the colour bar: 0 at the bottom, the largest count at the top
    for k in range(n * cell):
        d.line([(bx, T + k), (bx + 16, T + k)], fill=_blue(1 - k / max(1, n * cell - 1)))
    d.text((bx + 22, T), str(top), fill="black", font=small, anchor="lt")
    d.text((bx + 22, T + n * cell), "0", fill="black", font=small, anchor="lb")
    write_atomic(path, lambda f: img.save(f, format="PNG"))
    return path


def reliability_image(row: dict) -> Image.Image | None:
    """A test row's reliability diagram (``observe.calibration.Bins``): each confidence bin's accuracy as a bar, the
    diagonal a calibrated model's bars would reach, the gap in red, and the share of the images in each bin below.
    None where the row has no table of the expected shape (a row of another kind, or a stranger's file)."""
    table = row.get("reliability")
    if not isinstance(table, dict) or not all(isinstance(table.get(k), list) for k in ("count", "confidence", "accuracy")):
        return None
    count, conf, acc = table["count"], table["confidence"], table["accuracy"]
    n = len(count)
    if not n or len(conf) != n or len(acc) != n or not all(_number(v) for v in count + conf + acc) or sum(count) <= 0:
        return None
    L, T, W, H, B = 64, 44, 360, 300, 60  # the frame; B: the histogram's height below it
    img = Image.new("RGB", (L + W + 30, T + H + B + 50), "white")
    d, font, small = ImageDraw.Draw(img), _font(13), _font(11)
    ece = row.get("ece")
    d.text((L + W / 2, 14), "test reliability" + (f" (ECE {ece:.4f})" if _number(ece) else ""), fill="black",
           font=font, anchor="mt")
    for i in range(n):
        x0, x1 = L + W * i / n, L + W * (i + 1) / n
        if count[i]:
            a, c = min(max(acc[i], 0.0), 1.0), min(max(conf[i], 0.0), 1.0)
            d.rectangle([x0 + 1, T + H * (1 - a), x1 - 1, T + H], fill=COLORS[0])
            d.rectangle([x0 + 1, T + H * (1 - max(a, c)), x1 - 1, T + H * (1 - min(a, c))], outline=COLORS[3], width=2)
        share = count[i] / sum(count)
        d.rectangle([x0 + 1, T + H + B * (1 - share), x1 - 1, T + H + B], fill="#9ecae1")
    d.line([(L, T + H), (L + W, T)], fill="#555555", width=1)
    d.rectangle([L, T, L + W, T + H], outline="black")
    d.rectangle([L, T + H, L + W, T + H + B], outline="black")
    for v in (0.0, 0.5, 1.0):
        d.text((L + W * v, T + H + B + 4), f"{v:g}", fill="black", font=small, anchor="mt")
        d.text((L - 6, T + H * (1 - v)), f"{v:g}", fill="black", font=small, anchor="rm")
    d.text((L + W / 2, T + H + B + 22), "confidence (largest probability)", fill="black", font=small, anchor="mt")
    d.text((L - 6, T + H + B / 2), "share", fill="black", font=small, anchor="rm")
    d.text((L + 6, T + 6), "accuracy", fill="black", font=small, anchor="lt")
    return img


MOSAIC = 36  # tiles at most: a run keeps 36 test errors (training/evaluation.py)
TILE_MAX = 256  # a tile's longest side in pixels: larger images are shown smaller


def _errors(source: Path) -> tuple[torch.Tensor, list[int], list[int], list]:
    """``test_errors.pt`` checked before use: images N x C x H x W, ``true`` and ``pred`` N integer labels each,
    ``classes`` a list; anything else is one sentence. The first ``MOSAIC`` errors only."""
    e = read_torch(source, "test errors")
    if not isinstance(e, dict) or not {"images", "true", "pred", "classes"} <= set(e):
        raise BrickyardError(f"test errors {source} is not what a run writes there (images, true, pred, classes).")
    images, true, pred, classes = e["images"], e["true"], e["pred"], e["classes"]
    n = len(images) if isinstance(images, torch.Tensor) and images.dim() == 4 else -1
    labels = all(isinstance(t, torch.Tensor) and t.dim() == 1 and len(t) == n and not t.is_floating_point()
                 and not t.is_complex() and t.dtype != torch.bool for t in (true, pred))
    if n < 1 or images.is_complex() or images.dtype == torch.bool or min(images.shape) < 1 or not labels \
            or not isinstance(classes, list):
        shape = "x".join(map(str, images.shape)) if isinstance(images, torch.Tensor) else type(images).__name__
        raise BrickyardError(f"test errors {source} holds images {shape}, {_what(true)} true and {_what(pred)} pred "
                             f"labels; a run writes N x C x H x W images and N integer labels of each.")
    return images[:MOSAIC], true[:MOSAIC].tolist(), pred[:MOSAIC].tolist(), classes


def _what(t) -> str:
    return f"{len(t)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) and t.dim() == 1 else \
        ("x".join(map(str, t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__)


def _misclassified(source: Path, path: Path) -> Path:
    """One mosaic of the first ``MOSAIC`` errors, each tile scaled up (or down to ``TILE_MAX``) and labelled
    'true>predicted'."""
    raw, true, pred, classes = _errors(source)
    images = raw.float()
    n, c, h, w = images.shape
    if raw.dtype != torch.uint8:
        lo, hi = images.amin((1, 2, 3), keepdim=True), images.amax((1, 2, 3), keepdim=True)
        images = (images - lo) / (hi - lo).clamp(min=1e-6) * 255
    scale = max(1, 84 // max(h, w)) if max(h, w) <= TILE_MAX else TILE_MAX / max(h, w)
    cols, th, tw, label = 6, max(1, round(h * scale)), max(1, round(w * scale)), 18
    rows = max(1, (n + cols - 1) // cols)
    img = Image.new("RGB", (cols * (tw + 10) + 10, 30 + rows * (th + label + 8)), "white")
    d = ImageDraw.Draw(img)
    font, small = _font(13), _font(11)
    d.text((img.width / 2, 8), "misclassified test images (true>predicted)", fill="black", font=font, anchor="mt")
    name = lambda i: str(classes[i]) if 0 <= i < len(classes) else str(i)  # noqa: E731
    pixels = images.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for k in range(n):
        r, q = divmod(k, cols)
        x, y = 10 + q * (tw + 10), 30 + r * (th + label + 8)
        tile = Image.fromarray(pixels[k, :, :, :3] if c in (3, 4) else pixels[k, :, :, 0]).convert("RGB")
        img.paste(tile.resize((tw, th), Image.NEAREST), (x, y + label))
        d.text((x + tw / 2, y + label / 2), f"{name(true[k])}>{name(pred[k])}", fill="red", font=small, anchor="mm")
    write_atomic(path, lambda f: img.save(f, format="PNG"))
    return path


def sweep_trials(trials: list[tuple[int, float, str]], metric: str, path: Path, lower_better: bool) -> Path:
    """``brickyard sweep``'s sweep.png: each finished trial's value by its number (complete: circles; pruned: squares,
    at their last reported value) and the best so far (a line)."""
    img = Image.new("RGB", (720, 360), "white")
    d = ImageDraw.Draw(img)
    ax = _Axes(d, (70, 28, 690, 300), "trial", metric, legend_low=not lower_better)
    done = [(n, v) for n, v, s in trials if s == "complete"]
    best, running = [], None
    for n, v in done:
        running = v if running is None else (min if lower_better else max)(running, v)
        best.append((n, running))
    ax.plot([n for n, _ in best], [v for _, v in best], COLORS[0], "train", "best so far")
    ax.plot([n for n, _ in done], [v for _, v in done], COLORS[1], "val", "complete")
    pruned = [(n, v) for n, v, s in trials if s == "pruned"]
    ax.plot([n for n, _ in pruned], [v for _, v in pruned], COLORS[3], "test", "pruned")
    ax.render(_font(13), _font(11))
    write_atomic(path, lambda f: img.save(f, format="PNG"))
    return path


def importance_bars(importance: dict[str, float], path: Path) -> Path:
    """``brickyard sweep``'s importance.png: each parameter's share of the metric's variance, a bar each."""
    rows = sorted(importance.items(), key=lambda kv: -kv[1])
    img = Image.new("RGB", (720, 60 + 28 * len(rows)), "white")
    d = ImageDraw.Draw(img)
    font, small = _font(13), _font(11)
    d.text((10, 10), "parameter importance (share of the metric's variance)", fill="black", font=font)
    for i, (key, v) in enumerate(rows):
        y = 40 + 28 * i
        d.text((250, y + 9), key, fill="black", font=small, anchor="rm")
        d.rectangle([260, y, 260 + max(1, round(380 * v)), y + 18], fill=COLORS[0])
        d.text((266 + round(380 * v), y + 9), f"{v:.2f}", fill="black", font=small, anchor="lm")
    write_atomic(path, lambda f: img.save(f, format="PNG"))
    return path
