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
from brickyard.config import load_config
from brickyard.training import checkpoint
from brickyard.training.step import make_loss_sum
from conftest import SYNTH, run_cli, sets


@pytest.mark.fast
def test_subspace_bfgs_with_exact_line_search_converges_in_n_plus_1_steps():
    torch.manual_seed(0)
    n = 6
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64))
    A = q @ torch.diag(torch.linspace(0.5, 20, n, dtype=torch.float64)) @ q.T
    w_star = torch.randn(n, dtype=torch.float64)
    w = torch.zeros(n, dtype=torch.float64)
    B, s, g_prev = torch.eye(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), None
    for k in range(n + 1):  # noqa: B007 (the assertion after the loop reads k)
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


@pytest.mark.fast
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


def _numpy_mindspore(w, P, loss, grad, steps, rho=0.55, sigma=0.4, gamma=0.9, alpha=0.001):
    """MindSpore's ``boost/dim_reduce.py`` (commit 92e3ba5f), transcribed line by line in NumPy: column
    vectors as there, ``rho_list = [1, rho, 0]``, ``optimizer(x)`` is SGD at rate 1 (``w - x``)."""
    n = P.shape[0]
    gk_last, gk_last_init, bk, sk = np.zeros((n, 1)), False, np.eye(n), np.zeros((n, 1))
    grad_res_momentum = np.zeros_like(w)
    rho_list, max_search_time = [rho ** 0, rho ** 1, 0.0], 2
    ws, ts = [], []
    for _ in range(steps):
        old_grad, old_loss = grad(w), loss(w)
        gk = P @ old_grad.reshape(-1, 1)
        gk_last_back, bk_back = gk_last.copy(), bk.copy()
        if gk_last_init:  # _apply_quasi_newton_update
            yk = gk - gk_last
            g = (yk.T @ sk).item()
            if g > 1e-20:
                pk = 1.0 / g
                t1 = np.eye(n) - (pk * yk) @ sk.T
                bk = t1.T @ bk @ t1 + (pk * sk) @ sk.T
        else:
            gk_last_init = True
        gk_last = gk
        dk = -bk @ gk
        dn = (P.T @ dk).reshape(-1)
        res, find = rho_list[-1], False  # _line_search
        for i in range(max_search_time):
            r = rho_list[i]
            new_loss = loss(w - (-r * dn))  # _find_rho: optimizer(sn), sn = -rho dn
            if old_loss + sigma * r * (gk.T @ dk).item() > new_loss:
                sk, find, res = r * dk, True, r
                break
        if not find:
            gk_last, bk = gk_last_back, bk_back
        grad_proj = (P.T @ gk).reshape(-1)  # _res_loss
        grad_res_momentum = gamma * grad_res_momentum + old_grad - grad_proj
        w = w - (alpha * grad_res_momentum - res * dn)
        ws.append(w)
        ts.append(res)
    return ws, ts


def _numpy_dldr(w, P, loss, grad, steps, rho=0.4, sigma=0.4, gamma=0.9, alpha=0.0, search_times_max=20):
    """The authors' ``train_pbfgs.py`` ``P_plus_BFGS`` (nblt/DLDR), transcribed in NumPy."""
    n = P.shape[0]
    Bk, sk, gk_last, grad_res_momentum = np.eye(n), None, None, 0
    ws, ts = [], []
    for _ in range(steps):
        g, oldf = grad(w), loss(w)
        gk = P @ g.reshape(-1, 1)
        grad_res = g - (P.T @ gk).reshape(-1)
        if gk_last is not None:
            yk = gk - gk_last
            gg = (yk.T @ sk).item()
            if gg > 1e-20:
                pk = 1.0 / gg
                t1 = np.eye(n) - (pk * yk) @ sk.T
                Bk = t1.T @ Bk @ t1 + (pk * sk) @ sk.T
        gk_last = gk
        dk = -Bk @ gk
        m, descent, sk, size = 0, (gk.T @ dk).item(), dk.copy(), 1.0
        while m < search_times_max:
            newf = loss(w + (P.T @ sk).reshape(-1))
            if newf < oldf + sigma * descent:
                break
            m, descent, sk, size = m + 1, descent * rho, sk * rho, size * rho
        grad_res_momentum = grad_res_momentum * gamma + grad_res
        w = w + (P.T @ sk).reshape(-1) - alpha * grad_res_momentum
        ws.append(w)
        ts.append(size)
    return ws, ts


