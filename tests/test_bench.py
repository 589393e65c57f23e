"""`brickyard bench`: real steps, a step-time breakdown, scaling over device specs."""
import json

from conftest import SYNTH, run_cli, sets

BENCH = [s for s in SYNTH if not s.startswith("train.threads")]


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


def test_bench_bad_spec_is_one_line():
    r = run_cli("bench", "mnist", *sets(*BENCH), "--devices", "cpu", "tpu:3", "--steps", "2", "--warmup", "0")
    assert r.returncode == 2 and "bench --devices tpu:3 failed" in r.stderr


def test_superlinear_scaling_is_called_a_measurement_problem():
    from brickyard.bench import scaling_table
    one = {"images_per_second": 1000.0, "world_size": 1, "verdict": "compute-bound"}
    two = {"images_per_second": 10800.0, "world_size": 2, "verdict": "compute-bound"}  # 540%, as --warmup 2 gave
    table, rows = scaling_table([("cpu", one), ("cpu:2", two)])
    assert rows[1]["efficiency"] == 5.4 and "warning: cpu:2 scaled above 115% of linear" in table
    assert "warning" not in scaling_table([("cpu", one), ("cpu:2", dict(two, images_per_second=1800.0))])[0]
