"""Dimension-reduction training (MindSpore Boost's "dim_reduce"; Li et al., TPAMI 2022).

Stage 1 trains normally and saves *snapshots* of the flattened trainable parameters (batch-norm
running statistics are buffers, not parameters, so they are not included). The subspace is the
span of the top ``n_components`` principal directions of the centred N x M snapshot matrix,
found with a randomized SVD (``torch.svd_lowrank``: never an M x M matrix). ``P`` (n x M) has
orthonormal rows.

Stage 2, each step (``DimReduce.step``), with g the full gradient (already averaged across ranks
by DDP) and L0 the loss averaged across ranks:

1. gk = P g; from the second step on, y = gk - g_prev, s = the last low-dim step that passed the
   line search, and when y.s > 1e-20 the inverse-Hessian estimate B (n x n, starts as I) gets a
   BFGS update; g_prev = gk.
2. d = -B gk, dn = P^T d.
3. Armijo backtracking on the same batch: t = 1, rho, rho^2 (``max_search`` = 3 tries, as the
   reference); the first t with L(w + t dn) < L0 + sigma t gk.d passes and sets s = t d. When none
   passes, the last t (rho^2) is taken all the same and s keeps the last step that passed (the
   reference, ``DimReduce._line_search`` / ``_find_rho``). Trial forwards run in training mode and
   restore batch-norm statistics afterwards.
4. Residual momentum outside the subspace: m = gamma m + (g - P^T P g).
5. w = w + t dn - alpha m.

Data parallel: every rank holds the same P, B, g_prev, s and m and computes the same
low-dimensional quantities from the same averaged gradient; what is communicated per step is
DDP's gradient all-reduce plus one all-reduce of a scalar loss per trial point (and one for L0).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from brickyard.distributed import process as dist
from brickyard.distributed.flat import flat_grads
from brickyard.distributed.flat import flatten as flat_params
from brickyard.distributed.flat import load_flat as set_flat
from brickyard.errors import CheckpointError, ConfigError
from brickyard.optim.updates import Update
from brickyard.tools.memory import fmt
from brickyard.training.checkpoint import read, save_atomic

_SNAP = re.compile(r"^snap-(\d+)\.pt$")


# ---------------------------------------------------------------------------------------------
# Stage 1: snapshots


class Snapshots:
    """Saves ``snap-<step>.pt`` (one flat float32 vector and the parameter names) and keeps the last N."""

    def __init__(self, folder: Path, keep: int, names: list[str]):
        self.folder, self.keep, self.names = Path(folder), keep, names

    def save(self, step: int, params) -> None:
        save_atomic({"step": step, "names": self.names, "w": flat_params(params).float().cpu()}, self.folder / f"snap-{step:07d}.pt")
        for old in self.files()[:-self.keep]:
            old.unlink(missing_ok=True)

    def files(self) -> list[Path]:
        return list_snapshots(self.folder)


def list_snapshots(folder: Path) -> list[Path]:
    if not Path(folder).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(folder).iterdir() if (m := _SNAP.match(p.name))]
    return [p for _, p in sorted(found)]


# ---------------------------------------------------------------------------------------------
# The subspace


def fit_pca(matrix: torch.Tensor, n_components: int, seed: int = 0) -> torch.Tensor:
    """Top principal directions (rows, orthonormal) of the centred N x M ``matrix``."""
    n_snap = matrix.shape[0]
    if n_snap <= n_components:
        raise ConfigError(f"boost: {n_snap} snapshots cannot give {n_components} components; "
                          f"boost.snapshots.keep (and the snapshots taken) must exceed boost.dim_reduce.n_components.")
    centred = matrix - matrix.mean(0, keepdim=True)
    torch.manual_seed(seed)
    _, _, v = torch.svd_lowrank(centred, q=min(n_components + 8, n_snap), niter=4, M=None)
    p = v[:, :n_components].T.contiguous()
    q, _ = torch.linalg.qr(p.T)  # re-orthonormalise against round-off
    return q.T.contiguous()


def pca_from_snapshots(folder: Path, n_components: int, names: list[str]) -> dict:
    files = list_snapshots(folder)
    if not files:
        raise ConfigError(f"boost: no snapshots in {folder}; train stage 1 with boost.snapshots first.")
    rows = []
    for f in files:
        s = read(f, "snapshot")
        if not isinstance(s, dict) or "w" not in s:
            raise CheckpointError(f"snapshot {f} is not a brickyard snapshot (no 'w' entry).")
        if s.get("names") != names:
            raise CheckpointError(f"snapshot {f} was taken of other parameters than this model's.")
        rows.append(s["w"])
    return {"P": fit_pca(torch.stack(rows), n_components), "names": names, "snapshots": len(files)}


def save_pca(pca: dict, path: Path) -> None:
    save_atomic({"P": pca["P"], "names": pca["names"], "snapshots": pca.get("snapshots", 0)}, Path(path))


def load_pca(path: Path, names: list[str], size: int) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"boost.dim_reduce.pca_path: {path} does not exist.")
    d = read(path, "boost.dim_reduce.pca_path:")
    if not isinstance(d, dict) or "P" not in d:
        raise CheckpointError(f"boost.dim_reduce.pca_path: {path} is not a subspace written by brickyard boost (no 'P' entry).")
    if d.get("names") != names:
        raise CheckpointError(f"{path}: the subspace was computed for other parameters (order or names differ from this model's).")
    if d["P"].shape[1] != size:
        raise CheckpointError(f"{path}: P has {d['P'].shape[1]} columns, the model has {size} trainable values.")
    return d["P"]


# ---------------------------------------------------------------------------------------------
# Stage 2


def bn_state(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, saved copy) of every batch-norm statistic, to restore after trial forwards."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            for b in (m.running_mean, m.running_var, m.num_batches_tracked):
                if b is not None:
                    out.append((b, b.detach().clone()))
    return out


def bfgs_update(B: torch.Tensor, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Inverse-Hessian BFGS update; B unchanged unless the curvature condition y.s > 1e-20 holds."""
    ys = float(y @ s)
    if ys <= 1e-20:
        return B
    rho = 1.0 / ys
    left = torch.eye(len(s), device=s.device, dtype=B.dtype) - rho * torch.outer(s, y)
    return left @ B @ left.T + rho * torch.outer(s, s)


