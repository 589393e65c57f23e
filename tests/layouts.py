"""What the model-parallel tests share (``distributed/test_pipeline.py``, ``distributed/test_tensor_parallel.py``):
the ViT-Tiny recipe they compare layouts on, and running, reading and moving its runs.

Pinned: fp32 (SYNTH), deterministic algorithms, SGD with momentum at a constant rate (so the optimiser state moves
between layouts too), ViT-Tiny on 14-pixel images of one patch (2 tokens with the class token), global batches of
32, 20 steps with a checkpoint every 10, clipping every step (``CLIP``: the norm across stages, shards and whole
tensors is tested too)."""
import fcntl
import hashlib
import os
import shutil

from brickyard.training import checkpoint
from conftest import SYNTH, run_cli, sets

VIT = SYNTH + ["train.deterministic=true", "optim.name=momentum", "optim.weight_decay=0", "schedule.name=constant",
               "optim.lr=0.01", "model.name=vit_tiny", "model.patch_size=14", "data.synthetic.channels=3",
               "data.synthetic.height=14", "data.synthetic.width=14", "data.synthetic.num_train=640",
               "data.synthetic.num_val=64", "data.synthetic.num_test=64", "data.global_batch_size=32",
               "train.epochs=1", "train.max_steps=20", "checkpoint.every_steps=10", "train.plots=false"]

CLIP = "train.grad_clip=0.5"


def train(run_dir, *items, devices=None, resume=False):
    """`brickyard train` of ``items`` into ``run_dir`` (a real process; several with ``devices``); it must succeed."""
    args = ["train", *sets(*items), "--run-dir", str(run_dir)] + (["--devices", devices] if devices else []) + (
        ["--resume", "auto"] if resume else [])
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def reference(tmp_path_factory, *items):
    """The 1-process run of ``VIT + items``, trained once per pytest run and shared by the tests that compare
    layouts against it, on any xdist worker (a lock file orders them; read only: ``moved`` copies from it)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the pytest run's own folder, shared by its xdist workers
    run = root / f"vit-one-{hashlib.sha1(repr(items).encode()).hexdigest()[:10]}"
    with open(f"{run}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (run / "summary.json").exists():
            shutil.rmtree(run, ignore_errors=True)
            train(run, *VIT, *items)
    return run


def last(run_dir):
    return checkpoint.load(checkpoint.step_checkpoints(run_dir / "checkpoints")[-1])


def diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def moved(src, step: int, to):
    """A run directory holding ``src``'s config and its checkpoint of ``step``: what ``--resume auto`` continues."""
    (to / "checkpoints").mkdir(parents=True)
    shutil.copy(src / "config.yaml", to)
    shutil.copy(src / "checkpoints" / f"step-{step:07d}.pt", to / "checkpoints")
    return to
