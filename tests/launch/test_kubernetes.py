"""A Kubeflow PyTorchJob's pods, on loopback: each pod runs `brickyard train` as one process with the
environment the training operator gives it (kubeflow/training-operator, pkg/controller.v1/pytorch/
envvar.go, setPodEnv and the master generator in master.go: MASTER_ADDR (the master pod's own is
``localhost``, a worker's the master's service name), MASTER_PORT, WORLD_SIZE = replicas x
nprocPerNode, RANK = the replica's index (+1 for workers), PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_NNODES, PYTHONUNBUFFERED; no LOCAL_RANK). The pods share the run directory (a volume), as the
manifest in docs/multi-node.md mounts it. fp32, one thread, deterministic, a fixed global batch."""
import json
import os
import subprocess
import sys

from brickyard import api
from brickyard.config import load_config
from brickyard.training import checkpoint
from conftest import ACROSS_ORDERS, SYNTH, free_port, sets

JOB = [s for s in SYNTH if not s.startswith("data.batch_size")] + [
    "data.global_batch_size=50", "train.deterministic=true", "train.max_steps=8", "train.epochs=10"]


def _pod(rank: int, port: int, run_dir, log):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"MASTER_ADDR": "localhost" if rank == 0 else "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
                "RANK": str(rank), "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank), "PET_NNODES": "2",
                "PYTHONUNBUFFERED": "0"})
    return subprocess.Popen([sys.executable, "-m", "brickyard", "train", "mnist", *sets(*JOB), "--run-dir", str(run_dir)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def test_a_pytorchjob_of_two_pods_trains_one_run(tmp_path):
    port, run = free_port(), tmp_path / "shared-volume" / "run"
    logs = [open(tmp_path / f"pod{r}.log", "w") for r in range(2)]
    pods = [_pod(r, port, run, logs[r]) for r in range(2)]
    codes = [p.wait(timeout=300) for p in pods]
    for f in logs:
        f.close()
    texts = [(tmp_path / f"pod{r}.log").read_text() for r in range(2)]
    assert codes == [0, 0], texts
    assert "world size 2" in texts[0] and "test accuracy:" in texts[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["workerlog.0", "workerlog.1"]
    one = tmp_path / "one"
    api.train_config(load_config("mnist", JOB), one)
    a = checkpoint.load(checkpoint.step_checkpoints(run / "checkpoints")[-1])["model"]
    b = checkpoint.load(checkpoint.step_checkpoints(one / "checkpoints")[-1])["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < ACROSS_ORDERS
