"""`brickyard memory`: the breakdown, optimiser state per optimiser, the largest batch, OOM advice."""
import os

import pytest
import torch

from brickyard.api import build_model
from brickyard.config import load_config
from brickyard.data import build_data
from brickyard.errors import BrickyardError
from brickyard.training import memory
from conftest import SYNTH, needs_mnist, run_cli


def _est(*overrides):
    cfg = load_config("mnist", SYNTH + ["model.name=mnist_cnn", *overrides])
    data = build_data(cfg.data)
    return memory.estimate(cfg, build_model(cfg, data), data, torch.device("cpu")), cfg, data


@pytest.mark.parametrize("opt, copies", [("sgd", 0), ("momentum", 1), ("nesterov", 1), ("adagrad", 1), ("adadelta", 2), ("adam", 2), ("adamw", 2)])
@pytest.mark.fast
def test_optimizer_state_copies(opt, copies):
    est, _, _ = _est(f"optim.name={opt}")
    assert est["optimizer_copies"] == copies and est["optimizer_state"] == copies * est["gradients"]
    assert est["gradients"] == est["parameters"] > 0


@pytest.mark.fast
def test_activations_extrapolate_linearly_and_batch_limit():
    est, cfg, data = _est("data.batch_size=16")
    model = build_model(cfg, data).to(memory_format=torch.channels_last)
    x = torch.randn(16, 1, 28, 28).contiguous(memory_format=torch.channels_last)
    real = memory.activation_bytes(model, x, torch.zeros(16, dtype=torch.long), torch.device("cpu"), "fp32")
    assert abs(est["activations"] - real) / real < 0.05
    small = memory.largest_batch(est, 64 * 2**20)
    big = memory.largest_batch(est, 1 * 2**30)
    assert 0 < small < big
    tips = memory.oom_tips(est, cfg)
    assert "data.batch_size=8" in tips and "train.grad_accum=2" in tips and "train.precision=bf16" in tips


@needs_mnist
def test_memory_command_prints_the_breakdown():
    r = run_cli("memory", "mnist", "--device-memory", "1GiB", "--set", "optim.name=nesterov")  # one state copy per parameter
    assert r.returncode == 0, r.stderr
    for row in ("parameters", "gradients", "optimiser state (1 copy)", "activations", "in-memory data set", "total",
                "largest batch that fits"):
        assert row in r.stdout, row
    bad = run_cli("memory", "mnist", "--device-memory", "lots")
    assert bad.returncode == 2 and "expected a number with a unit" in bad.stderr


def test_per_rank_estimates_for_ddp_fsdp_offload_and_checkpointing():
    """FSDP's shards are 1/world of DDP's whole tensors; offload leaves the gathered parts; activation
    checkpointing's saving is the measured one; the largest batch grows in that order."""
    cfg = load_config("mnist", SYNTH + ["model.name=vit_tiny", "model.patch_size=7", "optim.name=adamw",
                                        "dist.strategy=fsdp", "data.global_batch_size=64"])
    data = build_data(cfg.data)
    est = memory.estimate(cfg, build_model(cfg, data), data, torch.device("cpu"), 2)
    assert est["strategy"] == "fsdp" and est["whole"] == est["parameters"] * 4  # AdamW: weights, grads, 2 states
    assert sum(est["sharded"].values()) == pytest.approx(est["whole"] / 2, rel=1e-6)
    block = sum(p.numel() * 4 for p in build_model(cfg, data).blocks[0].parameters())
    assert est["gathered"] >= 3 * block  # a block, the one prefetched, and a block's gradients before reduce-scatter
    rows = {label: (fixed, per) for label, fixed, per in memory.strategies(est)}
    assert list(rows) == ["ddp", "ddp + activation checkpointing", "fsdp", "fsdp + activation checkpointing",
                          "fsdp + offload (GPU)", "fsdp + offload (GPU) + activation checkpointing"]
    fits = [memory.largest_batch({"fixed": f, "per_sample_total": p}, 2**30) for f, p in rows.values()]
    assert fits[0] < fits[2] < fits[4] and fits[0] < fits[1]
    assert rows["ddp"][1] > rows["ddp + activation checkpointing"][1]
    assert est["total"] == pytest.approx(rows["fsdp"][0] + rows["fsdp"][1] * est["batch"])
    r = run_cli("memory", *sum((["--set", s] for s in SYNTH + ["model.name=vit_tiny", "model.patch_size=7", "dist.strategy=fsdp"]), []),
                "--devices", "cpu:2", "--device-memory", "2GiB")
    assert r.returncode == 0, r.stderr
    assert "world size 2, fsdp):" in r.stdout and "parameters (1/2)" in r.stdout and "gathered while computing" in r.stdout
    assert "fsdp + offload (GPU) + activation checkpointing" in r.stdout


