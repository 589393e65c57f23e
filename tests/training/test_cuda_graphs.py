"""``train.cuda_graphs``: when the step is captured and when it stays eager (decided without a GPU), the graphed
step's bookkeeping against the eager step (on a CPU, with a stand-in graph that replays by re-running the
captured function), and on a GPU, where there is one, the real capture."""
import contextlib
import json
import logging

import pytest
import torch
from torch import nn

import brickyard
from brickyard import models
from brickyard.callbacks import Callback
from brickyard.models.droppath import DropPath
from brickyard.optim import Adam, set_lr
from brickyard.training import graphs

pytestmark = pytest.mark.fast

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU unless one is there


def fused_sgd():
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9, fused=True)


def decide(**changes):
    """``graphs.decide`` on a run that can be captured, with ``changes``."""
    kw = dict(device=CUDA, precision="bf16", way_refusal=None, grad_accum=1, own_step=False, compiled=False,
              schedule="onecycle", optimizer=fused_sgd(), callbacks=[], model=nn.Linear(2, 2))
    kw.update(changes)
    return graphs.decide(kw.pop("setting", "auto"), **kw)


class Peeks(Callback):
    def on_before_update(self, run):
        pass


@pytest.mark.parametrize("changes, reason", [
    ({"device": torch.device("cpu")}, "the device is cpu"),
    ({"way_refusal": "2 processes train"}, "2 processes train"),
    ({"precision": "fp16"}, "fp16's loss scaler"),
    ({"grad_accum": 4}, "train.grad_accum is 4"),
    ({"compiled": True}, "train.compile is on"),
    ({"schedule": "none"}, "schedule.name is none"),
    ({"optimizer": Adam([nn.Parameter(torch.zeros(2))], lr=0.1)}, "the optimiser Adam has no fused update"),
    ({"optimizer": torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)}, "the optimiser SGD has no fused update"),
    ({"callbacks": [Callback(), Peeks()]}, "Peeks acts between the backward pass and the update"),
    ({"model": nn.Sequential(nn.Linear(2, 2), DropPath(0.1))}, "model.drop_path"),
    ({"own_step": True}, "a train_step or loss_fn of its own"),
    ({"setting": False}, "train.cuda_graphs is false"),
    ({"model": nn.Linear(2500, 2000)}, "auto captures models under 5M parameters, whose steps wait on kernel launches; this one has 5.0M"),
])
def test_what_keeps_the_step_eager_is_said(changes, reason):
    d = decide(**changes)
    assert not d.on and reason in d.reason


def test_a_run_that_nothing_forbids_is_captured_and_true_captures_a_users_step():
    assert decide() == graphs.Decision(True, "")
    assert decide(precision="fp32", optimizer=torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.1, fused=True)).on
    assert decide(setting=True, own_step=True).on and decide(setting=True, model=nn.Linear(2500, 2000)).on
    assert not decide(setting=True, device=torch.device("cpu")).on  # true asks; the device still decides


def test_the_rate_is_written_into_a_tensor_and_saved_as_a_number():
    opt = fused_sgd()
    set_lr(opt, 0.5)
    assert opt.param_groups[0]["lr"] == 0.5
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    opt.param_groups[0]["lr_mult"] = 0.5
    rate = opt.param_groups[0]["lr"]
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is rate and float(rate) == 0.125  # the same tensor: a graph reads it
    state = graphs.plain_lr(opt.state_dict())
    assert state["param_groups"][0]["lr"] == 0.125 and isinstance(state["param_groups"][0]["lr"], float)
    assert opt.param_groups[0]["lr"] is rate  # the optimiser's own groups keep the tensor


X = torch.randn(200, 1, 8, 8, generator=torch.Generator().manual_seed(0))
Y = torch.arange(200) % 4
CONFIG = {"train": {"epochs": 2, "precision": "fp32", "threads": 1, "progress": "none", "plots": False,
                    "device": "cpu", "grad_clip": 0.5, "log_every": 5},
          "data": {"batch_size": 32}, "optim": {"name": "sgd", "lr": 0.1, "l1": 1e-4}, "schedule": {"name": "onecycle"}}  # 7 steps an epoch, the last of 8


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))


class StandInGraph:
    """A graph on a CPU: ``capture`` keeps the function and runs nothing, as a capture runs nothing; ``replay``
    runs it with the gradients unset, as a replay writes them afresh."""
    params: list = []
    fail = False

    def capture(self, fn):
        if StandInGraph.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.fn, self.out = fn, torch.zeros(())
        return self.out

    def replay(self):
        for p in StandInGraph.params:
            p.grad = None
        self.out.copy_(self.fn())


