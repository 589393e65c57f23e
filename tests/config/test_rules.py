"""The config's rules: each section checks itself, each rule across sections names the sections it reads,
and where one mistake breaks two rules the same one is named as before the rules moved to their sections."""
import dataclasses
import inspect

import pytest

from brickyard.config import Config, load_config
from brickyard.config.rules import RULES
from brickyard.config.schema import Section
from brickyard.errors import ConfigError

pytestmark = pytest.mark.fast


def test_each_rule_across_sections_reads_the_sections_it_names():
    fields = {f.name for f in dataclasses.fields(Config)}
    for rule in RULES:
        assert set(rule.sections) <= fields, rule
        assert list(inspect.signature(rule.check).parameters) == list(rule.sections), rule.check.__name__


def test_every_section_checks_itself():
    cfg = Config()
    for f in dataclasses.fields(cfg):
        if f.name != "preset":
            assert isinstance(getattr(cfg, f.name), Section), f.name
    cfg.check()  # the defaults break no rule


def test_a_section_checks_itself_alone():
    with pytest.raises(ConfigError, match=r"optim.betas: \[0.9\] must be two numbers"):
        dataclasses.replace(Config().optim, betas=(0.9,)).check()
    with pytest.raises(ConfigError, match="boost.dim_reduce.rho: 1.5 must be between 0 and 1"):
        dataclasses.replace(Config().boost.dim_reduce, rho=1.5).check()


@pytest.mark.parametrize("overrides, message", [
    # dim_reduce on with accumulation and too few snapshots: the accumulation first
    (["boost.dim_reduce.enabled=true", "train.grad_accum=2", "boost.snapshots.keep=10"],
     "boost.dim_reduce works with train.grad_accum: 1"),
    # FSDP with the flat sync and SyncBatchNorm: dist's own rule first
    (["dist.strategy=fsdp", "dist.grad_sync=flat", "dist.sync_bn=true"], "dist.grad_sync: flat does not run SyncBatchNorm"),
    # FSDP with dim_reduce on a parameter server: the FSDP rule first
    (["dist.strategy=fsdp", "boost.dim_reduce.enabled=true", "dist.mode=ps"], "dist.strategy: fsdp does not combine with dist.mode: ps"),
    (["boost.dim_reduce.enabled=true", "dist.mode=ps", "train.early_stopping=3"], "boost.dim_reduce runs in the collective mode"),
    (["data.global_batch_size=100", "train.grad_accum=3", "boost.dim_reduce.enabled=true"], "is not divisible by train.grad_accum"),
    (["data.classes=[1, 1]"], "data.classes: 1 is listed twice"),
    (["train.loggers=[csv, foo]"], "train.loggers: 'foo' is not one of tensorboard, csv, mlflow, wandb."),
])
def test_where_one_mistake_breaks_two_rules_the_same_one_is_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("mnist", overrides)
