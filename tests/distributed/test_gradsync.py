"""The two gradient syncs (``dist.grad_sync``): DDP and one flat all-reduce train the same weights.

Real torchrun processes on gloo; fp32, one thread per process, deterministic kernels."""
import json
import os
import time

import pytest
import torch

from brickyard.distributed import gradsync
from conftest import SYNTH, run_cli, sets

SCRIPT = '''
import json, os, sys
import torch
from torch import nn
import brickyard

torch.distributed.init_process_group("gloo")  # one group for the three fits below


def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(),
                      nn.Flatten(), nn.Linear(8 * 4 * 4, 3))
    m[0].weight.requires_grad_(False)  # a frozen layer: not in the flat buffer, never changed
    return m


g = torch.Generator().manual_seed(1)
x = torch.randn(120, 1, 8, 8, generator=g)
y = torch.randint(0, 3, (120,), generator=g)
def own_step(run, batch):  # written from the README's contract, not wrapping brickyard's
    inputs, targets = batch
    outputs = run.forward(inputs)
    return nn.functional.cross_entropy(outputs, targets), outputs


out, rank = sys.argv[1], os.environ["RANK"]
for how in ("flat", "ddp", "auto-own-step", "ddp-own-step"):
    m = model()
    cfg = {"train": {"precision": "fp32", "threads": 1, "progress": "none", "plots": False, "tensorboard": False,
                     "deterministic": True, "epochs": 3, "grad_accum": 2, "seed": 3},
           "data": {"global_batch_size": 24}, "optim": {"name": "momentum", "lr": 0.05, "label_smoothing": 0.0},
           "dist": {"grad_sync": how.split("-")[0]}}
    own = own_step if how.endswith("own-step") else None
    brickyard.fit(m, (x, y), config=cfg, train_step=own, run_dir=f"{out}.{how}.run")
    sync = json.load(open(f"{out}.{how}.run/env.json"))["grad_sync"] if rank == "0" else None  # what rank 0 recorded
    torch.save({"state": m.state_dict(), "sync": sync}, f"{out}.{how}.{rank}.pt")
# the group this script made is its own to end: every rank leaves together (a rank still tearing down gloo
# while another has exited can abort with "terminate called without an active exception")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
'''


def test_flat_and_ddp_train_the_same_weights(tmp_path):
    script = tmp_path / "two_syncs.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    r = run_cli("run", "--devices", "cpu:3", str(script), str(out))  # 3 ranks: parts of 8; 1/3 is not exact
    assert r.returncode == 0, r.stderr
    hows = ("flat", "ddp", "auto-own-step", "ddp-own-step")
    got = {(how, rank): torch.load(f"{out}.{how}.{rank}.pt") for how in hows for rank in range(3)}
    assert [got[h, 0]["sync"] for h in hows] == ["flat", "ddp", "flat", "ddp"]  # brickyard syncs a user's step too
    flat, ddp = got["flat", 0]["state"], got["ddp", 0]["state"]
    torch.manual_seed(0)
    start = torch.nn.Conv2d(1, 4, 3).weight  # the script's first layer, as built
    assert torch.equal(flat["0.weight"], start) and torch.equal(ddp["0.weight"], start)  # frozen stays frozen
    assert not torch.equal(flat["3.weight"], ddp["3.weight"] * 0)  # trained
    # both multiply by 1/3 and sum in gloo's order; measured 0.0 here, 1e-6 allows another summation order
    assert max((flat[k].double() - ddp[k].double()).abs().max().item() for k in flat) < 1e-6
    for rank in (1, 2):  # every rank holds rank 0's weights and, with flat, rank 0's batch-norm statistics
        other = got["flat", rank]["state"]
        assert all(torch.equal(flat[k], other[k]) for k in flat)
    # a step written from scratch (mean cross-entropy) trains what brickyard's step (summed, then divided)
    # trains: the same weights up to float rounding, under either sync; measured 2e-8 here
    for how, builtin in (("auto-own-step", flat), ("ddp-own-step", ddp)):
        own = got[how, 0]["state"]
        assert max((own[k].double() - builtin[k].double()).abs().max().item() for k in own) < 1e-5, how


def test_pinned_cpu_processes_and_the_first_line_says_how_they_sync(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to pin 2 processes apart")
    run = tmp_path / "r"
    r = run_cli("train", "mnist", *sets(*[s for s in SYNTH if not s.startswith("train.threads")], "train.max_steps=3",
                                        "train.plots=false", "train.tensorboard=false", "train.pin_cpus=true"),
                "--devices", "cpu:2", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    cpus = sorted(os.sched_getaffinity(0))
    for rank in (0, 1):
        first = (run / "logs" / f"workerlog.{rank}").read_text().splitlines()[0]
        assert f"1 threads on CPU {cpus[rank]}," in first and "gradient sync flat" in first, first
    env = json.loads((run / "env.json").read_text())
    assert env["pinned_cpus"] == [cpus[0]] and env["grad_sync"] == "flat"


class _Work:
    def __init__(self, done_after_s):
        self.done_at, self.waited = time.perf_counter() + done_after_s, False

    def is_completed(self):
        return time.perf_counter() >= self.done_at

    def wait(self):
        self.waited = True


@pytest.mark.fast
def test_spin_wait_stays_awake_only_up_to_its_limit():
    quick = _Work(0.002)
    t0 = time.perf_counter()
    gradsync.spin_wait(quick, 1.0)
    assert quick.waited and time.perf_counter() - t0 < 0.5  # returned when the work was done, not at the limit
    never = _Work(3600)
    t0 = time.perf_counter()
    gradsync.spin_wait(never, 0.05)
    assert never.waited and 0.05 <= time.perf_counter() - t0 < 1.0  # then asleep in wait(), which raises its errors


def test_processes_that_share_cores_do_not_spin(tmp_path):
    import dataclasses

    import torch.distributed as tdist

    from brickyard.config import load_config
    from brickyard.training import device as dev
    from brickyard.training.ways.collective import grad_sync
    cfg = load_config("mnist", ["train.precision=fp32"])
    threads = torch.get_num_threads()
    try:  # more processes than CPUs: no slices to pin to, and nobody has cores of their own
        host = dev.setup(cfg.train, local_rank=0, local_world_size=2 * len(os.sched_getaffinity(0)))
    finally:
        torch.set_num_threads(threads)
    assert host.pinned is None and not host.own_cores
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(3, 2)
        flat = dataclasses.replace(cfg.dist, grad_sync="auto")
        assert grad_sync(flat, model, torch.device("cpu"), own_cores=False)[1].spin_s == 0  # asleep, as DDP waits
        assert grad_sync(flat, model, torch.device("cpu"), own_cores=True)[1].spin_s == gradsync.FlatGrads.SPIN_S
        assert grad_sync(dataclasses.replace(flat, grad_sync="ddp"), model, torch.device("cpu"))[1].name == "ddp"
    finally:
        tdist.destroy_process_group()
