"""The parts of a sweep that run no training: the space file as from a stranger, the folds, a trial's value, the
study's settings and its stale trials (Optuna's journal storage in a temporary folder). In-process."""
import json
import os

import pytest
import torch

from brickyard.data.folds import fold_indices
from brickyard.errors import ConfigError
from brickyard.sweep.space import override, read_space

optuna = pytest.importorskip("optuna")


def _space(tmp_path, text):
    p = tmp_path / "space.yaml"
    p.write_text(text)
    return p


@pytest.mark.fast
def test_a_space_file_reads_each_kind(tmp_path):
    ps = read_space(_space(tmp_path, "optim.lr: {log_uniform: [1.0e-4, 0.1]}\noptim.weight_decay: {uniform: [0, 0.1]}\n"
                                      "train.epochs: {int: [1, 5], step: 2}\nmodel.name: [mnist_fast, lenet5]\n"
                                      "data.mixup: 0.2\ndata.batch_size: {int: [16, 256], log: true}\n"))
    assert [(p.key, p.kind, p.values) for p in ps] == [
        ("optim.lr", "log_uniform", (1e-4, 0.1)), ("optim.weight_decay", "uniform", (0.0, 0.1)),
        ("train.epochs", "int", (1, 5)), ("model.name", "choice", ("mnist_fast", "lenet5")),
        ("data.mixup", "fixed", (0.2,)), ("data.batch_size", "int", (16, 256))]
    assert ps[2].grid() == [1, 3, 5] and ps[3].grid() == ["mnist_fast", "lenet5"] and ps[5].log
    with pytest.raises(ConfigError, match="optim.lr: the grid sampler takes choices and whole numbers"):
        ps[0].grid()
    assert override("model.name", "lenet5") == "model.name=lenet5" and override("optim.lr", 0.001) == "optim.lr=0.001"
    assert override("data.classes", [1, 2]) == "data.classes=[1, 2]" and override("train.compile", True) == "train.compile=true"


@pytest.mark.fast
def test_a_strangers_space_file_is_one_sentence(tmp_path):
    cases = {
        "": "must map config keys",
        "- optim.lr\n": "must map config keys",
        "optim.lr: {log_uniform: [0, 1]}\n": r"log_uniform \[0, 1\] needs a low above 0",
        "optim.lr: {uniform: [1, 0.5]}\n": "low must be below high",
        "optim.lr: {normal: [0, 1]}\n": "must be one of",
        "optim.lr: {uniform: [0, 1], choice: [1]}\n": "must be one of",
        "optim.lr: {uniform: [0, x]}\n": "takes \\[low, high\\], two numbers",
        "optim.lr: {uniform: [0, 1], step: 2}\n": "step and log belong to int ranges",
        "train.epochs: {int: [1.5, 3]}\n": "int takes whole numbers",
        "train.epochs: {int: [1, 3], step: 0}\n": "step 0 must be a whole number",
        "train.epochs: {int: [0, 3], log: true}\n": "log: true takes a low of 1",
        "model.name: {choice: []}\n": "choice takes a list of one value or more",
        "data.classes: [[0, 1], [2, 3]]\n": r"choice \[0, 1\] is not a single value",
        "optim.lr: [0.1\n": "is not YAML",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            read_space(_space(tmp_path, text))
    with pytest.raises(ConfigError, match="no such file"):
        read_space(tmp_path / "missing.yaml")


@pytest.mark.fast
def test_a_value_the_config_refuses_is_named_before_any_trial(tmp_path):
    from brickyard.sweep.space import check
    for text, message in (("optim.nope: [1, 2]\n", r"--space optim.nope: 1 is not a value this config takes \(optim.nope: unknown key"),
                          ("optim.lr: {uniform: [-1, 0.1]}\n", r"--space optim.lr: -1.0 is not a value .*below the minimum"),
                          ("model.name: [mnist_fast, resnet_huge]\n", "--space model.name: 'resnet_huge'")):
        with pytest.raises(ConfigError, match=message):
            check(read_space(_space(tmp_path, text)), "mnist", [])


@pytest.mark.fast
def test_folds_are_stratified_disjoint_and_cover_the_pool():
    labels = torch.arange(10).repeat_interleave(torch.tensor([30, 7, 12, 50, 9, 9, 9, 9, 9, 10]))
    held = []
    for i in range(3):
        train, val = fold_indices(len(labels), 3, i, labels)
        assert set(train.tolist()).isdisjoint(val.tolist()) and len(train) + len(val) == len(labels)
        counts = torch.bincount(labels[val], minlength=10)
        assert ((counts - torch.bincount(labels, minlength=10) / 3).abs() <= 1).all(), counts  # each class in proportion
        held.append(val)
        assert torch.equal(val, fold_indices(len(labels), 3, i, labels)[1])  # seeded: the same cut every time
    assert sorted(torch.cat(held).tolist()) == list(range(len(labels)))
    rows = (torch.rand(20, 4) > 0.5).float()  # several labels an image: dealt without regard to them
    assert sorted(torch.cat([fold_indices(20, 4, i, rows)[1] for i in range(4)]).tolist()) == list(range(20))


@pytest.mark.fast
def test_a_trials_value_is_the_best_validation(tmp_path):
    from brickyard.sweep.trial import best_value
    rows = [{"kind": "val", "loss": 0.5, "accuracy": 0.8}, {"kind": "train", "loss": 0.1}, "not json",
            {"kind": "val", "loss": 0.4, "accuracy": 0.7}, {"kind": "test", "accuracy": 0.99}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows))
    assert best_value(tmp_path, "val_loss") == 0.4 and best_value(tmp_path, "val_accuracy") == 0.8
    assert best_value(tmp_path, "val_map") is None and best_value(tmp_path / "none", "val_loss") is None


