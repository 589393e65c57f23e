"""The trainer's shape, as a user's code meets it: a step's context, the frames above a step, and one
state_dict that a checkpoint holds."""
import copy
import inspect

import pytest
import torch
from torch import nn

import brickyard
from brickyard.errors import UserCodeError
from brickyard.observe.loggers import Logger
from brickyard.observe.loggers.console import Console
from brickyard.training import loop
from brickyard.training.run import RunView
from brickyard.training.step import StepContext, default_step

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


class Rows(Logger):
    def __init__(self):
        self.rows = []

    def log(self, row):
        self.rows.append(dict(row))


def test_the_trainer_sets_train_loss_at_log_steps_and_every_logger_gets_the_same_rows(tmp_path, monkeypatch):
    seen, console = [], []

    class Reads(brickyard.Callback):
        def on_step_end(self, run, loss):
            seen.append((run.step, run.train_loss, run.train_accuracy))

    def heard(self, row):  # what the console logger is handed
        console.append(dict(row))

    monkeypatch.setattr(Console, "log", heard)
    rows = Rows()
    cfg = {**CONFIG, "train": {**CONFIG["train"], "log_every": 2}}
    brickyard.fit(model(), (X, Y), val_data=(X, Y), config=cfg, callbacks=[Reads()], loggers=[rows],
                  run_dir=tmp_path / "run")
    train = [r for r in rows.rows if r["kind"] == "train"]
    assert [(r["step"], r["loss"], r["accuracy"]) for r in train] == [s for s in seen if s[0] % 2 == 0]
    assert seen[0] == (1, None, None)  # before the first log step
    assert [r["kind"] for r in rows.rows][:5] == ["start", "train", "train", "val", "epoch"]
    assert console == rows.rows  # the console's lines come from the very rows the other loggers get


class Writes(brickyard.Callback):
    def __init__(self, name, value):
        self.name, self.value = name, value

    def on_step_end(self, run, loss):
        setattr(run, self.name, self.value)


@pytest.mark.parametrize("name, said", [
    ("train_loss", "run.train_loss is read-only in a callback (the trainer sets it); keep a value of your own on the "
                   "callback (self.train_loss)"),
    ("step", "run.step is read-only in a callback"),
    ("lr", "run.lr is read-only in a callback (the trainer sets it); set run.lr_scale, which multiplies the "
           "schedule's rate from the next step on"),
    ("stop", "run.stop is read-only in a callback")])
def test_a_callback_that_writes_a_field_of_the_run_gets_one_sentence(tmp_path, name, said):
    with pytest.raises(UserCodeError) as e:
        brickyard.fit(model(), (X, Y), config=CONFIG, callbacks=[Writes(name, 0.5)], run_dir=tmp_path / "run")
    assert str(e.value).startswith(f"callback Writes.on_step_end raised AttributeError: {said}")
    assert isinstance(e.value.__cause__, AttributeError)


def test_a_callback_sets_lr_scale_and_keeps_a_name_of_its_own_that_a_step_reads(tmp_path):
    lrs, kept = [], []

    class Halves(brickyard.Callback):
        def on_step_end(self, run, loss):
            lrs.append(run.lr)
            run.lr_scale = 0.5
            run.difficulty = run.step  # not a field of the run: kept on it, as before (a step reads it)

    def step(run, batch):
        kept.append(getattr(run, "difficulty", None))
        return default_step(run, batch)

    cfg = {**CONFIG, "schedule": {"name": "constant"}}
    brickyard.fit(model(), (X, Y), config=cfg, callbacks=[Halves()], train_step=step, run_dir=tmp_path / "run")
    assert lrs == [0.1, 0.05, 0.05, 0.05] and kept == [None, 1, 2, 3]


def test_the_view_reads_the_run_and_refuses_its_fields():
    run = a_run()
    view = RunView(run)
    assert view.step == 3 and view.is_main and copy.copy(view).step == 3
    with pytest.raises(AttributeError, match=r"^run\.metrics is read-only in a callback"):
        view.metrics = {}
    with pytest.raises(AttributeError, match=r"^run\._control is read-only in a callback"):
        view._control = None
    with pytest.raises(AttributeError, match=r"^run\.stopped is read-only .*; call run\.stop\(reason\)$"):
        del view.stopped
    view.lr_scale = 0.25
    assert run.lr_scale == 0.25


def a_run():
    from brickyard.training.run import Run
    return Run(None, None, None, None, 0, 1, torch.device("cpu"), "fp32", None, None, 4, 8, step=3)


def test_the_way_of_training_holds_the_config_the_trainer_runs_with(tmp_path, monkeypatch):
    made = []

    class Seen(loop.Trainer):
        def __init__(self, job, *args):
            made.append((job.way.cfg, job.config))
            super().__init__(job, *args)

    monkeypatch.setattr(loop, "Trainer", Seen)
    cfg = {**CONFIG, "data": {"batch_size": 16, "num_workers": "auto"}}
    brickyard.fit(model(), (X, Y), config=cfg, run_dir=tmp_path / "run")
    (way_cfg, job_cfg), = made
    assert way_cfg is job_cfg and job_cfg.data.num_workers != "auto"  # resolved before the way was built