@pytest.mark.fast
def test_parse_size():
    assert memory.parse_size("16GiB") == 16 * 2**30 and memory.parse_size("512 MB") == 512e6
    with pytest.raises(BrickyardError):
        memory.parse_size("12 parsecs")


@pytest.mark.fast
def test_batch_size_auto_is_chosen_and_recorded(tmp_path):
    from brickyard import api
    s = api.train_config(load_config("mnist", SYNTH + ["data.batch_size=auto", "train.epochs=1"]), tmp_path / "r")
    chosen = load_config(str(tmp_path / "r" / "config.yaml")).data.batch_size
    assert isinstance(chosen, int) and 1 <= chosen <= 512 and s["steps"] >= 1
    assert "data.batch_size: auto chose" in (tmp_path / "r" / "train.log").read_text()
    with pytest.raises(Exception, match="'huge' is not a number or one of auto"):
        load_config("mnist", ["data.batch_size=huge"])


@pytest.mark.fast
def test_batch_size_auto_on_a_cpu_keeps_an_epoch_of_steps(tmp_path):
    from brickyard import api
    s = api.train_config(load_config("mnist", SYNTH + ["data.batch_size=auto", "train.epochs=1",
                                                       "data.synthetic.num_train=2048"]), tmp_path / "r")
    chosen = load_config(str(tmp_path / "r" / "config.yaml")).data.batch_size
    assert chosen <= 2048 // 20 and s["steps"] >= 20  # it chose 2048 (one step) before


@pytest.mark.fast
def test_the_rows_of_tensor_parallel_are_rank_zeros_and_add_up_to_the_total():
    """Tensor parallel's rows are what rank 0 holds (its shards and its whole layers), as the run logs them, not
    FSDP's 1/world shards: the rows sum to the total."""
    cfg = load_config("mnist", SYNTH + ["model.name=vit_tiny", "model.patch_size=7", "dist.tensor_parallel=2"])
    data = build_data(cfg.data)
    model = build_model(cfg, data)
    est = memory.estimate(cfg, model, data, torch.device("cpu"), 2, compare=False)
    whole = 4 * sum(p.numel() for p in model.parameters())
    assert est["strategy"] == "tensor_parallel" and 0.5 * whole < est["parameters"] < whole
    text = memory.report(est, None, "cpu")
    assert "1/2" not in text and "gathered" not in text
    rows = [line.rsplit("  ", 1) for line in text.splitlines()[1:8]]
    assert [r[0].strip() for r in rows][:3] == ["parameters (rank 0's)", "gradients (rank 0's)",
                                                "optimiser state (1 copy) (rank 0's)"]
    assert rows[0][1].strip() == memory.fmt(est["parameters"])


def test_memory_of_an_image_folder_counts_the_loader_workers_auto_plans(tmp_path):
    """`data.num_workers: auto` (the default) on a folder of JPEGs: the workers the loader would start, not the
    word, in the streaming loader's host buffers (it was multiplied in as a string, and the report crashed)."""
    from PIL import Image
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("auto plans loader workers from 2 cores up")
    for cls in ("a", "b"):
        (tmp_path / "train" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (40 + i, 30), (60 * i, 20, 200)).save(tmp_path / "train" / cls / f"{i}.jpg")
    r = run_cli("memory", "mnist", "--set", "data.name=imagefolder", "--set", f"data.root={tmp_path}", "--set",
                "model.name=mnist_cnn", "--set", "data.batch_size=4", "--set", "train.precision=fp32", "--set",
                "data.train_transforms=[random_resized_crop:32]", "--set", "data.eval_transforms=[resize:32x32]")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "(host) streaming loader buffers" in r.stdout  # one process of 2 cores: auto plans 1 worker


@pytest.mark.fast
def test_precision_auto_is_not_measured_at_a_batch_that_would_take_the_memory_asked_about(monkeypatch):
    """Where `auto` is measured (a CPU with native bf16), the estimate times real fp32 and bf16 steps at the batch:
    not when their activations would pass half the available memory (ResNet-18 at 224 px and 256 a batch held
    28 GiB and was killed). Then the rule decides; with room, the measurement runs as before."""
    calls = []
    monkeypatch.setattr(memory, "needs_measuring", lambda *a: True)
    monkeypatch.setattr(memory, "for_model", lambda *a: calls.append(a[3]) or "fp32")
    monkeypatch.setattr(memory, "_available_host_memory", lambda: 2**20)  # 1 MiB: no batch of mnist_cnn fits in half
    est, _, _ = _est("data.batch_size=64", "train.precision=auto")
    assert calls == [] and est["batch"] == 64
    monkeypatch.setattr(memory, "_available_host_memory", lambda: 2**34)
    est, _, _ = _est("data.batch_size=64", "train.precision=auto")
    assert calls == [64] and est["precision"] == "fp32"
