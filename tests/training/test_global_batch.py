"""The same config on any number of processes: the global batch is part of the recipe.

Every run pins fp32, one thread per process and deterministic kernels; 50 is a global batch that
3 and 4 processes do not divide (17-17-16, 13-13-12-12)."""
import json
import shutil

import pytest

from brickyard import api
from brickyard.config import load_config
from brickyard.errors import ConfigError
from brickyard.training import checkpoint
from conftest import ACROSS_ORDERS, SYNTH, run_cli, run_cli_many, sets

SAME = [s for s in SYNTH if not s.startswith("data.batch_size")] + [
    "data.global_batch_size=50", "train.deterministic=true", "train.max_steps=20", "train.epochs=10",
    "optim.name=momentum", "schedule.name=cosine", "data.augment=shift", "train.log_every=5"]


def _final(run):
    return checkpoint.load(checkpoint.step_checkpoints(run / "checkpoints")[-1])["model"]


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    run = tmp_path_factory.mktemp("gb") / "one"
    api.train_config(load_config("mnist", SAME), run)
    return run


# 2 processes against 1 with the same global batch: tests/distributed/test_dist.py (and the console line there)
@pytest.mark.parametrize("devices, parts", [("cpu:3", "17-16 per device"), ("cpu:4", "13-12 per device")])
def test_any_world_size_trains_the_same_steps(one, tmp_path, devices, parts):
    r = run_cli("train", "mnist", *sets(*SAME), "--devices", devices, "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert f"global batch 50 ({parts} x {devices[-1]} x 1 accumulation)" in r.stdout
    assert _diff(_final(one), _final(tmp_path / "r")) < ACROSS_ORDERS
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["steps"] == 20


def test_resume_on_another_world_size_keeps_the_data_position(tmp_path):
    flat = SAME + ["schedule.name=constant"]  # the rate must not depend on where the first part stopped
    api.train_config(load_config("mnist", flat), tmp_path / "ref")
    run = tmp_path / "r"
    first = run_cli("train", "mnist", *sets(*flat, "train.max_steps=8"), "--devices", "cpu:2", "--run-dir", str(run))
    assert first.returncode == 0, first.stderr
    again = run_cli("train", "--set", "train.max_steps=20", "--devices", "cpu:3", "--run-dir", str(run), "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in (run / "logs" / "workerlog.2").read_text()
    assert _diff(_final(tmp_path / "ref"), _final(run)) < ACROSS_ORDERS


def test_a_per_device_batch_is_what_the_user_asked_for_and_says_so(tmp_path):
    r = run_cli("train", "mnist", *sets(*SYNTH, "train.max_steps=2"), "--devices", "cpu:2", "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert "global batch 64 (32 per device x 2 x 1 accumulation)" in r.stdout
    assert "data.batch_size 32 per device: the global batch grows with the world size (32 on one device, 64 on 2); " \
           "the peak rate stays 0.05 (dist.scale_lr: linear would make it 0.1)" in r.stdout
    assert load_config("mnist").data.global_batch_size == 256 and load_config("mnist", ["data.batch_size=64"]).data.global_batch_size == 0


def test_bad_global_batches_are_one_line_and_write_nothing(tmp_path):
    run = tmp_path / "r"
    r, few = run_cli_many(  # one process: both refusals come before any worker starts
        ["train", "mnist", *sets(*SAME, "data.global_batch_size=3"), "--devices", "cpu:4", "--run-dir", run],
        ["train", "mnist", *sets(*SAME, "data.synthetic.num_train=3", "data.global_batch_size=4"), "--devices", "cpu:4",
         "--run-dir", run])
    assert r.returncode == 2 and r.stderr.strip() == ("error: data.global_batch_size: 3 over 1 accumulation step(s) is "
                                                      "smaller than the 4 processes that read data; each needs at least one image.")
    with pytest.raises(ConfigError, match="data.global_batch_size: 50 is not divisible by train.grad_accum \\(3\\)"):
        load_config("mnist", SAME + ["train.grad_accum=3"])
    assert few.returncode == 2 and few.stderr.strip() == ("error: the training split has 3 samples, fewer than the 4 processes "
                                                          "that read data; use fewer processes or more data.")
    assert not run.exists()


def test_max_steps_and_stop_epoch_end_a_run_without_reshaping_its_schedule(tmp_path):
    """Plan 4 epochs, stop after 1: the rates of the steps taken are those of the 4-epoch run."""
    import json
    base = [*SYNTH, "train.epochs=4", "schedule.name=cosine", "train.log_every=4"]
    rates = {}
    runs = (("whole", []), ("steps", ["train.max_steps=16"]), ("epoch", ["train.stop_epoch=1"]))
    done = run_cli_many(*[["train", *sets(*base, *extra), "--run-dir", tmp_path / name] for name, extra in runs])  # one process
    for (name, _), r in zip(runs, done):
        assert r.returncode == 0, r.stderr
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        rates[name] = {x["step"]: x["lr"] for x in rows if x["kind"] == "train"}
    assert max(rates["steps"]) == max(rates["epoch"]) == 16 and max(rates["whole"]) == 64
    assert rates["steps"] == rates["epoch"] == {s: lr for s, lr in rates["whole"].items() if s <= 16}
    assert rates["steps"][16] > 0.5 * 0.05  # a quarter into a cosine: far from annealed


def test_eval_limit_reads_the_same_first_images_on_any_world_size_and_says_so(one, tmp_path):
    """data.eval_limit=50 of 128: validation and test read the first 50 images on 1 and on 3 processes
    (17-17-16, and 3-3-2 batches of 8, so the third rank's share is a batch short), the summary and the log
    say how many, training is untouched, and `brickyard eval` reads the whole split."""
    limited = SAME + ["data.eval_limit=50", "data.eval_batch_size=8"]
    api.train_config(load_config("mnist", limited), tmp_path / "one")
    r = run_cli("train", "mnist", *sets(*limited), "--devices", "cpu:3", "--run-dir", str(tmp_path / "three"))
    assert r.returncode == 0, r.stderr
    assert "on the first 50 test images (data.eval_limit)" in r.stdout
    s1, s3 = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("one", "three"))
    assert s1["test_images"] == s3["test_images"] == 50 and s1["eval_limit"] == 50
    assert abs(s1["test_loss"] - s3["test_loss"]) < 1e-4 and s1["test_accuracy"] == s3["test_accuracy"]
    vals = [[row for row in map(json.loads, (tmp_path / n / "metrics.jsonl").read_text().splitlines()) if row["kind"] == "val"]
            for n in ("one", "three")]
    assert len(vals[0]) == len(vals[1]) >= 1 and all(abs(a["loss"] - b["loss"]) < 1e-4 for a, b in zip(*vals))
    log = (tmp_path / "one" / "train.log").read_text()
    assert "data.eval_limit: validation and test read the first 50 images of each split only" in log
    assert "(the first 50 of 128 images)" in log
    assert _diff(_final(one), _final(tmp_path / "one")) == 0  # evaluation never changes what is trained
    full, part, r = run_cli_many(["eval", tmp_path / "one"], ["eval", tmp_path / "one", "--limit", "50"],
                                 ["eval", tmp_path / "one", "--limit", "-3"])  # one process, torch imported once
    assert json.loads(full.stdout)["count"] == 128
    part = json.loads(part.stdout)
    assert part["count"] == 50 and abs(part["loss"] - s1["test_loss"]) < 1e-5  # the run's own test pass, read again
    assert r.returncode == 2 and r.stderr == "error: --limit -3: give a number of images (0: the whole split).\n", r.stderr
    whole = json.loads((one / "summary.json").read_text())
    assert whole["test_images"] == 128 and "eval_limit" not in whole


@pytest.mark.fast
def test_the_last_line_says_what_the_test_accuracy_is_of(capsys):
    from brickyard.observe.runlog import print_result
    base = {"run_dir": "r", "steps": 2, "train_seconds": 1.0, "images_per_second": 10.0, "device": "cpu"}
    for extra, shown in (({"test_accuracy": 0.5, "test_loss": 1.0, "test_images": 128}, "test accuracy: 0.5000 (2 steps"),
                         ({"test_accuracy": 0.5, "test_loss": 1.0, "test_images": 50, "eval_limit": 50},
                          "test accuracy: 0.5000 on the first 50 test images (data.eval_limit) (2 steps"),
                         ({"test_accuracy": None, "test_loss": None}, "test accuracy: n/a (no test split) (2 steps"),
                         ({"test_accuracy": None, "test_loss": 0.3}, "test accuracy: n/a (2 steps")):  # a loss, no classes
        print_result({**base, **extra})
        assert capsys.readouterr().out.splitlines()[-1].startswith(shown)


def test_a_balanced_epoch_is_the_same_on_three_processes_and_after_a_resume_on_two(tmp_path):
    """``data.balance`` draws each epoch from (seed, epoch): one process, three, and the run of three resumed on two
    from its checkpoint mid-epoch end with the same weights. (A run stopped by train.max_steps and resumed on another
    number of processes: test_resume_on_another_world_size_keeps_the_data_position.)"""
    balanced = SAME + ["data.balance=true", "schedule.name=constant", "data.classes=[0, 1, 2]", "data.train_per_class=0"]
    api.train_config(load_config("mnist", balanced), tmp_path / "one")
    # a checkpoint at step 8 (mid-epoch: 11 steps an epoch) kept, to resume from below
    three = run_cli("train", "mnist", *sets(*balanced, "checkpoint.every_steps=8", "checkpoint.keep_last=10"),
                    "--devices", "cpu:3", "--run-dir", str(tmp_path / "three"))
    assert three.returncode == 0, three.stderr
    assert "data.balance: each epoch draws" in three.stdout
    assert _diff(_final(tmp_path / "one"), _final(tmp_path / "three")) < ACROSS_ORDERS
    # the three processes' run as it stood at step 8 (its checkpoint and config), resumed on two
    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "three" / "config.yaml", run)
    shutil.copy(tmp_path / "three" / "checkpoints" / "step-0000008.pt", run / "checkpoints")
    again = run_cli("train", "--set", "train.max_steps=20", "--devices", "cpu:2", "--run-dir", str(run), "--resume", "auto")
    assert again.returncode == 0, again.stderr
    assert "step-0000008.pt at step 8" in (run / "logs" / "workerlog.1").read_text()
    assert json.loads((run / "summary.json").read_text())["steps"] == 20
    assert _diff(_final(tmp_path / "one"), _final(run)) < ACROSS_ORDERS
