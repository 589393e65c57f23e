"""Pipeline stages (``dist.pipeline.stages``) with real processes (torchrun + gloo on localhost), and the inputs
they refuse, in-process.

Pinned as the FSDP tests are: fp32, one thread per process, deterministic algorithms, plain SGD at a constant
rate. ViT-Tiny on 14-pixel images of one patch (2 tokens with the class token) in global batches of 32.
"""
import json
import re

import pytest
import torch
from torch import nn

from brickyard.api import build_model
from brickyard.config import load_config
from brickyard.data import build_data
from brickyard.distributed.env import DistInfo
from brickyard.errors import ConfigError
from brickyard.training import checkpoint, memory, ways
from conftest import SYNTH, run_cli, sets, sigterm_rank_one
from layouts import CLIP, VIT, diff, last, moved, reference, train


def test_vit_tiny_on_two_stages_trains_one_process_weights_and_reshards_to_one_process_and_two_by_two(tmp_path,
                                                                                                     tmp_path_factory):
    """2 stages against 1 process (20 steps of SGD with momentum, so the optimiser state moves too, clipped); the 2-stage
    run's step-10 checkpoint resumed on 1 process, the 1-process one on 2 stages x 2 replicas (4 processes) with
    each stage sharded over its replicas (FSDP) and on 2 stages each split across 2 ranks (tensor parallel), all to
    the 1-process run's weights; the 2-stage one resumed on 2 stages bit for bit. (2 x 2 without FSDP: the two-host test, launch/test_multinode.py.)"""
    one, two = reference(tmp_path_factory, CLIP), tmp_path / "two"  # both clip every step: the norm across stages
    train(two, *VIT, CLIP, "dist.pipeline.stages=2", devices="cpu:2")
    a, b = last(one), last(two)
    assert a["step"] == b["step"] == 20 and list(a["model"]) == list(b["model"])  # the whole model, its own names
    assert diff(a["model"], b["model"]) < 1e-5
    # the optimiser state as one process numbers it: the momentum of every parameter, in one process's groups
    assert [g["params"] for g in a["optimizer"]["param_groups"]] == [g["params"] for g in b["optimizer"]["param_groups"]]
    assert diff({i: s["momentum_buffer"] for i, s in a["optimizer"]["state"].items()},
                 {i: s["momentum_buffer"] for i, s in b["optimizer"]["state"].items()}) < 1e-5
    held = {}
    for rank in (0, 1):  # what each process says it holds, from its own log
        line = re.search(r"pipeline: rank (\d) is stage (\d) of 2 .*: \S+, ([\d,]+) of ([\d,]+) parameters",
                         (two / "logs" / f"workerlog.{rank}").read_text())
        assert line and int(line[1]) == int(line[2]) == rank
        held[rank], total = int(line[3].replace(",", "")), int(line[4].replace(",", ""))
    assert held[0] + held[1] == total == sum(v.numel() for k, v in a["model"].items() if "running" not in k)
    assert all(0.45 * total < h < 0.55 * total for h in held.values()), held
    # `brickyard memory`'s count of each stage's parameters is what each rank held
    cfg = load_config("mnist", VIT + ["dist.pipeline.stages=2"])
    data = build_data(cfg.data)
    est = memory.estimate(cfg, build_model(cfg, data), data, torch.device("cpu"), 2, compare=False)
    assert [st["parameters"] for st in est["stages"]] == [4 * held[0], 4 * held[1]]
    assert all(st["in_flight"] == 4 and st["activations_per_microbatch"] > 0 for st in est["stages"])
    back = moved(two, 10, tmp_path / "back")  # 2 stages -> 1 process
    train(back, "dist.pipeline.stages=1", resume=True)
    assert "step-0000010.pt at step 10" in (back / "logs" / "workerlog.0").read_text()
    assert last(back)["step"] == 20 and diff(a["model"], last(back)["model"]) < 1e-5
    wide = moved(one, 10, tmp_path / "wide")  # 1 process -> 2 stages x 2 replicas, each stage sharded over its two
    r = train(wide, "dist.pipeline.stages=2", "dist.strategy=fsdp", devices="cpu:4", resume=True)
    log3 = (wide / "logs" / "workerlog.3").read_text()
    assert "rank 3 is stage 1 of 2, replica 1 of 2" in log3, r.stdout[-2000:]
    line = re.search(r"FSDP: shard 1 of 2 of the stage \((\d+) blocks and the stage sharded\), about ([\d,]+) parameters", log3)
    assert line and int(line[1]) > 0 and int(line[2].replace(",", "")) == held[1] // 2, log3[-2000:]
    summary = json.loads((wide / "summary.json").read_text())
    assert summary["strategy"] == "pipeline+fsdp" and summary["held_per_rank"]["parameters"] < 0.3 * 4 * total
    assert last(wide)["step"] == 20 and diff(a["model"], last(wide)["model"]) < 1e-5  # loaded, trained, gathered
    deep = moved(one, 10, tmp_path / "deep")  # 1 process -> 2 stages, each split across 2 ranks (tensor parallel)
    train(deep, "dist.pipeline.stages=2", "dist.tensor_parallel=2", devices="cpu:4", resume=True)
    log2 = (deep / "logs" / "workerlog.2").read_text()
    line = re.search(r"rank 2 is stage 1 of 2, tensor-parallel rank 0 of 2 .*; tensor parallel: rank 0 of 2 of the "
                     r"stage holds ([\d,]+) \((.*)\)", log2)
    assert line and held[1] // 2 < int(line[1].replace(",", "")) < held[1], log2[-2000:]
    assert line[2] == "6 MLPs column/row split, head rows split; attention replicated: 3 heads over 2"
    summary = json.loads((deep / "summary.json").read_text())
    assert summary["strategy"] == "pipeline+tensor_parallel" and summary["world_size"] == 4
    assert last(deep)["step"] == 20 and diff(a["model"], last(deep)["model"]) < 1e-5
    again = moved(two, 10, tmp_path / "again")  # the same layout: bit for bit
    train(again, resume=True, devices="cpu:2")
    c = last(again)
    assert c["step"] == 20 and all(torch.equal(b["model"][k], c["model"][k]) for k in b["model"])


