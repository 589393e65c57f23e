"""The extension contract: callbacks, a user's loss and data, run.stop(), the built-in callbacks,
user scripts on several processes. Every run pins fp32, one thread and the CPU."""
import json
import textwrap

import pytest
import torch
from torch import nn

import brickyard
from brickyard import api
from brickyard.callbacks import EMA, CSVLogger, EarlyStopping, MaxTime
from brickyard.errors import BrickyardError, ConfigError
from brickyard.training import checkpoint
from conftest import run_cli, sets

BASE = {"train": {"device": "cpu", "precision": "fp32", "threads": 1, "progress": "none", "plots": False,
                  "tensorboard": False, "epochs": 3}, "data": {"batch_size": 32}}


def cfg(**train):
    out = json.loads(json.dumps(BASE))
    out["train"].update(train)
    return out


def spirals(n=600, seed=0):
    """Two interleaved half-turn spirals in the plane: class 0 and class 1."""
    g = torch.Generator().manual_seed(seed)
    t = 0.3 + torch.rand(n, generator=g) * 1.2 * torch.pi
    label = torch.randint(0, 2, (n,), generator=g)
    sign = 1 - 2 * label.float()
    r = t / (1.5 * torch.pi)
    points = torch.stack([sign * r * torch.cos(t), sign * r * torch.sin(t)], 1) + 0.02 * torch.randn(n, 2, generator=g)
    return points, label


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))


class Recorder(brickyard.Callback):
    """Records the name of every hook called, in order."""

    def __init__(self):
        self.calls = []


for _hook in ("on_train_start", "on_epoch_start", "on_step_start", "on_before_update", "on_step_end",
              "on_validation_start", "on_validation_end", "on_checkpoint", "on_epoch_end", "on_loop_end", "on_train_end"):
    setattr(Recorder, _hook, lambda self, *a, _name=_hook: self.calls.append(_name))


def test_user_model_with_its_own_loss_learns_2d_points(tmp_path):
    x, y = spirals()
    seen = []

    def loss_fn(out, target):  # a hinge-like loss of the user's own
        seen.append(out.shape)
        return nn.functional.multi_margin_loss(out, target)

    s = api.fit(mlp(), (x[:500], y[:500]), val_data=(x[500:], y[500:]), test_data=(x[500:], y[500:]),
                config=cfg(epochs=40) | {"optim": {"name": "adam", "lr": 0.01}}, loss_fn=loss_fn, run_dir=tmp_path / "r")
    assert seen and seen[0] == (32, 2)
    assert s["test_accuracy"] > 0.9 and s["val_accuracy"] > 0.9
    test = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "test"][0]
    assert len(test["confusion"]) == 2 and test["loss"] == pytest.approx(s["test_loss"])


@pytest.mark.fast
def test_regression_outputs_get_the_loss_alone(tmp_path):
    x = torch.randn(256, 3)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    model = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0))
    s = api.fit(model, (x, y), val_data=(x, y), test_data=(x, y), config=cfg(epochs=20) | {"optim": {"name": "sgd", "lr": 0.05}},
                loss_fn=nn.functional.mse_loss, run_dir=tmp_path / "r")
    assert s["test_accuracy"] is None and s["test_loss"] < 0.01


@pytest.mark.fast
def test_hooks_are_called_in_order_and_stop_ends_cleanly_with_a_checkpoint(tmp_path):
    x, y = spirals(320)
    rec = Recorder()

    class StopAt(brickyard.Callback):
        def on_step_end(self, run, loss):
            assert loss.dim() == 0 and run.world_size == 1 and run.rank == 0 and run.optimizer is not None
            if run.step == 13:
                run.stop("enough")

    s = api.fit(mlp(), (x, y), val_data=(x, y), test_data=(x, y), config=cfg(epochs=5),
                callbacks=[rec, StopAt()], run_dir=tmp_path / "r")
    assert s["steps"] == 13 and s["stopped"] == "enough" and s["test_accuracy"] is not None
    assert checkpoint.load(tmp_path / "r" / "checkpoints" / "step-0000013.pt")["step"] == 13
    c = rec.calls
    assert c[0] == "on_train_start" and c[-1] == "on_train_end" and c[-2] == "on_loop_end"
    assert c[1:5] == ["on_epoch_start", "on_step_start", "on_before_update", "on_step_end"]
    assert c.count("on_step_end") == 13 and c.count("on_validation_end") == 2  # epoch 1 and the stop
    first_val = c.index("on_validation_end")
    assert c[first_val - 1] == "on_validation_start" and c[first_val + 1:first_val + 3] == ["on_checkpoint", "on_epoch_end"]


