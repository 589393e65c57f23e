"""Sharded data parallel (``dist.strategy: fsdp``) against DDP, with real processes: torchrun + gloo on localhost.

Pinned: fp32, one thread per process, deterministic algorithms, momentum SGD at a constant rate (Adam's
update divides by the root of the second moment, so the last-bit differences between a reduce-scatter and
an all-reduce of a near-zero gradient can move one weight by up to the learning rate; momentum SGD keeps
them at rounding level). Tolerance: conftest's ``ACROSS_ORDERS`` on every weight after 16-20 steps.
"""
import json
import shutil

import pytest
import torch

from brickyard.api import build_model
from brickyard.config import build, load_config
from brickyard.data import build_data
from brickyard.errors import ConfigError
from brickyard.training import checkpoint, memory
from conftest import ACROSS_ORDERS, SYNTH, run_cli, sets
from layouts import last, train

BASE = SYNTH + ["train.deterministic=true", "train.epochs=10", "optim.name=momentum", "schedule.name=constant",
                "data.global_batch_size=64", "data.synthetic.num_test=101", "data.eval_batch_size=11",
                "train.log_every=5", "train.plots=false"]
# colour images: DDP runs channels_last, FSDP (which shards contiguous parameters only) does not. 14-pixel images of
# one 14-pixel patch (2 tokens with the class token) and 256 training images in global batches of 32: 8 steps an
# epoch, a fifth of the arithmetic of 28-pixel images in batches of 64; sharding, gathering and resharding the 12
# blocks are the same
VIT = BASE + ["model.name=vit_tiny", "model.patch_size=14", "optim.lr=0.01", "data.synthetic.channels=3",
              "data.synthetic.height=14", "data.synthetic.width=14", "data.synthetic.num_train=256",
              "data.synthetic.num_val=64", "data.global_batch_size=32"]
TOL = ACROSS_ORDERS


def _train(run_dir, *items, devices="cpu:2", resume=False):
    return train(run_dir, *items, devices=devices, resume=resume)


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_fsdp_on_a_vit_trains_the_weights_of_ddp_holds_half_and_resumes_under_ddp(tmp_path):
    ddp, fsdp, half = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "half"
    _train(ddp, *VIT, "train.max_steps=16", "dist.grad_sync=ddp")
    # activation checkpointing on top: the gradients are those of a plain backward pass
    r = _train(fsdp, *VIT, "train.max_steps=16", "dist.strategy=fsdp", "train.activation_checkpointing=auto")
    assert "FSDP: 12 blocks (blocks.0, blocks.1, blocks.2, blocks.3, ...) and the root sharded across 2 ranks" in r.stdout
    assert "gradient sync fsdp" in r.stdout
    a, b = last(ddp), last(fsdp)
    assert b["step"] == 16 and _diff(a["model"], b["model"]) < TOL
    # the checkpoint is whole: the optimiser's momentum in DDP's layout
    assert all(_diff({0: a["optimizer"]["state"][i]["momentum_buffer"]}, {0: b["optimizer"]["state"][i]["momentum_buffer"]}) < TOL
               for i in a["optimizer"]["state"])
    s_ddp, s_fsdp = _summary(ddp), _summary(fsdp)
    assert s_fsdp["strategy"] == "fsdp" and s_ddp["strategy"] == "ddp"
    assert s_fsdp["test_accuracy"] == pytest.approx(s_ddp["test_accuracy"], abs=1e-6)  # uneven test shares (34/11 vs 33/11 batches)
    for part in ("parameters", "optimizer_state"):  # measured from each rank's tensors: rank 0 holds about half
        assert s_fsdp["held_per_rank"][part] <= 0.52 * s_ddp["held_per_rank"][part], (part, s_fsdp["held_per_rank"], s_ddp["held_per_rank"])
    # brickyard memory's per-rank estimate of the shards, against what rank 0 held (1%: its shard of each tensor is the larger one)
    cfg = load_config("mnist", VIT + ["dist.strategy=fsdp"])
    data = build_data(cfg.data)
    est = memory.estimate(cfg, build_model(cfg, data), data, torch.device("cpu"), 2)
    for part in ("parameters", "optimizer_state"):
        assert est["sharded"][part] == pytest.approx(s_fsdp["held_per_rank"][part], rel=0.01), part
    # the FSDP run's first 8 steps (its checkpoint at the end of epoch 1, with its config), the other 8 under DDP
    # without activation checkpointing: DDP's 16 steps
    (half / "checkpoints").mkdir(parents=True)
    shutil.copy(fsdp / "config.yaml", half)
    shutil.copy(fsdp / "checkpoints" / "step-0000008.pt", half / "checkpoints")
    _train(half, "train.max_steps=16", "dist.strategy=ddp", "dist.grad_sync=ddp", "train.activation_checkpointing=[]",
           resume=True)
    c = last(half)
    assert "step-0000008.pt at step 8" in (half / "logs" / "workerlog.0").read_text()
    assert c["step"] == 16 and _diff(a["model"], c["model"]) < TOL
    # eval reads the FSDP run's checkpoint as any other
    e = run_cli("eval", str(fsdp), "--split", "test")
    assert e.returncode == 0, e.stderr
    assert json.loads(e.stdout)["accuracy"] == pytest.approx(s_fsdp["test_accuracy"], abs=1e-6)


