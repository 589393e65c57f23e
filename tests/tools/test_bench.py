"""`brickyard bench`: real steps, a step-time breakdown, scaling over device specs."""
import json

import pytest

from conftest import BENCH, run_cli, sets


def test_bench_one_spec_breaks_the_step_down():
    r = run_cli("bench", "mnist", *sets(*BENCH), "--steps", "10", "--warmup", "2")
    assert r.returncode == 0, r.stderr
    assert "images/s" in r.stdout and "data wait" in r.stdout and "gradient sync" in r.stdout and "verdict:" in r.stdout


def test_bench_scaling_writes_json_and_png(tmp_path):
    r = run_cli("bench", "mnist", *sets(*BENCH), "--steps", "10", "--warmup", "2", "--devices", "cpu", "cpu:2",
                "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "bench.json").read_text())
    rows = doc["scaling"]
    assert [x["world_size"] for x in rows] == [1, 2] and rows[0]["speedup"] == 1.0
    assert doc["results"]["cpu:2"]["threads_per_process"] == 1 and doc["results"]["cpu"]["threads_per_process"] == 2
    assert doc["results"]["cpu"]["step_ms"]["grad_sync"] == 0  # one process: nothing to all-reduce
    assert doc["results"]["cpu:2"]["step_ms"]["grad_sync"] > 0
    assert doc["results"]["cpu:2"]["grad_sync"] == "flat" and "the real step (flat)" in r.stdout  # what training uses on CPUs
    assert doc["results"]["cpu:2"]["step_ms"]["rank_wait"] >= 0 and "waiting for the slower rank" in r.stdout
    for res in doc["results"].values():
        ms = res["step_ms"]
        assert abs(ms["data_wait"] + ms["forward_backward"] + ms["grad_sync"] + ms["optimizer"] - ms["total"]) < 0.25 * ms["total"]
    assert (tmp_path / "scaling.png").stat().st_size > 1000
    assert "efficiency" in r.stdout


def test_bench_loader_comparison():
    r = run_cli("bench", "mnist", *sets(*BENCH, "data.num_workers=1"), "--steps", "5", "--warmup", "1", "--loader")
    assert r.returncode == 0, r.stderr
    assert "[memory]" in r.stdout and "[stream]" in r.stdout and "StreamLoader" in r.stdout


# The tests of what bench says and in what order (not of its figures) pin one thread a process: two OpenMP threads
# spin-wait for each other on a loaded 2-core machine (the test of rounds took 163 s so in a per-folder run)
ONE_THREAD = [*BENCH, "train.threads=1"]


def test_bench_bad_spec_is_one_line():
    r = run_cli("bench", "mnist", *sets(*ONE_THREAD), "--devices", "tpu:3", "--steps", "2", "--warmup", "0")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: bench --devices tpu:3 failed: "), r.stderr
    assert lines[0].count("error:") == 1, lines[0]  # the failed run's own "error: " is not repeated inside


@pytest.mark.fast
def test_superlinear_scaling_is_called_a_measurement_problem():
    from brickyard.tools.bench import scaling_table
    one = {"images_per_second": 1000.0, "world_size": 1, "verdict": "compute-bound"}
    two = {"images_per_second": 10800.0, "world_size": 2, "verdict": "compute-bound"}  # 540%, as --warmup 2 gave
    table, rows = scaling_table([("cpu", one), ("cpu:2", two)])
    assert rows[1]["efficiency"] == 5.4 and "warning: cpu:2 scaled above 115% of linear" in table
    assert "warning" not in scaling_table([("cpu", one), ("cpu:2", dict(two, images_per_second=1800.0))])[0]


@pytest.mark.fast
def test_rounds_pair_the_runs_and_take_the_median_ratio():
    from brickyard.tools.bench import paired, scaling_table
    one, two = {"world_size": 1, "verdict": "v"}, {"world_size": 2, "verdict": "v"}
    ips = [(1000.0, 900.0), (2000.0, 1900.0), (1500.0, 1200.0)]  # the host drifts 2x; the pairs do not
    rounds = [{"cpu": dict(one, images_per_second=a), "cpu:2": dict(two, images_per_second=b)} for a, b in ips]
    (_, base), (_, r) = paired(rounds, ["cpu", "cpu:2"])
    assert base["images_per_second"] == 1500.0 and r["images_per_second"] == 1200.0 and r["rounds"] == 3
    assert r["speedup"] == 0.9  # the median of 0.9, 0.95 and 0.8; medians apart would say 1200 / 1500 = 0.8
    rows = scaling_table([("cpu", base), ("cpu:2", r)])[1]
    assert rows[1]["speedup"] == 0.9 and rows[1]["efficiency"] == 0.45


def test_bench_rounds_runs_the_specs_in_turn(tmp_path):
    r = run_cli("bench", "mnist", *sets(*ONE_THREAD), "--steps", "3", "--warmup", "1", "--devices", "cpu", "cpu:2",
                "--rounds", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    order = [l.split()[2] for l in r.stdout.splitlines() if l.startswith("--- devices")]
    assert order == ["cpu", "cpu:2", "cpu:2", "cpu"]  # each spec first as often as last
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["results"]["cpu:2"]["rounds"] == 2 and doc["scaling"][0]["speedup"] == 1.0
    bad = run_cli("bench", "mnist", "--rounds", "0")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --steps and --rounds must be at least 1")
