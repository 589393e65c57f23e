"""Tensor parallel (``dist.tensor_parallel``) with real processes (torchrun + gloo on localhost), and the inputs it
refuses and the plans it makes, in-process.

Pinned as the pipeline's tests are: fp32, one thread per process, deterministic algorithms, SGD with momentum at a
constant rate; ViT-Tiny on 14-pixel images of one patch (2 tokens with the class token) in global batches of 32.
"""
import json
import re

import pytest
import torch
from torch import nn

from brickyard.config import load_config
from brickyard.distributed import tensor_parallel as tp
from brickyard.distributed.env import DistInfo
from brickyard.errors import ConfigError
from brickyard.models import create
from brickyard.training import ways
from conftest import SYNTH, run_cli
from layouts import CLIP, VIT, diff, last, moved, reference, train


def test_vit_tiny_on_two_ranks_trains_one_process_weights_and_resumes_across_them(tmp_path, tmp_path_factory):
    """2 ranks (with 2 accumulation steps) against 1 process, both clipping: the same weights and momentum, the
    whole tensors under the model's own names; each rank says it holds less than the whole model; the 2-rank run's
    step-10 checkpoint resumed on 1 process, and the 1-process one on 2 replicas of 2 ranks (4 processes, the
    replicas' gradients averaged), both to the 1-process run's weights."""
    one, two = reference(tmp_path_factory, CLIP), tmp_path / "two"
    train(two, *VIT, CLIP, "dist.tensor_parallel=2", "train.grad_accum=2", devices="cpu:2")
    a, b = last(one), last(two)
    assert a["step"] == b["step"] == 20 and list(a["model"]) == list(b["model"])  # the model's own names
    assert all(type(v) is torch.Tensor and v.shape == a["model"][k].shape for k, v in b["model"].items())  # whole
    assert diff(a["model"], b["model"]) < 1e-5
    assert diff({i: s["momentum_buffer"] for i, s in a["optimizer"]["state"].items()},
                 {i: s["momentum_buffer"] for i, s in b["optimizer"]["state"].items()}) < 1e-5
    total, holds = sum(v.numel() for v in a["model"].values()), {}
    for rank in (0, 1):
        line = re.search(r"tensor parallel: rank (\d) of 2 holds ([\d,]+) of ([\d,]+) parameters \((.*)\)",
                         (two / "logs" / f"workerlog.{rank}").read_text())
        assert line and int(line[1]) == rank and int(line[3].replace(",", "")) == total
        holds[rank] = int(line[2].replace(",", ""))
        assert 0.5 * total < holds[rank] < 0.75 * total  # MLPs and head halved; the rest whole
        assert line[4] == "12 MLPs column/row split, head rows split; attention replicated: 3 heads over 2"
    assert json.loads((two / "summary.json").read_text())["strategy"] == "tensor_parallel"
    # `brickyard memory`'s count of a rank's parameters (fp32 bytes) is what rank 0 held
    from brickyard.api import build_model
    from brickyard.data import build_data
    from brickyard.training import memory
    cfg = load_config("mnist", VIT + ["dist.tensor_parallel=2"])
    data = build_data(cfg.data)
    est = memory.estimate(cfg, build_model(cfg, data), data, torch.device("cpu"), 2, compare=False)
    assert est["parameters"] == 4 * holds[0] and est["strategy"] == "tensor_parallel"
    back = moved(two, 10, tmp_path / "back")  # 2 ranks -> 1 process
    train(back, "dist.tensor_parallel=1", resume=True)
    assert "step-0000010.pt at step 10" in (back / "logs" / "workerlog.0").read_text()
    assert last(back)["step"] == 20 and diff(a["model"], last(back)["model"]) < 1e-5
    wide = moved(one, 10, tmp_path / "wide")  # 1 process -> 2 groups of 2 ranks, each reading half of each batch
    train(wide, "dist.tensor_parallel=2", devices="cpu:4", resume=True)
    assert "tensor parallel: rank 1 of 2, replica 1 of 2 holds" in (wide / "logs" / "workerlog.3").read_text()
    assert last(wide)["step"] == 20 and diff(a["model"], last(wide)["model"]) < 1e-5
    assert json.loads((wide / "summary.json").read_text())["world_size"] == 4