MLP = BASE + ["model.name=mlp", "optim.lr=0.05", "train.ema=0.9"]


def test_fsdp_on_three_processes_with_ema_equals_ddp_and_resumes_a_ddp_run_of_two(tmp_path):
    ddp, fsdp, moved = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "moved"
    # evaluation of the first 50 test images in batches of 8: 3-3-2 on FSDP's three ranks, so its third rank runs
    # one forward more on a batch it has counted (each forward is a collective)
    limited = ["data.eval_limit=50", "data.eval_batch_size=8"]
    # the reference: DDP on 2 processes (the global batch is the same 64 samples on 2 and 3)
    _train(ddp, *MLP, *limited, "train.max_steps=20", "dist.grad_sync=ddp", devices="cpu:2")
    r = _train(fsdp, *MLP, *limited, "train.max_steps=20", "dist.strategy=fsdp", devices="cpu:3")
    assert "FSDP: the whole model as one unit sharded across 3 ranks" in r.stdout  # an MLP has no blocks
    a, b = last(ddp), last(fsdp)
    assert _diff(a["model"], b["model"]) < TOL
    best_a = checkpoint.load(ddp / "checkpoints" / "best.pt")["model"]
    assert _diff(best_a, checkpoint.load(fsdp / "checkpoints" / "best.pt")["model"]) < TOL  # EMA's averaged weights
    assert _diff(dict(enumerate(a["callbacks"]["EMA{'decay': 0.9}"]["avg"])),
                 dict(enumerate(b["callbacks"]["EMA{'decay': 0.9}"]["avg"]))) < TOL
    s_ddp, s_fsdp = _summary(ddp), _summary(fsdp)
    assert s_fsdp["held_per_rank"]["parameters"] <= 0.4 * s_ddp["held_per_rank"]["parameters"]
    assert s_ddp["test_images"] == s_fsdp["test_images"] == 50 and abs(s_ddp["test_loss"] - s_fsdp["test_loss"]) < 1e-4
    # the DDP run of 2 processes (its checkpoint at the end of epoch 2, with its config), resumed by FSDP on 3
    (moved / "checkpoints").mkdir(parents=True)
    shutil.copy(ddp / "config.yaml", moved)
    shutil.copy(ddp / "checkpoints" / "step-0000016.pt", moved / "checkpoints")
    _train(moved, "train.max_steps=20", "dist.strategy=fsdp", "dist.grad_sync=auto", devices="cpu:3", resume=True)
    assert "step-0000016.pt at step 16" in (moved / "logs" / "workerlog.2").read_text()
    assert last(moved)["step"] == 20 and _diff(a["model"], last(moved)["model"]) < TOL


