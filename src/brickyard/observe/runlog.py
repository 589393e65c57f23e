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
from brickyard.files import naming


class MetricsWriter:
    """Appends rows to ``path`` (None: writes nothing, the other ranks). A ``start`` row waits for the
    first row of the run's own (a logged step, an evaluation), and the file is opened then: a run that
    fails before it has anything to say leaves no ``metrics.jsonl``, which marks a directory as
    holding a run and would block the next start."""

    def __init__(self, path: Path | None):
        self.path, self.f, self.pending = path, None, []
        self.listeners: list = []  # callables that see every row written (the experiment trackers)

    def write(self, **record) -> None:
        if self.path is None:
            return
        record.setdefault("time", round(time.time(), 3))
        for listener in self.listeners:
            listener(record)
        if record.get("kind") == "start":
            self.pending.append(record)
            return
        with naming(self.path):
            if self.f is None:
                self.f = open(self.path, "a", buffering=1)
            for row in self.pending + [record]:
                self.f.write(json.dumps(row) + "\n")
        self.pending = []

    def close(self) -> None:
        if self.f:
            f, self.f = self.f, None
            with naming(self.path):
                f.close()


def read_metrics(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
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
    acc = summary.get("test_accuracy")
    shown = f"{acc:.4f}" if acc is not None else "n/a" if summary.get("test_loss") is not None else "n/a (no test split)"
    if acc is not None and summary.get("eval_limit"):
        shown += f" on the first {summary['test_images']:,} test images (data.eval_limit)"
    print(f"run dir: {summary['run_dir']}")
    print(f"test accuracy: {shown} ({summary['steps']} steps, {summary['train_seconds']:.1f}s training, "
          f"{summary['images_per_second']:,.0f} img/s on {summary['device']})")