def _problem(kind, rng, M):
    if kind == "quadratic":
        Q = np.linalg.qr(rng.normal(size=(M, M)))[0]
        A, b = Q @ np.diag(np.linspace(0.5, 2.5, M)) @ Q.T, rng.normal(size=M)  # both methods meet each branch
        return (lambda w: 0.5 * w @ A @ w - b @ w), (lambda w: A @ w - b)
    X, y = rng.normal(size=(60, M)), (rng.random(60) < 0.5).astype(float) * 2 - 1
    return (lambda w: np.mean(np.logaddexp(0.0, -y * (X @ w)))), (lambda w: X.T @ (-y / (1 + np.exp(y * (X @ w)))) / len(y))


@pytest.mark.parametrize("method", ["mindspore", "dldr"])
@pytest.mark.parametrize("problem", ["quadratic", "logistic"])
@pytest.mark.fast
def test_stage2_follows_its_source_step_by_step(method, problem):
    rng = np.random.default_rng(3)
    M, n = 24, 5
    P = np.linalg.qr(rng.normal(size=(M, n)))[0].T  # n x M, orthonormal rows
    loss, grad = _problem(problem, rng, M)
    w0 = rng.normal(size=M) * (3.0 if problem == "quadratic" else 1.0)
    cfg = boost.method_settings(SimpleNamespace(method=method, rho=None, alpha=0.01, max_search=None, sigma=0.4, gamma=0.9))
    numpy_stage2 = _numpy_mindspore if method == "mindspore" else _numpy_dldr
    want, want_t = numpy_stage2(w0.copy(), P, loss, grad, 15, alpha=0.01)

    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float32))
    dr = boost.DimReduce([p], torch.tensor(P, dtype=torch.float32), cfg)
    got, got_t = [], []
    for _ in range(15):
        w = p.detach().double().numpy()
        p.grad = torch.tensor(grad(w), dtype=torch.float32)
        out = dr.step(float(loss(w)), lambda: float(loss(p.detach().double().numpy())))
        got.append(p.detach().double().numpy())
        got_t.append(out["t"])
    assert got_t == pytest.approx(want_t)
    for a, b_ in zip(got, want):
        assert np.abs(a - b_).max() < 1e-4 * (1 + np.abs(b_).max())  # float32 against float64
    if problem == "quadratic":  # the search's branches were met: a pass at 1, a backtrack, and (mindspore) a failure
        assert 1.0 in got_t and (0.0 in got_t if method == "mindspore" else min(got_t) < 0.4), got_t


def _linear_problem():
    torch.manual_seed(2)
    lin = nn.Linear(5, 3)
    params = list(lin.parameters())
    P = boost.fit_pca(torch.randn(10, sum(p.numel() for p in params)), 4)
    return params, P


@pytest.mark.fast
def test_mindspore_failed_search_takes_no_subspace_step_and_rolls_back():
    params, P = _linear_problem()
    cfg = boost.method_settings(SimpleNamespace(method="mindspore", rho=None, alpha=0.0, max_search=None, sigma=0.4, gamma=0.9))
    dr = boost.DimReduce(params, P, cfg)
    for p in params:
        p.grad = torch.randn_like(p)
    first = dr.step(1.0, lambda: -1e9)  # passes at t = 1
    for p in params:
        p.grad = torch.randn_like(p)
    second = dr.step(1.0, lambda: -1e9)  # passes again: B has had a BFGS update
    B, g_prev, s, w = dr.B.clone(), dr.g_prev.clone(), dr.s.clone(), boost.flat_params(params).clone()
    for p in params:
        p.grad = torch.randn_like(p)
    out = dr.step(1.0, lambda: float("inf"))  # no size passes
    assert first["accepted"] and second["accepted"] and not torch.equal(B, torch.eye(4))
    assert not out["accepted"] and out["tries"] == 2 and out["t"] == 0.0
    assert torch.equal(dr.B, B) and torch.equal(dr.g_prev, g_prev) and torch.equal(dr.s, s)  # as before the step
    assert torch.equal(boost.flat_params(params), w)  # t = 0 and alpha 0: nothing moved
    assert dr.stats.total["steps"] == 3 and dr.stats.total["passed"] == 2


@pytest.mark.fast
def test_dldr_failed_search_takes_the_smallest_step_and_remembers_it():
    params, P = _linear_problem()
    cfg = boost.method_settings(SimpleNamespace(method="dldr", rho=None, alpha=None, max_search=None, sigma=0.4, gamma=0.9))
    dr = boost.DimReduce(params, P, cfg)
    for p in params:
        p.grad = torch.randn_like(p)
    w = boost.flat_params(params).clone()
    out = dr.step(1.0, lambda: float("inf"))
    assert not out["accepted"] and out["tries"] == 20 and out["t"] == pytest.approx(0.4 ** 20)
    d = -(dr.B @ dr.g_prev)
    assert torch.allclose(dr.s, 0.4 ** 20 * d) and not torch.equal(boost.flat_params(params), w)


