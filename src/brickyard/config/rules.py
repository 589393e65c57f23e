"""The config's rules across sections: each a small function of the sections it names, registered with
``@across(...)`` and run by ``Config.check`` after every section has checked itself.

``RULES`` runs in the order the rules are written here, which is the order of precedence where one
mistake breaks two of them (``dist.strategy: fsdp`` with ``boost.dim_reduce`` and ``dist.mode: ps`` is
named by the FSDP rule). A new way of training adds its rules here, naming the sections each reads.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from brickyard.errors import ConfigError


@dataclass(frozen=True)
class Rule:
    """A check that reads the config ``sections`` named (``Config`` field names), given in that order."""
    sections: tuple[str, ...]
    check: Callable[..., None]

    def __call__(self, cfg) -> None:
        self.check(*(getattr(cfg, name) for name in self.sections))


RULES: list[Rule] = []


def across(*sections: str):
    """Register the decorated function as a rule of ``sections``, after those registered before it."""
    def register(check: Callable[..., None]) -> Callable[..., None]:
        RULES.append(Rule(sections, check))
        return check
    return register


@across("model", "finetune")
def whiten_or_init_from(model, finetune) -> None:
    if model.whiten and finetune.init_from:
        raise ConfigError(f"model.whiten sets the first convolution from the data and finetune.init_from loads it from "
                          f"{finetune.init_from}; choose one.")


@across("data", "train")
def global_batch_splits_into_accumulation(data, train) -> None:
    g, accum = data.global_batch_size, train.grad_accum
    if g and g % accum:
        raise ConfigError(f"data.global_batch_size: {g} is not divisible by train.grad_accum ({accum}); "
                          f"each accumulation step takes an equal share.")


@across("boost", "train")
def dim_reduce_takes_one_batch_a_step(boost, train) -> None:
    if boost.dim_reduce.enabled and train.grad_accum != 1:
        raise ConfigError("boost.dim_reduce works with train.grad_accum: 1 (the line search needs one batch per step).")


@across("boost")  # boost's own rule, here to come after the one above when dim_reduce is on, as it always has
def more_snapshots_than_components(boost) -> None:
    snap, dr = boost.snapshots, boost.dim_reduce
    if (dr.enabled or snap.enabled) and not dr.pca_path and snap.keep <= dr.n_components:
        raise ConfigError(f"boost.snapshots.keep: {snap.keep} must exceed boost.dim_reduce.n_components "
                          f"({dr.n_components}); PCA needs more snapshots than components.")


@across("dist", "boost", "train")
def fsdp_alone(dist, boost, train) -> None:
    """What ``dist.strategy: fsdp`` does not combine with (each needs the whole model on every rank)."""
    if dist.strategy != "fsdp":
        return
    other = [(on, key) for on, key in (
        (dist.mode == "ps", "dist.mode: ps (the servers hold the parameters)"),
        (boost.dim_reduce.enabled or boost.snapshots.enabled,
         "boost (its snapshots and subspace are of the whole parameter vector)"),
        (dist.grad_sync != "auto", f"dist.grad_sync: {dist.grad_sync} (FSDP syncs the gradients itself)"),
        (dist.sync_bn, "dist.sync_bn"),
        (bool(train.watch) or bool(train.histograms_every), "train.watch and train.histograms_every (they read whole weights)"),
    ) if on]
    if other:
        raise ConfigError(f"dist.strategy: fsdp does not combine with {other[0][1]}; use dist.strategy: ddp for it.")


@across("boost", "dist")
def dim_reduce_is_collective(boost, dist) -> None:
    if boost.dim_reduce.enabled and dist.mode == "ps":
        raise ConfigError("boost.dim_reduce runs in the collective mode (dist.mode: collective).")


@across("train", "schedule")
def swa_rate_needs_the_schedule(train, schedule) -> None:
    if train.swa.start and train.swa.lr and schedule.name == "none":
        raise ConfigError("train.swa.lr sets the rate through brickyard's schedule, and schedule.name: none leaves the "
                          "rates to your own scheduler; set train.swa.lr: 0 (averaging alone) or choose a schedule.")


@across("train", "dist")
def swa_is_collective(train, dist) -> None:
    if train.swa.start and dist.mode == "ps":
        raise ConfigError("train.swa runs in the collective mode (dist.mode: collective): the servers hold the weights.")


@across("train", "dist")
def synchronous_ps_runs_to_the_end(train, dist) -> None:
    stops = [k for k, on in (("train.early_stopping", train.early_stopping), ("train.max_time_s", train.max_time_s)) if on]
    if stops and dist.mode == "ps" and dist.ps.sync:
        raise ConfigError(f"{stops[0]}: a synchronous parameter-server run cannot stop before its last step yet; "
                          f"use dist.mode: collective.")


@across("dist", "boost", "train", "data", "optim")
def pipeline_alone(dist, boost, train, data, optim) -> None:
    """What ``dist.pipeline.stages`` above 1 does not combine with, and the batch its microbatches cut."""
    p = dist.pipeline
    if p.split and len(p.split) != p.stages - 1:
        raise ConfigError(f"dist.pipeline.split names {len(p.split)} module(s) and dist.pipeline.stages is {p.stages}; "
                          f"name stages - 1 = {p.stages - 1} split points.")
    if p.stages == 1:
        return
    other = [key for on, key in (
        (dist.mode == "ps", "dist.mode: ps (the servers hold the whole model)"),
        (boost.dim_reduce.enabled or boost.snapshots.enabled, "boost (its snapshots and subspace are of the whole parameter vector)"),
        (train.grad_accum != 1, f"train.grad_accum: {train.grad_accum} (the microbatches are the accumulation)"),
        (bool(train.ema), "train.ema (each stage would average and save its own weights only)"),
        (bool(train.swa.start), "train.swa (each stage would average and save its own weights only)"),
        (bool(optim.l1), "optim.l1 (the pipeline's step adds no penalty yet)"),
        (dist.sync_bn, "dist.sync_bn (its statistics would span every stage's processes)"),
    ) if on]
    if other:
        raise ConfigError(f"dist.pipeline.stages: {p.stages} does not combine with {other[0]}.")
    # a device's batch, when the config fixes it (a global batch is shared by the pipelines: the way checks it); auto
    # takes a divisor of it
    m = p.microbatch_count()
    if p.microbatches != "auto" and isinstance(data.batch_size, int) and not data.global_batch_size and data.batch_size % m:
        raise ConfigError(f"dist.pipeline.microbatches: {m} does not divide a device's batch (data.batch_size: "
                          f"{data.batch_size}); choose a divisor of it.")


@across("dist", "boost", "train", "optim")
def tensor_parallel_alone(dist, boost, train, optim) -> None:
    """What ``dist.tensor_parallel`` above 1 does not combine with (yet, or at all)."""
    if dist.tensor_parallel == 1:
        return
    other = [key for on, key in (
        (dist.mode == "ps", "dist.mode: ps (the servers hold the whole model)"),
        (boost.dim_reduce.enabled or boost.snapshots.enabled, "boost (its snapshots and subspace are of the whole parameter vector)"),
        (dist.strategy == "fsdp", "dist.strategy: fsdp (FSDP around tensor-parallel groups, or beside them in a "
                                   "pipeline's stages, is not built yet)"),
        (dist.grad_sync != "auto", f"dist.grad_sync: {dist.grad_sync} (the split layers sync inside their passes; nothing follows)"),
        (dist.sync_bn, "dist.sync_bn (every rank normalises the same whole batch already)"),
        (bool(train.watch) or bool(train.histograms_every), "train.watch and train.histograms_every (they read whole weights)"),
        (bool(optim.l1), "optim.l1 (its penalty sums whole weights)"),
    ) if on]
    if other:
        raise ConfigError(f"dist.tensor_parallel: {dist.tensor_parallel} does not combine with {other[0]}.")