def _check(model, *items):
    ways.choose(load_config("mnist", SYNTH + list(items)), DistInfo()).check(model, None)


def _seq(n=2):
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def test_more_stages_than_blocks_is_one_sentence():
    with pytest.raises(ConfigError, match=r"dist.pipeline.stages: 3 is more than the 2 blocks of Sequential \(0, 1\)\."):
        _check(_seq(2), "dist.pipeline.stages=3", "data.batch_size=30")


@pytest.mark.fast
def test_every_stage_holds_weights_by_any_balance_and_a_split_that_leaves_one_none_is_one_sentence():
    """mnist_cnn is 8 pieces and 3 of them have weights (conv1, conv2, fc): cut by parameters, by time or by memory,
    3 stages each get one (a stage of a ReLU alone had no parameters, and its optimiser refused to be made); 4
    stages, or a split whose stage is relu2 alone, are one sentence before anything trains."""
    from brickyard.distributed import pipeline as pp
    from brickyard.models import create
    model = create("mnist_cnn", 10, 1, (28, 28))
    parts = pp.pieces(model)
    x = torch.randn(4, 1, 28, 28)
    for starts in (pp.cuts(model, 3), pp.timed_cuts(model, 3, x, repeats=1),
                   pp.memory_cuts(model, 3, x, 1, lambda i: 1)):
        ends = starts[1:] + [len(parts)]
        assert all(any(p.requires_grad for _, m in parts[a:b] for p in m.parameters()) for a, b in zip(starts, ends)), starts
    with pytest.raises(ConfigError, match=re.escape("dist.pipeline.stages: 4 is more than the 3 blocks of Sequential that "
                                                    "hold trainable weights (conv1, conv2, fc), and each stage needs some")):
        pp.cuts(model, 4)
    with pytest.raises(ConfigError, match=re.escape("dist.pipeline.split: stage 1 (relu2..relu2) would hold no trainable "
                                                    "weights")):
        pp.cuts(model, 3, ("relu2", "pool2"))