@pytest.mark.fast
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


@pytest.mark.parametrize("method", ["dldr", "mindspore"])
def test_stage2_two_processes_equal_one(tmp_path, method):
    base, s1 = _stage1(tmp_path, ["data.batch_size=64"])
    init = str(checkpoint.step_checkpoints(s1 / "checkpoints")[-1])
    stage2 = [s for s in base if not s.startswith("data.batch_size")] + [
        "train.epochs=2", "boost.dim_reduce.enabled=true", f"boost.dim_reduce.method={method}", f"boost.dim_reduce.snapshots_dir={s1 / 'snapshots'}", f"finetune.init_from={init}"]
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


@pytest.mark.fast
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
    assert sum(total["step_sizes"].values()) == 32 and set(total["step_sizes"]) <= {f"{0.4 ** i:.6g}" for i in range(21)}
    assert "% passed the Armijo test; step sizes" in (tmp_path / "s2" / "train.log").read_text()


def test_snapshots_follow_the_stage1_length_and_impossible_counts_fail_before_training(tmp_path):
    auto = SYNTH + ["boost.snapshots.enabled=true", "boost.dim_reduce.n_components=8", "boost.snapshots.keep=10",
                    "train.epochs=1.5"]  # 16 steps an epoch: 24 steps for 10 snapshots
    api.train_config(load_config("mnist", auto), tmp_path / "a")
    assert len(boost.list_snapshots(tmp_path / "a" / "snapshots")) == 10
    r = run_cli("train", *sets(*auto, "train.epochs=0.25"), "--run-dir", str(tmp_path / "b"))  # 4 steps: 5 snapshots at most
    assert r.returncode == 2 and r.stderr.startswith("error: boost.snapshots: 5 snapshot(s) over steps 0..4")
    assert not list((tmp_path / "b").glob("checkpoints/*.pt")) and "epoch 1 step" not in (tmp_path / "b" / "train.log").read_text()


@pytest.mark.parametrize("method", ["dldr", "mindspore"])
def test_the_boost_command_learns_with_either_method(tmp_path, method):
    """`brickyard boost dim-reduce` as a new user runs it: stage 2 ends finite, no worse than stage 1, and
    reports its steps per epoch in the log and metrics.jsonl."""
    sets_ = sets(*[s for s in SYNTH if not s.startswith("optim.lr")], "boost.dim_reduce.n_components=4",
                 "boost.snapshots.keep=10", f"boost.dim_reduce.method={method}")
    r = run_cli("boost", "dim-reduce", "mnist-course", *sets_, "--stage1-epochs", "1", "--stage2-epochs", "1",
                "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    acc = {line.split(":")[0]: float(line.split("test accuracy ")[1].split()[0])
           for line in r.stdout.splitlines() if line.startswith(("stage 1:", "stage 2:"))}
    assert acc["stage 2"] >= acc["stage 1"] - 0.02, acc
    summary = json.loads((tmp_path / "r" / "stage2" / "summary.json").read_text())
    assert summary["test_loss"] == summary["test_loss"] and summary["dim_reduce"]["steps"] == summary["steps"]
    rows = [json.loads(l) for l in (tmp_path / "r" / "stage2" / "metrics.jsonl").read_text().splitlines()]
    assert [r_["kind"] for r_ in rows].count("dim_reduce") == 1
    assert f"dimension-reduction stage 2 ({method}:" in (tmp_path / "r" / "stage2" / "train.log").read_text()


def test_the_boost_command_reads_the_snapshots_where_stage1_wrote_them(tmp_path):
    """A boost.dim_reduce.snapshots_dir of the user's: stage 1 writes there, so stage 2 reads there (it looked in
    stage1/snapshots and said there were none)."""
    sets_ = sets(*[s for s in SYNTH if not s.startswith("optim.lr")], "boost.dim_reduce.n_components=4",
                 "boost.snapshots.keep=10", f"boost.dim_reduce.snapshots_dir={tmp_path / 'snaps'}")
    r = run_cli("boost", "dim-reduce", "mnist-course", *sets_, "--stage1-epochs", "1", "--stage2-epochs", "1",
                "--run-dir", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    assert list((tmp_path / "snaps").glob("snap-*.pt")) and not (tmp_path / "r" / "stage1" / "snapshots").exists()
    assert f"snapshots in {tmp_path / 'snaps'}" in (tmp_path / "r" / "stage2" / "train.log").read_text()