class DimReduce:
    """Stage 2, as MindSpore's ``boost.DimReduce`` does it (see the module docstring for the equations).

    ``failed_search: skip`` is brickyard's option, not the reference's: when no step size passes, no
    subspace step is taken (the residual momentum still moves). With the reference's ``take``, stage 2
    of the course network on MNIST diverged within 10 steps here (benchmarks/dim_reduce.py).

    Where this differs from the reference, on purpose: the parameters are updated directly
    (``w + t dn - alpha m``) instead of through an optimiser cell given ``-delta`` with rate 1 (the same
    arithmetic), and ``P`` is held whole on every rank instead of split by rows across ranks (the
    same ``gk``; one matrix-vector product instead of an all-gather)."""

    def __init__(self, params: list[torch.Tensor], P: torch.Tensor, cfg):
        self.params, self.cfg = params, cfg
        device = params[0].device
        self.P = P.to(device=device, dtype=torch.float32)
        n, m = self.P.shape
        self.B = torch.eye(n, device=device)
        self.g_prev: torch.Tensor | None = None
        self.s = torch.zeros(n, device=device)
        self.m = torch.zeros(m, device=device)
        self.stats = Stage2Stats()  # for the log; not part of the method's state

    @property
    def steps(self) -> int:
        return self.stats.total["steps"]

    @property
    def accepted(self) -> int:
        return self.stats.total["passed"]

    def state_dict(self) -> dict:
        return {"B": self.B, "g_prev": self.g_prev, "s": self.s, "m": self.m}

    def load_state_dict(self, state: dict) -> None:
        self.B = state["B"].to(self.B.device)
        self.g_prev = None if state["g_prev"] is None else state["g_prev"].to(self.B.device)
        self.s, self.m = state["s"].to(self.B.device), state["m"].to(self.m.device)

    def step(self, loss0: float, trial_loss) -> dict:
        """One stage-2 update; ``trial_loss()`` returns the rank-averaged loss at the current weights."""
        c = self.cfg
        g = flat_grads(self.params).float()
        gk = self.P @ g
        if self.g_prev is not None:  # BFGS with the last step that passed the test (s is kept otherwise)
            self.B = bfgs_update(self.B, self.s, gk - self.g_prev)
        self.g_prev = gk
        d = -(self.B @ gk)
        dn = self.P.T @ d
        slope = float(gk @ d)
        w0 = flat_params(self.params)
        sizes = [c.rho ** i for i in range(c.max_search)]
        t, passed, loss_at = sizes[-1], False, None
        for size in sizes:  # Armijo backtracking; when no size passes, the last one is taken all the same
            set_flat(self.params, w0 + size * dn)
            loss_at = trial_loss()
            if loss_at < loss0 + c.sigma * size * slope:
                t, passed = size, True
                self.s = size * d
                break
        if not passed and getattr(c, "failed_search", "take") == "skip":
            t, loss_at = 0.0, loss0  # brickyard's option, not the reference's: no subspace step on a failed search
        self.m = c.gamma * self.m + (g - self.P.T @ gk)
        set_flat(self.params, w0 + t * dn - c.alpha * self.m)
        self.stats.add(t, passed, loss0, loss_at)
        tries = sizes.index(t) + 1 if passed else len(sizes)
        return {"t": t, "tries": tries, "accepted": passed, "loss_before": loss0, "loss_after": loss_at}


