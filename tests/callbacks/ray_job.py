"""A Ray Train job run by tests/callbacks/test_ray_train.py (in a process of its own: Ray starts servers): a
local Ray cluster of 2 CPUs, a ``TorchTrainer`` of 2 workers each calling ``brickyard.fit`` with ``RayReport``, the
workers made to fail at the start of the third epoch once, Ray restarting them (``max_failures=1``), ``ray_resume``
continuing from the checkpoint reported at the second epoch's end. Then the same training by ``brickyard.launch``
on 2 processes, uninterrupted, for the weights to compare. Writes OUT/result.json and the final weights."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import brickyard
from brickyard.callbacks import Callback, RayReport, ray_resume

EPOCHS = 3
PINNED = ["train.precision=fp32", "train.threads=1", "train.progress=none", "data.num_workers=0", "optim.lr=0.01"]


class FailOnce(Callback):
    """Fails every worker at the start of the third epoch, the first time only (a marker file a rank)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def on_epoch_start(self, run):
        marker = self.folder / f"failed-rank{run.rank}"
        if run.epoch == 2 and not marker.exists():
            marker.touch()
            raise RuntimeError("injected failure at the start of epoch 3")


def data():
    from brickyard.data.idx import load_idx  # the local MNIST copy ($BRICKYARD_DATA)
    a = load_idx("mnist", None, False)
    x, y = a["train-images-idx3-ubyte"][:2000], a["train-labels-idx1-ubyte"][:2000]
    xv, yv = a["t10k-images-idx3-ubyte"][:500], a["t10k-labels-idx1-ubyte"][:500]
    return (torch.tensor(x).unsqueeze(1), torch.tensor(y).long()), (torch.tensor(xv).unsqueeze(1), torch.tensor(yv).long())


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))


def train_func(config):
    train, val = data()
    net = model()
    with ray_resume(config["run_dir"]) as resume:
        summary = brickyard.fit(net, train, val_data=val, run_dir=config["run_dir"], resume=resume, epochs=EPOCHS,
                                batch_size=100, overrides=PINNED,
                                callbacks=[RayReport(), FailOnce(Path(config["out"]))])
    if torch.distributed.get_rank() == 0:
        torch.save(net.state_dict(), Path(config["out"]) / "ray-weights.pt")
        (Path(config["out"]) / "ray-resumed-from.txt").write_text(str(resume))
    return summary


def reference(out: str):
    train, val = data()
    net = model()
    brickyard.fit(net, train, val_data=val, run_dir=f"{out}/reference-run", epochs=EPOCHS, batch_size=100, overrides=PINNED)
    if os.environ["RANK"] == "0":  # fit made the group and has ended it
        torch.save(net.state_dict(), Path(out) / "reference-weights.pt")


def main(out: str) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        trainer = TorchTrainer(train_func, train_loop_config={"run_dir": f"{out}/ray-run", "out": out},
                               scaling_config=ScalingConfig(num_workers=2),
                               run_config=RunConfig(storage_path=f"{out}/ray-storage", name="mnist",
                                                    failure_config=FailureConfig(max_failures=1)))
        result = trainer.fit()
        reports = [(c.path, m) for c, m in result.best_checkpoints]
    finally:
        ray.shutdown()
    brickyard.launch(reference, devices="cpu:2", args=(out,))
    (Path(out) / "result.json").write_text(json.dumps({"metrics": result.metrics, "checkpoint": result.checkpoint.path,
                                                       "reports": reports}, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
