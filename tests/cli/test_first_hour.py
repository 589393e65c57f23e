"""What a user meets in the first hour: the numbers and lines a run prints, `models`, `memory`."""
import json
import re
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from brickyard import api
from brickyard.data import loaders
from brickyard.errors import BrickyardError
from conftest import SYNTH, run_cli, run_cli_many, sets

CPU = {"device": "cpu", "precision": "fp32", "threads": 1, "progress": "none", "plots": False, "tensorboard": False}


@pytest.mark.fast
def test_log_lines_count_epochs_from_one_and_show_small_rates(tmp_path):
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    cfg = {"train": CPU | {"epochs": 2, "log_every": 2}, "data": {"batch_size": 16},
           "optim": {"lr": 5e-5}, "schedule": {"name": "constant"}}
    api.fit(nn.Linear(4, 2), (x, y), val_data=(x, y), config=cfg, run_dir=tmp_path / "r")
    log = (tmp_path / "r" / "train.log").read_text()
    assert "epoch 1 step 2/4 loss" in log and "lr 5e-05 " in log and "epoch 0 " not in log
    assert "epoch 1 step 4 val loss" in log and "epoch 2 step 8 val loss" in log


@pytest.mark.fast
def test_non_finite_loss_without_a_checkpoint_says_so(tmp_path):
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.fill_(float("inf"))
    with pytest.raises(BrickyardError) as e:
        api.fit(model, (x, y), config={"train": CPU}, run_dir=tmp_path / "r")
    assert "no checkpoint was written yet" in str(e.value) and "newest checkpoint" not in str(e.value)


def test_models_are_listed_at_their_natural_input():
    r = run_cli("models")
    assert r.returncode == 0
    line = next(l for l in r.stdout.splitlines() if l.startswith("mnist_fast "))
    assert "29,322 params" in line and "(1x28x28" in line  # what the training log says for MNIST


def test_memory_reports_the_precision_training_would_use():
    for forced, want in (("1", "precision bf16"), ("0", "precision fp32")):
        r = run_cli("memory", "mnist", *sets(*[s for s in SYNTH if not s.startswith("train.precision")]),
                    env={"BRICKYARD_CPU_BF16": forced})
        assert r.returncode == 0, r.stderr
        assert want in r.stdout


@pytest.mark.fast
def test_the_licence_is_declared_the_way_setuptools_wants():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^license = "MIT"$', text, re.M)  # a table is deprecated and printed a warning at every install


def test_resume_continues_the_run_in_the_directory_and_refuses_changes_to_it(tmp_path):
    run = tmp_path / "r"
    first = run_cli("train", *sets(*SYNTH, "train.epochs=1", "data.synthetic.num_train=320"), "--run-dir", str(run))
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()}
    metrics = (run / "metrics.jsonl").read_bytes()
    changes = ((["--set", "data.name=mnist"], "data.name"), (["mnist"], "data.name"), (["--set", "optim.lr=5e-5"], "optim.lr"))
    refused = run_cli_many(*[["train", *extra, "--run-dir", run, "--resume", "auto"] for extra, _ in changes])  # one process
    for (_, key), r in zip(changes, refused):
        assert r.returncode == 2 and r.stderr.startswith(f"error: --resume: {key} is ") and r.stderr.count("\n") == 1, r.stderr
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").iterdir()} == before
    assert (run / "metrics.jsonl").read_bytes() == metrics
    again = run_cli("train", "--run-dir", str(run), "--resume", "auto", "--set", "train.epochs=2")  # as printed, plus epochs
    assert again.returncode == 0, again.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"] == "synthetic" and summary["steps"] == 2 * 10 and summary["epochs"] == 2


def test_validation_compares_recent_training_accuracy_and_hints_only_with_reason(tmp_path):
    run = tmp_path / "r"
    r = run_cli("train", *sets(*SYNTH, "data.synthetic.num_train=2048", "data.batch_size=128", "train.log_every=10",
                               "train.epochs=1", "optim.lr=0.1"), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    val = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"val"' in l][0]
    first_window = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in l][0]
    # the epoch's first steps are near chance; the comparison uses the steps since the last log line
    assert first_window["accuracy"] < 0.9 and val["train_accuracy"] > 0.95 and val["accuracy"] > 0.95
    assert "under-fitting" not in (run / "train.log").read_text()
    assert "(last 768 training images)" in (run / "train.log").read_text()


