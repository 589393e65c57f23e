"""The trainer's shape, as a user's code meets it: a step's context, the frames above a step, and one
state_dict that a checkpoint holds."""
import copy
import inspect

import pytest
import torch
from torch import nn

import brickyard
from brickyard.training.step import StepContext

pytestmark = pytest.mark.fast

X = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))
Y = torch.arange(64) % 4
CONFIG = {"train": {"epochs": 1, "precision": "fp32", "threads": 1, "progress": "none", "plots": False,
                    "device": "cpu"}, "data": {"batch_size": 16}, "optim": {"name": "sgd", "lr": 0.1}}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 4))


def test_a_step_is_four_frames_below_train_and_gets_a_context_of_its_own(tmp_path):
    seen = {}

    def step(run, batch):
        frames = [f.function for f in inspect.stack()[1:]]
        seen["above"] = frames[:frames.index("train") + 1]
        seen["context"], seen["step"] = run, run.step  # the run's fields read through
        x, y = batch
        out = run.forward(x)
        loss = run.compute_loss(out, y)
        run.backward(loss)  # the step's own backward pass: brickyard weighs it and does not call it again
        return loss, out

    brickyard.fit(model(), (X, Y), config=CONFIG, train_step=step, run_dir=tmp_path / "run")
    assert seen["above"] == ["_call_step", "optimizer_step", "fit", "train"]
    assert isinstance(seen["context"], StepContext) and seen["step"] == 3


def test_a_step_that_calls_backward_trains_the_weights_of_one_that_does_not(tmp_path):
    def own_backward(run, batch):
        x, y = batch
        out = run.forward(x)
        loss = run.compute_loss(out, y)
        run.backward(loss)
        return loss, out

    a, b = model(), model()
    brickyard.fit(a, (X, Y), config=CONFIG, run_dir=tmp_path / "a")
    brickyard.fit(b, (X, Y), config=CONFIG, train_step=own_backward, run_dir=tmp_path / "b")
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_what_a_step_keeps_on_run_outlives_the_step(tmp_path):
    counts = []

    def step(run, batch):
        run.calls = getattr(run, "calls", 0) + 1  # a user's own state, kept on the run as before
        copy.copy(run)  # copying the context (a user's debugging) reads no attribute before it has one
        counts.append(run.calls)
        x, y = batch
        out = run.forward(x)
        return run.compute_loss(out, y), out

    brickyard.fit(model(), (X, Y), config=CONFIG, train_step=step, run_dir=tmp_path / "run")
    assert counts == [1, 2, 3, 4]