@pytest.mark.fast
def test_early_stopping_stops_and_restores_the_best_weights(tmp_path):
    x, y = spirals(320)
    best = {}

    class Keep(brickyard.Callback):  # records the weights at each validation, to compare with the end
        def on_validation_end(self, run, metrics):
            best[run.step] = (metrics["loss"], {k: v.clone() for k, v in run.model.state_dict().items()})

    # a rate this high makes the validation loss bounce: patience 2 stops it early
    es = EarlyStopping("val_loss", patience=2)
    s = api.fit(mlp(), (x, y), val_data=(x[:64], y[:64]), config=cfg(epochs=30) | {"optim": {"name": "sgd", "lr": 2.0}},
                callbacks=[Keep(), es], run_dir=tmp_path / "r")
    assert s["stopped"].startswith("EarlyStopping") and s["steps"] < 30 * 10
    losses = {step: loss for step, (loss, _) in best.items()}
    best_step = min(losses, key=losses.get)
    assert es.best_step == best_step and list(losses)[-1] - best_step == 2 * 10
    final = torch.load(tmp_path / "r" / "checkpoints" / f"step-{s['steps']:07d}.pt", weights_only=True)["model"]
    assert all(torch.equal(final[k], v) for k, v in best[best_step][1].items())


@pytest.mark.fast
def test_ema_evaluates_and_saves_the_averaged_weights(tmp_path):
    x, y = spirals(320)
    model = mlp()
    ema = EMA(0.9)
    seen = []

    class Peek(brickyard.Callback):  # runs after EMA: at each validation, the raw and the evaluated weights
        def on_validation_end(self, run, metrics):
            raw = run.model[0].weight.detach().clone()
            with run.eval_weights():
                seen.append((metrics["accuracy"], raw, run.model[0].weight.detach().clone()))

    s = api.fit(model, (x, y), val_data=(x, y), config=cfg(epochs=3), callbacks=[ema, Peek()], run_dir=tmp_path / "r")
    assert all(not torch.equal(raw, avg) for _, raw, avg in seen)  # training runs on the raw weights
    first_best = max(range(len(seen)), key=lambda i: (seen[i][0], -i))
    best = torch.load(tmp_path / "r" / "checkpoints" / "best.pt", weights_only=True)
    assert torch.equal(best["model"]["0.weight"], seen[first_best][2]) and any(k.startswith("EMA") for k in best["callbacks"])
    step = torch.load(tmp_path / "r" / "checkpoints" / f"step-{s['steps']:07d}.pt", weights_only=True)
    assert torch.equal(step["model"]["0.weight"], seen[-1][1])  # resume continues the raw weights
    assert torch.equal(model[0].weight.detach(), seen[-1][2])  # fit returns the averaged weights


@pytest.mark.fast
def test_max_time_and_csv_logger(tmp_path):
    x, y = spirals(320)
    s = api.fit(mlp(), (x, y), val_data=(x, y), config=cfg(epochs=100000),
                callbacks=[MaxTime(1.0), CSVLogger("val.csv")], run_dir=tmp_path / "r")
    assert s["stopped"].startswith("MaxTime") and 0 < s["steps"] < 100000 * 10
    rows = (tmp_path / "r" / "val.csv").read_text().splitlines()
    assert rows[0].startswith("step,epoch,lr,train_loss,val_loss") and len(rows) >= 2


@pytest.mark.fast
def test_bad_callbacks_and_losses_are_one_sentence_and_keep_what_was_written(tmp_path):
    x, y = spirals(320)

    class Boom(brickyard.Callback):
        def on_validation_end(self, run, metrics):
            raise ValueError("no luck")

    with pytest.raises(BrickyardError, match=r"^callback Boom.on_validation_end raised ValueError: no luck\.$"):
        api.fit(mlp(), (x, y), val_data=(x, y), config=cfg(), callbacks=[Boom()], run_dir=tmp_path / "a")
    with pytest.raises(BrickyardError, match=r"loss_fn <lambda> must return the mean loss as a 0-dim tensor; it returned \(32,\)"):
        api.fit(mlp(), (x, y), config=cfg(), loss_fn=lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"),
                run_dir=tmp_path / "b")
    with pytest.raises(BrickyardError, match="EarlyStopping: monitor 'val_accuracy' is not among this run's metrics"):
        api.fit(nn.Sequential(nn.Linear(2, 1), nn.Flatten(0)), (x, y.float()), val_data=(x, y.float()), config=cfg(),
                loss_fn=nn.functional.mse_loss, callbacks=[EarlyStopping("val_accuracy")], run_dir=tmp_path / "c")
    with pytest.raises(BrickyardError, match="is not a brickyard.Callback"):
        api.fit(mlp(), (x, y), config=cfg(), callbacks=[print], run_dir=tmp_path / "d")
    with pytest.raises(BrickyardError, match=r"data.augment: 'shift' works on images \(N x C x H x W\); these inputs are N x 2"):
        api.fit(mlp(), (x, y), config=cfg() | {"data": {"augment": "shift"}}, run_dir=tmp_path / "e")


