"""Calibration: the expected calibration error against the reference loop of Guo et al.'s code, the temperature
against a plain LBFGS fit of the same loss, and ``train.calibrate`` in a real run: kept in the checkpoints, used
by the test, eval and predict (``--uncalibrated`` for the raw outputs), the same after a resume. fp32, one thread."""
import json

import pytest
import torch
import torch.nn.functional as F

from brickyard.observe.calibration import Bins, fit_temperature
from brickyard.observe.metrics import EvalAccumulator
from brickyard.training import checkpoint
from conftest import SYNTH, run_cli, run_cli_many, sets


def reference_ece(logits, y, n_bins=15):
    """gpleiss/temperature_scaling's ``_ECELoss``: bins (lo, hi], |mean confidence - accuracy| by share."""
    confidence, pred = logits.softmax(1).max(1)
    edges, ece = torch.linspace(0, 1, n_bins + 1), 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        inside = (confidence > lo) & (confidence <= hi)
        if inside.any():
            ece += abs(confidence[inside].mean() - (pred == y)[inside].float().mean()).item() * inside.float().mean().item()
    return ece


@pytest.mark.fast
def test_ece_equals_the_reference_loop_and_adds_over_ranks():
    torch.manual_seed(0)
    y = torch.randint(0, 10, (1000,))
    logits = torch.randn(1000, 10) * 3 + 6 * F.one_hot(y, 10) * (torch.rand(1000, 1) < 0.8)  # most right, some sure
    bins = Bins(torch.device("cpu"))
    bins.update(logits, y)
    ece, table = bins.result()
    assert ece == pytest.approx(reference_ece(logits, y), abs=1e-6) and sum(table["count"]) == 1000
    first, second = Bins(torch.device("cpu")), Bins(torch.device("cpu"))  # two ranks' shares: their sums add up
    first.update(logits[:400], y[:400])
    second.update(logits[400:], y[400:])
    first.sums += second.sums  # what result()'s all-reduce does over two ranks
    assert first.result()[0] == pytest.approx(ece, abs=1e-12)
    # a temperature divides the logits scored; the predictions and the raw ECE stay
    acc = EvalAccumulator(10, torch.device("cpu"), temperature=2.0)
    acc.update(logits, y)
    r = acc.result()
    assert r["ece"] == pytest.approx(reference_ece(logits / 2, y), abs=1e-6)
    assert r["ece_uncalibrated"] == pytest.approx(ece, abs=1e-6) and r["temperature"] == 2.0
    assert r["accuracy"] == pytest.approx((logits.argmax(1) == y).double().mean().item(), abs=1e-12)
    assert r["loss"] == pytest.approx(F.cross_entropy(logits / 2, y).item(), rel=1e-6)


@pytest.mark.fast
def test_the_temperature_is_the_minimum_of_the_validation_loss():
    torch.manual_seed(1)
    y = torch.randint(0, 10, (2000,))
    logits = (torch.randn(2000, 10) + 2.5 * F.one_hot(y, 10)) * 4  # over-confident by about 4
    kept = [(logits[:700], y[:700]), (logits[700:], y[700:])]
    t = fit_temperature(kept, torch.device("cpu"))
    log_t = torch.zeros(1, dtype=torch.float64, requires_grad=True)  # the same loss, minimised by LBFGS over log T
    opt = torch.optim.LBFGS([log_t], lr=0.5, max_iter=100, tolerance_grad=1e-12, tolerance_change=1e-15)

    def nll():
        opt.zero_grad()
        loss = F.cross_entropy(logits.double() / log_t.exp(), y)
        loss.backward()
        return loss
    opt.step(nll)
    assert t == pytest.approx(log_t.exp().item(), rel=1e-6) and 1.2 < t < 8
    assert fit_temperature([], torch.device("cpu")) == 1.0  # a rank with no share, alone: nothing to fit
    separable = torch.eye(10)[y] * 5  # every sample right: the loss falls as T does (no minimum); 50 steps sharpen
    assert 0.01 <= fit_temperature([(separable, y)], torch.device("cpu")) < 0.2


S = SYNTH + ["model.name=mnist_cnn", "train.epochs=3", "train.calibrate=true", "schedule.name=constant",
             "optim.lr=0.1", "data.synthetic.num_train=256", "data.synthetic.num_test=200"]


def test_calibrate_keeps_the_temperature_uses_it_and_resumes_to_it(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    for r in run_cli_many(
            ["train", "mnist", *sets(*S), "--run-dir", whole],
            ["train", "mnist", *sets(*S, "train.max_steps=12"), "--run-dir", parts],
            ["train", "mnist", *sets(*S, "train.max_steps=0"), "--run-dir", parts, "--resume", "auto"]):
        assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if r["kind"] == "val"]
    summary = json.loads((whole / "summary.json").read_text())
    t = val[-1]["temperature"]
    assert len(val) == 3 and all(r["temperature"] > 0 for r in val) and t != 1.0
    assert summary["test_temperature"] == t and summary["test_ece"] != summary["test_ece_uncalibrated"]
    again = json.loads((parts / "summary.json").read_text())
    assert (again["test_temperature"], again["test_ece"]) == (t, summary["test_ece"])  # the resumed run's, exactly
    best = checkpoint.load(whole / "checkpoints" / "best.pt")
    assert best["meta"]["temperature"] == next(r["temperature"] for r in val if r["step"] == best["step"])
    # eval and predict of the last step's checkpoint: calibrated as the run's test, or raw on request
    last = checkpoint.step_checkpoints(whole / "checkpoints")[-1]
    calibrated, raw = (json.loads(run_cli("eval", str(last), *flag).stdout) for flag in ((), ("--uncalibrated",)))
    assert calibrated["ece"] == pytest.approx(summary["test_ece"], abs=1e-6) and calibrated["temperature"] == t
    assert raw["ece"] == pytest.approx(summary["test_ece_uncalibrated"], abs=1e-6) and "temperature" not in raw
    from brickyard.tools.predict import predict
    x = torch.rand(4, 1, 28, 28)
    p, q = predict(last, x), predict(last, x, calibrated=False)
    assert torch.allclose(p["probabilities"], (q["logits"] / t).softmax(1), atol=1e-6)
    assert torch.equal(p["predicted"], q["predicted"]) and torch.equal(p["logits"], q["logits"])


def test_calibrate_without_a_validation_split_is_one_sentence(tmp_path):
    r = run_cli("train", "mnist", *sets(*S, "data.synthetic.num_val=0"), "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: train.calibrate fits")
    assert not (tmp_path / "r").exists()  # refused before anything is written