def test_epoch_times_and_test_accuracy_during_training(tmp_path):
    run = tmp_path / "r"
    r = run_cli("train", *sets(*SYNTH, "train.epochs=3", "train.test_every=1"), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    tests = [x for x in rows if x["kind"] == "test"]
    assert [x.get("epoch") for x in tests] == [1, 2, None]  # during training, then the final pass
    summary = json.loads((run / "summary.json").read_text())
    assert len(summary["epoch_seconds"]) == 3 and all(s > 0 for s in summary["epoch_seconds"])
    assert [x["epoch"] for x in rows if x["kind"] == "epoch"] == [1, 2, 3]
    assert "epoch 2 took" in (run / "train.log").read_text()


class SlowReads(torch.utils.data.Dataset):
    """Tensors read as a streamed data set whose every read waits (a slow disk): the run is input-bound."""

    def __init__(self, x, y, seconds: float):
        self.x, self.y, self.seconds = x, y, seconds

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return self.x[i], self.y[i]


@pytest.mark.fast
def test_input_bound_advice_fits_the_loader(tmp_path, monkeypatch):
    """The in-memory loader has no workers to add: its input-bound line must not suggest them; a streamed
    run's does. Both are real runs that wait on every batch (metrics.jsonl measures it), so what differs is
    the run's own choice of the advice, by where its data lives."""
    memory_epoch = loaders.InMemoryLoader.epoch

    def slow_epoch(self, *args, **kwargs):  # in-memory batches that come late, as a slow loader's would
        for batch in memory_epoch(self, *args, **kwargs):
            time.sleep(0.02)
            yield batch

    monkeypatch.setattr(loaders.InMemoryLoader, "epoch", slow_epoch)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    cfg = {"train": CPU | {"epochs": 1, "log_every": 2}, "data": {"batch_size": 16, "num_workers": 0}}
    lines = {}
    for where, data in (("memory", (x, y)), ("stream", SlowReads(x, y, 0.002))):
        api.fit(nn.Linear(4, 2), data, num_classes=2, config=cfg, run_dir=tmp_path / where)
        log = (tmp_path / where / "train.log").read_text().splitlines()
        lines[where] = [line for line in log if " step " in line and " img/s" in line]
        rows = [json.loads(line) for line in (tmp_path / where / "metrics.jsonl").read_text().splitlines()]
        waits = [row["data_wait_fraction"] for row in rows if row["kind"] == "train"]
        assert len(lines[where]) == 2 and len(waits) == 2 and min(waits) > 0.5, (log, waits)  # both input-bound
    assert all("input-bound" not in line and "num_workers" not in line for line in lines["memory"]), lines
    assert all("input-bound" in line and "(try more data.num_workers)" in line for line in lines["stream"]), lines


def test_a_run_that_stops_learning_says_so_and_can_end_there(tmp_path):
    frozen = [*SYNTH, "optim.lr=0", "train.epochs=4", "train.log_every=4", "checkpoint.every_steps=8"]  # lr 0: at chance
    r, stop, healthy = run_cli_many(  # one process, torch imported once
        ["train", *sets(*frozen), "--run-dir", tmp_path / "warn"],
        ["train", *sets(*frozen, "train.stop_if_not_learning=true"), "--run-dir", tmp_path / "stop"],
        ["train", *sets(*SYNTH, "train.epochs=4", "train.log_every=4"), "--run-dir", tmp_path / "ok"])
    assert r.returncode == 0, r.stderr
    warnings = [l for l in r.stderr.splitlines() if l.startswith("warning: not learning")]
    assert len(warnings) == 1 and "ln 10 = 2.303" in warnings[0] and "learning rate too high" in warnings[0]
    assert json.loads((tmp_path / "warn" / "summary.json").read_text())["not_learning"].startswith("not learning")
    lines = stop.stderr.strip().splitlines()
    assert stop.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: not learning") and "stopped" in lines[0]
    assert list((tmp_path / "stop" / "checkpoints").glob("step-*.pt"))  # what it had is kept
    assert healthy.returncode == 0 and "not learning" not in healthy.stderr


def test_resume_auto_with_no_run_and_no_config_is_one_sentence(tmp_path):
    """A 2-process run stopped before config.yaml was written leaves logs/ and train.log only; `--resume auto`
    there with no config named must not train the default preset on real MNIST."""
    run = tmp_path / "r"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "workerlog.0").write_text("started\n")
    (run / "train.log").write_text("started\n")
    r = run_cli("train", "--run-dir", str(run), "--resume", "auto")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --resume: {run} holds no config.yaml of a run to continue; name the config"), r.stderr
    assert sorted(p.name for p in run.rglob("*")) == ["logs", "train.log", "workerlog.0"]
    assert (run / "train.log").read_text() == "started\n"