@pytest.mark.fast
def test_fit_leaves_the_process_as_it_found_it(tmp_path):
    x, y = spirals(128)
    threads = torch.get_num_threads()
    assert not torch.are_deterministic_algorithms_enabled()
    api.fit(mlp(), (x, y), config=cfg(epochs=1, deterministic=True, threads=1), run_dir=tmp_path / "r")
    assert not torch.are_deterministic_algorithms_enabled() and torch.get_num_threads() == threads


@pytest.mark.fast
def test_fit_without_config_trains_the_default_recipe():
    from brickyard.config import load_config
    a, b = api.resolve_config(None).to_dict(), load_config("mnist").to_dict()
    assert a == b


SCRIPT = textwrap.dedent('''
    import json, os, sys, torch
    from torch import nn
    import brickyard

    class Order(brickyard.Callback):
        def __init__(self):
            self.calls = []
        def on_train_start(self, run): self.calls.append("train_start")
        def on_validation_end(self, run, metrics): self.calls.append(f"val {run.step} {metrics['accuracy']:.4f}")
        def on_step_end(self, run, loss):
            if run.step == 9 and run.rank == 1:
                run.stop("rank 1 had enough")  # one rank only: the others must follow
        def on_train_end(self, run, summary): self.calls.append(f"end {run.step}")

    if os.environ.get("OWN_GROUP"):  # the caller's own process group: fit must use it and leave it
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.randn(200, 2)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
    cb = Order()
    cfg = {"train": {"precision": "fp32", "threads": 1, "progress": "none", "plots": False, "tensorboard": False,
                     "epochs": 4}, "data": {"batch_size": 16}}
    summary = brickyard.fit(model, (x, y), val_data=(x, y), config=cfg, callbacks=[cb])
    out = sys.argv[1]
    with open(f"{out}.{os.environ['RANK']}", "w") as f:
        json.dump({"calls": cb.calls, "world": summary["world_size"], "steps": summary["steps"],
                   "group_alive": torch.distributed.is_initialized()}, f)
    if os.environ.get("OWN_GROUP"):  # torch asks its owner to end it: torch 2.13's gloo can abort an exit without
        torch.distributed.destroy_process_group()  # ("terminate called without an active exception", pytorch#190489)
''')


