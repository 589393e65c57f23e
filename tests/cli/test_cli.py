import json

import pytest

from conftest import SYNTH, needs_mnist, run_cli, run_cli_many, sets


@pytest.mark.parametrize("args, expected", [
    (["train", *sets("optim.name=adamm")], "error: optim.name: 'adamm' is not one of sgd, momentum, nesterov, adagrad, adadelta, adam, adamw"),
    (["train", "nope"], "error: 'nope' is neither a YAML file nor a preset"),
    (["train", *sets("data.batch_size=-3")], "error: data.batch_size: -3 is below the minimum 1"),
    (["train", "--device", "cuda:7", *sets(*SYNTH)], "error: device 'cuda:7' asked for, but CUDA is not available"),
    (["train", "--device", "gpu", *sets(*SYNTH)], "error: device 'gpu' is not one of auto, cpu, cuda, cuda:N"),
    (["train", *sets(*SYNTH, "train.precision=fp16")], "error: train.precision: 'fp16' needs a CUDA device"),
    (["train", *sets(*SYNTH, "model.name=resnet7")], "error: model.name: 'resnet7' is not one of"),
    (["train", "--devices", "cpu:2", *sets(*SYNTH, "model.name=resnet7")], "error: model.name: 'resnet7' is not one of"),
    (["eval", "does-not-exist.pt"], "error: checkpoint does-not-exist.pt does not exist."),
    (["data", "info", "cifar"], "error: data set 'cifar' is not one of mnist, fashion-mnist, cifar10, cifar100."),
])
def test_bad_input_is_one_line_and_non_zero(args, expected, tmp_path):
    r = run_cli(*args, "--run-dir", str(tmp_path / "run")) if args[0] == "train" else run_cli(*args)
    assert r.returncode == 2
    assert r.stderr.startswith(expected), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
    assert "launching" not in r.stdout and not (tmp_path / "run").exists()  # said before any worker starts


def test_a_folder_that_cannot_be_made_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    r = run_cli("train", *sets(*SYNTH, "train.epochs=0.01"), "--run-dir", str(blocker / "run"))
    assert r.returncode == 1 and r.stderr.strip() == f"error: {blocker / 'run'}: Not a directory.", r.stderr


def test_a_finished_run_is_not_trained_over(tmp_path):
    run = tmp_path / "run"
    assert run_cli("train", *sets(*SYNTH, "train.epochs=1"), "--run-dir", str(run)).returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for extra in ([], ["--devices", "cpu:2"]):
        r = run_cli("train", *sets(*SYNTH, "train.epochs=0.5"), "--run-dir", str(run), *extra)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
            f"error: run directory {run} already holds a run; continue it with --resume auto, or pick another --run-dir.")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # not a byte changed or added


@pytest.mark.fast
def test_default_run_dirs_do_not_collide(tmp_path, monkeypatch):
    from brickyard.training.rundir import default_path as default_run_dir
    monkeypatch.chdir(tmp_path)
    first = default_run_dir("mnist")
    first.mkdir(parents=True)
    second = default_run_dir("mnist")
    assert second != first and not second.exists()
    if second.name.startswith(first.name):  # the same second (else the clock moved on, and the name with it)
        assert second.name == first.name + "-2"


def test_nothing_written_is_lost_by_a_bad_resume(tmp_path):
    run = tmp_path / "run"
    assert run_cli("train", *sets(*SYNTH, "train.epochs=1"), "--run-dir", str(run)).returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    r = run_cli("train", *sets(*SYNTH, "train.epochs=1"), "--run-dir", str(run), "--resume", str(bad))
    assert r.returncode == 2 and "cannot be read" in r.stderr
    for p, content in before.items():
        if p.name in ("train.log", "workerlog.0"):  # logs only grow: the error is appended
            assert p.read_bytes().startswith(content) and b"cannot be read" in p.read_bytes(), p
        else:
            assert p.read_bytes() == content, p


def test_help_everywhere():
    for args in (["--help"], ["train", "--help"], ["eval", "--help"], ["data", "--help"]):
        r = run_cli(*args)
        assert r.returncode == 0 and "usage: brickyard" in r.stdout
    assert "examples:" in run_cli("train", "--help").stdout


def test_help_presets_and_config_errors_do_not_import_torch():
    """Importing torch takes seconds; help, presets and a bad --set come back without it."""
    import subprocess
    import sys
    code = ("import sys; from brickyard.cli import main; codes = [main(a) for a in {argv!r}]; "
            "print(codes, 'torch' in sys.modules)")
    argv = [["presets"], ["train", "--set", "nope=1"], ["train", "--set", "optim.lr=abc"], ["bench", "--set", "nope=1"],
            ["memory", "--set", "nope=1"], ["boost", "dim-reduce", "--stage1-epochs", "1", "--stage2-epochs", "1", "--set", "nope=1"]]
    r = subprocess.run([sys.executable, "-c", code.format(argv=argv)], capture_output=True, text=True)
    assert r.stdout.strip().splitlines()[-1] == "[0, 2, 2, 2, 2, 2] False", r.stdout + r.stderr
    assert "error: nope: unknown key" in r.stderr and "error: optim.lr: 'abc' is not a number or one of find." in r.stderr


def test_models_and_presets_lists():
    m = run_cli("models")
    assert m.returncode == 0 and "mnist_cnn" in m.stdout and "20,350 params" in m.stdout
    p = run_cli("presets")
    assert p.returncode == 0 and all(n in p.stdout for n in ("mnist ", "mnist-course", "fashion-resnet18", "mnist-lenet"))


