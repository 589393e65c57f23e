"""Dimension-reduction training: the subspace, P-BFGS, its guarantees, resume and data parallel."""
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from brickyard import api
from brickyard.boost import dim_reduce as boost
from brickyard.training import checkpoint
from brickyard.config import load_config
from brickyard.training.step import make_loss_sum
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


def _numpy_stage2(w, P, loss, grad, cfg, steps):
    """The reference's equations (MindSpore boost.DimReduce; Li et al. 2022), written again in NumPy."""
    n = P.shape[0]
    B, s, g_prev, m = np.eye(n), np.zeros(n), None, np.zeros_like(w)
    ws, ts = [], []
    for _ in range(steps):
        g, L0 = grad(w), loss(w)
        gk = P @ g
        if g_prev is not None:
            y = gk - g_prev
            if y @ s > 1e-20:
                r = 1.0 / (y @ s)
                T = np.eye(n) - r * np.outer(y, s)
                B = T.T @ B @ T + r * np.outer(s, s)
        g_prev = gk
        d = -B @ gk
        dn = P.T @ d
        t = cfg.rho ** (cfg.max_search - 1)
        for i in range(cfg.max_search):
            if loss(w + cfg.rho ** i * dn) < L0 + cfg.sigma * cfg.rho ** i * (gk @ d):
                t, s = cfg.rho ** i, cfg.rho ** i * d
                break
        m = cfg.gamma * m + g - P.T @ gk
        w = w + t * dn - cfg.alpha * m
        ws.append(w)
        ts.append(t)
    return ws, ts


@pytest.mark.parametrize("problem", ["quadratic", "logistic"])
def test_stage2_follows_the_reference_equations(problem):
    rng = np.random.default_rng(3)
    M, n = 24, 5
    P = np.linalg.qr(rng.normal(size=(M, n)))[0].T  # n x M, orthonormal rows
    if problem == "quadratic":
        Q = np.linalg.qr(rng.normal(size=(M, M)))[0]
        A, b = Q @ np.diag(np.linspace(0.5, 6.0, M)) @ Q.T, rng.normal(size=M)
        loss = lambda w: 0.5 * w @ A @ w - b @ w  # noqa: E731
        grad = lambda w: A @ w - b  # noqa: E731
    else:
        X, y = rng.normal(size=(60, M)), (rng.random(60) < 0.5).astype(float) * 2 - 1
        loss = lambda w: np.mean(np.logaddexp(0.0, -y * (X @ w)))  # noqa: E731
        grad = lambda w: X.T @ (-y / (1 + np.exp(y * (X @ w)))) / len(y)  # noqa: E731
    cfg = SimpleNamespace(rho=0.55, sigma=0.4, gamma=0.9, alpha=0.01, max_search=3)
    w0 = rng.normal(size=M)
    want, want_t = _numpy_stage2(w0.copy(), P, loss, grad, cfg, 12)

    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32))
    dr = boost.DimReduce([p], torch.tensor(P, dtype=torch.float32), cfg)
    got, got_t = [], []
    for _ in range(12):
        w = p.detach().double().numpy()
        p.grad = torch.tensor(grad(w), dtype=torch.float32)
        out = dr.step(float(loss(w)), lambda: float(loss(p.detach().double().numpy())))
        got.append(p.detach().double().numpy())
        got_t.append(out["t"])
    assert got_t == pytest.approx(want_t)
    assert 0 < dr.accepted < dr.steps or problem == "logistic"  # the quadratic takes both branches of the search
    for a, b_ in zip(got, want):
        assert np.abs(a - b_).max() < 1e-4 * (1 + np.abs(b_).max())  # float32 against float64


def test_when_no_step_size_passes_the_last_is_taken_and_s_is_kept():
    torch.manual_seed(2)
    lin = nn.Linear(5, 3)
    params = list(lin.parameters())
    M = sum(p.numel() for p in params)
    P = boost.fit_pca(torch.randn(10, M), 4)
    cfg = SimpleNamespace(rho=0.55, sigma=0.4, gamma=0.9, alpha=0.0, max_search=3)
    dr = boost.DimReduce(params, P, cfg)
    for p in params:
        p.grad = torch.randn_like(p)
    first = dr.step(1.0, lambda: -1e9)  # passes at t = 1
    s_before, w_before = dr.s.clone(), boost.flat_params(params).clone()
    for p in params:
        p.grad = torch.randn_like(p)
    out = dr.step(1.0, lambda: float("inf"))
    assert first["accepted"] and not out["accepted"] and out["tries"] == 3 and out["t"] == pytest.approx(0.55 ** 2)
    assert torch.equal(dr.s, s_before) and not torch.equal(boost.flat_params(params), w_before)  # it moved all the same
    assert dr.stats.total["steps"] == 2 and dr.stats.total["passed"] == 1


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