def test_a_split_point_that_is_not_a_module_name_is_one_sentence():
    with pytest.raises(ConfigError, match=r"dist.pipeline.split: 'layer9' is not a module name of Sequential"):
        _check(_seq(3), "dist.pipeline.stages=2", "dist.pipeline.split=[layer9]")


def test_a_split_point_names_a_block_boundary():
    with pytest.raises(ConfigError, match=r"'0' is not a block boundary of Sequential; a stage can begin at 1, 2"):
        _check(_seq(3), "dist.pipeline.stages=2", "dist.pipeline.split=[0]")


def test_stages_must_divide_the_processes():
    with pytest.raises(ConfigError, match=re.escape("dist.pipeline.stages: 2 does not divide the job's 3 processes; a job "
                                                    "runs whole pipelines (processes = stages x replicas).")):
        ways.choose(load_config("mnist", SYNTH + ["dist.pipeline.stages=2"]), DistInfo(world_size=3)).check(_seq(3), None)
    with pytest.raises(ConfigError, match=re.escape(
            "dist.pipeline.stages: 2 x dist.tensor_parallel: 2 does not divide the job's 6 processes; a job runs whole "
            "pipelines (processes = stages x tensor-parallel ranks x replicas).")):
        ways.choose(load_config("mnist", SYNTH + ["dist.pipeline.stages=2", "dist.tensor_parallel=2"]),
                    DistInfo(world_size=6)).check(_seq(3), None)
    with pytest.raises(ConfigError, match=re.escape("dist.tensor_parallel: Sequential has no layer tensor parallel")):
        ways.choose(load_config("mnist", SYNTH + ["dist.pipeline.stages=2", "dist.tensor_parallel=2"]),
                    DistInfo(world_size=4)).check(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Conv2d(2, 2, 3)), None)


