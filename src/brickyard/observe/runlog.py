"""Run directories and what is written into them: the metrics file, ``env.json``, ``summary.json``
(the log files are ``brickyard.observe.logs``).

- ``MetricsWriter``: rank 0 appends one JSON object per line to ``metrics.jsonl`` and flushes, so
  a crash loses at most the line being written.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy
import torch

from brickyard import __version__
from brickyard.errors import BrickyardError


def default_run_dir(preset: str) -> Path:
    """``runs/PRESET-YYYYmmdd-HHMMSS``, with ``-2``, ``-3``, ... when runs start within the same second."""
    base = Path("runs") / f"{preset}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def refuse_reuse(run_dir: Path) -> None:
    """A folder that holds a run is continued with ``--resume``, never trained into afresh: the old
    checkpoints would mix with the new ones (``--resume auto`` would then pick the other run's newest
    step) and the metrics of two runs would interleave."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl").is_file() or any((run_dir / "checkpoints").glob("step-*.pt")):
        raise BrickyardError(f"run directory {run_dir} already holds a run; continue it with --resume auto, "
                             f"or pick another --run-dir.")


class MetricsWriter:
    def __init__(self, path: Path | None):
        self.f = open(path, "a", buffering=1) if path else None

    def write(self, **record) -> None:
        if self.f:
            record.setdefault("time", round(time.time(), 3))
            self.f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.f:
            self.f.close()
            self.f = None


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash
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


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def print_result(summary: dict) -> None:
    """The two lines a finished `brickyard train` prints."""
    acc = summary.get("test_accuracy")
    shown = f"{acc:.4f}" if acc is not None else "n/a"
    print(f"run dir: {summary['run_dir']}")
    print(f"test accuracy: {shown} ({summary['steps']} steps, {summary['train_seconds']:.1f}s training, "
          f"{summary['images_per_second']:,.0f} img/s on {summary['device']})")