@pytest.mark.fast
def test_a_study_keeps_its_settings_and_fails_the_trials_of_a_dead_process(tmp_path):
    from brickyard.sweep import study as st
    storage = st.open_storage(str(tmp_path / st.JOURNAL))
    settings = {"config": "mnist", "overrides": [], "metric": "val_accuracy", "folds": 0, "space": []}
    with pytest.raises(ConfigError, match="--resume: there is no sweep 's' in this storage"):
        st.open_study("s", storage, settings, None, None, resume=True)
    s, made = st.open_study("s", storage, settings, None, None, resume=False)
    joined, again = st.open_study("s", storage, settings, None, None, resume=True)
    assert made and not again and joined.study_name == "s"  # made once, then joined
    # two machines starting at once: both saw no study; the storage lets one make it, the other joins it
    import unittest.mock
    with unittest.mock.patch.object(optuna.study, "get_all_study_summaries", lambda storage: []):
        late, made_too = st.open_study("s", storage, settings, None, None, resume=False)
    assert not made_too and late.study_name == "s"
    with pytest.raises(ConfigError, match="sweep 's' was started with another metric, overrides"):
        st.open_study("s", storage, {**settings, "metric": "val_loss", "overrides": ["optim.lr=1"]}, None, None, False)
    trial = s.ask({"optim.lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True)})
    import socket
    trial.set_user_attr("host", socket.gethostname())
    trial.set_user_attr("pid", 4194304 + 7)  # above Linux's largest pid: no such process
    live = s.ask()
    live.set_user_attr("host", socket.gethostname())
    live.set_user_attr("pid", os.getpid())
    assert st.fail_stale(s) == 1
    states = {t.number: t.state.name for t in s.get_trials()}
    assert states == {0: "FAIL", 1: "RUNNING", 2: "WAITING"}
    assert s.get_trials()[2].system_attrs["fixed_params"] == trial.params and "ended before it finished" in s.get_trials()[0].user_attrs["error"]


@pytest.mark.fast
def test_a_trial_is_judged_at_each_validation_but_its_last():
    """The pruner is asked after every validation but the one at the run's end: a trial that trained to its end is
    complete (the fashion sweep had one pruned at its last step, which saved nothing)."""
    import logging
    from types import SimpleNamespace

    from brickyard.sweep.trial import Report

    class Trial:
        def __init__(self):
            self.reported = []

        def report(self, value, step):
            self.reported.append((value, step))

        def should_prune(self):
            return True

    stops = []
    report = Report("journal", "s", 0, "val_accuracy")
    report.trial = Trial()
    for step in (20, 40, 60):
        run = SimpleNamespace(step=step, steps_per_epoch=20, total_steps=60, log=logging.getLogger("t"),
                              stop=lambda reason, step=step: stops.append((step, reason)))
        report.on_validation_end(run, {"accuracy": 0.5 + step / 1000})
    assert report.trial.reported == [(0.52, 100), (0.54, 200), (0.56, 300)]
    assert [s for s, _ in stops] == [20, 40] and stops[0][1] == "pruned by the sweep at step 20"
