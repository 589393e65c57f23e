"""What a run directory's records hold: ``metrics.jsonl`` read back (written by the ``jsonl`` logger,
``brickyard.observe.loggers.files``), ``env.json``, the result lines (the log files are ``brickyard.observe.logs``)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path

import numpy
import torch

from brickyard import __version__


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():  # a stranger's bytes are a line that is not a row
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if isinstance(row, dict):  # a line of something else is not a row
                rows.append(row)
    return rows


def env_record(device: torch.device, seed: int, world_size: int, extra: dict | None = None) -> dict:
    info = {
        "brickyard": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "numpy": numpy.__version__, "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": str(device),
        "cuda": torch.version.cuda, "seed": seed, "world_size": world_size, "command": sys.argv,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info.update(extra or {})
    return info


def print_result(summary: dict) -> None:
    """The two lines a finished `brickyard train` prints."""
    several = summary.get("test_map") is not None  # several labels an image: their mean average precision
    acc = summary.get("test_map") if several else summary.get("test_accuracy")
    shown = f"{acc:.4f}" if acc is not None else "n/a" if summary.get("test_loss") is not None else "n/a (no test split)"
    if acc is not None and summary.get("eval_limit"):
        shown += f" on the first {summary['test_images']:,} test images (data.eval_limit)"
    print(f"run dir: {summary['run_dir']}")
    print(f"test {'mAP' if several else 'accuracy'}: {shown} ({summary['steps']} steps, {summary['train_seconds']:.1f}s training, "
          f"{summary['images_per_second']:,.0f} img/s on {summary['device']})")
