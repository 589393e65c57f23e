"""``schedule.name: plateau`` and ``ReduceLROnPlateau``: Keras's counting, read against what a run logged, on 1 and 2
processes, across a resume, on top of another schedule, and the one-sentence refusals. Synthetic data, fp32, one
thread per process, a fixed global batch."""
import json
import math

import pytest
import torch

from brickyard import fit
from brickyard.callbacks import ReduceLROnPlateau
from brickyard.config import load_config
from brickyard.errors import ConfigError
from brickyard.training import checkpoint
from conftest import ACROSS_ORDERS, SYNTH, run_cli, sets

PLATEAU = [s for s in SYNTH if not s.startswith("data.batch_size")] + [
    "data.global_batch_size=64", "optim.name=momentum", "optim.lr=0.2", "train.epochs=8", "train.log_every=1",
    "train.plots=false", "schedule.name=plateau", "schedule.patience=1", "schedule.gamma=0.5",
    "schedule.min_delta=0.02", "schedule.cooldown=1", "schedule.lr_end=0.03"]


def _rows(run, kind):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def keras(values, lr, factor, patience, min_delta, cooldown, min_lr, higher=False):
    """The rate after each validation, as Keras's ``ReduceLROnPlateau.on_epoch_end`` sets it (written out here
    from keras/src/callbacks/reduce_lr_on_plateau.py to check brickyard against)."""
    best, wait, counter, out = -math.inf if higher else math.inf, 0, 0, []
    for v in values:
        if counter > 0:
            counter, wait = counter - 1, 0
        if (v > best + min_delta) if higher else (v < best - min_delta):
            best, wait = v, 0
        elif counter == 0:
            wait += 1
            if wait >= patience and lr > min_lr:
                lr, counter, wait = max(lr * factor, min_lr), cooldown, 0
        out.append(lr)
    return out


def _rates_after_validations(run):
    """Each validation's step and the rate of the step after it, from the run's metrics."""
    lrs = {r["step"]: r["lr"] for r in _rows(run, "train")}
    vals = _rows(run, "val")
    return [v["loss"] for v in vals], [lrs.get(v["step"] + 1) for v in vals], vals


