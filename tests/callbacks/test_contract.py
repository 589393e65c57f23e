"""What a user writes from the docs: a step from scratch, two callbacks of one class that resume with
their own state, user code that keeps its traceback, torch's schedulers on ``run.optimizer``, a Dataset
without ``num_classes``. Every run pins the CPU, fp32, one thread and one process."""
import logging
import traceback

import pytest
import torch
from test_callbacks import cfg, mlp, spirals
from torch import nn

import brickyard
from brickyard import api
from brickyard.callbacks import EarlyStopping
from brickyard.errors import BrickyardError, UserCodeError


def own_step(run, batch):
    """Written from the contract in docs/extending.md, not wrapping brickyard's step."""
    inputs, targets = batch
    outputs = run.forward(inputs)
    return nn.functional.cross_entropy(outputs, targets), outputs


@pytest.mark.fast
def test_a_step_written_from_scratch_trains_the_builtin_weights(tmp_path):
    x, y = spirals(320)
    conf = cfg(epochs=2, grad_accum=2) | {"optim": {"name": "momentum", "lr": 0.1, "label_smoothing": 0.0}}
    builtin, own = mlp(), mlp()
    a = api.fit(builtin, (x, y), val_data=(x, y), config=conf, run_dir=tmp_path / "builtin")
    b = api.fit(own, (x, y), val_data=(x, y), config=conf, train_step=own_step, run_dir=tmp_path / "own")
    # brickyard sums then divides, the step takes the mean: equal up to float rounding (measured < 1e-7)
    assert max((p - q).abs().max().item() for p, q in zip(builtin.parameters(), own.parameters())) < 1e-5
    assert b["steps"] == a["steps"] and abs(b["val_accuracy"] - a["val_accuracy"]) < 1e-9
    assert abs(b["val_loss"] - a["val_loss"]) < 1e-5  # the totals, the NaN guard and evaluation ran as for brickyard's


@pytest.mark.fast
def test_a_step_that_returns_a_dict_as_lightnings_training_step_may(tmp_path):
    """Lightning's ``training_step`` may return ``{"loss": loss, ...}``: the same weights and accuracy as the pair."""
    x, y = spirals(320)
    conf = cfg(epochs=2)
    pair, as_dict = mlp(), mlp()
    a = api.fit(pair, (x, y), val_data=(x, y), config=conf, train_step=own_step, run_dir=tmp_path / "pair")

    def dict_step(run, batch):
        loss, outputs = own_step(run, batch)
        return {"loss": loss, "outputs": outputs, "anything": 1}

    b = api.fit(as_dict, (x, y), val_data=(x, y), config=conf, train_step=dict_step, run_dir=tmp_path / "dict")
    assert all(torch.equal(p, q) for p, q in zip(pair.parameters(), as_dict.parameters()))
    assert b["val_accuracy"] == a["val_accuracy"]
    import json
    trained = [[row.get("accuracy") for row in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                if row.get("kind") == "train"] for name in ("pair", "dict")]
    assert trained[0] == trained[1] and trained[0] and None not in trained[0]  # the outputs gave the training accuracy


@pytest.mark.fast
def test_a_step_that_calls_backward_itself_and_returns_the_loss_alone(tmp_path):
    x, y = spirals(320)
    calls = []

    def two_losses(run, batch):
        inputs, targets = batch
        out = run.forward(inputs)
        loss = run.compute_loss(out, targets) + 0.0 * out.pow(2).mean()
        run.backward(loss)
        calls.append(run.step)
        return loss.detach()

    s = api.fit(mlp(), (x, y), val_data=(x, y), config=cfg(epochs=2), train_step=two_losses, run_dir=tmp_path / "r")
    assert len(calls) == s["steps"] and s["val_accuracy"] > 0.6


@pytest.mark.fast
def test_a_bad_step_result_is_one_sentence(tmp_path):
    x, y = spirals(64)
    with pytest.raises(BrickyardError, match=r"must return the mean loss as a 0-dim tensor \(or \(loss, outputs\), or .*it returned \(32,\)"):
        api.fit(mlp(), (x, y), config=cfg(epochs=1),
                train_step=lambda run, b: nn.functional.cross_entropy(run.forward(b[0]), b[1], reduction="none"),
                run_dir=tmp_path / "a")
    with pytest.raises(BrickyardError, match=r"it returned dict with keys 'logits' and no 'loss'\."):
        api.fit(mlp(), (x, y), config=cfg(epochs=1), train_step=lambda run, b: {"logits": run.forward(b[0])},
                run_dir=tmp_path / "c")
    with pytest.raises(BrickyardError, match="returned a loss without a gradient"):
        api.fit(mlp(), (x, y), config=cfg(epochs=1), train_step=lambda run, b: torch.tensor(1.0), run_dir=tmp_path / "b")