def test_train_then_eval_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    r = run_cli("train", *sets(*SYNTH, "train.epochs=2", "optim.label_smoothing=0.1"), "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    assert f"run dir: {run}" in r.stdout and "test accuracy:" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    e = run_cli("eval", str(run / "checkpoints" / "step-0000032.pt"))
    assert e.returncode == 0, e.stderr
    result = json.loads(e.stdout)
    assert result["accuracy"] == pytest.approx(summary["test_accuracy"]) and result["count"] == 128
    # one checkpoint, one test loss: training evaluates without label smoothing, as eval does (and timm)
    assert result["loss"] == pytest.approx(summary["test_loss"], rel=1e-4)
    v = json.loads(run_cli("eval", str(run / "checkpoints" / "best.pt"), "--split", "val").stdout)
    assert v["split"] == "val" and v["count"] == 128
    d = json.loads(run_cli("eval", str(run), "--split", "val").stdout)  # a run directory stands for its best.pt
    assert d["checkpoint"] == str(run / "checkpoints" / "best.pt") and d["accuracy"] == v["accuracy"]
    (run / "checkpoints" / "best.pt").unlink()
    n = json.loads(run_cli("eval", str(run / "checkpoints")).stdout)  # else its newest step
    assert n["checkpoint"] == str(run / "checkpoints" / "step-0000032.pt") and n["accuracy"] == result["accuracy"]
    empty = run_cli("eval", str(tmp_path))
    assert empty.returncode == 2 and "is a folder with no checkpoint" in empty.stderr


def test_eval_scores_a_checkpoint_with_the_test_time_augmentation_asked_for(tmp_path):
    """--tta on a run trained without it scores what the same run trained with data.tta scored (tta
    changes only the evaluation, so the weights are the same); the default is the run's own."""
    common = (*SYNTH, "train.epochs=2", "train.seed=4", "data.shift=1")
    plain, with_tta = tmp_path / "plain", tmp_path / "tta"
    step = "checkpoints/step-0000032.pt"
    # one process (torch imported once): the two runs, then the four evaluations
    *runs, asked, own, off, bad = run_cli_many(*[["train", *sets(*common, *extra), "--run-dir", run]
                                                 for run, extra in ((plain, ()), (with_tta, ("data.tta=flip-shift",)))],
                                               ["eval", plain / step, "--tta", "flip-shift"],
                                               ["eval", with_tta / step],  # the run's own data.tta
                                               ["eval", with_tta / step, "--tta", "none"],
                                               ["eval", plain / step, "--tta", "rotate"])
    for r in runs:
        assert r.returncode == 0, r.stderr
    trained = json.loads((with_tta / "summary.json").read_text())
    asked = json.loads(asked.stdout)
    assert asked["tta"] == "flip-shift" and asked["count"] == 128
    assert asked["accuracy"] == pytest.approx(trained["test_accuracy"])
    assert asked["loss"] == pytest.approx(trained["test_loss"], rel=1e-4)
    own = json.loads(own.stdout)
    assert own["tta"] == "flip-shift" and own["loss"] == pytest.approx(asked["loss"], rel=1e-4)
    off = json.loads(off.stdout)
    assert off["tta"] == "none" and off["loss"] == pytest.approx(json.loads((plain / "summary.json").read_text())["test_loss"], rel=1e-4)
    assert abs(off["loss"] - asked["loss"]) > 1e-3  # the views changed the score
    assert bad.returncode == 2 and "invalid choice: 'rotate'" in bad.stderr


@needs_mnist
def test_data_info_finds_mnist():
    r = run_cli("data", "info", "mnist")
    assert r.returncode == 0 and "checksums verified" in r.stdout


@needs_mnist
def test_default_preset_reaches_99_percent_on_mnist(tmp_path):
    """The README's promise: `brickyard train` with no arguments reaches >= 99.0% test accuracy."""
    run = tmp_path / "mnist"
    r = run_cli("train", "--run-dir", str(run), "--device", "cpu")
    assert r.returncode == 0, r.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.990, summary
    assert f"test accuracy: {summary['test_accuracy']:.4f}" in r.stdout


def test_every_command_has_help_and_bad_flags_are_one_line():
    commands = ["train", "eval", "data", "plot", "inspect", "predict", "export", "bench", "memory", "boost", "run",
                "models", "presets"]
    for c in commands:
        r = run_cli(c, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: brickyard {c}"), (c, r.stderr)
    for argv in (["train", "--frobnicate"], ["eval"], ["inspect", "mnist", "--batch", "many"], ["nope"],
                 ["export", "runs/x", "--format", "pickle"], ["bench", "--steps", "x"], ["data", "export", "mnist"]):
        r = run_cli(*argv)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: brickyard") and not r.stdout, (argv, r.stderr)


def test_run_says_when_its_own_options_follow_the_script(tmp_path):
    """Options after the script are the script's (torchrun's rule), so `brickyard run script.py --devices cpu:2`
    runs one process; a note says where the option went, and the script still gets its arguments."""
    script = tmp_path / "show.py"
    # one write a line: the two processes of the second run share stdout, and print's pieces interleaved once
    script.write_text("import os, sys\nos.write(1, f\"args {sys.argv[1:]} world {os.environ.get('WORLD_SIZE')}\\n\".encode())\n")
    r = run_cli("run", str(script), "--devices", "cpu:2", "--epochs=3")
    assert r.returncode == 0, r.stderr
    assert "args ['--devices', 'cpu:2', '--epochs=3'] world 1" in r.stdout
    assert (f"note: --devices after {script} went to the script; brickyard run's own options come before it "
            f"(brickyard run --devices ... {script} ...)") in r.stderr
    r = run_cli("run", "--devices", "cpu:2", str(script), "--epochs=3")
    assert r.returncode == 0 and "note:" not in r.stderr, r.stderr
    assert "args ['--epochs=3'] world 2" in r.stdout
