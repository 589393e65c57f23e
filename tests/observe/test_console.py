"""The console: a logger found by name like the others, always on, that turns the rows every logger gets into the
progress lines a run prints (the bar where train.progress asks for one)."""
import logging

import pytest

from brickyard.observe import loggers
from brickyard.observe.loggers import RunInfo
from brickyard.observe.loggers.console import Console
from brickyard.observe.loggers.fanout import for_run

pytestmark = pytest.mark.fast


def started(progress="plain", rank=0, mixup=0.0):
    console = loggers.create("console")
    console.start(RunInfo("/nowhere", {"train": {"progress": progress}, "data": {"mixup": mixup, "cutmix": 0.0}},
                          rank=rank))
    console.log({"kind": "start", "step": 0, "world_size": 1, "total_steps": 392, "steps_per_epoch": 196})
    return console


def test_the_console_is_in_the_registry_and_on_in_every_run():
    assert "console" in loggers.names() and "console" not in loggers.choices()  # always on: not a choice to list
    assert isinstance(loggers.create("console"), Console)
    loggers.check(["console", "csv"])  # naming it is allowed, as naming jsonl is
    main = for_run(["csv"])
    assert [lg.name for lg in main.loggers] == ["jsonl", "console", "csv"]
    other = for_run(["csv"], rank=1)  # another rank: its own log file's progress lines, nothing else
    assert [lg.name for lg in other.loggers] == ["console"]


def test_rows_become_the_lines_a_run_has_always_printed(caplog):
    console = started()
    with caplog.at_level(logging.INFO, logger="brickyard.run"):
        console.log({"kind": "train", "step": 60, "epoch": 0.3061, "loss": 1.00884, "accuracy": 0.81652, "lr": 2.4361e-05,
                     "images_per_second": 448.2, "data_wait_fraction": 0.01})
        console.log({"kind": "train", "step": 196, "epoch": 1.0, "loss": 0.5, "accuracy": None, "lr": 0.01,
                     "images_per_second": 12345.0, "data_wait_fraction": 0.5, "note": ", a note",
                     "hint": "input-bound: 50% of the time waiting for data (try more data.num_workers)"})
        console.log({"kind": "train", "step": 197, "epoch": 1.0051, "loss": 0.5, "accuracy": 0.5, "lr": 0.01,
                     "images_per_second": 10.0, "data_wait_fraction": 0.0})
        console.log({"kind": "val", "step": 60, "epoch": 0.3061, "loss": 0.19871, "accuracy": 0.97421, "top5": 0.99851,
                     "train_accuracy": 0.81652, "hint": "under-fitting?", "train_images": 15360})
        console.log({"kind": "val", "step": 60, "epoch": 0.3061, "loss": 0.19871, "accuracy": None, "top5": None,
                     "train_accuracy": None, "hint": None, "train_images": 0})
        console.log({"kind": "epoch", "step": 196, "epoch": 1.0, "seconds": 37.94})
        console.log({"kind": "watch", "step": 196, "layers": {}})  # kinds it has no line for: nothing
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "epoch 1 step 60/196 loss 1.0088 acc 0.8165 lr 2.436e-05 448 img/s",
        "epoch 1 step 196/196 loss 0.5000 lr 0.01 12,345 img/s, a note, input-bound: 50% of the time waiting for data "
        "(try more data.num_workers)",
        "epoch 2 step 1/196 loss 0.5000 acc 0.5000 lr 0.01 10 img/s",
        "epoch 0.3061 step 60 val loss 0.1987 acc 0.9742 top5 0.9985; train acc 0.8165 (last 15,360 training images); "
        "under-fitting?",
        "epoch 0.3061 step 60 val loss 0.1987",
        "epoch 1 took 37.9 s"]
    # the terminal: the training and epoch lines as train.progress says, the validation line always
    assert [r.console for r in caplog.records] == [True] * 6
    quiet = started("none")
    with caplog.at_level(logging.INFO, logger="brickyard.run"):
        caplog.clear()
        quiet.log({"kind": "train", "step": 2, "epoch": 0.01, "loss": 1.0, "accuracy": None, "lr": 0.1,
                   "images_per_second": 1.0, "data_wait_fraction": 0.0})
        quiet.log({"kind": "val", "step": 2, "epoch": 0.01, "loss": 1.0, "accuracy": None, "top5": None,
                   "train_accuracy": None, "hint": None, "train_images": 0})
    assert [(r.getMessage()[:13], r.console, r.rank) for r in caplog.records] == [("epoch 1 step ", False, 0),
                                                                                 ("epoch 0.01 st", True, 0)]


def test_the_bar_follows_every_step_and_closes_when_the_loop_ends():
    console = started("bar")
    assert console.bar is not None and console.bar.total == 392 and console.bar.n == 0
    for step in range(1, 6):
        console.progress(step)
    assert console.bar.n == 5
    console.log({"kind": "train", "step": 5, "epoch": 0.0255, "loss": 2.0, "accuracy": 0.25, "lr": 0.1,
                 "images_per_second": 1.0, "data_wait_fraction": 0.0})
    assert "loss 2.0000 acc 0.2500" in str(console.bar)
    console.progress(5, ended=True)
    assert console.bar is None
    console.finish(True)
    assert started("bar", rank=1).bar is None and started("auto").bar is None  # another rank; no terminal under pytest
