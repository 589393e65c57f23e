"""PNG pictures of runs with matplotlib: curves, confusion matrix, misclassified test images.

Layouts are fixed margins rather than ``tight_layout``, which draws every figure twice (text layout
is most of the cost; this halves the time a run spends on its pictures).

``plot_runs([run])`` writes ``curves.png``, ``confusion.png`` and ``misclassified.png`` into the run
directory; several runs overlay their curves in one ``curves.png`` written to ``out``.
"""
from __future__ import annotations

from pathlib import Path

from brickyard.errors import BrickyardError
from brickyard.runlog import read_metrics


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BrickyardError("plots need matplotlib (pip install matplotlib).") from None
    return plt


def plot_runs(run_dirs, out: Path | None = None) -> list[Path]:
    runs = [Path(r) for r in run_dirs]
    for r in runs:
        if not (r / "metrics.jsonl").is_file():
            raise BrickyardError(f"{r} is not a run directory (no metrics.jsonl).")
    plt = _pyplot()
    out = Path(out) if out else runs[0]
    out.mkdir(parents=True, exist_ok=True)
    written = [_curves(plt, runs, out / ("curves.png" if len(runs) == 1 else "compare-curves.png"))]
    if len(runs) == 1:
        rows = read_metrics(runs[0] / "metrics.jsonl")
        test = [x for x in rows if x.get("kind") == "test" and "confusion" in x]
        if test:
            written.append(_confusion(plt, test[-1]["confusion"], out / "confusion.png"))
        if (runs[0] / "test_errors.pt").is_file():
            written.append(_misclassified(plt, runs[0] / "test_errors.pt", out / "misclassified.png"))
    return written


def _curves(plt, runs, path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for run in runs:
        rows = read_metrics(run / "metrics.jsonl")
        label = run.name
        for kind, style in (("train", ".-"), ("val", "o--"), ("test", "s:")):
            pts = [x for x in rows if x.get("kind") == kind and "epoch" in x]  # test: train.test_every's points
            if not pts:
                continue
            steps = [x["step"] for x in pts]
            epochs = [x["epoch"] for x in pts]
            nan = float("nan")  # a run without accuracy (a regression) has none to draw
            for col, xs in ((0, steps), (1, epochs)):
                axes[0][col].plot(xs, [x["loss"] for x in pts], style, label=f"{label} {kind}")
                axes[1][col].plot(xs, [nan if x.get("accuracy") is None else x["accuracy"] for x in pts], style,
                                  label=f"{label} {kind}")
    for col, xl in ((0, "step"), (1, "epoch")):
        axes[0][col].set(xlabel=xl, ylabel="loss", yscale="log")
        axes[1][col].set(xlabel=xl, ylabel="accuracy")
        for row in (0, 1):
            axes[row][col].grid(alpha=0.3)
            axes[row][col].legend(fontsize=7)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.97, wspace=0.18, hspace=0.25)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _confusion(plt, confusion, path: Path) -> Path:
    import numpy as np
    m = np.array(confusion)
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(m, cmap="Blues")
    ax.set(xlabel="predicted", ylabel="true", title="test confusion matrix")
    if len(m) <= 20:
        for i in range(len(m)):
            for j in range(len(m)):
                ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=6,
                        color="white" if m[i, j] > m.max() / 2 else "black")
    fig.colorbar(im)
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.1, top=0.93)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _misclassified(plt, source: Path, path: Path) -> Path:
    """One mosaic image (fast to draw) with a 'true/pred' label over each tile."""
    import numpy as np
    import torch
    d = torch.load(source, weights_only=True)
    images, true, pred, classes = d["images"].float(), d["true"].tolist(), d["pred"].tolist(), d["classes"]
    n, c, h, w = images.shape
    if images.dtype != torch.uint8 and d["images"].dtype != torch.uint8:
        lo, hi = images.amin((1, 2, 3), keepdim=True), images.amax((1, 2, 3), keepdim=True)
        images = (images - lo) / (hi - lo).clamp(min=1e-6) * 255
    cols = 6
    rows = max(1, (n + cols - 1) // cols)
    pad, gap = max(4, h // 3), max(2, w // 8)
    W = w + gap
    mosaic = np.full((rows * (h + pad), cols * W, c), 255.0)
    for k in range(n):
        r, q = divmod(k, cols)
        mosaic[r * (h + pad) + pad:(r + 1) * (h + pad), q * W:q * W + w] = images[k].permute(1, 2, 0).numpy()
    fig, ax = plt.subplots(figsize=(cols * 1.4, rows * 1.6))
    ax.imshow(mosaic.squeeze(-1) if c == 1 else mosaic.astype(np.uint8), cmap="gray" if c == 1 else None, vmin=0, vmax=255)
    name = lambda i: classes[i] if i < len(classes) else str(i)  # noqa: E731
    for k in range(n):
        r, q = divmod(k, cols)
        ax.text(q * W + w / 2, r * (h + pad) + pad / 2, f"{name(true[k])}>{name(pred[k])}", ha="center", va="center", fontsize=7, color="red")
    ax.set_title("misclassified test images (true>predicted)", fontsize=9)
    ax.axis("off")
    fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=0.92)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
