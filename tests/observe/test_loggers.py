"""The loggers' registry and fan-out, in-process: names and entry points, the rows every logger gets, the lazy
metrics.jsonl, a failing or stalled logger dropped with one warning, the files the built-ins write."""
import json
import threading
import time

import pytest

from brickyard.errors import BrickyardError, ConfigError
from brickyard.observe import loggers
from brickyard.observe.loggers import Logger, RunInfo
from brickyard.observe.loggers.fanout import STOP_WAIT_S, Loggers
from brickyard.observe.loggers.files import CSV, JSONL

pytestmark = pytest.mark.fast


class Rows(Logger):
    def __init__(self):
        self.rows, self.events = [], []

    def start(self, run):
        self.events.append(("start", run.step))

    def log(self, row):
        self.rows.append(json.dumps(row))

    def finish(self, ok):
        self.events.append(("finish", ok))


class Boom(Logger):
    def log(self, row):
        if row["kind"] == "val":
            raise ValueError("the server went away")


class Stalls(Logger):
    timeout_s = 0.3

    def __init__(self, at="log"):
        self.at, self.release = at, threading.Event()

    def start(self, run):
        if self.at == "start":
            self.release.wait()

    def log(self, row):
        if self.at == "log":
            self.release.wait()

    def finish(self, ok):
        if self.at == "finish":
            self.release.wait()


def info(tmp_path, step=0):
    return RunInfo(tmp_path, {"optim": {"lr": 0.1, "betas": [0.9, 0.99]}}, step=step)


def rows_of(fan):
    fan.write(kind="start", step=0, world_size=1)
    fan.write(kind="train", step=4, loss=0.5, accuracy=None, lr=0.1, images_per_second=100.0)
    fan.write(kind="val", step=8, epoch=1.0, loss=0.4, accuracy=0.9, top5=1.0, train_accuracy=0.8, hint=None)
    fan.write(kind="watch", step=8, layers={"fc": {"act_mean": 0.1}})
    fan.write(kind="test", step=8, loss=0.3, accuracy=0.95, top5=1.0, per_class_accuracy=[1.0, 0.9])


def test_the_registry_lists_the_built_ins_and_says_what_is_unknown_or_missing(monkeypatch):
    assert loggers.names()[:6] == ["jsonl", "console", "tensorboard", "csv", "mlflow", "wandb"]
    loggers.check(["jsonl", "tensorboard", "csv"])
    with pytest.raises(ConfigError, match=r"^train.loggers: 'neptune' is not one of tensorboard, csv, mlflow, wandb\.$"):
        loggers.check(["csv", "neptune"])
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    with pytest.raises(ConfigError, match=r"^train.loggers: mlflow needs the mlflow package: pip install "
                                          r"'brickyard\[mlflow\]'\.$"):
        loggers.check(["mlflow"])
    made = loggers.create("jsonl")
    assert isinstance(made, JSONL) and made.name == "jsonl" and isinstance(loggers.create("csv"), CSV)


def test_a_package_adds_a_logger_through_the_entry_point_group(tmp_path, monkeypatch):
    (tmp_path / "mylogs.py").write_text("from brickyard.observe.loggers import Logger\n"
                                        "class Mine(Logger):\n    def log(self, row):\n        pass\n"
                                        "class NotOne:\n    pass\n")
    meta = tmp_path / "mylogs-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: mylogs\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text("[brickyard.loggers]\nmine = mylogs:Mine\nbad = mylogs:NotOne\n"
                                           "csv = mylogs:Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert loggers.names() == ["jsonl", "console", "tensorboard", "csv", "mlflow", "wandb", "bad", "mine"]
    made = loggers.create("mine")
    assert type(made).__name__ == "Mine" and made.name == "mine"
    assert isinstance(loggers.create("csv"), CSV)  # a built-in's name stays the built-in's
    with pytest.raises(ConfigError, match=r"^train.loggers: bad \(entry point mylogs:NotOne\) made a NotOne, which has no"):
        loggers.create("bad")
    with pytest.raises(ConfigError, match="is not one of tensorboard, csv, mlflow, wandb, bad, mine"):
        loggers.check(["nope"])


def test_every_logger_gets_the_rows_metrics_jsonl_holds_and_the_file_opens_at_the_first_real_row(tmp_path):
    mine, warned = Rows(), []
    fan = Loggers([loggers.create("jsonl"), mine], warned.append)
    fan.start(info(tmp_path))
    fan.write(kind="start", step=0, world_size=1)
    assert not (tmp_path / "metrics.jsonl").exists()  # a run that says nothing more leaves no metrics.jsonl
    rows_of(fan)
    fan.finish(True)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == mine.rows and len(mine.rows) == 6
    assert mine.events == [("start", 0), ("finish", True)] and not warned
    assert json.loads(mine.rows[1])["time"] > 0


def test_a_logger_that_fails_is_dropped_with_one_warning_and_the_others_go_on(tmp_path):
    mine, warned = Rows(), []
    fan = Loggers([Boom(), mine], warned.append)
    fan.start(info(tmp_path))
    rows_of(fan)
    fan.finish(True)
    assert warned == ["train.loggers: Boom failed: the server went away; dropped, training goes on without it."]
    assert len(mine.rows) == 5


