"""PNG pictures of runs with matplotlib: curves, confusion matrix, misclassified test images.

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
        for kind, style in (("train", ".-"), ("val", "o--")):
            pts = [x for x in rows if x.get("kind") == kind]
            if not pts:
                continue
            steps = [x["step"] for x in pts]
            epochs = [x["epoch"] for x in pts]
            for col, xs in ((0, steps), (1, epochs)):
                axes[0][col].plot(xs, [x["loss"] for x in pts], style, label=f"{label} {kind}")
                axes[1][col].plot(xs, [x["accuracy"] for x in pts], style, label=f"{label} {kind}")
    for col, xl in ((0, "step"), (1, "epoch")):
        axes[0][col].set(xlabel=xl, ylabel="loss", yscale="log")
        axes[1][col].set(xlabel=xl, ylabel="accuracy")
        for row in (0, 1):
            axes[row][col].grid(alpha=0.3)
            axes[row][col].legend(fontsize=7)
    fig.tight_layout()
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
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _misclassified(plt, source: Path, path: Path) -> Path:
    import torch
    d = torch.load(source, weights_only=True)
    images, true, pred, classes = d["images"], d["true"], d["pred"], d["classes"]
    n = len(images)
    cols = 6
    rows = max(1, (n + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.6, rows * 1.8), squeeze=False)
    for k, ax in enumerate(axes.flat):
        ax.axis("off")
        if k >= n:
            continue
        img = images[k].float()
        if images.dtype != torch.uint8:
            img = img - img.min()
        img = img.permute(1, 2, 0).squeeze(-1).numpy()
        ax.imshow(img, cmap="gray" if img.ndim == 2 else None)
        name = lambda i: classes[i] if i < len(classes) else str(i)  # noqa: E731
        ax.set_title(f"true {name(int(true[k]))}\npred {name(int(pred[k]))}", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
