"""A built-in callback's arguments are checked where the user passes them: one sentence, never a TypeError mid-run
or a NaN patience that never stops."""
import pytest
import torch
from torch import nn

import brickyard
from brickyard.callbacks import EMA, EarlyStopping, LayerOutputs, MaxTime, ReduceLROnPlateau
from brickyard.errors import ConfigError

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("make, said", [
    (lambda: EarlyStopping(patience=float("nan")), "EarlyStopping: patience nan must be a whole number at least 1."),
    (lambda: EarlyStopping(patience="3"), "EarlyStopping: patience '3' must be a whole number at least 1."),
    (lambda: EarlyStopping(patience=2.5), "EarlyStopping: patience 2.5 must be a whole number at least 1."),
    (lambda: EarlyStopping(min_delta="0.1"), "EarlyStopping: min_delta '0.1' must be a finite number."),
    (lambda: EarlyStopping(monitor=3), "EarlyStopping: monitor 3 must be a validation metric"),
    (lambda: ReduceLROnPlateau(monitor=1), "ReduceLROnPlateau: monitor 1 is not one of"),
    (lambda: ReduceLROnPlateau(min_delta="a"), "ReduceLROnPlateau: min_delta ('a')"),
    (lambda: ReduceLROnPlateau(factor="0.5"), "ReduceLROnPlateau: factor '0.5' must lie between 0 and 1"),
    (lambda: EMA("0.9"), "EMA: decay 0.9 must be between 0 and 1"),
    (lambda: MaxTime(float("nan")), "MaxTime: seconds nan must be a positive number."),
    (lambda: LayerOutputs("fc", every="a"), "LayerOutputs: every 'a' must be a whole number at least 1."),
])
def test_a_bad_argument_is_one_sentence(make, said):
    with pytest.raises(ConfigError) as e:
        make()
    assert str(e.value).startswith(said)


def test_a_plateau_schedule_and_a_reduce_lr_callback_say_there_are_two(tmp_path):
    x, y = torch.randn(32, 4), torch.arange(32) % 2
    with pytest.raises(ConfigError, match=r"^schedule.name: plateau adds a ReduceLROnPlateau of its own .* keep one of them"):
        brickyard.fit(nn.Linear(4, 2), (x, y), val_data=(x, y), callbacks=[ReduceLROnPlateau()], run_dir=tmp_path / "r",
                      config={"schedule": {"name": "plateau"}, "train": {"device": "cpu", "precision": "fp32"}})
    assert not (tmp_path / "r").exists()


def test_not_learning_keeps_its_streak_across_a_resume():
    from brickyard.callbacks.not_learning import NotLearning
    a = NotLearning(windows=3)
    a.streak = 2
    b = NotLearning(windows=3)
    b.load_state_dict(a.state_dict())
    assert (b.streak, b.said) == (2, None)
    assert NotLearning().state_dict() == {}  # nothing to keep: no entry in the checkpoint
    for bad in ({"streak": "2"}, {"streak": -1}, {"streak": 1, "said": 3}):
        with pytest.raises(ValueError, match="is not its state"):
            NotLearning().load_state_dict(bad)
