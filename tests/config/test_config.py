import pytest

from brickyard.config import Config, build, describe, list_presets, load_config
from brickyard.errors import ConfigError


@pytest.mark.fast
def test_defaults_yaml_then_overrides(tmp_path):
    f = tmp_path / "my.yaml"
    f.write_text("optim:\n  lr: 0.2\n  name: adam\ndata:\n  batch_size: 64\n")
    cfg = load_config(str(f), ["optim.lr=0.05", "data.batch_size=256", "train.channels_last=false"])
    assert isinstance(cfg, Config)
    assert cfg.optim.lr == 0.05 and cfg.optim.name == "adam"
    assert cfg.data.batch_size == 256
    assert cfg.train.channels_last is False
    assert cfg.preset == "my"
    assert cfg.schedule == Config().schedule  # untouched sections keep defaults


@pytest.mark.fast
def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(AttributeError):  # a frozen dataclass's FrozenInstanceError is one
        cfg.optim.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("override, message", [
    ("optim.name=adamm", "optim.name: 'adamm' is not one of sgd, momentum, nesterov, adagrad, adadelta, adam, adamw"),
    ("optim.lrr=0.1", "optim.lrr: unknown key"),
    ("nosection.x=1", "nosection: unknown key"),
    ("train.grad_accum=abc", "train.grad_accum: 'abc' is not an integer"),
    ("data.batch_size=abc", "data.batch_size: 'abc' is not a number or one of auto"),
    ("data.batch_size=0", "data.batch_size: 0 is below the minimum 1"),
    ("optim.momentum=1.5", "optim.momentum: 1.5 is above the maximum 1.0"),
    ("train.precision=fp8", "train.precision: 'fp8' is not one of auto, fp32, bf16, fp16"),
    ("train.grad_accum=1.5", "train.grad_accum: 1.5 is not an integer"),
    ("optim=3", "optim: expected a mapping"),
    ("novalue", "expected KEY=VALUE"),
    ("data.tta=flip-shift,data.shift=0", "data.tta: flip-shift moves each image data.shift pixels four ways, and data.shift is 0"),
])
@pytest.mark.fast
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("mnist", override.split(","))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.fast
def test_one_item_where_a_list_is_expected_is_a_list_of_one():
    cfg = load_config("mnist", ["train.loggers=csv", "finetune.freeze=all_but_last:2", "train.watch=conv*", "data.classes=[5, 6]"])
    assert cfg.train.loggers == ("csv",) and cfg.finetune.freeze == ("all_but_last:2",) and cfg.train.watch == ("conv*",)
    with pytest.raises(ConfigError, match=r"train.loggers: '' is not a list"):
        load_config("mnist", ["train.loggers="])
    with pytest.raises(ConfigError, match=r"train.profile_steps: \[5\] must be \[first, last\]"):
        load_config("mnist", ["train.profile_steps=5"])


@pytest.mark.fast
def test_name_patterns_are_names_whatever_yaml_reads():
    """YAML reads [0, fc] as a number and a word; nn.Sequential names its children 0, 1, ..."""
    cfg = load_config("mnist", ["train.watch=[0, fc]", "finetune.freeze=3", "train.activation_checkpointing=[1]", "dist.fsdp.blocks=[2]"])
    assert (cfg.train.watch, cfg.finetune.freeze) == (("0", "fc"), ("3",))
    assert (cfg.train.activation_checkpointing, cfg.dist.fsdp.blocks) == (("1",), ("2",))
    for bad, shown in (("train.watch=[1.5]", "1.5"), ("finetune.freeze=[true]", "True"), ("dist.fsdp.blocks=[{a: 1}]", "{'a': 1}")):
        with pytest.raises(ConfigError) as e:
            load_config("mnist", [bad])
        assert str(e.value) == f"{bad.split('=')[0]}: {shown} is not a name or a pattern, e.g. [conv1, layer1.*]."


@pytest.mark.fast
def test_every_preset_loads_and_round_trips():
    names = list_presets()
    assert {"mnist", "mnist-course", "fashion-resnet18", "mnist-lenet"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert cfg.preset == name
        assert build(cfg.to_dict()) == cfg


@pytest.mark.fast
def test_course_preset_is_the_course_recipe():
    cfg = load_config("mnist-course")
    assert (cfg.optim.name, cfg.optim.lr, cfg.data.batch_size, cfg.train.epochs) == ("sgd", 0.01, 100, 5)
    assert cfg.train.precision == "fp32" and cfg.model.name == "mnist_cnn" and not cfg.data.train_on_all


@pytest.mark.fast
def test_unknown_preset_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="neither a YAML file nor a preset"):
        load_config("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML \(line 2, column 1: expected ',' or '\]'"):
        load_config(str(bad))
    bad.write_text("optim:\n\tlr: 0.1\n")  # a tab where YAML wants spaces: the line and the fix
    with pytest.raises(ConfigError, match=r"line 2, column 1: found character '\\t' .*; YAML indents with spaces, not tabs\)\.$"):
        load_config(str(bad))


@pytest.mark.fast
def test_reference_rows_cover_all_sections():
    keys = [k for k, _, _ in describe()]
    for section in ("data.", "model.", "optim.", "schedule.", "train.", "checkpoint.", "dist."):
        assert any(k.startswith(section) for k in keys)