def test_an_essential_logger_that_fails_ends_the_run(tmp_path):
    jsonl = JSONL(tmp_path / "missing" / "metrics.jsonl")
    fan = Loggers([jsonl], print)
    fan.start(info(tmp_path))
    with pytest.raises(OSError):
        fan.write(kind="train", step=1, loss=1.0)


def test_a_stalled_logger_is_dropped_within_its_bound_and_never_holds_up_a_row_or_the_end(tmp_path):
    stalls, mine, warned = Stalls("log"), Rows(), []
    fan = Loggers([stalls, mine], warned.append)
    fan.start(info(tmp_path))
    began = time.monotonic()
    fan.write(kind="train", step=1, loss=1.0)
    time.sleep(0.5)
    fan.write(kind="train", step=2, loss=0.9)
    fan.write(kind="train", step=3, loss=0.8)
    assert time.monotonic() - began < 2
    assert warned == ["train.loggers: Stalls did not answer within 0.3 s; dropped, training goes on without it."]
    fan.finish(True)
    assert len(mine.rows) == 3 and mine.events[-1] == ("finish", True)
    stalls.release.set()


def test_a_stall_at_the_end_waits_its_bound_and_less_after_a_stop(tmp_path, monkeypatch):
    monkeypatch.setenv("BRICKYARD_LOGGER_TIMEOUT_S", "60")
    stalls, warned = Stalls("finish"), []
    fan = Loggers([stalls], warned.append)
    fan.start(info(tmp_path))
    began = time.monotonic()
    fan.finish(False)  # a failure or a signal: the stop is not held up
    assert time.monotonic() - began < STOP_WAIT_S + 1
    assert warned == [f"train.loggers: Stalls did not finish within {STOP_WAIT_S:g} s; left behind."]
    stalls.release.set()


def test_a_stall_at_the_start_is_dropped_and_a_failure_is_one_sentence(tmp_path):
    stalls, mine, warned = Stalls("start"), Rows(), []
    fan = Loggers([stalls, mine], warned.append)
    fan.start(info(tmp_path))
    assert warned == ["train.loggers: Stalls did not start within 0.3 s; dropped, training goes on without it."]
    fan.write(kind="train", step=1, loss=1.0)
    assert len(mine.rows) == 1
    stalls.release.set()

    class Refuses(Rows):
        timeout_s = 5

        def start(self, run):
            raise RuntimeError("no such experiment\nsecond line")

    fan = Loggers([mine, Refuses()], warned.append)
    with pytest.raises(BrickyardError, match=r"^train.loggers: Refuses could not start: no such experiment second line$"):
        fan.start(info(tmp_path))
    fan.finish(False)
    assert mine.events[-1] == ("finish", False)  # the ones started are finished


def test_a_bad_timeout_override_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("BRICKYARD_LOGGER_TIMEOUT_S", "soon")
    with pytest.raises(BrickyardError, match=r"BRICKYARD_LOGGER_TIMEOUT_S='soon' is not a number of seconds"):
        Loggers([Stalls()]).start(info(tmp_path))


def test_csv_writes_a_row_per_validation_and_a_resume_drops_the_rows_past_its_step(tmp_path):
    fan = Loggers([CSV()])
    fan.start(info(tmp_path))
    rows_of(fan)
    fan.write(kind="train", step=12, loss=0.25, lr=0.05)
    fan.write(kind="val", step=16, epoch=2.0, loss=0.2, accuracy=0.95, top5=1.0)
    fan.finish(True)
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,epoch,lr,train_loss,val_loss,val_accuracy,val_top5,seconds"
    assert [x.rsplit(",", 1)[0] for x in lines[1:]] == ["8,1.0,0.1,0.5,0.4,0.9,1.0", "16,2.0,0.05,0.25,0.2,0.95,1.0"]
    fan = Loggers([CSV()])
    fan.start(info(tmp_path, step=8))
    fan.write(kind="start", step=8)
    fan.finish(True)
    assert (tmp_path / "metrics.csv").read_text().splitlines() == lines[:2]


def test_tensorboard_writes_the_scalars_and_histograms_synchronously(tmp_path):
    pytest.importorskip("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    fan = Loggers([loggers.create("tensorboard"), Rows()])
    fan.start(info(tmp_path))
    fan.write(kind="start", step=0)
    assert not list(tmp_path.glob("events.out.tfevents.*"))  # made at the first value
    rows_of(fan)
    fan.write(kind="test", step=4, epoch=1, loss=0.6, accuracy=0.7, top5=1.0)  # a test during training
    fan.histograms(8, model)
    fan.finish(True)
    [path] = tmp_path.glob("events.out.tfevents.*")
    acc = EventAccumulator(str(path), size_guidance={"histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert set(tags["scalars"]) == {"train/loss", "train/lr", "train/images_per_second", "val/loss", "val/accuracy",
                                    "val/top5", "watch/fc/act_mean", "test/loss", "test/accuracy", "test/top5",
                                    "test_during/loss", "test_during/accuracy"}
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("val/accuracy")] == [(8, 0.9)]
    assert set(tags["histograms"]) == {"weights/weight", "weights/bias", "grads/weight", "grads/bias"}
