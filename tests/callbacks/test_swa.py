"""Stochastic weight averaging (``train.swa``, ``brickyard.callbacks.SWA``): the average, the rate and batch norm's
statistics equal what torch's own ``swa_utils`` give for the same weights; real runs resume to the same result and
agree on 1 and 2 processes. Pinned: fp32, one thread a process, constant rates."""
import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from brickyard.callbacks import SWA
from brickyard.config import load_config
from brickyard.errors import ConfigError
from conftest import ACROSS_ORDERS, SYNTH, run_cli, run_cli_many, sets
from layouts import diff, last, train


class FakeRun(SimpleNamespace):
    """What SWA reads of a run, and the two requests it makes (the eval weights, a batch norm pass)."""

    def use_eval_weights(self, swap):
        self.swap = swap

    def recompute_bn(self):
        update_bn(self.loader, self.model)
        return True


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.fast
def test_swa_equals_torchs_averaged_model_swalr_and_update_bn():
    torch.set_num_threads(1)
    model = _net()
    loader = [torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    run = FakeRun(model=model, total_steps=20, planned_steps=20, steps_per_epoch=5, step=0, lr=0.1, lr_override=None, stopped=None,
                  interrupted=False, loader=loader, log=SimpleNamespace(info=lambda *_: None), swap=None)
    cb = SWA(start=0.5, lr=0.01, anneal=0.25, every=2)  # begins after step 10, averages every 2, anneals over 2.5 -> 2
    cb.on_train_start(run)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_model = AveragedModel(model, use_buffers=True)  # torch's average of parameters and buffers
    ref_opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    swalr = None
    for s in range(20):
        lr = run.lr_override if run.lr_override is not None else 0.1
        if s >= 10:  # torch's SWALR from the rate at the start, one of its steps a step here
            swalr = swalr or SWALR(ref_opt, swa_lr=0.01, anneal_epochs=2, anneal_strategy="cos")
            ref_opt.step()
            swalr.step()
            assert lr == pytest.approx(ref_opt.param_groups[0]["lr"], rel=1e-12), s
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(100 + s))
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.step, run.lr = s + 1, lr
        cb.on_step_end(run, loss)
        if run.step >= 10 and (run.step - 10) % 2 == 0:
            ref_model.update_parameters(model)
    assert cb.count == 6 and run.swap is not None  # steps 10, 12, ..., 20
    run.stopped = "end"
    cb.on_validation_start(run)  # the last validation: batch norm recomputed for the average
    update_bn(loader, ref_model)
    raw = copy.deepcopy(model.state_dict())
    with run.swap():  # what evaluations see: the average, batch norm's statistics recomputed for it
        assert diff(model.state_dict(), ref_model.module.state_dict()) < 1e-6
    assert diff(model.state_dict(), raw) == 0  # and the raw weights back after
    state = cb.state_dict()
    cb.on_loop_end(run)
    assert diff(model.state_dict(), raw) == 0  # the loop's last checkpoint holds the raw weights
    cb.on_train_end(run, {})  # the run ends with the average
    assert diff(model.state_dict(), ref_model.module.state_dict()) < 1e-6 and run.swap is None
    # a resumed callback holds the same average and gives the same rate
    again = SWA(start=0.5, lr=0.01, anneal=0.25, every=2)
    resumed = FakeRun(**{**vars(run), "step": 14, "swap": None, "lr_override": None})
    again.load_state_dict(state)
    again.on_train_start(resumed)
    assert again.count == 6 and all(torch.equal(a, b) for a, b in zip(again.avg, cb.avg))
    assert resumed.lr_override == pytest.approx(0.01) and resumed.swap is not None
    mid = FakeRun(**{**vars(run), "step": 10, "swap": None, "lr_override": None})  # resumed in the anneal
    halfway = SWA(start=0.5, lr=0.01, anneal=0.25, every=2)
    halfway.load_state_dict(state)
    halfway.on_train_start(mid)
    assert mid.lr_override == pytest.approx(0.1 * 0.5 + 0.01 * 0.5)  # SWALR's cosine halfway: (1 - cos(pi / 2)) / 2