@pytest.mark.fast
def test_a_rank_of_a_pipeline_of_split_stages_knows_its_place():
    """Rank ``(stage x replicas + replica) x tensor_parallel + shard``: the pipeline outermost, tensor parallel
    innermost (torchtitan's order); each pipeline reads its replica's share."""
    cfg = load_config("mnist", SYNTH + ["dist.pipeline.stages=2", "dist.tensor_parallel=2"])
    got = [ways.choose(cfg, DistInfo(rank=r, world_size=8)) for r in range(8)]
    assert [(w.stage_index, w.replica, w.tp_index) for w in got] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert {(w.readers, w.summary_name(8)) for w in got} == {(2, "pipeline+tensor_parallel")}
    assert [w.reader_index for w in got] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("items, sentence", [
    (["dist.pipeline.microbatches=5"], r"dist.pipeline.microbatches: 5 does not divide a device's batch \(data.batch_size: 32\)"),
    (["dist.mode=ps"], r"dist.pipeline.stages: 2 does not combine with dist.mode: ps"),
    (["train.ema=0.9"], r"dist.pipeline.stages: 2 does not combine with train.ema \(each stage would average"),
    (["optim.l1=0.001"], r"dist.pipeline.stages: 2 does not combine with optim.l1"),
    (["dist.sync_bn=true"], r"dist.pipeline.stages: 2 does not combine with dist.sync_bn"),
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
@pytest.mark.parametrize("world, items, sentence", [
    (2, ("train.precision=fp16",), "train.precision: fp16 needs the loss scaler"),
    (2, ("data.global_batch_size=30", "dist.pipeline.microbatches=4"),
     "dist.pipeline.microbatches: 4 does not divide a device's batch of 30 (data.global_batch_size: 30); choose a divisor of it."),
    (4, ("data.global_batch_size=20", "dist.pipeline.microbatches=4"),
     "dist.pipeline.microbatches: 4 does not divide a device's batch of 10 (data.global_batch_size: 20 over 2 pipelines); "
     "choose a divisor of it."),
    (4, ("data.global_batch_size=33", "dist.pipeline.microbatches=4"),
     "does not divide a device's batch of 17 (data.global_batch_size: 33 over 2 pipelines)"),
])
def test_what_a_pipeline_layout_cannot_do_is_one_sentence_before_anything_runs(world, items, sentence):
    cfg = load_config("mnist", SYNTH + ["dist.pipeline.stages=2", "dist.pipeline.split=[2]", *items])
    with pytest.raises(ConfigError, match=re.escape(sentence)):
        ways.choose(cfg, DistInfo(world_size=world)).check(_seq(3), None)


@pytest.mark.parametrize("extra, devices, sentence", [
    (["dist.pipeline.stages=2"], "cpu:3", "dist.pipeline.stages: 2 does not divide the job's 3 processes"),
    (["dist.pipeline.stages=2", "data.global_batch_size=30", "dist.pipeline.microbatches=4"], "cpu:2",
     "dist.pipeline.microbatches: 4 does not divide a device's batch of 30"),
    (["dist.tensor_parallel=2"], "cpu:3", "dist.tensor_parallel: 2 does not divide the job's 3 processes"),
    (["dist.pipeline.stages=2", "train.precision=fp16"], "cpu:2", "train.precision: fp16 needs the loss scaler"),
])
def test_a_layout_the_way_refuses_is_said_by_the_launcher_before_any_worker_starts(tmp_path, extra, devices, sentence):
    """What needs no model (the processes, fp16, a number of microbatches) is refused by the command itself: one
    line, no "launching" line, no worker and no run directory (it was said by the workers, 5-8 s in)."""
    run = tmp_path / "run"
    r = run_cli("train", *sets(*SYNTH, *extra), "--devices", devices, "--run-dir", str(run))
    assert r.returncode == 2 and r.stderr.startswith(f"error: {sentence}") and r.stderr.count("\n") == 1, r.stderr
    assert "launching" not in r.stdout and not run.exists()


@pytest.mark.fast
@pytest.mark.parametrize("world, stages, batch, want", [
    (2, 2, 64, [4]), (2, 2, 50, [5]), (4, 2, 50, [5, 5]), (4, 2, 51, [2, 5]), (2, 2, 47, [1]), (3, 3, 30, [6]),
    (2, 2, 6, [3]), (2, 2, 1, [1]),
])
def test_auto_microbatches_are_the_divisor_of_each_device_batch_nearest_twice_the_stages(world, stages, batch, want):
    """A batch no number of microbatches was chosen for trains, where a fixed 2 x stages would be refused: 50 on 2
    stages is 5 microbatches of 10; 51 over 2 pipelines is 26 (2 of 13) and 25 (5 of 5); a prime batch is one."""
    cfg = load_config("mnist", SYNTH + [f"dist.pipeline.stages={stages}", f"data.global_batch_size={batch}"])
    way = ways.choose(cfg, DistInfo(world_size=world))
    way.check(_seq(3), None)  # no sentence: auto takes a divisor
    assert [way.microbatches(r) for r in range(world // stages)] == want
    explicit = load_config("mnist", SYNTH + [f"dist.pipeline.stages={stages}", "dist.pipeline.microbatches=3",
                                            "data.global_batch_size=48"])
    assert explicit.dist.pipeline.microbatch_count(50) == 3  # a number is kept (and refused where it does not divide)


def test_sigterm_to_the_last_stage_stops_both_stages_at_one_step_with_a_checkpoint(tmp_path):
    """The stop vote spans the pipeline: a signal to the last stage alone (as a scheduler may send it) stops the
    first stage at the same step, one checkpoint is written, and the run ends as any stopped run does."""
    run = tmp_path / "run"
    args = ["train", *sets(*VIT, "train.max_steps=0", "train.epochs=50", "train.log_every=1", "dist.pipeline.stages=2",
                           "dist.pipeline.balance=time"),
            "--devices", "cpu:2"]
    code, err = sigterm_rank_one(args, run, rows=3)
    assert code == 130, err
    log1 = run / "logs" / "workerlog.1"
    m = re.fullmatch(r"error: SIGTERM to rank 1 at step (\d+): saved a checkpoint to (\S+); resume with `brickyard train "
                     r"--run-dir \S+ --devices cpu:2 --resume auto`\.", err.strip())  # the layout it resumes on
    assert m, err
    step = int(m.group(1))
    assert step % 10 == 0 and checkpoint.load(m.group(2))["step"] == step
    assert f"SIGTERM at step {step}: saved a checkpoint;" in log1.read_text()
    log0 = (run / "logs" / "workerlog.0").read_text()
    assert f"SIGTERM to rank 1 at step {step}: saved a checkpoint" in log0  # stage 0 agreed
    assert "stage 0 of 2 (balanced by each block's measured time)" in log0  # rank 0 measured, both cut there


@pytest.mark.fast
def test_a_cut_by_measured_time_leaves_the_model_and_the_random_state_as_they_were():
    """mnist_fast's parameters sit in conv3 and fc, its time in conv2 and conv3 (the same multiply-adds each, the
    rest a tenth of it): by time the second stage begins before conv3, by parameters after it."""
    from brickyard.distributed import pipeline as pp
    from brickyard.models import create
    torch.set_num_threads(1)
    model = create("mnist_fast", 10, 1, (28, 28))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 1, 28, 28)
    rng = torch.get_rng_state()
    timed, counted = pp.timed_cuts(model, 2, x), pp.cuts(model, 2)
    names = [n for n, _ in pp.pieces(model)]
    assert names[counted[1]] == "pool3" and 0 < timed[1] <= names.index("conv3") < counted[1], (timed, counted)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters()) and model.training


@pytest.mark.fast
def test_a_cut_by_memory_makes_the_largest_stage_smaller_than_a_cut_by_parameters():
    """ResNet-18 on 28-pixel images with Adam: its parameters sit in layer4, its activations in the stem and the
    early layers (full resolution). Cut by parameters, stage 0 holds every activation but layer4.1's and is 2.7
    times stage 1; cut by memory the largest stage (`brickyard memory`'s figures, cut where the run cuts) is 30%
    smaller, and the model, its batch norm statistics and the random state are left as they were. And the
    partition itself: the least largest stage, each stage's cost weighed by its microbatches in flight."""
    from brickyard.distributed import pipeline as pp
    torch.set_num_threads(1)
    assert pp._least_largest(lambda i, a, b: b - a, 10, 3) == [0, 3, 6]  # 3, 3, 4 pieces
    assert pp._least_largest(lambda i, a, b: (b - a) * (3 - i), 7, 3) == [0, 1, 3]  # 1x3, 2x2, 4x1: in flight weighs
    assert pp.in_flight("1f1b", 8, 4, 1) == 3 and pp.in_flight("gpipe", 8, 4, 1) == 8 and pp.in_flight("1f1b", 2, 4, 0) == 2
    cfg = load_config("mnist", SYNTH + ["model.name=resnet18", "optim.name=adam", "dist.pipeline.stages=2",
                                        "data.batch_size=32"])
    data = build_data(cfg.data)
    model = build_model(cfg, data)
    before, rng = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
    largest, first = {}, {}
    for balance in ("params", "memory"):
        est = memory.stage_estimates(cfg.replace(**{"dist.pipeline.balance": balance}), model, data, "fp32", 32)
        largest[balance] = max(st["total"] for st in est)
        first[balance] = [st["first"] for st in est]
    assert first == {"params": ["conv1", "layer4.1"], "memory": ["conv1", "layer4.0"]}  # one block earlier
    assert largest["memory"] < 0.75 * largest["params"], largest  # 152 MB against 216 (bytes counted and measured)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and torch.equal(rng, torch.get_rng_state())


@pytest.mark.fast
def test_a_train_step_of_ones_own_is_one_sentence_before_anything_runs():
    from brickyard.training.resolve import check_before_writing
    from brickyard.training.trainer import UserParts
    cfg = load_config("mnist", SYNTH + ["dist.pipeline.stages=2"])
    data = build_data(cfg.data)
    info = DistInfo(world_size=2)
    with pytest.raises(ConfigError, match="a train_step of your own is not built for it yet; pass loss_fn instead"):
        check_before_writing(cfg, build_model(cfg, data), data, UserParts(train_step=lambda run, batch: None), info,
                             ways.choose(cfg, info), None)


@pytest.mark.fast
def test_the_shapes_a_stage_is_given_leave_batch_norm_and_the_modes_as_they_were():
    """torch's own shape inference would run a later stage's forward in training mode on an uninitialised input,
    into its batch norm's running statistics: the stages are given their shapes and dtypes instead, computed once
    through the model in evaluation mode under the run's autocast. Each rank then holds its stage's parameters and
    buffers only: the other stages' are freed."""
    import copy

    from brickyard.distributed import pipeline as pp
    from brickyard.models import create
    torch.set_num_threads(1)
    model = create("fashion_lean", 10, 1, (28, 28)).train()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    norms[0].eval()  # a module left in evaluation mode by the user (a frozen norm) stays so
    reference = copy.deepcopy(model).eval()
    starts = pp.cuts(model, 2)
    stage = pp.stage_module(model, starts, 1)
    names = pp.own_names(model, stage)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 1, 28, 28)
    with torch.autocast("cpu", torch.bfloat16):  # the dtypes the run's forward passes make
        io = pp.io(model, starts, 1, x[:2])
    pp.release_others(model, stage)
    received, sent = io.batch(4, torch.device("cpu"))
    with torch.no_grad():
        first = pp.stage_module(reference, starts, 0)(x)
        assert received.shape == first.shape and sent.shape == pp.stage_module(reference, starts, 1)(first).shape == (4, 10)
    assert received.dtype == torch.bfloat16 and not received.requires_grad  # a convolution's output under autocast
    own = set(names.values())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in own) and all(after[k].is_meta for k in after if k not in own)
    assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for k, v in before.items() if "running" not in k
                                                             and "num_batches" not in k)  # the log's count stands
    assert model.training and not norms[0].training and all(m.training for m in norms[1:])