def test_damaged_snapshot_and_subspace_files_are_one_sentence(tmp_path):
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "snap-0000010.pt").write_bytes(b"not a torch file")
    with pytest.raises(checkpoint.CheckpointError, match="snapshot .*snap-0000010.pt cannot be read"):
        boost.pca_from_snapshots(tmp_path / "snap", 2, ["w"])
    torch.save([1, 2], tmp_path / "snap" / "snap-0000010.pt")
    with pytest.raises(checkpoint.CheckpointError, match="is not a brickyard snapshot"):
        boost.pca_from_snapshots(tmp_path / "snap", 2, ["w"])
    (tmp_path / "pca.pt").write_bytes((tmp_path / "snap" / "snap-0000010.pt").read_bytes()[:40])  # cut short
    with pytest.raises(checkpoint.CheckpointError, match="boost.dim_reduce.pca_path: .*pca.pt cannot be read"):
        boost.load_pca(tmp_path / "pca.pt", ["w"], 5)
    torch.save({"names": ["w"]}, tmp_path / "pca.pt")
    with pytest.raises(checkpoint.CheckpointError, match="not a subspace written by brickyard boost"):
        boost.load_pca(tmp_path / "pca.pt", ["w"], 5)


def test_stage2_reports_its_steps_per_epoch(tmp_path):
    base, s1 = _stage1(tmp_path)
    init = str(checkpoint.step_checkpoints(s1 / "checkpoints")[-1])  # the paper's setting: from stage 1's end
    stage2 = base + ["train.epochs=2", "boost.dim_reduce.enabled=true", f"boost.dim_reduce.snapshots_dir={s1 / 'snapshots'}",
                     f"finetune.init_from={init}"]
    summary = api.train_config(load_config("mnist", stage2), tmp_path / "s2")
    rows = [json.loads(l) for l in (tmp_path / "s2" / "metrics.jsonl").read_text().splitlines()]
    per_epoch = [r for r in rows if r["kind"] == "dim_reduce"]
    assert [r["epoch"] for r in per_epoch] == [1, 2] and all(r["steps"] == 16 for r in per_epoch)
    total = summary["dim_reduce"]
    assert total["steps"] == 32 and total["passed"] == sum(r["passed"] for r in per_epoch)
    assert sum(total["step_sizes"].values()) == 32 and set(total["step_sizes"]) <= {"1", "0.55", "0.3025"}
    assert "% passed the Armijo test; step sizes" in (tmp_path / "s2" / "train.log").read_text()


def test_snapshots_follow_the_stage1_length_and_impossible_counts_fail_before_training(tmp_path):
    auto = SYNTH + ["boost.snapshots.enabled=true", "boost.dim_reduce.n_components=8", "boost.snapshots.keep=10",
                    "train.epochs=1.5"]  # 16 steps an epoch: 24 steps for 10 snapshots
    api.train_config(load_config("mnist", auto), tmp_path / "a")
    assert len(boost.list_snapshots(tmp_path / "a" / "snapshots")) == 10
    r = run_cli("train", *sets(*auto, "train.epochs=0.25"), "--run-dir", str(tmp_path / "b"))  # 4 steps: 5 snapshots at most
    assert r.returncode == 2 and r.stderr.startswith("error: boost.snapshots: 5 snapshot(s) over steps 0..4")
    assert not list((tmp_path / "b").glob("checkpoints/*.pt")) and "epoch 1 step" not in (tmp_path / "b" / "train.log").read_text()


def test_failed_search_skip_takes_no_subspace_step():
    torch.manual_seed(2)
    lin = nn.Linear(5, 3)
    params = list(lin.parameters())
    P = boost.fit_pca(torch.randn(10, sum(p.numel() for p in params)), 4)
    dr = boost.DimReduce(params, P, SimpleNamespace(rho=0.55, sigma=0.4, gamma=0.9, alpha=0.0, max_search=3,
                                                    failed_search="skip"))
    for p in params:
        p.grad = torch.randn_like(p)
    before = boost.flat_params(params).clone()
    out = dr.step(1.0, lambda: float("inf"))
    assert out["t"] == 0.0 and not out["accepted"] and torch.equal(boost.flat_params(params), before)
