"""The learning-rate range test: `brickyard lr-find` and `optim.lr: find`. Synthetic data, fp32, one
thread per process, deterministic kernels, a fixed global batch (so 1 and 2 processes see one curve)."""
import json

import pytest

from brickyard.config import load_config
from brickyard.errors import ConfigError
from brickyard.tools.lrfind import suggest
from conftest import SYNTH, run_cli, run_cli_many, sets

FIND = [s for s in SYNTH if not s.startswith("data.batch_size")] + ["data.global_batch_size=64", "train.deterministic=true"]


@pytest.mark.fast
def test_the_suggestion_is_the_steepest_fall_against_log_lr_past_the_first_points():
    lrs = [10 ** (-6 + i * 0.1) for i in range(50)]
    losses = [2.3] * 20 + [2.3 - 0.01 * i for i in range(10)] + [2.2 - 0.2 * i for i in range(5)] + [1.4 + 0.3 * i for i in range(15)]
    lr, i = suggest(lrs, losses)
    assert 30 <= i <= 34 and lr == lrs[i]
    assert suggest(lrs[:5], losses[:5]) == (None, None)  # too few points past the skipped ones


def test_lr_find_prints_a_suggestion_writes_its_plot_and_touches_no_run(tmp_path):
    r = run_cli("lr-find", "mnist", *sets(*FIND), "--steps", "40", "--min-lr", "1e-5", "--max-lr", "10",
                "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "lr-find: suggested optim.lr" in r.stdout and "rule: steepest descent of the smoothed loss against log10(lr)" in r.stdout
    one = json.loads((tmp_path / "out" / "lr_find.json").read_text())
    assert 1e-5 <= one["suggested_lr"] <= 10 and len(one["lrs"]) == len(one["losses"]) == one["steps"] <= 40
    assert (tmp_path / "out" / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no run directory, no checkpoint
    two = run_cli("lr-find", "mnist", *sets(*FIND), "--steps", "40", "--min-lr", "1e-5", "--max-lr", "10",
                  "--devices", "cpu:2", "--out", str(tmp_path / "out2"), cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    other = json.loads((tmp_path / "out2" / "lr_find.json").read_text())
    # the ranks average one global batch's loss: the curve of one process, up to fp32 sums in another order
    assert other["world_size"] == 2 and other["index"] == one["index"] and other["steps"] == one["steps"]
    low = min(range(one["steps"]), key=lambda i: one["losses"][i])  # past the lowest loss the divergence amplifies noise
    assert max(abs(a - b) for a, b in zip(one["losses"][:low + 1], other["losses"][:low + 1])) < 1e-4


def test_optim_lr_find_runs_the_test_first_and_writes_the_rate_into_the_run(tmp_path):
    run = tmp_path / "r"
    r, again, bad = run_cli_many(  # one process, torch imported once: the run, its resume, a refused range test
        ["train", "mnist", *sets(*FIND, "optim.lr=find", "train.max_steps=6", "train.plots=false"), "--run-dir", run],
        ["train", "mnist", *sets(*FIND, "optim.lr=find", "train.max_steps=8", "train.plots=false"), "--run-dir", run,
         "--resume", "auto"],
        ["lr-find", "mnist", *sets(*FIND), "--min-lr", "1", "--max-lr", "0.1"])
    assert r.returncode == 0, r.stderr
    assert "optim.lr: find: the range test suggests optim.lr" in r.stdout
    assert again.returncode == 0, again.stderr
    # the rate in config.yaml after both is the one the first run found and trained with (the resume kept it)
    found = load_config(str(run / "config.yaml")).optim.lr
    assert isinstance(found, float) and f"peak lr {found:g}" in r.stdout
    assert "range test" not in again.stdout
    with pytest.raises(ConfigError, match="optim.lr: 'fast' is not a number or one of find"):
        load_config("mnist", ["optim.lr=fast"])
    assert bad.returncode == 2 and bad.stderr.strip() == "error: lr-find: needs 0 < --min-lr < --max-lr and at least 13 steps."


def test_lr_find_reads_the_batches_train_draws_with_data_balance(tmp_path):
    """With ``data.balance`` the range test's first loss is that of the first batch `brickyard train` draws (the
    same model and seed), not of the permutation's first batch."""
    found, losses = {}, {}
    commands = [["lr-find", "mnist", *sets(*FIND, f"data.balance={on}"), "--steps", "13", "--out", tmp_path / on]
                for on in ("true", "false")]
    commands += [["train", "mnist", *sets(*FIND, f"data.balance={on}", "train.max_steps=1", "train.log_every=1",
                                         "train.plots=false"), "--run-dir", tmp_path / f"run-{on}"] for on in ("true", "false")]
    for r in run_cli_many(*commands):  # one process, torch imported once: each command seeds its own draws
        assert r.returncode == 0, r.stderr
    for on in ("true", "false"):
        found[on] = json.loads((tmp_path / on / "lr_find.json").read_text())["losses"][0]
        rows = [json.loads(line) for line in (tmp_path / f"run-{on}" / "metrics.jsonl").read_text().splitlines()]
        losses[on] = next(row["loss"] for row in rows if row["kind"] == "train" and row["step"] == 1)
    assert found == losses and found["true"] != found["false"]