@pytest.mark.fast
def test_swa_settings_a_run_cannot_take_are_one_sentence():
    for bad in (0, -1, 2.5, math.nan, True):
        with pytest.raises(ConfigError, match="SWA: start"):
            SWA(start=bad)
    with pytest.raises(ConfigError, match="SWA: lr"):
        SWA(lr=0)
    with pytest.raises(ConfigError, match="at or past the run's last step"):
        SWA(start=5).on_train_start(FakeRun(total_steps=20, planned_steps=0, steps_per_epoch=5, model=_net(), step=0))
    with pytest.raises(ConfigError, match="train.swa.start: 2.5"):
        load_config(None, ["train.swa.start=2.5"])
    with pytest.raises(ConfigError, match="train.swa and train.ema"):
        load_config(None, ["train.swa.start=0.5", "train.ema=0.99"])
    with pytest.raises(ConfigError, match="does not combine with train.swa"):
        load_config(None, ["train.swa.start=0.5", "dist.pipeline.stages=2"])
    with pytest.raises(ConfigError, match="train.swa runs in the collective mode"):
        load_config(None, ["train.swa.start=0.5", "dist.mode=ps"])


S = sets("data.name=synthetic", "data.synthetic.num_train=512", "data.synthetic.num_val=128",
         "data.synthetic.num_test=128", "train.threads=1", "data.global_batch_size=64", "train.precision=fp32",
         "train.progress=none", "train.plots=false", "schedule.name=constant", "optim.lr=0.003", "train.epochs=4",
         "train.swa.start=0.5", "train.swa.lr=0.001", "model.name=fashion_lean")
SWA_KEY = "SWA{'start': 0.5}"


def rows(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


def test_swa_resumes_to_the_same_average_and_ends_with_it(tmp_path):
    """A net with batch norm (fashion_lean) on 32 steps, averaging from step 16 every step (a phase under ten epochs:
    ten averages at least), the rate annealed to 0.001 over 3 steps; stopped at step 20 and resumed from its
    checkpoint of step 16, the first average's (written at the step's end, after the average: SWA runs first)."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    every = sets("checkpoint.every_steps=4")
    first, second = run_cli_many(
        ["train", "mnist", *S, *every, "--device", "cpu", "--run-dir", whole],
        ["train", "mnist", *S, *every, *sets("train.max_steps=20"), "--device", "cpu", "--run-dir", parts])
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    (parts / "checkpoints" / "step-0000020.pt").unlink()
    r = run_cli("train", "mnist", *S, *every, *sets("train.max_steps=0"), "--device", "cpu", "--run-dir", parts,
                "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert "step-0000016.pt at step 16" in (parts / "train.log").read_text()
    a, b = last(whole), last(parts)
    assert a["step"] == b["step"] == 32 and a["callbacks"][SWA_KEY]["count"] == 17
    assert all(torch.equal(x, y) for x, y in zip(a["callbacks"][SWA_KEY]["avg"], b["callbacks"][SWA_KEY]["avg"]))
    sa, sb = (rows(d, "summary")[-1] for d in (whole, parts))
    assert sa["test_loss"] == sb["test_loss"] and sa["swa_averages"] == sb["swa_averages"] == 17
    rates = {r["step"]: r["lr"] for r in rows(whole, "train")}
    assert rates[10] == pytest.approx(0.003) and rates[32] == pytest.approx(0.001)
    assert "batch norm's statistics recomputed for the average of 17 weights" in (whole / "train.log").read_text()


def test_swa_on_two_processes_averages_what_one_does(tmp_path):
    """Momentum SGD on an MLP (no batch norm: every rank's statistics would be of its half of a batch)."""
    mlp = SYNTH + ["model.name=mlp", "optim.name=momentum", "schedule.name=constant", "optim.lr=0.05",
                   "data.global_batch_size=64", "train.deterministic=true", "train.epochs=3", "train.plots=false",
                   "train.swa.start=2", "train.swa.lr=0.02"]
    one, two = tmp_path / "one", tmp_path / "two"
    train(one, *mlp, devices="cpu")
    train(two, *mlp, devices="cpu:2")
    a, b = last(one), last(two)
    key = "SWA{'start': 2.0}"
    assert a["callbacks"][key]["count"] == b["callbacks"][key]["count"] == 17  # after steps 8 to 24 (8-step epochs)
    assert diff(dict(enumerate(a["callbacks"][key]["avg"])), dict(enumerate(b["callbacks"][key]["avg"]))) < ACROSS_ORDERS
