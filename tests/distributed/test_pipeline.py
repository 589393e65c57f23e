"""Pipeline stages (``dist.pipeline.stages``) with real processes (torchrun + gloo on localhost), and the inputs
they refuse, in-process.

Pinned as the FSDP tests are: fp32, one thread per process, deterministic algorithms, plain SGD at a constant
rate. ViT-Tiny on 14-pixel images of one patch (2 tokens with the class token) in global batches of 32.
"""
import re

import pytest
import torch
from torch import nn

from brickyard.config import load_config
from brickyard.distributed.env import DistInfo
from brickyard.errors import ConfigError
from brickyard.training import checkpoint, ways
from conftest import SYNTH, run_cli, sets

VIT = SYNTH + ["train.deterministic=true", "optim.name=sgd", "optim.weight_decay=0", "schedule.name=constant",
               "optim.lr=0.01", "model.name=vit_tiny", "model.patch_size=14", "data.synthetic.channels=3",
               "data.synthetic.height=14", "data.synthetic.width=14", "data.synthetic.num_train=640",
               "data.synthetic.num_val=64", "data.synthetic.num_test=64", "data.global_batch_size=32",
               "train.epochs=1", "train.max_steps=20", "train.plots=false"]


def _train(run_dir, *items, devices=None):
    args = ["train", *sets(*items), "--run-dir", str(run_dir)] + (["--devices", devices] if devices else [])
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _last(run_dir):
    return checkpoint.load(checkpoint.step_checkpoints(run_dir / "checkpoints")[-1])


def test_vit_tiny_on_two_stages_trains_the_weights_of_one_process_and_each_rank_holds_its_half(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _train(one, *VIT)
    _train(two, *VIT, "dist.pipeline.stages=2", devices="cpu:2")
    a, b = _last(one), _last(two)
    assert a["step"] == b["step"] == 20 and list(a["model"]) == list(b["model"])  # the whole model, its own names
    diff = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    assert diff < 1e-5, diff
    held = {}
    for rank in (0, 1):  # what each process says it holds, from its own log
        line = re.search(r"pipeline: stage (\d) of 2 .* holds \S+: (\d+) of (\d+) parameters",
                         (two / "logs" / f"workerlog.{rank}").read_text())
        assert line and int(line[1]) == rank
        held[rank], total = int(line[2]), int(line[3])
    assert held[0] + held[1] == total == sum(v.numel() for k, v in a["model"].items() if "running" not in k)
    assert all(0.45 * total < h < 0.55 * total for h in held.values()), held


def _check(model, *items):
    ways.choose(load_config("mnist", SYNTH + list(items)), DistInfo()).check(model, None)


def _seq(n=2):
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def test_more_stages_than_blocks_is_one_sentence():
    with pytest.raises(ConfigError, match=r"dist.pipeline.stages: 3 is more than the 2 blocks of Sequential \(0, 1\)\."):
        _check(_seq(2), "dist.pipeline.stages=3", "data.batch_size=30")


def test_a_split_point_that_is_not_a_module_name_is_one_sentence():
    with pytest.raises(ConfigError, match=r"dist.pipeline.split: 'layer9' is not a module name of Sequential"):
        _check(_seq(3), "dist.pipeline.stages=2", "dist.pipeline.split=[layer9]")


def test_a_split_point_names_a_block_boundary():
    with pytest.raises(ConfigError, match=r"'0' is not a block boundary of Sequential; a stage can begin at 1, 2"):
        _check(_seq(3), "dist.pipeline.stages=2", "dist.pipeline.split=[0]")


def test_stages_need_one_process_each():
    with pytest.raises(ConfigError, match="runs one process a stage and this job has 1; replicas of a pipeline are not built yet"):
        _check(_seq(3), "dist.pipeline.stages=2", "dist.pipeline.split=[2]")


@pytest.mark.parametrize("items, sentence", [
    (["data.global_batch_size=30"], r"dist.pipeline.microbatches: 4 does not divide a device's batch \(data.global_batch_size: 30\)"),
    (["dist.pipeline.microbatches=5"], r"dist.pipeline.microbatches: 5 does not divide a device's batch \(data.batch_size: 32\)"),
    (["dist.mode=ps"], r"dist.pipeline.stages: 2 does not combine with dist.mode: ps"),
    (["boost.dim_reduce.enabled=true"], r"dist.pipeline.stages: 2 does not combine with boost"),
    (["dist.pipeline.split=[a,b]"], r"dist.pipeline.split names 2 module\(s\) and dist.pipeline.stages is 2"),
])
def test_config_refusals_are_one_sentence(items, sentence):
    with pytest.raises(ConfigError, match=sentence):
        load_config("mnist", SYNTH + ["dist.pipeline.stages=2", *items])


def test_stages_cut_a_vit_at_its_blocks_and_compose_to_its_forward():
    from brickyard.distributed import pipeline as pp
    from brickyard.models import create
    model = create("vit_tiny", 10, 3, (14, 14), patch_size=14)
    starts = pp.cuts(model, 3)
    assert starts[0] == 0 and len(starts) == 3
    x = torch.randn(3, 3, 14, 14)
    h = x
    for i in range(3):
        h = pp.stage_module(model, starts, i)(h)
    assert torch.equal(h, model(x))
    assert pp.cuts(model, 2, ("blocks.4",)) == [0, 5]


@pytest.mark.fast
@pytest.mark.parametrize("resume, items, sentence", [
    ("auto", (), "resuming a pipeline run is not built yet; start it afresh"),
    (None, ("train.max_time_s=60",), "train.max_time_s stops each pipeline stage by its own clock"),
    (None, ("train.precision=fp16",), "train.precision: fp16 needs the loss scaler"),
])
def test_what_pipelines_cannot_do_yet_is_one_sentence_before_anything_runs(resume, items, sentence):
    """A resume (the stage's checkpoint check would blame the checkpoint), and a stop by each rank's own clock
    (the stages do not agree on a stop yet: one would leave while the others wait in the pipeline)."""
    cfg = load_config("mnist", SYNTH + ["dist.pipeline.stages=2", "dist.pipeline.split=[2]", *items])
    with pytest.raises(ConfigError, match=re.escape(sentence)):
        ways.choose(cfg, DistInfo(world_size=2)).check(_seq(3), resume)