HEADS = '''
import json, sys
import torch, torch.distributed as dist
from torch import nn
from brickyard.distributed import fsdp, tensor_parallel as tp
from brickyard.models import create
from brickyard.optim import build_optimizer
from brickyard.config import load_config
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
torch.set_num_threads(1)
torch.manual_seed(0)
whole = create("vit_small", 10, 3, (14, 14), patch_size=7)  # 6 heads: 3 a rank
torch.manual_seed(1 + dist.get_rank())  # another start on each rank: apply gives every rank rank 0's weights
split = create("vit_small", 10, 3, (14, 14), patch_size=7)
if dist.get_rank() == 0:
    split.load_state_dict(whole.state_dict())
plan = tp.plan(split, 2)
tp.apply(split, plan, init_device_mesh("cpu", (2,)))
cfg = load_config("mnist", ["optim.name=momentum", "optim.lr=0.1", "optim.weight_decay=0.01"]).optim
optimizers = [build_optimizer(cfg, m.parameters()) for m in (whole, split)]
torch.manual_seed(2)
x, y = torch.randn(8, 3, 14, 14), torch.randint(0, 10, (8,))
for step in range(2):
    for m, opt in zip((whole, split), optimizers):
        nn.functional.cross_entropy(m(x), y).backward()
    norms = [nn.utils.clip_grad_norm_(list(whole.parameters()), 1.0).item(),
             tp.clip_grad_norm_(list(split.parameters()), 1.0, dist.group.WORLD).item()]
    grads = max((fsdp.full(p.grad) - q.grad).abs().max().item() for p, q in zip(split.parameters(), whole.parameters()))
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
state = {k: fsdp.full(v) for k, v in split.state_dict().items()}
own = whole.state_dict()
with open(f"{sys.argv[1]}.{dist.get_rank()}", "w") as f:
    json.dump({"split": plan.heads_split, "described": plan.describe(2), "held": tp.held(split), "norms": norms,
               "planned": tp.planned_held(whole, tp.plan(whole, 2), 2),
               "grads": grads, "names": list(state) == list(own),
               "weights": max((state[k] - own[k]).abs().max().item() for k in own)}, f)
dist.destroy_process_group()
'''


def test_attention_split_by_heads_computes_what_the_whole_model_does(tmp_path):
    """ViT-Small's 6 heads over 2 ranks: two steps of the split model (momentum and weight decay on DTensors and
    plain tensors in one optimiser, gradients clipped) against the whole model in the same process."""
    script = tmp_path / "heads.py"
    script.write_text(HEADS)
    r = run_cli("run", "--devices", "cpu:2", "--run-dir", str(tmp_path / "run"), str(script), str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.{rank}").read_text())
        assert got["split"] == [f"blocks.{i}.attn" for i in range(12)]
        assert got["described"] == "12 MLPs column/row split, head rows split; attention split by heads (12 modules)"
        held, total = got["held"]
        assert 0.45 * total < held < 0.55 * total  # all but the norms, embeddings and second-layer biases halved
        assert got["planned"] == held  # counted on the whole model before the split (brickyard memory's figure)
        assert got["norms"][0] == pytest.approx(got["norms"][1], rel=1e-5) and got["norms"][0] > 1.0  # clipped
        assert got["grads"] < 1e-6 and got["names"] and got["weights"] < 1e-6


def _check(model, *items, world=2):
    cfg = load_config("mnist", SYNTH + ["dist.tensor_parallel=2", *items])
    ways.choose(cfg, DistInfo(world_size=world)).check(model, None)


@pytest.mark.fast
def test_the_config_selects_the_way():
    cfg = load_config("mnist", SYNTH + ["dist.tensor_parallel=2"])
    assert ways.name_of(cfg) == "tensor_parallel"
    way = ways.choose(cfg, DistInfo(rank=1, world_size=2))
    assert (way.readers, way.reader_index, way.sharded, way.summary_name(2)) == (1, 0, True, "tensor_parallel")
    replicas = [ways.choose(cfg, DistInfo(rank=r, world_size=6)) for r in range(6)]  # 3 groups of 2, side by side
    assert [(w.readers, w.reader_index, w.replica, w.index) for w in replicas] == [
        (3, r // 2, r // 2, r % 2) for r in range(6)]
    assert way.vote_group("readers") is None and "not captured" in way.capture_refusal()


@pytest.mark.fast
@pytest.mark.parametrize("model, items, world, sentence", [
    (nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten()), (), 2,
     "dist.tensor_parallel: Sequential has no layer tensor parallel can split (an nn.Linear); train it with "
     "dist.tensor_parallel: 1."),
    (nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), (), 3,
     "dist.tensor_parallel: 2 does not divide the job's 3 processes; a job runs whole groups (processes = 2 x "
     "replicas)."),
    (nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), ("train.precision=fp16",), 2, "train.precision: fp16 needs the loss scaler"),
])
def test_what_the_way_cannot_do_is_one_sentence_before_anything_runs(model, items, world, sentence):
    with pytest.raises(ConfigError, match=re.escape(sentence)):
        _check(model, *items, world=world)