class Stage2Stats:
    """Per epoch and in total: subspace steps, how many passed the Armijo test, the step sizes taken,
    and the mean loss before the step and at the subspace point it moved to."""

    def __init__(self):
        self.total = self._empty()
        self.epoch = self._empty()

    @staticmethod
    def _empty() -> dict:
        return {"steps": 0, "passed": 0, "sizes": {}, "loss_before": 0.0, "loss_after": 0.0}

    def add(self, t: float, passed: bool, before: float, after: float) -> None:
        for d in (self.total, self.epoch):
            d["steps"] += 1
            d["passed"] += int(passed)
            key = f"{t:.6g}"  # 0: a failed search skipped (failed_search: skip)
            d["sizes"][key] = d["sizes"].get(key, 0) + 1
            d["loss_before"] += before
            d["loss_after"] += after

    @staticmethod
    def summary(d: dict) -> dict:
        n = max(d["steps"], 1)
        return {"steps": d["steps"], "passed": d["passed"], "passed_fraction": round(d["passed"] / n, 4),
                "step_sizes": dict(d["sizes"]), "loss_before": d["loss_before"] / n, "loss_after": d["loss_after"] / n}

    def end_epoch(self) -> dict:
        out, self.epoch = self.summary(self.epoch), self._empty()
        return out


def make_trial_loss(model: nn.Module, x, y, n_global: int, loss_sum, autocast, group=None):
    """The rank-averaged training-mode loss of ``model`` on this batch, batch-norm statistics restored;
    ``loss_sum(outputs, targets)`` is the run's summed loss."""

    def trial() -> float:
        saved = bn_state(model)
        with torch.no_grad(), autocast():
            loss = loss_sum(model(x), y)
        for buf, copy in saved:
            buf.copy_(copy)
        total = dist.all_reduce_sum(loss.detach().double().reshape(1), group)
        return float(total) / n_global
    return trial


def p_memory(P_shape) -> str:
    n, m = P_shape
    return f"P is {n} x {m:,} float32 = {fmt(4 * n * m)}"


def snapshot_dir(cfg, run_dir: Path) -> Path:
    return Path(cfg.boost.dim_reduce.snapshots_dir) if cfg.boost.dim_reduce.snapshots_dir else Path(run_dir) / "snapshots"


def resolve_subspace(cfg, run_dir: Path, names: list[str], size: int, log) -> torch.Tensor:
    dr = cfg.boost.dim_reduce
    if dr.pca_path:
        return load_pca(Path(dr.pca_path), names, size)
    folder = snapshot_dir(cfg, run_dir)
    pca = pca_from_snapshots(folder, dr.n_components, names)
    out = Path(run_dir) / "pca.pt"
    if dist.from_env().is_main:
        save_pca(pca, out)
    log.info(f"subspace: top {dr.n_components} principal directions of {pca['snapshots']} snapshots in {folder}; saved {out}")
    return pca["P"]


class DimReduceUpdate(Update):
    """Stage 2 of dimension-reduction training as the step's update: P-BFGS in the subspace (``DimReduce``)."""

    def __init__(self, booster: DimReduce, loss_sum, autocast, group=None):
        self.booster, self.loss_sum, self.autocast, self.group = booster, loss_sum, autocast, group

    def __call__(self, run, loss_sum, batch) -> None:
        x, y, n_global = batch
        # the method needs the loss on the host every step: one scalar all-reduce
        loss0 = float(dist.all_reduce_sum(loss_sum.detach().double().reshape(1), self.group)) / n_global
        self.booster.step(loss0, make_trial_loss(run.model, x, y, n_global, self.loss_sum, self.autocast, self.group))

    def describe(self) -> str:
        return f", subspace steps that passed the Armijo test {self.booster.accepted}/{self.booster.steps}"

    def state_dict(self) -> dict | None:
        return self.booster.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.booster.load_state_dict(state)