def test_the_rate_falls_as_keras_lowers_it_on_one_and_two_processes(tmp_path):
    one = tmp_path / "one"
    r = run_cli("train", "mnist", *sets(*PLATEAU), "--run-dir", str(one))
    assert r.returncode == 0, r.stderr
    losses, after, vals = _rates_after_validations(one)
    assert len(vals) == 8
    want = keras(losses, 0.2, 0.5, 1, 0.02, 1, 0.03)
    assert after[:-1] == pytest.approx(want[:-1], rel=1e-9)  # no step follows the last validation
    summary = json.loads((one / "summary.json").read_text())
    assert 2 <= len(summary["lr_reduced_at"]) and summary["lr_reduced_at"] == [
        v["step"] for v, a, b in zip(vals, [0.2] + want, want) if b < a]
    log = (one / "train.log").read_text()
    assert "ReduceLROnPlateau: val_loss has not improved by more than 0.02 for 1 validation(s)" in log
    two = tmp_path / "two"
    r = run_cli("train", "mnist", *sets(*PLATEAU), "--devices", "cpu:2", "--run-dir", str(two))
    assert r.returncode == 0, r.stderr
    assert json.loads((two / "summary.json").read_text())["lr_reduced_at"] == summary["lr_reduced_at"]
    a = checkpoint.load(checkpoint.step_checkpoints(one / "checkpoints")[-1])["model"]
    b = checkpoint.load(checkpoint.step_checkpoints(two / "checkpoints")[-1])["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < ACROSS_ORDERS


def test_a_resumed_run_keeps_the_reductions_and_ends_with_the_same_weights(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_cli("train", "mnist", *sets(*PLATEAU), "--run-dir", str(whole)).returncode == 0
    r = run_cli("train", "mnist", *sets(*PLATEAU, "train.stop_epoch=5"), "--run-dir", str(parts))
    assert r.returncode == 0, r.stderr
    before = json.loads((parts / "summary.json").read_text())["lr_reduced_at"]
    r = run_cli("train", "mnist", *sets(*PLATEAU, "train.stop_epoch=0"), "--run-dir", str(parts), "--resume", "auto")
    assert r.returncode == 0, r.stderr
    reduced = json.loads((whole / "summary.json").read_text())["lr_reduced_at"]
    assert before and before == [s for s in reduced if s <= 5 * 8]
    assert json.loads((parts / "summary.json").read_text())["lr_reduced_at"] == reduced
    a = checkpoint.load(checkpoint.step_checkpoints(whole / "checkpoints")[-1])["model"]
    b = checkpoint.load(checkpoint.step_checkpoints(parts / "checkpoints")[-1])["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.fast
def test_the_callback_scales_another_schedule_and_watches_accuracy(tmp_path):
    """Given to ``fit`` on top of a cosine schedule, watching val_accuracy (higher is better): each step's rate is
    the cosine's times the reductions so far."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 8, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(400, generator=g) > 0).long()  # noisy: accuracy stalls
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    cb = ReduceLROnPlateau("val_accuracy", factor=0.25, patience=2, min_delta=0.01)
    cfg = ["train.progress=none", "train.precision=fp32", "train.threads=1", "train.plots=false", "train.log_every=1",
           "train.tensorboard=false", "optim.name=momentum", "optim.lr=0.1", "schedule.name=cosine", "train.epochs=10",
           "data.batch_size=40"]
    s = fit(model, (x[:300], y[:300]), val_data=(x[300:], y[300:]), run_dir=tmp_path / "r", overrides=cfg, callbacks=[cb])
    run = tmp_path / "r"
    vals = _rows(run, "val")
    accs = [v["accuracy"] for v in vals]
    scales = [f / 0.1 for f in keras(accs, 0.1, 0.25, 2, 0.01, 0, 0.0, higher=True)]
    assert s["lr_reduced_at"] and scales[-1] < 1
    total = 80
    cosine = {k: 0.05 * (1 + math.cos(math.pi * k / total)) for k in range(total)}
    assert len(set(scales)) >= 2 and any(b > a for a, b in zip(accs, accs[1:]))  # improvements and reductions
    for r in _rows(run, "train"):  # the row of step k (1-based) carries the rate of schedule(k - 1)
        k = r["step"] - 1
        assert r["lr"] == pytest.approx(cosine[k] * _scale_before(vals, scales, k), rel=1e-9)


def _scale_before(vals, scales, k):
    """The scale in force for schedule(k): that of the last validation made after k steps or fewer."""
    done = [sc for v, sc in zip(vals, scales) if v["step"] <= k]
    return done[-1] if done else 1.0


def test_a_plateau_without_validations_or_with_the_users_scheduler_is_one_sentence(tmp_path):
    cases = {
        "no-val": ([], "schedule.name plateau lowers the learning rate when val_loss stops improving, and this run has "
                       "no validation data"),
        "end-only": (["train.eval_every=0", "data.val_fraction=0.2"], "train.eval_every 0 validates only at the end"),
        "gamma": (["schedule.gamma=1", "data.val_fraction=0.2"], "schedule.gamma: 1 must lie between 0 and 1"),
        "regression": (["schedule.monitor=val_accuracy", "data.val_fraction=0.2"],
                       "schedule.name plateau watches val_accuracy, which scores classes, and this run's labels are not"),
    }
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    for name, (extra, said) in cases.items():
        regression = name == "regression"  # float targets, a loss of the user's
        with pytest.raises(ConfigError, match=said):
            fit(torch.nn.Linear(4, 1 if regression else 2), (x, y.float()[:, None] if regression else y),
                run_dir=tmp_path / name, overrides=["train.progress=none", "schedule.name=plateau", *extra],
                loss_fn=torch.nn.functional.mse_loss if regression else None)
        assert not (tmp_path / name).exists()
    with pytest.raises(ConfigError, match="ReduceLROnPlateau scales brickyard's learning-rate schedule, and schedule.name "
                                          "none leaves the rates to a scheduler of your own"):
        fit(torch.nn.Linear(4, 2), (x, y), val_data=(x, y), run_dir=tmp_path / "none", callbacks=[ReduceLROnPlateau()],
            overrides=["train.progress=none", "schedule.name=none"])
    assert not (tmp_path / "none").exists()
    with pytest.raises(ConfigError, match="factor 1.5 must lie between 0 and 1"):
        ReduceLROnPlateau(factor=1.5)
    bad = run_cli("train", "mnist", *sets("data.train_on_all=true", "schedule.name=plateau"), "--run-dir", str(tmp_path / "cli"))
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: schedule.name plateau lowers the learning rate")
    assert not (tmp_path / "cli").exists()
    assert load_config("mnist", ["schedule.name=plateau"]).schedule.patience == 10  # Keras's default


def test_a_checkpoint_whose_saved_state_is_not_the_callbacks_is_one_sentence_and_nothing_changes(tmp_path):
    """A checkpoint rewritten by a stranger (its checksum made anew) whose ReduceLROnPlateau state holds a string for
    its scale: one sentence at the resume, not a crash at the first step, and the run's files stay as they were.
    EarlyStopping refuses a state not its own the same way."""
    from brickyard.callbacks import EarlyStopping
    from brickyard.training.checkpoint import write_torch
    run = tmp_path / "r"
    assert run_cli("train", "mnist", *sets(*PLATEAU, "train.stop_epoch=2"), "--run-dir", str(run)).returncode == 0
    newest = checkpoint.step_checkpoints(run / "checkpoints")[-1]
    state = checkpoint.load(newest)
    key = next(k for k in state["callbacks"] if k.startswith("ReduceLROnPlateau"))
    state["callbacks"][key]["scale"] = "x"
    write_torch(state, newest)
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "train.lock"}
    r = run_cli("train", "mnist", *sets(*PLATEAU, "train.stop_epoch=0"), "--run-dir", str(run), "--resume", "auto")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: checkpoint {newest}: a callback's saved state does not fit it (ReduceLROnPlateau: "
        f"{str(state['callbacks'][key])[:120]} is not its state)."], r.stderr
    after = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "train.lock"}
    for name, old in before.items():  # the logs say the attempt after what they held; the rest is as it was
        assert after[name].startswith(old) if name in ("train.log", "workerlog.0") else after[name] == old, name
    for bad in ({"best": "x", "wait": 0, "best_step": 3}, {"best": 0.5, "wait": -1, "best_step": 3}):
        with pytest.raises(ValueError, match="is not its state"):
            EarlyStopping().load_state_dict(bad)