@pytest.mark.fast
def test_two_early_stoppings_resume_with_their_own_state(tmp_path):
    x, y = spirals(320)
    by_loss, by_acc = EarlyStopping("val_loss", patience=50), EarlyStopping("val_accuracy", patience=50)
    assert by_loss.state_key != by_acc.state_key
    api.fit(mlp(), (x, y), val_data=(x, y), config=cfg(epochs=2), callbacks=[by_loss, by_acc], run_dir=tmp_path / "r")
    saved = torch.load(sorted((tmp_path / "r" / "checkpoints").glob("step-*.pt"))[-1], weights_only=True)["callbacks"]
    assert saved[by_loss.state_key]["best"] == pytest.approx(by_loss.best) and by_loss.best < 1.0
    assert saved[by_acc.state_key]["best"] == pytest.approx(by_acc.best) and by_acc.best > 0.5
    again_loss, again_acc = EarlyStopping("val_loss", patience=50), EarlyStopping("val_accuracy", patience=50)
    api.fit(mlp(), (x, y), val_data=(x, y), config=cfg(epochs=2), callbacks=[again_acc, again_loss],
            run_dir=tmp_path / "r", resume="auto")  # listed in the other order: the key, not the place, decides
    assert (again_loss.best, again_acc.best) == (pytest.approx(by_loss.best), pytest.approx(by_acc.best))
    with pytest.raises(BrickyardError, match="two callbacks save their state under"):
        api.fit(mlp(), (x, y), val_data=(x, y), config=cfg(epochs=1),
                callbacks=[EarlyStopping("val_loss"), EarlyStopping("val_loss")], run_dir=tmp_path / "twice")


@pytest.mark.fast
def test_user_code_keeps_its_traceback(tmp_path):
    x, y = spirals(64)

    class Boom(brickyard.Callback):
        def on_step_end(self, run, loss):
            raise KeyError("the user's line")

    def bad_loss(out, target):
        return out.no_such_method()

    def bad_step(run, batch):
        raise ValueError("a step's bug")

    for kwargs, where in (({"callbacks": [Boom()]}, "on_step_end"), ({"loss_fn": bad_loss}, "bad_loss"),
                          ({"train_step": bad_step}, "bad_step")):
        with pytest.raises(UserCodeError) as info:
            api.fit(mlp(), (x, y), config=cfg(epochs=1), run_dir=tmp_path / where, **kwargs)
        frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
        assert where in frames, frames  # the user's function is in the traceback Python prints
        assert info.value.__cause__ is not None and str(info.value).count("\n") == 0  # one sentence, the cause kept


@pytest.mark.fast
def test_torch_schedulers_accept_run_optimizer(tmp_path):
    x, y = spirals(320)
    seen = []

    class Scheduled(brickyard.Callback):
        def on_train_start(self, run):
            assert isinstance(run.optimizer, torch.optim.Optimizer)
            self.sched = torch.optim.lr_scheduler.StepLR(run.optimizer, step_size=5, gamma=0.5)

        def on_step_end(self, run, loss):
            seen.append(run.lr)
            self.sched.step()

    conf = cfg(epochs=1) | {"optim": {"name": "momentum", "lr": 0.1}, "schedule": {"name": "none"}}
    s = api.fit(mlp(), (x, y), config=conf, callbacks=[Scheduled()], run_dir=tmp_path / "r")
    assert s["steps"] == 10 and seen == [0.1] * 5 + [0.05] * 5  # schedule: none leaves the rates to StepLR


def test_fit_takes_the_classes_of_a_dataset_from_the_model(tmp_path):
    x, y = spirals(320)
    s = api.fit(mlp(), torch.utils.data.TensorDataset(x, y), val_data=(x, y), config=cfg(epochs=2),
                run_dir=tmp_path / "r")
    assert s["val_accuracy"] > 0.6
    wide = nn.Sequential(mlp(), nn.Linear(2, 5))  # five outputs: five classes, two of them never seen
    s = api.fit(wide, torch.utils.data.TensorDataset(x, y), config=cfg(epochs=1), run_dir=tmp_path / "wide")
    import json
    assert json.loads((tmp_path / "wide" / "summary.json").read_text())["steps"] == s["steps"]


@pytest.mark.fast
def test_logs_go_through_python_logging(tmp_path, capsys):
    x, y = spirals(64)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    log = logging.getLogger("brickyard")
    keep = Keep()
    log.addHandler(keep)
    try:
        api.fit(mlp(), (x, y), config=cfg(epochs=1), run_dir=tmp_path / "info")
        assert any("world size 1" in r.getMessage() and r.rank == 0 for r in records)
        assert "world size 1" not in capsys.readouterr().out  # the application has a handler: brickyard does not print
        records.clear()
        log.setLevel(logging.WARNING)
        api.fit(mlp(), (x, y), config=cfg(epochs=1), run_dir=tmp_path / "quiet")
        assert not [r for r in records if r.levelno < logging.WARNING]
        assert "world size" not in (tmp_path / "quiet" / "train.log").read_text()  # the level holds in the files too
    finally:
        log.removeHandler(keep)
        log.setLevel(logging.NOTSET)
    api.fit(mlp(), (x, y), config=cfg(epochs=1), run_dir=tmp_path / "console")
    assert "world size 1" in capsys.readouterr().out  # no handler of the application's: rank 0 on the console
    line = (tmp_path / "console" / "logs" / "workerlog.0").read_text().splitlines()[0]
    assert "[rank 0] device cpu" in line