def test_a_batch_norm_net_with_whitening_and_flipped_views_trains_in_two_stages(tmp_path):
    """fashion_lean as the Fashion-MNIST presets train it (its first convolution whitened from the data, test-time
    flips), in bf16 (the activation sent between the stages is bf16: the stages are told so): the log describes the
    whole model, and the permuted activation the first stage sends is made dense. A batch of 30, which 2 x stages
    does not divide, is cut into 5 microbatches by auto (and the epoch's last 2 images into 2)."""
    r = train(tmp_path / "r", *SYNTH, "model.name=fashion_lean", "model.whiten=true", "data.tta=flip", "train.max_steps=0",
              "train.epochs=1", "data.synthetic.num_train=62", "data.global_batch_size=30", "train.precision=bf16", "train.threads=1",
              "train.plots=false", "dist.pipeline.stages=2", devices="cpu:2")
    log = (tmp_path / "r" / "train.log").read_text()
    assert "test accuracy:" in r.stdout and "whiten" in log and "model fashion_lean (" in log
    assert "5 microbatches a step" in log and "(3 steps," in r.stdout


def test_bench_times_each_schedule_and_each_stage(tmp_path):
    """`brickyard bench` of a pipeline config: each schedule a real 2-process training job of the trainer's step, its
    images/s, each stage's compute against its step and the schedule's own bubble, in the table and bench.json."""
    recipe = [s for s in VIT if not s.startswith(("train.max_steps", "checkpoint"))] + ["dist.pipeline.stages=2",
                                                                                         "dist.pipeline.microbatches=4"]
    r = run_cli("bench", "mnist", *sets(*recipe), "--steps", "6", "--warmup", "3", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((tmp_path / "bench.json").read_text())
    cfg = load_config("mnist", recipe)
    whole = 4 * sum(p.numel() for p in build_model(cfg, build_data(cfg.data)).parameters())  # bytes in fp32
    assert list(doc["results"]) == ["cpu:2 gpipe", "cpu:2 1f1b"]  # the default spec: one process a stage
    for label, res in doc["results"].items():
        pipe = res["pipeline"]
        assert res["way"] == "pipeline" and res["world_size"] == 2 and res["images_per_second"] > 0
        assert pipe["schedule"] == label.split()[1] and pipe["microbatches"] == 4 and pipe["textbook_bubble"] == 0.2
        assert [row["stage"] for row in pipe["ranks"]] == [0, 1]
        assert all(row["steps"] == 7 and 0 < row["busy_ms"] < row["step_ms"] for row in pipe["ranks"])  # 9 less 2 untimed
        assert 0.4 * whole < res["held_per_rank"]["parameters"] < 0.6 * whole  # rank 0 holds about half the model
    assert re.search(r"stage 1, replica 0: computes [\d.]+ ms of each [\d.]+ ms step, idle [\d.]+%", r.stdout)
    assert "the schedule's own bubble (S - 1) / (M + S - 1) is 20.0% of a step" in r.stdout
    assert "cpu:2 1f1b" in r.stdout.split("efficiency")[-1]  # the table's rows


@pytest.mark.fast
def test_a_split_given_on_resume_is_checked_against_the_runs_stages(tmp_path):
    """`brickyard train --run-dir R --resume auto --set dist.pipeline.split=[blocks.4]` of a 2-stage run: the split
    is read with the run's saved config (2 stages, one split point), not the default preset's single stage."""
    from brickyard.cli.main import _parser
    from brickyard.cli.train import config_of
    from brickyard.config import save_config
    save_config(load_config("mnist", VIT + ["dist.pipeline.stages=2"]), tmp_path / "config.yaml")
    over = ["dist.pipeline.split=[blocks.4]"]
    args = _parser().parse_args(["train", "--run-dir", str(tmp_path), "--resume", "auto", "--set", *over])
    cfg = config_of(args, over)
    assert (cfg.dist.pipeline.stages, cfg.dist.pipeline.split) == (2, ("blocks.4",))
    args = _parser().parse_args(["train", "--set", *over])
    with pytest.raises(ConfigError, match="dist.pipeline.split names 1 module"):  # a new run of the default preset
        config_of(args, over)


@pytest.mark.fast
def test_bench_tells_the_tensor_parallel_ranks_of_a_stage_apart():
    from brickyard.tools.bench import format_trained
    rows = [{"stage": s, "replica": 0, "shard": t, "busy_ms": 3.0, "step_ms": 4.0, "idle": 0.25} for s in (0, 1) for t in (0, 1)]
    r = {"model": "vit_tiny", "data": "mnist", "device": "cpu", "precision": "fp32", "world_size": 4, "global_batch": 32,
         "way": "pipeline+tensor_parallel", "warmup": 2, "steps": 4, "images_per_second": 10.0, "images_per_second_min": 9.0,
         "images_per_second_max": 11.0, "verdict": "pipeline",
         "pipeline": {"schedule": "gpipe", "microbatches": 4, "textbook_bubble": 0.2, "ranks": rows}}
    lines = [line for line in format_trained(r).splitlines() if line.startswith("  stage")]
    assert len(set(lines)) == 4 and "  stage 1, replica 0, tensor-parallel rank 1: computes 3.0 ms" in lines[3]
