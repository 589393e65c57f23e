"""Dimension-reduction training (Li et al., "Low Dimensional Trajectory Hypothesis is True: DNNs can be
Trained in Tiny Subspaces", TPAMI 2022), in two implementations of stage 2, each as its source does it.

Stage 1 trains normally and saves *snapshots* of the flattened trainable parameters (batch-norm
running statistics are buffers, not parameters, so they are not included). The subspace is the
span of the top ``n_components`` principal directions of the centred N x M snapshot matrix,
found with a randomized SVD (``torch.svd_lowrank``: never an M x M matrix). ``P`` (n x M) has
orthonormal rows.

Stage 2 replaces the optimiser. Each step, with g the full gradient (averaged across ranks) and L0
the batch loss (averaged across ranks, exactly), gk = P g, d = -B gk (B: the n x n inverse-Hessian
estimate, starting as I), BFGS updates of B from the pair (s, y = gk - g_prev) when y.s > 1e-20, an
Armijo line search on the same batch (L(w + t P^T d) < L0 + sigma t gk.d), and residual momentum
outside the subspace, m = gamma m + (g - P^T gk); the weights move to w + t P^T d - alpha m. The two
methods differ in the line search and in what a failed search leaves behind:

``method: mindspore`` — MindSpore's ``mindspore/python/mindspore/boost/dim_reduce.py`` (read at commit
92e3ba5f): ``_set_rho_list`` sets ``max_search_time = 2`` and ``rho_list = [1, rho, 0]``, so the sizes 1
and rho (0.55) are tried; ``_line_search`` starts from ``rho_list[-1]``, which is 0: when neither passes,
**no subspace step is taken** (the residual-momentum part of the update still happens). ``construct``
saves ``gk_last`` and ``bk`` before the BFGS update (``gk_last_back``, ``bk_back``) and puts them back
``if not find``; ``_find_rho`` writes ``sk`` only when a size passes. ``_apply_quasi_newton_update``
skips the BFGS update on the first step (``gk_last_init``) and then sets ``gk_last = gk``. Defaults:
rho 0.55, sigma 0.4, gamma 0.9, alpha 0.001. Another revision of the file (commit 38b2d942) tries 1,
rho, rho^2, takes rho^2 when none passes and keeps the BFGS update; brickyard 0.1 followed that one,
and its stage 2 diverged on small nets (non-finite within 10 steps: docs/benchmarks.md).

``method: dldr`` — the paper authors' ``train_pbfgs.py`` (GitHub nblt/DLDR, ``P_plus_BFGS``, and
``run.sh``): backtracking with rho 0.4 up to ``search_times_MAX = 20`` times; ``sk`` is the step
actually taken (``sk *= rho`` per backtrack; when no size passes, rho^20 d is taken); ``gk_last = gk``
every step; BFGS whenever y.s > 1e-20; ``alpha`` 0 (``--alpha`` default), gamma 0.9, sigma 0.4. Stage 2
may start from the initial weights (``--params_start 0``: the PCA includes ``0.pt``, the initial
weights), with a batch of its own (``run.sh``: 1024 for CIFAR).

Deliberate differences, both methods: the parameters are updated directly (``w + t dn - alpha m``)
instead of through an optimiser at rate 1 given the negated step (the same arithmetic: MindSpore's
``AutoBoost.network_auto_process_train`` in ``boost/boost.py`` puts ``SGD(network.trainable_params(),
learning_rate=1)`` in place of the user's optimiser; DLDR builds ``optim.SGD(lr=1, momentum=0)``); ``P`` is held whole
on every rank instead of split by rows across ranks (the same ``gk``; one matrix-vector product
instead of an all-gather); trial forwards run in training mode and restore batch-norm statistics
afterwards (DLDR reloads the whole state dict, MindSpore's cell does not touch them); the loss is
averaged across ranks by exact division — MindSpore's multi-device path computes
``allreduce(loss) // rank_size``, a floor division on both sides of the Armijo test, which looks like a
bug rather than a design (it rounds a loss of 0.7 to 0.0) and is not copied.

Data parallel: every rank holds the same P, B, g_prev, s and m and computes the same low-dimensional
quantities from the same averaged gradient; what is communicated per step is the gradient all-reduce
plus one all-reduce of a scalar loss per trial point (and one for L0).
"""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from brickyard.distributed import process as dist
from brickyard.distributed.flat import flat_grads
from brickyard.distributed.flat import flatten as flat_params
from brickyard.distributed.flat import load_flat as set_flat
from brickyard.errors import CheckpointError, ConfigError
from brickyard.files import read_torch, write_torch
from brickyard.models import bn_state, restore_bn_state
from brickyard.observe.metrics import fmt
from brickyard.optim.updates import Update