@pytest.mark.fast
@pytest.mark.parametrize("items, what", [
    (["dist.mode=ps"], "dist.mode: ps (the servers hold the whole model)"),
    (["boost.snapshots.enabled=true"], "boost (its snapshots and subspace are of the whole parameter vector)"),
    (["dist.strategy=fsdp"], "dist.strategy: fsdp (FSDP around tensor-parallel groups, or beside them in a pipeline's "
                             "stages, is not built yet)"),
    (["dist.grad_sync=flat"], "dist.grad_sync: flat (the split layers sync inside their passes; nothing follows)"),
    (["dist.sync_bn=true"], "dist.sync_bn (every rank normalises the same whole batch already)"),
    (["train.watch=[fc]"], "train.watch and train.histograms_every (they read whole weights)"),
    (["optim.l1=0.001"], "optim.l1 (its penalty sums whole weights)"),
])
def test_config_refusals_are_one_sentence(items, what):
    with pytest.raises(ConfigError, match=re.escape(f"dist.tensor_parallel: 2 does not combine with {what}.")):
        load_config("mnist", SYNTH + ["dist.tensor_parallel=2", *items])


@pytest.mark.fast
def test_the_plan_names_the_mlps_the_head_and_the_attention_it_splits():
    vit = tp.plan(create("vit_tiny", 10, 3, (14, 14), patch_size=14), 2)
    assert vit.pairs == [(f"blocks.{i}.mlp.0", f"blocks.{i}.mlp.2") for i in range(12)] and vit.head == "head"
    assert vit.heads_split == [] and vit.heads_kept == [(f"blocks.{i}.attn", 3) for i in range(12)]
    assert vit.describe(2) == "12 MLPs column/row split, head rows split; attention replicated: 3 heads over 2"
    assert tp.plan(create("vit_tiny", 10, 3, (14, 14), patch_size=14), 3).heads_split == [f"blocks.{i}.attn" for i in range(12)]
    convnet = tp.plan(create("convnet", 10, 1, (28, 28)), 2)  # conv..., fc1, relu4, fc: the head alone
    assert (convnet.pairs, convnet.head, convnet.heads_split, convnet.heads_kept) == ([], "fc", [], [])
    assert convnet.describe(2) == "fc rows split"
    mlp = tp.plan(create("mlp", 10, 1, (28, 28)), 2)
    assert (mlp.pairs, mlp.head) == ([("fc1", "fc2")], "fc")
    three = tp.plan(create("mlp", 10, 1, (28, 28)), 3)
    assert three.pairs == [] and three.mlps_kept == [("fc1", 256)]  # 256 hidden units do not split in 3 equal shards
    assert three.describe(3) == "fc rows split; 1 MLP whole: a hidden width of 256 does not split evenly over 3"
    five = tp.plan(create("vit_tiny", 10, 3, (14, 14), patch_size=14), 5)  # 3 heads and 768 hidden units over 5
    assert five.describe(5) == ("head rows split; attention replicated: 3 heads over 5; 12 MLPs whole: a hidden width "
                                "of 768 does not split evenly over 5")
    dropout = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert tp.plan(dropout, 2).pairs == []  # a dropout between would draw its mask on each shard apart
    assert not tp.plan(nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten()), 2)