def test_fsdp_in_bf16_gathers_bf16_weights_and_trains_as_ddp_under_autocast(tmp_path):
    """train.precision: bf16 (emulated on CPUs without AVX-512-BF16, forced here either way): FSDP computes
    with bf16 copies of the weights and reduces the gradients in fp32; DDP autocasts fp32 weights. Both
    round the same products to bf16, so the weights agree to bf16 rounding after 10 steps."""
    bf16 = [s for s in MLP if s not in ("train.precision=fp32", "train.ema=0.9")] + ["train.precision=bf16", "train.max_steps=10"]
    _train(tmp_path / "ddp", *bf16, "dist.grad_sync=ddp")
    _train(tmp_path / "fsdp", *bf16, "dist.strategy=fsdp")
    assert _summary(tmp_path / "fsdp")["precision"] == "bf16"
    a, b = last(tmp_path / "ddp")["model"], last(tmp_path / "fsdp")["model"]
    assert all(v.dtype == torch.float32 for v in b.values())  # the sharded weights and the checkpoint stay fp32
    assert _diff(a, b) < 2e-3, _diff(a, b)


@pytest.mark.parametrize("extra, message", [
    (["dist.mode=ps"], "dist.strategy: fsdp does not combine with dist.mode: ps"),
    (["dist.grad_sync=flat"], "dist.strategy: fsdp does not combine with dist.grad_sync: flat"),
    (["boost.snapshots.enabled=true"], "dist.strategy: fsdp does not combine with boost"),
    (["train.watch=[fc1]"], "dist.strategy: fsdp does not combine with train.watch"),
])
@pytest.mark.fast
def test_what_fsdp_does_not_combine_with_is_one_sentence(extra, message):
    from brickyard.config import load_config
    with pytest.raises(ConfigError, match=message):
        load_config("mnist", ["dist.strategy=fsdp", *extra])


def test_a_block_pattern_that_matches_nothing_is_refused_before_anything_is_written(tmp_path):
    r = run_cli("train", *sets(*MLP, "dist.strategy=fsdp", "dist.fsdp.blocks=[blocks.*]"), "--devices", "cpu:2",
                "--run-dir", str(tmp_path / "r"))
    assert r.returncode != 0
    assert "error: dist.fsdp.blocks: 'blocks.*' matches no module of Sequential" in r.stderr, r.stderr
    assert not (tmp_path / "r" / "metrics.jsonl").exists() and not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.fast
def test_fsdp_keys_are_in_the_schema():
    cfg = build({"dist": {"strategy": "fsdp", "fsdp": {"blocks": ["layer?.*"], "offload": True}}})
    assert cfg.dist.fsdp.blocks == ("layer?.*",) and cfg.dist.fsdp.offload
    with pytest.raises(ConfigError, match="dist.strategy"):
        build({"dist": {"strategy": "zero3"}})
    assert torch.distributed.is_available()



def test_a_run_without_fsdp_never_imports_it(tmp_path):
    """torch.distributed.fsdp and .tensor cost 0.6 s of every process's start-up (DTensor's operator
    tables, sympy); one process trains (with EMA, which reads the fsdp helpers), resumes from a checkpoint
    and evaluates one without them (``train.deterministic`` is off: torch.use_deterministic_algorithms
    imports torch._inductor, which imports both)."""
    import subprocess
    import sys
    run = str(tmp_path / "r")
    plain = [s for s in BASE if s != "train.deterministic=true"] + ["train.ema=0.9"]
    first = ["train", *sets(*plain, "train.epochs=2"), "--run-dir", run]
    more = ["train", *sets(*plain, "train.epochs=3"), "--run-dir", run, "--resume", "auto"]
    code = ("import sys\nfrom brickyard.cli.main import main\n"
            f"assert main({first!r}) == 0\nassert main({more!r}) == 0\n"
            f"assert main(['eval', {run + '/checkpoints/best.pt'!r}]) == 0\n"
            "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resum" in r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"