@pytest.fixture
def stand_in(monkeypatch):
    """The graphed step on a CPU: nothing refused, the stand-in graph, no side stream, the rate a number."""
    monkeypatch.setattr(graphs, "_refusal", lambda *a: None)
    monkeypatch.setattr(graphs, "Graph", StandInGraph)
    monkeypatch.setattr(graphs, "side_stream", contextlib.nullcontext)
    monkeypatch.setattr(graphs.GraphedStep, "_start", lambda self, run: setattr(
        self, "params", [p for g in run.optimizer.param_groups for p in g["params"]]))
    StandInGraph.fail = False
    return StandInGraph


def train(tmp_path, name, graphed, net):
    cfg = {**CONFIG, "train": {**CONFIG["train"], "cuda_graphs": graphed}}
    StandInGraph.params = list(net.parameters())
    return brickyard.fit(net, (X, Y), config=cfg, run_dir=tmp_path / name)


def test_the_graphed_step_trains_the_eager_steps_weights(tmp_path, stand_in, caplog):
    eager, graphed = model(), model()
    a = train(tmp_path, "eager", False, eager)
    with caplog.at_level(logging.INFO, logger="brickyard"):
        b = train(tmp_path, "graphed", True, graphed)
    assert a["cuda_graphs"] is False and b["cuda_graphs"] is True
    for p, q in zip(eager.parameters(), graphed.parameters()):  # 14 steps: 3 warm-up, the capture, 2 short batches
        assert torch.equal(p, q)
    rows = [json.loads(line) for line in (tmp_path / "graphed" / "metrics.jsonl").read_text().splitlines()]
    eager_rows = [json.loads(line) for line in (tmp_path / "eager" / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]
    assert losses and losses == [(r["step"], r["loss"]) for r in eager_rows if r.get("kind") == "train"]
    assert "captured at step 3" in caplog.text


def test_a_capture_that_fails_leaves_the_run_eager_and_says_why(tmp_path, stand_in, caplog):
    eager, graphed = model(), model()
    train(tmp_path, "eager", False, eager)
    stand_in.fail = True
    with caplog.at_level(logging.INFO, logger="brickyard"):
        b = train(tmp_path, "graphed", True, graphed)
    assert b["cuda_graphs"] is False
    assert "capturing the step failed (RuntimeError: operation not permitted" in caplog.text
    for p, q in zip(eager.parameters(), graphed.parameters()):
        assert torch.equal(p, q)


def test_on_a_cpu_auto_says_nothing_and_true_says_why_it_is_off(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="brickyard"):
        s = brickyard.fit(model(), (X, Y), config={**CONFIG, "train": {**CONFIG["train"], "epochs": 0.2}},
                          run_dir=tmp_path / "auto")
    assert s["cuda_graphs"] is False and "cuda_graphs" not in caplog.text
    with caplog.at_level(logging.INFO, logger="brickyard"):
        brickyard.fit(model(), (X, Y), config={**CONFIG, "train": {**CONFIG["train"], "epochs": 0.2, "cuda_graphs": True}},
                      run_dir=tmp_path / "true")
    assert "train.cuda_graphs: the training step runs eagerly: the device is cpu" in caplog.text


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_a_gpu_the_captured_step_trains_as_the_eager_one(tmp_path, precision):
    data = (torch.randn(1000, 1, 28, 28, generator=torch.Generator().manual_seed(0)), torch.arange(1000) % 10)
    cfg = {"train": {"epochs": 3, "precision": precision, "progress": "none", "plots": False, "device": "cuda",
                     "grad_clip": 1.0}, "data": {"batch_size": 96}, "optim": {"name": "adam", "lr": 0.003},
           "schedule": {"name": "onecycle"}, "model": {"name": "mnist_fast"}}
    got = {}
    for graphed in (False, True):
        cfg["train"]["cuda_graphs"] = graphed
        torch.manual_seed(0)
        got[graphed] = brickyard.fit(models.create("mnist_fast", 10, 1, (28, 28)), data, config=cfg,
                                     run_dir=tmp_path / str(graphed))
    assert got[True]["cuda_graphs"] is True and got[False]["cuda_graphs"] is False
    rows = {k: [json.loads(line) for line in (tmp_path / str(k) / "metrics.jsonl").read_text().splitlines()] for k in got}
    last = {k: [r for r in v if r.get("kind") == "train"][-1]["loss"] for k, v in rows.items()}
    assert abs(last[True] - last[False]) < 0.05 * last[False] + 0.02
    # the checkpoint of a graphed run keeps its rates as numbers and resumes eagerly
    last = sorted((tmp_path / "True" / "checkpoints").glob("step-*.pt"))[-1]
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert all(isinstance(g["lr"], float) for g in state["optimizer"]["param_groups"])
