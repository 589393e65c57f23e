"""``train.profile_steps`` the run does not reach says so, and a trace that is written is named in the log:
a run that stops inside the range (its steps written at the end) said nothing, and one past the run's end
recorded nothing and said nothing. Real runs."""
from conftest import SYNTH, run_cli, sets


def _train(run, *extra):
    return run_cli("train", "mnist", *sets(*SYNTH, "train.plots=false", *extra), "--run-dir", str(run))


def test_a_range_the_run_stops_inside_is_written_and_named_and_one_past_its_end_is_a_warning(tmp_path):
    r = _train(tmp_path / "inside", "train.max_steps=4", "train.profile_steps=[2, 100]")
    assert r.returncode == 0, r.stderr
    trace = next((tmp_path / "inside" / "profile").glob("*.pt.trace.json"))
    assert f"profile of steps 2-3: {trace}" in r.stdout + r.stderr
    r = _train(tmp_path / "past", "train.max_steps=4", "train.profile_steps=[100, 110]")
    assert r.returncode == 0, r.stderr
    assert ("train.profile_steps [100, 110]: this run took steps 0-3, none of steps 100-109; nothing was recorded."
            in r.stdout + r.stderr)
    assert not (tmp_path / "past" / "profile").exists()