_SNAP = re.compile(r"^snap-(\d+)\.pt$")


# ---------------------------------------------------------------------------------------------
# Stage 1: snapshots


class Snapshots:
    """Saves ``snap-<step>.pt`` (one flat float32 vector and the parameter names) and keeps the last N;
    with ``keep_init`` the initial weights' snapshot (step 0) is kept besides them."""

    def __init__(self, folder: Path, keep: int, names: list[str], keep_init: bool = False):
        self.folder, self.keep, self.names, self.keep_init = Path(folder), keep, names, keep_init

    def save(self, step: int, params) -> None:
        write_torch({"step": step, "names": self.names, "w": flat_params(params).float().cpu()}, self.folder / f"snap-{step:07d}.pt")
        rolling = [f for f in self.files() if not (self.keep_init and f.name == "snap-0000000.pt")]
        for old in rolling[:-self.keep]:
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
        s = read_torch(f, "snapshot")
        if not isinstance(s, dict) or "w" not in s:
            raise CheckpointError(f"snapshot {f} is not a brickyard snapshot (no 'w' entry).")
        if s.get("names") != names:
            raise CheckpointError(f"snapshot {f} was taken of other parameters than this model's.")
        rows.append(s["w"])
    return {"P": fit_pca(torch.stack(rows), n_components), "names": names, "snapshots": len(files)}


def save_pca(pca: dict, path: Path) -> None:
    write_torch({"P": pca["P"], "names": pca["names"], "snapshots": pca.get("snapshots", 0)}, Path(path))


def load_pca(path: Path, names: list[str], size: int) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"boost.dim_reduce.pca_path: {path} does not exist.")
    d = read_torch(path, "boost.dim_reduce.pca_path:")
    if not isinstance(d, dict) or "P" not in d:
        raise CheckpointError(f"boost.dim_reduce.pca_path: {path} is not a subspace written by brickyard boost (no 'P' entry).")
    if d.get("names") != names:
        raise CheckpointError(f"{path}: the subspace was computed for other parameters (order or names differ from this model's).")
    if d["P"].shape[1] != size:
        raise CheckpointError(f"{path}: P has {d['P'].shape[1]} columns, the model has {size} trainable values.")
    return d["P"]


# ---------------------------------------------------------------------------------------------
# Stage 2


