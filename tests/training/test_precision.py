"""``precision: auto`` on a CPU by measurement: each outcome forced with a fake clock, the cache, the
forcing variable. The model really runs its steps in both precisions; only the clock is fake."""
import json

import pytest
import torch
from torch import nn

from brickyard.training import precision


class FakeClock:
    """Each timed step takes ``fp32`` or ``bf16`` seconds: the steps alternate fp32, bf16 (warm-up too)."""

    def __init__(self, fp32: float, bf16: float):
        self.durations, self.now, self.calls = (fp32, bf16), 0.0, 0

    def __call__(self) -> float:
        if self.calls % 2:  # the end of a step
            self.now += self.durations[(self.calls // 2) % 2]
        self.calls += 1
        return self.now


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


@pytest.mark.parametrize("fp32, bf16, chosen", [(0.010, 0.005, "bf16"),   # bf16 twice as fast
                                                 (0.010, 0.015, "fp32"),   # bf16 slower (the Intel Xeon without AMX)
                                                 (0.010, 0.0095, "fp32"),  # 5% faster: within the margin, fp32 wins
                                                 (0.010, 0.0089, "bf16")])  # 11% faster: past it
@pytest.mark.fast
def test_the_faster_precision_is_chosen_past_the_margin(tmp_path, fp32, bf16, chosen):
    r = precision.choose(_model(), (1, 8, 8), 16, torch.device("cpu"), 1, True, clock=FakeClock(fp32, bf16),
                         cache=tmp_path / "p.json")
    assert r["chosen"] == chosen and not r["cached"]
    assert (r["fp32_ms"], r["bf16_ms"]) == (fp32 * 1e3, bf16 * 1e3)
    assert f"fp32 {fp32 * 1e3:.1f} ms/step, bf16 {bf16 * 1e3:.1f} ms/step" in r["how"]


@pytest.mark.fast
def test_the_answer_is_cached_per_cpu_torch_and_model(tmp_path):
    cache = tmp_path / "p.json"
    first = precision.choose(_model(), (1, 8, 8), 16, torch.device("cpu"), 1, True, clock=FakeClock(0.01, 0.005), cache=cache)
    again = precision.choose(_model(), (1, 8, 8), 16, torch.device("cpu"), 1, True, clock=FakeClock(0.01, 0.02), cache=cache)
    assert first["chosen"] == again["chosen"] == "bf16" and again["cached"] and "measured on this machine before" in again["how"]
    other = precision.choose(_model(), (1, 8, 8), 32, torch.device("cpu"), 1, True, clock=FakeClock(0.01, 0.02), cache=cache)
    assert other["chosen"] == "fp32" and not other["cached"]  # another batch is another signature
    keys = json.loads(cache.read_text())
    assert len(keys) == 2 and all(torch.__version__ in k and precision.cpu_model() in k for k in keys)
    cache.write_text("[not, a, mapping")  # a damaged cache is measured again, never a crash
    assert precision.choose(_model(), (1, 8, 8), 16, torch.device("cpu"), 1, True, clock=FakeClock(0.01, 0.02),
                            cache=cache)["chosen"] == "fp32"


@pytest.mark.parametrize("record", [{"chosen": "bf16"}, {"chosen": "bf16", "fp32_ms": "abc", "bf16_ms": 1, "cpu": "x"},
                                    {"chosen": "bf16", "fp32_ms": float("nan"), "bf16_ms": 1.0, "cpu": "x"},
                                    {"chosen": "bf16", "fp32_ms": 2.0, "bf16_ms": 1.0, "cpu": 7}])
@pytest.mark.fast
def test_a_cached_record_missing_a_figure_is_measured_again(tmp_path, record):
    """The cache is a file anyone could have edited: a record without its figures crashed the log line (KeyError)."""
    cache = tmp_path / "p.json"
    precision.choose(_model(), (1, 8, 8), 16, torch.device("cpu"), 1, True, clock=FakeClock(0.01, 0.02), cache=cache)
    (key,) = json.loads(cache.read_text())
    cache.write_text(json.dumps({key: record}))
    r = precision.choose(_model(), (1, 8, 8), 16, torch.device("cpu"), 1, True, clock=FakeClock(0.01, 0.02), cache=cache)
    assert r["chosen"] == "fp32" and not r["cached"]


@pytest.mark.fast
def test_forcing_and_other_devices_are_not_measured(monkeypatch):
    cpu = torch.device("cpu")
    for forced in ("0", "1"):
        monkeypatch.setenv("BRICKYARD_CPU_BF16", forced)
        assert not precision.needs_measuring("auto", cpu)
    monkeypatch.delenv("BRICKYARD_CPU_BF16")
    assert not precision.needs_measuring("fp32", cpu) and not precision.needs_measuring("bf16", cpu)
    assert not precision.needs_measuring("auto", torch.device("meta"))


@pytest.mark.skipif(not precision.dev.bf16_supported(torch.device("cpu")) or
                    __import__("os").environ.get("BRICKYARD_CPU_BF16", "") in ("0", "1"),
                    reason="this CPU has no native bf16 (or BRICKYARD_CPU_BF16 forces it): auto is fp32 without measuring")
def test_a_run_says_what_it_measured_and_records_it(tmp_path):
    from conftest import SYNTH, run_cli, sets
    auto = [s for s in SYNTH if not s.startswith("train.precision")] + ["train.max_steps=2"]
    r = run_cli("train", *sets(*auto), "--run-dir", str(tmp_path / "r"), env={"BRICKYARD_CACHE": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    env = json.loads((tmp_path / "r" / "env.json").read_text())
    m = env["precision_measured"]
    assert env["precision"] == m["chosen"] and env["cpu_model"] == m["cpu"] and m["fp32_ms"] > 0 and m["bf16_ms"] > 0
    first = (tmp_path / "r" / "train.log").read_text().splitlines()[0]
    assert f"precision {m['chosen']} (auto: measured: fp32 " in first


@pytest.mark.fast
def test_eval_and_the_memory_report_take_the_precision_the_run_trained_in(tmp_path, monkeypatch):
    """A CPU with native bf16 where fp32 measured faster (the Intel Xeon without AMX), forced on any CPU: the
    run trains in fp32, and `brickyard eval` scores it in fp32 too (its figures are the run's own, to the
    last digit), as `brickyard memory` reports it; the rule alone would have said bf16."""
    from brickyard import api
    from brickyard.config import load_config
    from brickyard.data import build_data
    from brickyard.training import memory
    from conftest import SYNTH
    monkeypatch.delenv("BRICKYARD_CPU_BF16", raising=False)
    monkeypatch.setenv("BRICKYARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(precision.dev, "bf16_supported", lambda device: device.type == "cpu")
    timed = []
    monkeypatch.setattr(precision, "_time", lambda *a: timed.append(a) or (0.010, 0.015))  # bf16 the slower
    settings = [s for s in SYNTH if not s.startswith(("train.precision", "model.name"))] + [
        "train.precision=auto", "model.name=mnist_cnn", "train.max_steps=4", "train.plots=false", "train.tensorboard=false"]
    cfg = load_config("mnist", settings)
    assert precision.dev.resolve_precision("auto", torch.device("cpu")) == "bf16"  # what the rule says
    summary = api.train_config(cfg, tmp_path / "r")
    assert json.loads((tmp_path / "r" / "env.json").read_text())["precision"] == "fp32" and len(timed) == 1
    again = api.evaluate_checkpoint(tmp_path / "r", "test", "cpu")
    assert (again["accuracy"], again["loss"]) == (summary["test_accuracy"], pytest.approx(summary["test_loss"], rel=1e-6))
    data = build_data(cfg.data)
    assert memory.estimate(cfg, api.build_model(cfg, data), data, torch.device("cpu"))["precision"] == "fp32"
