"""What a checkpoint holds is checked against the resumed run's settings, and a resumed run ends as the
uninterrupted one would (fp32, one thread, synthetic data, a constant rate: the same steps bit for bit)."""
import json

import pytest
import torch

from conftest import run_cli, run_cli_many, sets

S = sets("data.name=synthetic", "data.synthetic.num_train=512", "data.synthetic.num_val=128",
         "data.synthetic.num_test=128", "train.threads=1", "data.global_batch_size=64", "train.precision=fp32",
         "train.progress=none", "train.plots=false", "schedule.name=constant", "optim.lr=0.003")


def rows(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == kind]


def test_a_changed_checkpoint_monitor_compares_the_best_under_the_new_metric(tmp_path):
    run = tmp_path / "run"
    first, again = run_cli_many(  # one process, torch imported once: the run, then its resume
        ["train", "mnist", *S, *sets("train.epochs=5", "checkpoint.monitor=val_accuracy", "train.max_steps=16"),
         "--device", "cpu", "--run-dir", run],
        ["train", "mnist", *S, *sets("train.epochs=5", "checkpoint.monitor=val_loss", "train.max_steps=0"),
         "--device", "cpu", "--run-dir", run, "--resume", "auto"])
    assert first.returncode == 0, first.stderr
    assert again.returncode == 0, again.stderr
    assert "checkpoint.monitor changed from val_accuracy to val_loss" in (run / "train.log").read_text()
    val = rows(run, "val")
    lowest = min(val, key=lambda r: r["loss"])["step"]
    best = torch.load(run / "checkpoints" / "best.pt", weights_only=True)
    assert best["step"] == lowest, ([(r["step"], r["loss"]) for r in val], best["step"])


def test_early_stopping_restores_its_best_weights_after_a_resume(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    es = sets("train.epochs=8", "train.early_stopping=2")
    r = run_cli("train", "mnist", *S, *es, "--device", "cpu", "--run-dir", str(whole))
    assert r.returncode == 0, r.stderr
    stopped = rows(whole, "summary")[-1]["steps"]
    best = int(next(line for line in (whole / "train.log").read_text().splitlines() if "early stopping" in line)
               .split(" at step ")[1].split(";")[0])
    assert best < stopped - 8, "the data must make early stopping wait past the best validation"
    for r in run_cli_many(  # one process: the stopped run, then its resume
            ["train", "mnist", *S, *es, *sets(f"train.max_steps={best + 8}"), "--device", "cpu", "--run-dir", parts],
            ["train", "mnist", *S, *es, *sets("train.max_steps=0"), "--device", "cpu", "--run-dir", parts, "--resume", "auto"]):
        assert r.returncode == 0, r.stderr
    assert "its weights restored" in (parts / "train.log").read_text()
    assert rows(parts, "test")[-1]["loss"] == rows(whole, "test")[-1]["loss"]


FIXTURE = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "run-0.2.0"
EMA_KEY, ES_KEY = "EMA{'decay': 0.99}", "EarlyStopping{'monitor': 'val_loss', 'min_delta': 0.0}"


# `brickyard train --resume auto` on each run directory given, one after another in one process (torch imported
# once, not once a case): each command's exit code and what it wrote to stderr, as JSON lines on stdout
RESUMES = """
import contextlib, io, json, sys
from brickyard.cli.main import main
for run in sys.argv[1:]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["train", run + "/config.yaml", "--run-dir", run, "--resume", "auto"])
    print(json.dumps({"code": code, "stderr": err.getvalue()}), flush=True)
"""


def test_a_checkpoint_whose_callback_states_hold_tensors_is_one_sentence(tmp_path):
    """Checked when the run is resumed, before any step: never a crash report mid-run."""
    import shutil
    import subprocess
    import sys

    from brickyard.files import write_torch
    state = torch.load(FIXTURE / "checkpoints" / "step-0000008.pt", weights_only=True)
    es = state["callbacks"][ES_KEY]
    runs = []
    for i, callbacks in enumerate([torch.zeros(3), {EMA_KEY: torch.zeros(2)}, {ES_KEY: {**es, "best": torch.ones(1)}},
                                   {ES_KEY: torch.ones(2, 2)}, {EMA_KEY: {"avg": [torch.zeros(2)]}, ES_KEY: es}]):
        run = tmp_path / f"r{i}"
        shutil.copytree(FIXTURE, run)
        write_torch({**state, "callbacks": callbacks}, run / "checkpoints" / "step-0000008.pt")
        runs.append(str(run))
    r = subprocess.run([sys.executable, "-c", RESUMES, *runs], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(runs), r.stdout[-3000:]
    for i, said in enumerate(results):
        lines = said["stderr"].strip().splitlines()
        assert said["code"] != 0 and len(lines) == 1 and lines[0].startswith("error: "), (i, said["stderr"][-1500:])
        assert "crashed" not in said["stderr"] and ("checkpoint" in lines[0] or "EMA" in lines[0]), (i, lines)


def test_not_learning_stops_a_resumed_run_where_it_stops_an_uninterrupted_one(tmp_path):
    """A model that does not learn (a rate of 1e-9) is stopped after 3 log windows at chance (steps 4, 8, 12); the
    same run resumed from its checkpoint of step 8 is stopped at step 12 too (its streak is in the checkpoint)."""
    import shutil
    stuck = sets("optim.lr=1e-9", "train.log_every=4", "train.epochs=5", "train.stop_if_not_learning=true")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    r = run_cli("train", "mnist", *S, *stuck, "--device", "cpu", "--run-dir", str(whole))
    assert r.returncode == 1 and "not learning: for 3 log windows up to step 12" in r.stderr, r.stderr
    shutil.copytree(whole, parts)
    for later in [p for p in (parts / "checkpoints").iterdir() if p.name != "step-0000008.pt"]:
        later.unlink()
    r = run_cli("train", "mnist", *S, *stuck, "--device", "cpu", "--run-dir", str(parts), "--resume", "auto")
    assert "resumed from" in (parts / "train.log").read_text()
    assert r.returncode == 1 and "not learning: for 3 log windows up to step 12" in r.stderr, r.stderr


@pytest.mark.fast
def test_a_strangers_temperature_or_threshold_in_a_checkpoint_is_one_sentence():
    """The numbers eval and predict read from a checkpoint's meta: defaults where none is kept, kept ones as they
    are, and a value no run writes (a string, a bool, nan, out of range) one CheckpointError naming the file."""
    from brickyard.errors import CheckpointError
    from brickyard.training import checkpoint
    assert checkpoint.temperature({}, "c.pt") == 1.0 and checkpoint.threshold({"meta": None}, "c.pt") == 0.5
    assert checkpoint.temperature({"meta": {"temperature": 2}}, "c.pt") == 2.0
    assert checkpoint.threshold({"meta": {"threshold": 0.35}}, "c.pt") == 0.35
    for key, bad in (("temperature", 0), ("temperature", float("nan")), ("temperature", "1.5"), ("temperature", True),
                     ("threshold", 1.0), ("threshold", float("inf")), ("threshold", [0.5])):
        with pytest.raises(CheckpointError, match=rf"checkpoint c.pt: its {key} .* is not a"):
            getattr(checkpoint, key)({"meta": {key: bad}}, "c.pt")
