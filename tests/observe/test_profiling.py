"""torch.profiler traces from `train.profile_steps` and `brickyard bench --profile`: files in the Chrome
trace format that TensorBoard's profile plugin finds (``*.pt.trace.json``), the chosen steps marked."""
import json

import pytest

from brickyard.config import load_config
from brickyard.errors import ConfigError
from conftest import BENCH, SYNTH, run_cli, sets


def _steps(trace) -> set:
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)  # the operators are in it
    return {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}


def test_train_profiles_the_steps_asked_for_on_every_rank(tmp_path):
    run = tmp_path / "r"
    r = run_cli("train", "mnist", *sets(*SYNTH, "train.max_steps=6", "train.profile_steps=[2, 4]", "train.plots=false"),
                "--devices", "cpu:2", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    traces = sorted((run / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    assert _steps(traces[0]) == {"ProfilerStep#2", "ProfilerStep#3"}
    assert "profile of steps 2-3:" in r.stdout


def test_bench_profile_writes_a_trace_and_bad_ranges_are_one_sentence(tmp_path):
    r = run_cli("bench", "mnist", *sets(*BENCH), "--steps", "6", "--warmup", "2", "--profile", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    traces = list((tmp_path / "p").glob("*.pt.trace.json"))
    assert len(traces) == 1 and _steps(traces[0]) == {f"ProfilerStep#{i}" for i in range(2, 7)}
    for bad in ("[4, 2]", "[1]", "[-1, 3]", "[0, 5000]"):
        with pytest.raises(ConfigError, match="train.profile_steps: .* must be \\[first, last\\] step numbers"):
            load_config("mnist", [f"train.profile_steps={bad}"])