def bfgs_update(B: torch.Tensor, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Inverse-Hessian BFGS update; B unchanged unless the curvature condition y.s > 1e-20 holds."""
    ys = float(y @ s)
    if ys <= 1e-20:
        return B
    rho = 1.0 / ys
    left = torch.eye(len(s), device=s.device, dtype=B.dtype) - rho * torch.outer(s, y)
    return left @ B @ left.T + rho * torch.outer(s, s)


METHODS = {  # each source's defaults (module docstring)
    "mindspore": {"rho": 0.55, "alpha": 0.001, "max_search": 2},
    "dldr": {"rho": 0.4, "alpha": 0.0, "max_search": 20},
}


def method_settings(dr) -> SimpleNamespace:
    """``boost.dim_reduce`` with the method's defaults filled in where a key is left unset (None)."""
    base = METHODS[dr.method]
    pick = {k: (getattr(dr, k) if getattr(dr, k) is not None else v) for k, v in base.items()}
    return SimpleNamespace(method=dr.method, sigma=dr.sigma, gamma=dr.gamma, **pick)


class DimReduce:
    """Stage 2: P-BFGS in the subspace, as ``method`` (``mindspore`` or ``dldr``) does it; the module
    docstring states both and the source lines they follow. ``cfg`` has ``method``, ``rho``, ``sigma``,
    ``gamma``, ``alpha`` and ``max_search`` (``method_settings``)."""

    def __init__(self, params: list[torch.Tensor], P: torch.Tensor, cfg):
        self.params, self.cfg = params, cfg
        device = params[0].device
        self.P = P.to(device=device, dtype=torch.float32)
        n, m = self.P.shape
        self.B = torch.eye(n, device=device)
        self.g_prev = torch.zeros(n, device=device)  # MindSpore's gk_last starts at zeros
        self.started = False                         # MindSpore's gk_last_init; DLDR's gk_last is not None
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
        return {"B": self.B, "g_prev": self.g_prev, "started": self.started, "s": self.s, "m": self.m,
                "method": self.cfg.method}

    def load_state_dict(self, state: dict) -> None:
        dev = self.B.device
        self.B, self.s, self.m = state["B"].to(dev), state["s"].to(dev), state["m"].to(dev)
        self.g_prev = state["g_prev"].to(dev) if state.get("g_prev") is not None else torch.zeros_like(self.s)
        self.started = bool(state.get("started", state.get("g_prev") is not None))

    def step(self, loss0: float, trial_loss) -> dict:
        """One stage-2 update; ``trial_loss()`` returns the rank-averaged loss at the current weights."""
        g = flat_grads(self.params).float()
        gk = self.P @ g
        w0 = flat_params(self.params)
        search = self._mindspore if self.cfg.method == "mindspore" else self._dldr
        t, passed, tries, loss_at = search(gk, w0, loss0, trial_loss)
        self.m = self.cfg.gamma * self.m + (g - self.P.T @ gk)
        set_flat(self.params, w0 + self.P.T @ (t * self._d) - self.cfg.alpha * self.m)
        self.stats.add(t, passed, loss0, loss_at)
        return {"t": t, "tries": tries, "accepted": passed, "loss_before": loss0, "loss_after": loss_at}

    def _mindspore(self, gk, w0, loss0, trial_loss):
        """``construct`` / ``_line_search`` / ``_find_rho`` / ``_apply_quasi_newton_update``: sizes 1 and rho;
        none passing takes t = 0 and puts B and the previous gradient back; s is written on a pass only."""
        c = self.cfg
        g_prev_back, B_back = self.g_prev.clone(), self.B.clone()
        if self.started:
            self.B = bfgs_update(self.B, self.s, gk - self.g_prev)
        self.started = True
        self.g_prev = gk
        d = self._d = -(self.B @ gk)
        dn, slope = self.P.T @ d, float(gk @ d)
        for i in range(c.max_search):
            size = c.rho ** i
            set_flat(self.params, w0 + size * dn)
            loss_at = trial_loss()
            if loss0 + c.sigma * size * slope > loss_at:
                self.s = size * d
                return size, True, i + 1, loss_at
        self.g_prev, self.B = g_prev_back, B_back
        return 0.0, False, c.max_search, loss0

    def _dldr(self, gk, w0, loss0, trial_loss):
        """``P_plus_BFGS``: backtracking by rho up to ``max_search`` times; s is the step taken (rho^max_search
        d when none passes); the previous gradient moves every step."""
        c = self.cfg
        if self.started:
            self.B = bfgs_update(self.B, self.s, gk - self.g_prev)
        self.started = True
        self.g_prev = gk
        d = self._d = -(self.B @ gk)
        dn, descent, size = self.P.T @ d, float(gk @ d), 1.0
        for i in range(c.max_search):
            set_flat(self.params, w0 + size * dn)
            loss_at = trial_loss()
            if loss_at < loss0 + c.sigma * descent:
                self.s = size * d
                return size, True, i + 1, loss_at
            descent *= c.rho
            size *= c.rho
        self.s = size * d
        return size, False, c.max_search, loss0


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
            key = f"{t:.6g}"  # 0: mindspore's failed search, no subspace step
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
        restore_bn_state(saved)
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
