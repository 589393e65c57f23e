"""Config.replace: a frozen config changed key by key as `--set` changes it, built directly (no YAML)."""
import dataclasses

import pytest
import yaml

from brickyard.config import Config, build, load_config
from brickyard.errors import ConfigError

pytestmark = pytest.mark.fast


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _as_set(changes: dict) -> list[str]:
    """The `--set` items that say the same as ``changes`` (how replace was once made)."""
    return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for k, v in changes.items()]


def test_replace_changes_the_keys_named_and_keeps_every_other_value():
    cfg = load_config("mnist-course")
    new = cfg.replace(**{"train.epochs": 7, "boost.snapshots.enabled": True, "data.num_workers": 3})
    assert (new.train.epochs, new.boost.snapshots.enabled, new.data.num_workers) == (7.0, True, 3)
    before, after = _flat(cfg.to_dict()), _flat(new.to_dict())
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"train.epochs", "boost.snapshots.enabled", "data.num_workers"}
    assert new.model is cfg.model and new.optim is cfg.optim  # sections it does not name are the same objects
    assert isinstance(new, Config) and cfg.train.epochs == 5  # the original is untouched


@pytest.mark.parametrize("changes", [
    {"data.batch_size": 64},  # the per-device batch alone: the global batch follows the world size (0)
    {"data.batch_size": 64, "data.global_batch_size": 128},
    {"optim.name": "sgd"},  # a new optimiser gets its own conventions, not the old one's tuned rate
    {"optim.name": "nesterov", "optim.lr": 0.05},
    {"optim.lr": "find"},
    {"train.loggers": "csv", "train.watch": [0, "fc"]},
    {"optim.param_groups": [{"match": "fc.*", "lr_mult": 2}]},
    {"data.synthetic.num_train": 10},
    {"data.synthetic": {"num_train": 10}},
    {"optim": {"lr": 0.5}},
    {"preset": "mine", "train.device": "cpu"},
])
def test_replace_gives_what_set_gives(changes):
    cfg = load_config("mnist")
    assert cfg.replace(**changes) == build(cfg.to_dict(), _as_set(changes))


@pytest.mark.parametrize("changes", [
    {"data.batch_size": 0},
    {"optim.name": "adamm"},
    {"optim.lrr": 0.1},
    {"nosection.x": 1},
    {"train.precision": "fp8"},
    {"optim.lr": "x"},
    {"optim": 3},
    {"optim.param_groups": [{"match": "fc.*", "lr_mul": 2}]},
    {"train.epochs": -1, "data.batch_size": 0},  # two bad values: the first in the schema's order is named
    {"optim.betas": [0.9]},  # a section's own rule
    {"data.tta": "flip-shift", "data.shift": 0},
    {"dist.strategy": "fsdp", "dist.mode": "ps"},  # a rule across sections
])
def test_a_bad_value_is_the_loaders_sentence(changes):
    cfg = load_config("mnist")
    with pytest.raises(ConfigError) as loaded:
        load_config("mnist", _as_set(changes))
    with pytest.raises(ConfigError) as replaced:
        cfg.replace(**changes)
    assert str(replaced.value) == str(loaded.value)


def test_replace_does_not_go_through_yaml(monkeypatch):
    def no_yaml(*args, **kwargs):
        raise AssertionError("replace went through YAML")

    cfg = load_config("mnist")
    for name in ("safe_dump", "dump", "safe_load", "load"):
        monkeypatch.setattr(yaml, name, no_yaml)

    class Weight(float):  # a float YAML's safe dumper refuses ("cannot represent an object")
        pass

    new = cfg.replace(**{"optim.lr": Weight(0.05), "optim.class_weights": (1.0, 2.5)})
    assert new.optim.lr == 0.05 and type(new.optim.lr) is float and new.optim.class_weights == (1.0, 2.5)
    # one weight a class for 5,000 classes: some 100,000 characters as a --set value, refused as a typing slip
    weights = tuple(1 / (i + 3) for i in range(5000))
    assert cfg.replace(**{"optim.class_weights": weights}).optim.class_weights == weights


def test_replace_runs_the_checks_again_on_what_it_did_not_change():
    cfg = load_config("mnist", ["data.tta=flip-shift"])
    with pytest.raises(ConfigError, match="data.tta: flip-shift moves each image data.shift pixels four ways"):
        cfg.replace(**{"data.shift": 0})
    fsdp = load_config("mnist", ["dist.strategy=fsdp"])
    with pytest.raises(ConfigError, match="dist.strategy: fsdp does not combine with train.watch"):
        fsdp.replace(**{"train.watch": ["fc"]})
    assert dataclasses.replace(cfg.data, shift=3) == cfg.replace(**{"data.shift": 3}).data
