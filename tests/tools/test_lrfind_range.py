"""``lr-find`` with a rate that is not a finite number (``--max-lr inf`` swept up to inf and then advised a lower
--min-lr), or a range whose ratio no float holds, is one sentence before anything runs."""
import pytest

from brickyard.errors import BrickyardError
from brickyard.tools.lrfind import check_range
from conftest import run_cli


@pytest.mark.fast
@pytest.mark.parametrize("low, high, said", [
    (1e-8, float("inf"), "lr-find: --max-lr inf is not a finite number; give a rate such as 1e-8 or 10."),
    (float("-inf"), 1.0, "lr-find: --min-lr -inf is not a finite number"),
    (float("nan"), 1.0, "lr-find: --min-lr nan is not a finite number"),
    (1e-300, 1e300, "lr-find: --max-lr / --min-lr is inf, past what a float holds; narrow the range."),
    (1.0, 0.1, "lr-find: needs 0 < --min-lr < --max-lr and at least 13 steps."),
])
def test_a_range_that_cannot_be_swept_is_one_sentence(low, high, said):
    with pytest.raises(BrickyardError) as e:
        check_range(low, high, 100)
    assert str(e.value).startswith(said)


def test_the_command_says_it_before_anything_runs(tmp_path):
    r = run_cli("lr-find", "mnist", "--max-lr", "inf", "--devices", "cpu:2", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: lr-find: --max-lr inf is not a finite number; give a rate such as 1e-8 or 10."), r.stderr
    assert not (tmp_path / "o").exists()
