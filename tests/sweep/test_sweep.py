"""Real sweeps: `brickyard sweep` processes train MNIST trials (100 images a class, 3 epochs of 20 steps, fp32, one
thread each), prune, share a storage, die and resume, cross-validate, and refuse a stranger's command before any
trial."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import popen_cli, run_cli, sets

optuna = pytest.importorskip("optuna")

BASE = sets("optim.lr=0.005", "schedule.name=constant", "data.train_per_class=100", "train.epochs=3",
            "data.global_batch_size=50", "data.eval_limit=300", "train.progress=none", "train.plots=false",
            "train.precision=fp32", "train.threads=1", "train.tensorboard=false")


def _study(sweep_dir):
    from brickyard.sweep.study import JOURNAL, open_storage
    return optuna.load_study(study_name=sweep_dir.name, storage=open_storage(str(sweep_dir / JOURNAL)))


def _space(tmp_path, text="optim.lr: {log_uniform: [1.0e-7, 0.005]}\n"):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return str(p)


def test_a_sweep_prunes_a_poor_trial_through_the_stop_path_and_answers(tmp_path):
    """Trial 0 is the config's own rate (the baseline); random rates down to 1e-7 learn nothing in 20 steps and the
    median pruner stops them at their first validation: the run directory is whole (checkpoint, test, summary) and
    says why. The answer: the table, trials.csv, sweep.png, best.yaml that brickyard train takes."""
    d = tmp_path / "s"
    r = run_cli("sweep", "mnist", "--space", _space(tmp_path), "--trials", "4", "--sampler", "random", "--seed", "3",
                "--prune-startup", "1", "--prune-warmup", "0", "--dir", str(d), *BASE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trial 0 is the config's own values (the baseline): optim.lr=0.005" in r.stdout
    s = _study(d)
    trials = s.get_trials()
    assert trials[0].params == {"optim.lr": 0.005} and trials[0].state.name == "COMPLETE" and s.best_trial.number == 0
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned and all(t.params["optim.lr"] < 1e-3 for t in pruned), [(t.state.name, t.params) for t in trials]
    run = d / f"trial-{pruned[0].number:04d}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped"].startswith("pruned by the sweep at step 20") and summary["test_accuracy"] is not None
    assert (run / "checkpoints" / "last.pt").exists() or any((run / "checkpoints").glob("step-*.pt"))
    assert "pruned by the sweep: val_accuracy" in (run / "train.log").read_text()
    assert list(pruned[0].intermediate_values) == [100]  # reported once, at its only validation: after epoch 1
    for name in ("trials.csv", "sweep.png", "best.yaml"):
        assert (d / name).is_file(), name
    assert f"trial 0, val_accuracy {trials[0].value:.4f}" in r.stdout
    again = run_cli("train", str(d / "best.yaml"), *sets("train.max_steps=2"), "--run-dir", str(tmp_path / "best"))
    assert again.returncode == 0, again.stderr[-2000:]
    show = run_cli("sweep", "--show", str(d))
    assert show.returncode == 0 and " *\n" in show.stdout and "pruned" in show.stdout


def test_hyperband_prunes_in_its_brackets_from_the_first_validation(tmp_path):
    """--pruner hyperband over 3-epoch trials: resources from the first validation (epoch 1) to the last (epoch 3),
    so two brackets (Optuna's own defaults would judge nothing before a trial completes). The sweep's name puts
    trials 0-2 in the bracket that judges at epoch 1 (Optuna assigns brackets by crc32 of the study name and the
    trial number): the baseline, judged first, goes on; two rates far below it are pruned at their first
    validation, through the stop path."""
    d = tmp_path / "brackets"
    space = _space(tmp_path, "optim.lr: {choice: [0.005, 1.0e-6, 1.0e-7]}\n")
    r = run_cli("sweep", "mnist", "--space", space, "--trials", "3", "--sampler", "random", "--seed", "0",
                "--pruner", "hyperband", "--dir", str(d), *BASE)
    assert r.returncode == 0, r.stderr[-3000:]
    study = _study(d)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "PRUNED"], [(t.state.name, t.params) for t in trials]
    assert trials[0].params["optim.lr"] == 0.005 and list(trials[0].intermediate_values) == [100, 200, 300]
    for t in trials[1:]:
        assert t.params["optim.lr"] < 1e-5 and list(t.intermediate_values) == [100]
        summary = json.loads((d / f"trial-{t.number:04d}" / "summary.json").read_text())
        assert summary["stopped"].startswith("pruned by the sweep at step 20") and summary["test_accuracy"] is not None
    assert "hyperband pruner" in r.stdout


def test_a_grid_of_choices_and_whole_numbers_goes_on_past_failed_trials_and_answers_in_full(tmp_path):
    """The grid sampler over a choice and an int range visits each of its 4 points once; a rate that makes the loss
    non-finite fails its trials with their one sentence and the sweep goes on, ending 0. The answer: each parameter's
    importance, the best trials' curves, and best.yaml carrying the best trial's values."""
    import yaml
    d = tmp_path / "grid"
    space = _space(tmp_path, "optim.lr: {choice: [0.005, 1.0e+30]}\ntrain.seed: {int: [0, 1]}\n")
    r = run_cli("sweep", "mnist", "--space", space, "--sampler", "grid", "--trials", "4", "--seed", "0",
                "--pruner", "hyperband", "--dir", str(d), *BASE, *sets("train.epochs=1"))
    assert r.returncode == 0, r.stderr[-3000:]
    study = _study(d)
    trials = study.get_trials()
    assert sorted((t.params["optim.lr"], t.params["train.seed"]) for t in trials) == [(0.005, 0), (0.005, 1),
                                                                                       (1e30, 0), (1e30, 1)]
    for t in trials:
        if t.params["optim.lr"] == 1e30:
            assert t.state.name == "FAIL" and "training loss became non-finite" in t.user_attrs["error"], t.user_attrs
            assert f"trial {t.number}: fail, training loss became non-finite" in r.stdout
        else:  # a trial's only validation is its last: never judged, whatever the pruner
            assert t.state.name == "COMPLETE" and list(t.intermediate_values) == [100]
    best = study.best_trial
    assert (d / "importance.png").is_file() and any((d / "best-curves").glob("*.png"))
    cfg = yaml.safe_load((d / "best.yaml").read_text())
    assert cfg["optim"]["lr"] == 0.005 and cfg["train"]["seed"] == best.params["train.seed"]
    assert "non-finite" in (d / "trials.csv").read_text()


def _sweep_process(tmp_path, d, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return popen_cli(["sweep", "mnist", "--space", _space(tmp_path), "--dir", str(d), "--pruner", "none", *BASE, *extra],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_two_sweep_processes_share_one_study_and_run_no_trial_twice(tmp_path):
    d = tmp_path / "shared"
    first = run_cli("sweep", "mnist", "--space", _space(tmp_path), "--dir", str(d), "--trials", "1", "--pruner", "none", *BASE)
    assert first.returncode == 0, first.stderr[-2000:]  # the study exists, with its baseline done
    procs = [_sweep_process(tmp_path, d, "--trials", "5") for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    trials = _study(d).get_trials()
    assert 5 <= len(trials) <= 6 and all(t.state.name == "COMPLETE" for t in trials)  # one more where both asked at once
    lrs = [t.params["optim.lr"] for t in trials]
    assert len(set(lrs)) == len(lrs)  # no values trained twice
    ran = [line for out, _ in outs for line in out.splitlines() if line.startswith("trial ")]
    numbers = [int(line.split()[1].rstrip(":")) for line in ran if "complete" in line]
    assert len(numbers) == len(set(numbers)) == len(trials) - 1 and all(outs[i][0].count("trial ") >= 1 for i in (0, 1))
    for t in trials:  # each trial trained once, in its own directory, with its own values
        run = d / f"trial-{t.number:04d}"
        assert (run / "train.log").read_text().count("global batch") == 1
        assert f"lr: {t.params['optim.lr']}" in (run / "config.yaml").read_text()


def test_a_sweep_killed_with_sigkill_resumes_and_keeps_every_finished_trial(tmp_path):
    d = tmp_path / "killed"
    p = _sweep_process(tmp_path, d, "--trials", "3", "--seed", "1", *sets("train.epochs=6"))
    deadline = time.time() + 300
    while time.time() < deadline and not ((d / "trial-0000" / "summary.json").is_file() and (d / "trial-0001").is_dir()):
        time.sleep(0.2)
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    before = {t.number: (t.state.name, t.value) for t in _study(d).get_trials()}
    assert before[0][0] == "COMPLETE" and before[1][0] == "RUNNING"
    r = run_cli("sweep", "mnist", "--space", _space(tmp_path), "--dir", str(d), "--pruner", "none", "--trials", "3",
                "--seed", "1", "--resume", *BASE, *sets("train.epochs=6"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 trial(s) of a sweep process that ended were marked failed and queued again" in r.stdout
    after = _study(d).get_trials()
    assert after[0].state.name == "COMPLETE" and after[0].value == before[0][1]
    assert after[1].state.name == "FAIL" and "ended before it finished" in after[1].user_attrs["error"]
    assert after[2].params == after[1].params and sum(t.state.name == "COMPLETE" for t in after) == 3


def test_cross_validation_scores_a_trial_as_its_folds_mean(tmp_path):
    """--folds 3: three runs a trial on disjoint validation folds whose union is the pooled training set; the
    trial's value is their mean, the spread kept."""
    from brickyard.config import load_config
    from brickyard.data import build_data
    d = tmp_path / "cv"
    r = run_cli("sweep", "mnist", "--space", _space(tmp_path, "optim.lr: [0.005]\n"), "--dir", str(d), "--trials", "1",
                "--folds", "3", *BASE, *sets("data.train_on_all=true"))
    assert r.returncode == 0, r.stderr[-3000:]
    t = _study(d).get_trials()[0]
    from brickyard.sweep.trial import best_value
    scores = [best_value(d / "trial-0000" / f"fold-{i}", "val_accuracy") for i in range(3)]
    assert t.user_attrs["folds"] == scores and t.value == pytest.approx(sum(scores) / 3)
    held = []
    for i in range(3):
        assert f"fold {i} of 3" in (d / "trial-0000" / f"fold-{i}" / "train.log").read_text()
        cfg = load_config("mnist", ["data.train_per_class=100", "data.train_on_all=true", "data.folds=3", f"data.fold={i}"])
        held.append({tuple(x.flatten()[::7].tolist()) for x in build_data(cfg.data).val.images})
    assert all(a.isdisjoint(b) for a, b in ((held[0], held[1]), (held[0], held[2]), (held[1], held[2])))
    assert sum(map(len, held)) == 1000  # 100 images of each class, every one validated once


def test_a_trial_of_two_processes_reports_once(tmp_path):
    d = tmp_path / "two"
    r = run_cli("sweep", "mnist", "--space", _space(tmp_path, "optim.lr: [0.005]\n"), "--dir", str(d), "--trials", "1",
                "--devices", "cpu:2", *BASE)
    assert r.returncode == 0, r.stderr[-3000:]
    t = _study(d).get_trials()[0]
    assert t.state.name == "COMPLETE" and list(t.intermediate_values) == [100, 200, 300]  # hundredths of an epoch
    reports = [json.loads(line) for line in (d / "study.journal").read_text().splitlines()]
    assert sum(op["op_code"] == 7 for op in reports) == 3  # SET_TRIAL_INTERMEDIATE_VALUE: rank 0 alone
    assert (d / "trial-0000" / "logs" / "workerlog.1").is_file()


@pytest.mark.parametrize("args, message", [
    (["--space", "MISSING"], "--space .*: no such file"),
    (["--space", "SPACE", "--metric", "val_map"], "--metric val_map is not scored for one label an image"),
    (["--space", "SPACE", "--metric", "val_nope"], "--metric val_nope is not a validation metric; one of val_loss"),
    (["--space", "SPACE", "--storage", "sweeps.db"], "--storage 'sweeps.db' is not a database URL"),
    (["--space", "SPACE", "--devices", "cpu:0"], "--devices"),
    (["--space", "SPACE", "--storage", "postgresql://u:secret@127.0.0.1:9/sweeps"], r"--storage postgresql://u:\*\*\*@127.0.0.1:9/sweeps( cannot be used|: its database driver)"),
    (["--space", "SPACE", "--storage", "sqlite:////proc/no/such/dir/s.db"], "--storage sqlite:////proc/no/such/dir/s.db cannot be used"),
    (["--space", "SPACE", *sets("data.train_on_all=true")], "keeps no validation split to score a trial on"),
    (["--space", "SPACE", "--folds", "1"], "--folds 1: cross-validation takes 2 folds or more"),
])
def test_a_strangers_sweep_is_one_sentence_before_any_trial(tmp_path, args, message):
    d = tmp_path / "bad"
    args = [_space(tmp_path) if a == "SPACE" else str(tmp_path / "missing.yaml") if a == "MISSING" else a for a in args]
    r = run_cli("sweep", "mnist", *args, "--dir", str(d))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    import re
    assert re.search(message, lines[0]), lines[0]
    assert not list(d.glob("trial-*")) and "secret" not in r.stderr


def test_two_machines_share_a_sweep_on_postgresql(tmp_path):
    """A real PostgreSQL on loopback (a data directory of its own, stopped by PID): two sweep processes started with
    the same command but their own folders, as two machines would be, share the study's trials; an unreachable
    database is one sentence."""
    import postgres_server
    why = postgres_server.unavailable()
    if why:
        pytest.skip(why)
    with postgres_server.Server() as url:
        procs = [_sweep_process(tmp_path, tmp_path / machine / "pg", "--storage", url, "--trials", "4")
                 for machine in ("a", "b")]
        outs = [p.communicate(timeout=600) for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
        from brickyard.sweep.study import open_storage
        trials = optuna.load_study(study_name="pg", storage=open_storage(url)).get_trials()
        assert 4 <= len(trials) <= 5 and all(t.state.name == "COMPLETE" for t in trials)
        dirs = [t.user_attrs["run_dir"] for t in trials]
        machines = {os.path.relpath(d, tmp_path).split(os.sep)[0] for d in dirs}
        assert machines == {"a", "b"}, dirs  # both machines trained trials of the one study
        assert all(os.path.isfile(os.path.join(d, "summary.json")) for d in dirs)
        lrs = [t.params["optim.lr"] for t in trials]
        assert len(set(lrs)) == len(lrs)  # no values trained twice
    r = run_cli("sweep", "mnist", "--space", _space(tmp_path), "--dir", str(tmp_path / "gone"), "--storage", url,
                *BASE)  # the server has stopped
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"error: --storage {url}")
    assert "cannot be used" in r.stderr


def test_ctrl_c_stops_a_sweep_keeps_its_trials_and_resume_finishes_it(tmp_path):
    """SIGINT (Ctrl-C) during trial 1: the run saves and ends, the sweep ends with 130 saying how to continue, trial 0
    is kept, trial 1 is failed with its values queued again, and --resume trains them."""
    d = tmp_path / "int"
    p = _sweep_process(tmp_path, d, "--trials", "2", "--seed", "2", *sets("train.epochs=6"))
    log, deadline = d / "trial-0001" / "train.log", time.time() + 300
    # as soon as trial 1 logs its first steps: its 120 steps take about 0.6 s on a fast core (Zen 5), so a fixed pause
    # after its log appeared let it finish first
    while time.time() < deadline and not (log.is_file() and "epoch 1 step " in log.read_text()):
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "continue with --resume" in out, (out[-2000:], err[-2000:])
    first = _study(d).get_trials()
    assert [t.state.name for t in first[:2]] == ["COMPLETE", "FAIL"] and "interrupted" in first[1].user_attrs["error"]
    r = run_cli("sweep", "mnist", "--space", _space(tmp_path), "--dir", str(d), "--pruner", "none", "--trials", "2",
                "--seed", "2", "--resume", *BASE, *sets("train.epochs=6"))
    assert r.returncode == 0, r.stderr[-3000:]
    after = _study(d).get_trials()
    assert after[2].params == first[1].params and [t.state.name for t in after] == ["COMPLETE", "FAIL", "COMPLETE"]


def test_parallel_runs_trials_side_by_side_on_shares_of_the_cores(tmp_path):
    """--parallel 2 on this CPU: two sweep processes on the study, each trial on half the cores (train.threads),
    the parent writes the answer; and brickyard train never imports Optuna, a database driver or Ray."""
    d = tmp_path / "par"
    r = run_cli("sweep", "mnist", "--space", _space(tmp_path), "--dir", str(d), "--trials", "3", "--parallel", "2",
                "--pruner", "none", "--seed", "4", *sets(*[v for v in BASE[1::2] if v != "train.threads=1"]))
    assert r.returncode == 0, r.stderr[-3000:]
    trials = _study(d).get_trials()
    assert 3 <= len(trials) <= 4 and all(t.state.name == "COMPLETE" for t in trials) and (d / "trials.csv").is_file()
    assert any(a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete
               for i, a in enumerate(trials) for b in trials[i + 1:]), [(t.datetime_start, t.datetime_complete) for t in trials]
    cores = len(os.sched_getaffinity(0))
    for t in trials:
        assert f"threads: {max(1, cores // 2)}" in (d / f"trial-{t.number:04d}" / "config.yaml").read_text()
    probe = subprocess.run([sys.executable, "-c", "import sys; from brickyard.cli.main import main; "
                            f"code = main(['train', 'mnist', '--run-dir', {str(tmp_path / 'plain')!r}, "
                            "'--set', 'train.max_steps=2', '--set', 'train.progress=none', '--set', 'train.plots=false']); "
                            "print(code, sorted({'optuna', 'sqlalchemy', 'psycopg', 'psycopg2', 'ray'} & set(sys.modules)))"],
                           capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip().splitlines()[-1] == "0 []", probe.stderr[-2000:]