@pytest.mark.parametrize("devices", ["cpu", "cpu:2"])
def test_brickyard_run_launches_a_user_script(tmp_path, devices):
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    world = 2 if devices == "cpu:2" else 1
    r = run_cli("run", "--devices", devices, "--run-dir", str(tmp_path / "run"), str(script), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    results = [json.loads((tmp_path / f"out.{k}").read_text()) for k in range(world)]
    assert all(x["world"] == world for x in results)
    assert results[0]["calls"] == results[-1]["calls"]  # every rank: the same hooks, the same metrics
    calls = results[0]["calls"]
    assert calls[0] == "train_start" and calls[-1].startswith("end")
    if world == 2:
        assert not any(x["group_alive"] for x in results)  # the group fit made, fit ended
    if world == 2:  # rank 1 asked to stop at step 9; the ranks agreed on one step, within 20
        assert 9 < results[0]["steps"] <= 30 and results[0]["steps"] == results[1]["steps"]
        assert (tmp_path / "run" / "logs" / "workerlog.1").is_file()
    assert (tmp_path / "run" / "summary.json").is_file()
    assert len([p for p in (tmp_path / "run" / "checkpoints").glob("step-*.pt")]) >= 1


def test_fit_under_plain_torchrun(tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(script),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "OWN_GROUP": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    results = [json.loads((tmp_path / f"out.{k}").read_text()) for k in range(2)]
    assert results[0]["calls"] == results[1]["calls"] and results[0]["world"] == 2
    assert all(x["group_alive"] for x in results)  # the script's own group outlives fit
    runs = list((tmp_path / "runs").iterdir())  # fit's default run directory, one for both ranks
    assert len(runs) == 1 and (runs[0] / "summary.json").is_file()


@pytest.mark.fast
def test_layer_outputs_are_captured_every_n_steps_and_other_steps_run_without_hooks(tmp_path):
    from brickyard.callbacks import LayerOutputs

    class Spy(brickyard.Callback):
        """What the model looks like on the steps between captures, and brickyard.predict mid-run."""

        def __init__(self):
            self.hooked, self.modes, self.predicted = [], [], None

        def on_step_end(self, run, loss):
            self.hooked.append((run.step, sum(len(m._forward_hooks) for m in run.model.modules())))
            if run.step == 3:
                self.predicted = brickyard.predict(run.model, torch.zeros(4, 2))["logits"].shape
            self.modes.append(run.model.training)

    points, labels = spirals()
    model = mlp()
    grab, spy = LayerOutputs(["0", "4"], every=5, keep=3), Spy()
    api.fit(model, (points, labels), config=cfg(epochs=2), callbacks=[grab, spy], run_dir=tmp_path / "r")
    steps = 2 * 19  # 19 steps an epoch (600 points, batch 32), the last one short
    assert sorted(grab.outputs) == [25, 30, 35] == list(range(0, steps, 5))[-3:]  # the newest 3 capture steps
    last = max(grab.outputs)
    assert grab.outputs[last]["0"].shape[1] == 64 and grab.outputs[last]["4"].shape[1] == 2
    assert grab.outputs[last]["0"].device.type == "cpu" and not grab.outputs[last]["0"].requires_grad
    assert all(hooks == 0 for _, hooks in spy.hooked)  # hooks are on for the capture step's forward pass only
    assert all(spy.modes) and spy.predicted == (4, 2)  # predict inside a callback leaves the model training
    with pytest.raises(Exception, match="LayerOutputs: nope match no module"):
        api.fit(mlp(), (points, labels), config=cfg(epochs=1), callbacks=[LayerOutputs("nope")], run_dir=tmp_path / "bad")


def test_checkpoint_monitor_picks_best_pt_by_the_metric_named(tmp_path):
    """``best.pt`` holds the validation with the lowest val_loss under ``checkpoint.monitor: val_loss`` and the highest
    val_accuracy under ``auto``, read against what each validation logged: on data a line separates, accuracy is
    at its best from the first validations while the loss goes on falling, so the two pick different ones on any
    CPU. A monitor the run cannot have is one sentence before anything is written."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 2, generator=g)
    y = (x[:, 0] + 0.3 * x[:, 1] > 0).long()
    seen = {}
    for monitor in ("val_loss", "auto"):
        class Keep(brickyard.Callback):
            def on_validation_end(self, run, metrics, monitor=monitor):
                seen.setdefault(monitor, []).append((metrics["loss"], metrics["accuracy"], run.step,
                                                     {k: v.clone() for k, v in run.model.state_dict().items()}))
        torch.manual_seed(0)
        api.fit(mlp(), (x, y), val_data=(x[:64], y[:64]), callbacks=[Keep()], run_dir=tmp_path / monitor,
                config=cfg(epochs=12) | {"optim": {"name": "sgd", "lr": 0.3}, "checkpoint": {"monitor": monitor}})
    by_loss = min(seen["val_loss"], key=lambda v: (v[0], v[2]))
    by_accuracy = max(seen["auto"], key=lambda v: (v[1], -v[2]))
    assert by_accuracy[2] <= 30 < 90 <= by_loss[2]  # the two rules pick different validations here
    for monitor, want in (("val_loss", by_loss), ("auto", by_accuracy)):
        best = torch.load(tmp_path / monitor / "checkpoints" / "best.pt", weights_only=True)
        assert best["step"] == want[2] and all(torch.equal(best["model"][k], v) for k, v in want[3].items())
    for extra, said in ((["data.train_on_all=true"], "checkpoint.monitor: val_loss picks best.pt from the validations, "
                                                     "and this run has no validation data"),):
        r = run_cli("train", "mnist", *sets("checkpoint.monitor=val_loss", *extra), "--run-dir", str(tmp_path / "cli"))
        assert r.returncode == 2 and r.stderr.strip().startswith(f"error: {said}"), r.stderr
        assert not (tmp_path / "cli").exists()
    with pytest.raises(ConfigError, match="checkpoint.monitor: val_accuracy scores classes, and this run's labels are "
                                          "not classes"):
        api.fit(torch.nn.Linear(2, 1), (x, x[:, :1]), val_data=(x, x[:, :1]), loss_fn=torch.nn.functional.mse_loss,
                config=cfg(epochs=1) | {"checkpoint": {"monitor": "val_accuracy"}}, run_dir=tmp_path / "reg")
    assert not (tmp_path / "reg").exists()
