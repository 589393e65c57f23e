"""Dimension reduction, stage 2 (``boost.dim_reduce``): P-BFGS in the subspace of the weights the first
stage's snapshots span replaces the optimiser (``boost.dim_reduce``); the ranks' gradients meet as in
collective data parallel."""
from __future__ import annotations

from brickyard.boost import dim_reduce as boost
from brickyard.boost.callbacks import Snapshotting, Stage2Log
from brickyard.training import device as dev
from brickyard.training.ways.collective import Collective


def trainable(model) -> list:
    """(name, parameter) of what the optimiser trains: the order of boost's snapshots and subspace."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class DimReduceWay(Collective):
    name = "ddp"

    def capture_refusal(self) -> str | None:
        return "dim_reduce trains in a subspace with its own update, which is not captured"

    def update(self, run, param_groups, loss_sum, scaler, group, messages):
        cfg, named = self.cfg, trainable(run.model)
        P = boost.resolve_subspace(cfg, run.run_dir, [n for n, _ in named], sum(p.numel() for _, p in named), run.log)
        how = boost.method_settings(cfg.boost.dim_reduce)
        run.log.info(f"dimension-reduction stage 2 ({how.method}: rho {how.rho:g}, up to {how.max_search} step sizes, "
                     f"alpha {how.alpha:g}): {boost.p_memory(P.shape)}; the optimiser is replaced by P-BFGS")
        return boost.DimReduceUpdate(boost.DimReduce([p for _, p in named], P, boost.method_settings(cfg.boost.dim_reduce)),
                                     loss_sum, lambda: dev.autocast(run.device, run.precision), group)

    def callbacks(self, run, update, writer):
        return [Stage2Log(update.booster.stats, writer)]



def snapshot_callbacks(cfg, run) -> list:
    """Stage 1 (``boost.snapshots``): the weights saved as ordinary training goes, for stage 2's subspace."""
    b = cfg.boost
    if not b.snapshots.enabled:
        return []
    named = trainable(run.model)
    snaps = boost.Snapshots(boost.snapshot_dir(cfg, run.run_dir), b.snapshots.keep, [n for n, _ in named],
                            b.snapshots.include_init) if run.is_main else None
    return [Snapshotting(snaps, b.snapshots, b.dim_reduce.n_components, [p for _, p in named])]
