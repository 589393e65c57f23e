"""Dimension-reduction training: the subspace, P-BFGS, its guarantees, resume and data parallel."""
import json
import shutil
from types import SimpleNamespace

import torch
from torch import nn

from brickyard import api, boost, checkpoint
from brickyard.config import load_config
from brickyard.steps import make_loss_sum
from conftest import SYNTH, run_cli, sets

DR = SimpleNamespace(rho=0.55, sigma=0.4, gamma=0.9, alpha=0.0, max_search=2)


def test_subspace_bfgs_with_exact_line_search_converges_in_n_plus_1_steps():
    torch.manual_seed(0)
    n = 6
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    A = q @ torch.diag(torch.linspace(0.5, 20, n, dtype=torch.float64)) @ q.T
    w_star = torch.randn(n, dtype=torch.float64)
    w = torch.zeros(n, dtype=torch.float64)
    B, s, g_prev = torch.eye(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), None
    for k in range(n + 1):
        g = A @ (w - w_star)
        if g.norm() < 1e-9:
            break
        if g_prev is not None:
            B = boost.bfgs_update(B, s, g - g_prev)
        g_prev = g
        d = -B @ g
        t = float(-(g @ d) / (d @ A @ d))  # exact line search on a quadratic
        s = t * d
        w = w + s
    assert (A @ (w - w_star)).norm() < 1e-8 and k <= n + 1


def test_pca_rows_are_orthonormal_and_capture_a_planted_subspace():
    torch.manual_seed(1)
    M, k = 500, 4
    Q, _ = torch.linalg.qr(torch.randn(M, k))
    coeffs = torch.randn(30, k) * torch.tensor([10.0, 6.0, 4.0, 2.0])
    traj = torch.randn(M) + coeffs @ Q.T + 0.01 * torch.randn(30, M)
    P = boost.fit_pca(traj, k)
    assert P.shape == (k, M)
    assert torch.allclose(P @ P.T, torch.eye(k), atol=1e-5)
    assert (Q - P.T @ (P @ Q)).norm() / Q.norm() < 0.02


def test_a_rejected_line_search_leaves_weights_and_B_unchanged():
    torch.manual_seed(2)
    lin = nn.Linear(5, 3)
    params = list(lin.parameters())
    M = sum(p.numel() for p in params)
    P = boost.fit_pca(torch.randn(10, M), 4)
    dr = boost.DimReduce(params, P, DR)
    for p in params:
        p.grad = torch.randn_like(p)
    dr.step(1.0, lambda: 0.5)  # accepted: builds a step s and g_prev
    B_before, w_before = dr.B.clone(), boost.flat_params(params).clone()
    for p in params:
        p.grad = torch.randn_like(p)
    out = dr.step(1.0, lambda: float("inf"))
    assert not out["accepted"] and out["tries"] == 2
    assert torch.equal(dr.B, B_before) and torch.equal(boost.flat_params(params), w_before)


def test_trial_forwards_leave_batch_norm_statistics_alone():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    import contextlib
    trial = boost.make_trial_loss(model, torch.randn(8, 1, 8, 8), torch.zeros(8, dtype=torch.long), 8,
                                  make_loss_sum(None), contextlib.nullcontext)
    trial()
    trial()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _stage1(tmp_path, extra=()):
    base = SYNTH + ["train.deterministic=true", "boost.snapshots.every_steps=2", "boost.snapshots.keep=12",
                    "boost.dim_reduce.n_components=4", *extra]
    s1 = tmp_path / "s1"
    summary = api.train_config(load_config("mnist", base + ["train.epochs=1", "boost.snapshots.enabled=true"]), s1)
    snaps = boost.list_snapshots(s1 / "snapshots")
    assert len(snaps) == 1 + summary["steps"] // 2  # the initial weights, then every 2 steps
    assert torch.load(snaps[0], weights_only=True)["names"][0] == "fc1.weight"
    return base, s1


def test_stage2_learns_and_resumes_exactly(tmp_path):
    base, s1 = _stage1(tmp_path)
    init = str(checkpoint.step_checkpoints(s1 / "checkpoints")[-1])
    stage2 = base + ["train.epochs=3", "boost.dim_reduce.enabled=true", f"boost.dim_reduce.snapshots_dir={s1 / 'snapshots'}",
                     f"finetune.init_from={init}", "checkpoint.every_steps=4", "checkpoint.keep_last=20"]
    full = api.train_config(load_config("mnist", stage2), tmp_path / "full")
    assert (tmp_path / "full" / "pca.pt").is_file() and full["test_accuracy"] > 0.5
    state = checkpoint.load(tmp_path / "full" / "checkpoints" / "step-0000012.pt")
    assert state["boost"]["B"].shape == (4, 4) and state["boost"]["m"].numel() > 0
    res = tmp_path / "resumed"
    (res / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "full" / "checkpoints" / "step-0000012.pt", res / "checkpoints")
    api.train_config(load_config("mnist", stage2), res, resume="auto")
    a = checkpoint.load(checkpoint.step_checkpoints(tmp_path / "full" / "checkpoints")[-1])["model"]
    b = checkpoint.load(checkpoint.step_checkpoints(res / "checkpoints")[-1])["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stage2_two_processes_equal_one(tmp_path):
    base, s1 = _stage1(tmp_path, ["data.batch_size=64"])
    init = str(checkpoint.step_checkpoints(s1 / "checkpoints")[-1])
    stage2 = [s for s in base if not s.startswith("data.batch_size")] + [
        "train.epochs=2", "boost.dim_reduce.enabled=true", f"boost.dim_reduce.snapshots_dir={s1 / 'snapshots'}", f"finetune.init_from={init}"]
    api.train_config(load_config("mnist", stage2 + ["data.batch_size=64"]), tmp_path / "one")
    r = run_cli("train", "mnist", *sets(*stage2, "data.batch_size=32"), "--devices", "cpu:2", "--run-dir", str(tmp_path / "two"))
    assert r.returncode == 0, r.stderr
    a = checkpoint.load(checkpoint.step_checkpoints(tmp_path / "one" / "checkpoints")[-1])["model"]
    b = checkpoint.load(checkpoint.step_checkpoints(tmp_path / "two" / "checkpoints")[-1])["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["world_size"] == 2


def test_too_few_snapshots_and_bad_pca_are_clear(tmp_path):
    r = run_cli("train", *sets(*SYNTH, "boost.snapshots.enabled=true", "boost.snapshots.keep=10"), "--run-dir", str(tmp_path / "a"))
    assert r.returncode == 2 and "boost.snapshots.keep: 10 must exceed boost.dim_reduce.n_components (32)" in r.stderr
    torch.save({"P": torch.zeros(2, 5), "names": ["x"]}, tmp_path / "pca.pt")
    r = run_cli("train", *sets(*SYNTH, "boost.dim_reduce.enabled=true", f"boost.dim_reduce.pca_path={tmp_path / 'pca.pt'}"),
                "--run-dir", str(tmp_path / "b"))
    assert r.returncode == 2 and "computed for other parameters" in r.stderr