@pytest.mark.fast
def test_configuration_reference_is_generated_from_the_schema():
    from pathlib import Path

    from brickyard.config import TABLE_END, TABLE_START, describe, markdown_table
    readme = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    shown = readme[readme.index(TABLE_START):readme.index(TABLE_END) + len(TABLE_END)]
    assert shown == markdown_table(), "docs/configuration.md's table differs: run `python -m brickyard.config docs/configuration.md`"
    assert all(f"| `{key}` |" in shown for key, _, _ in describe())  # every key, data.cache and optim.l1 included


@pytest.mark.fast
def test_numbers_are_taken_as_people_write_them(tmp_path):
    f = tmp_path / "ft.yaml"
    f.write_text("base: mnist\noptim:\n  lr: 5e-5\nschedule:\n  lr_max: 3e-4\ntrain:\n  max_steps: 1e3\n")
    cfg = load_config(str(f), ["optim.weight_decay=1e-4"])
    assert cfg.optim.lr == 5e-5 and cfg.schedule.lr_max == 3e-4 and cfg.train.max_steps == 1000 and cfg.optim.weight_decay == 1e-4
    for bad, msg in (("train.max_steps=1.5e0", "is not an integer"), ("optim.lr=abc", "is not a number"),
                     ("train.epochs=.inf", "give a finite number")):
        with pytest.raises(ConfigError, match=msg):
            load_config("mnist", [bad])


@pytest.mark.fast
def test_cross_field_checks_run_when_the_config_is_built():
    for override, msg in (
        (["boost.snapshots.enabled=true", "boost.snapshots.keep=10"], "boost.snapshots.keep: 10 must exceed"),
        (["boost.dim_reduce.enabled=true", "train.grad_accum=2"], "train.grad_accum: 1"),
        (["optim.betas=[0.9]"], "optim.betas: \\[0.9\\] must be two numbers"),
        (["optim.betas=[0.9, 1.5]"], "must be two numbers in \\[0, 1\\)"),
        (["data.train_transforms=[resize:abc]"], "data.train_transforms: transform 'resize:abc' is not one of"),
        (["dist.mode=ps", "train.early_stopping=3"], "train.early_stopping: a synchronous parameter-server run"),
        (["dist.grad_sync=flat", "dist.sync_bn=true"], "dist.grad_sync: flat does not run SyncBatchNorm"),
    ):
        with pytest.raises(ConfigError, match=msg):
            load_config("mnist", override)


def test_a_data_folder_named_like_the_preset_does_not_hide_it(tmp_path, monkeypatch):
    """People keep MNIST in ./mnist: `brickyard train` (preset mnist) from that folder's parent must still
    find the preset (it said "config file mnist does not exist"), while a YAML file is still read by path."""
    from conftest import run_cli
    (tmp_path / "mnist").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_config(None).preset == load_config("mnist").preset == "mnist" and load_config("mnist").train.epochs == 1.5
    (tmp_path / "mine.yaml").write_text("train:\n  epochs: 3\n")
    assert load_config("mine.yaml").train.epochs == 3
    with pytest.raises(ConfigError, match="neither a YAML file nor a preset"):
        load_config("nothing-here")
    r = run_cli("memory", cwd=tmp_path)  # the default preset, through the CLI
    assert r.returncode == 0 and "memory per device" in r.stdout, r.stderr


@pytest.mark.fast
def test_the_schema_follows_torch_and_a_changed_optimiser_gets_its_own_conventions(tmp_path):
    import inspect

    import torch

    from brickyard.config.schema import CONVENTIONAL
    for name, cls in (("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW),
                      ("adagrad", torch.optim.Adagrad), ("adadelta", torch.optim.Adadelta)):
        params = inspect.signature(cls).parameters
        for key in ("lr", "weight_decay", "eps", "betas"):
            if key in params:
                assert CONVENTIONAL[name][key] == params[key].default, (name, key)
    mine = tmp_path / "mine.yaml"  # a YAML without base: torch's Adam, cross-entropy without smoothing, no schedule
    mine.write_text("optim:\n  name: adam\n")
    o = load_config(str(mine)).optim
    assert (o.lr, tuple(o.betas), o.eps, o.weight_decay, o.label_smoothing) == (1e-3, (0.9, 0.999), 1e-8, 0.0, 0.0)
    assert load_config(str(mine)).schedule.name == "constant"
    notes = []
    o = load_config("mnist", ["optim.name=nesterov"], notes=notes).optim  # the preset's Adam rate is not carried over
    assert (o.lr, o.momentum, o.label_smoothing) == (1e-3, 0.9, 0.1)
    assert notes == ["optim.name nesterov (--set) replaces adam: optim.lr 0.001, optim.momentum 0.9, optim.weight_decay "
                     "0.0 are nesterov's conventional settings, not the ones tuned for adam; set them to choose others"]
    assert load_config("mnist", ["optim.name=nesterov", "optim.lr=0.05"]).optim.lr == 0.05  # said with it: kept
    course = tmp_path / "course.yaml"
    course.write_text("base: mnist-course\noptim:\n  name: adam\n")  # the course's "now try Adam"
    assert load_config(str(course)).optim.lr == 1e-3  # not SGD's tuned 0.01
