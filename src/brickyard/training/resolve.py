"""Everything a run decides before any part is built, decided once: the checks that need the data or the
model (before anything is written), the device's settings (``training.device.Host``), the batch size, the
batch plan, the step counts and the learning-rate schedule (``Plan``), the precision and whether to compile
(``training.loop`` puts them together in the ``Job``). The results are a frozen config and a frozen host;
nothing built later decides them again or writes them back.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from brickyard.callbacks import reduce_lr
from brickyard.callbacks.checkpointing import check_monitor
from brickyard.callbacks.trackers import check_reachable
from brickyard.config import Config
from brickyard.config.schema import loggers
from brickyard.data import balance
from brickyard.data.loaders import BatchPlan, check_readers, step_batch
from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError, ConfigError
from brickyard.observe.loggers import check as check_loggers
from brickyard.optim import Schedule
from brickyard.training import activation_checkpointing, memory
from brickyard.training.rundir import default_path
from brickyard.training.step import check_class_weights


@dataclass(frozen=True, eq=False)
class Plan:
    """What a run will do, resolved once from the config, the data and the job before any part is built:
    the batch plan, the step counts and the learning-rate schedule."""
    batches: BatchPlan                # which samples each rank reads at each step (any world size, any resume)
    steps_per_epoch: int
    total_steps: int                  # where the run stops
    peak_lr: float
    schedule: Schedule                # step -> learning rate
    planned_steps: int = 0            # what the schedule spans (train.epochs); max_steps and stop_epoch stop earlier


def check_before_writing(cfg: Config, model: nn.Module, data, user, info, way, resume) -> None:
    """What the config, the data, the model and the user's parts cannot do together: one sentence each,
    before anything is written (``user``: the run's ``UserParts``)."""
    check_readers(cfg, info.world_size, len(data.train))
    balance(data, cfg.data.balance)
    check_class_weights(cfg.optim.class_weights, data.num_classes,
                        "loss_fn" if user.loss_fn is not None else "train_step" if user.train_step is not None else None)
    reduce_lr.check(cfg, user.callbacks, data)
    check_monitor(cfg, data)
    check_loggers(loggers(cfg.train))  # a name no built-in or installed package has; a package missing
    if info.rank == 0:
        check_reachable(loggers(cfg.train))  # a tracking server that takes no connection
    activation_checkpointing.choose(model, cfg.train.activation_checkpointing)
    way.check(model, resume)
    if user.train_step is not None and way.step_function() is not None:
        raise ConfigError(f"train_step: the {way.name} way of training runs its own step (its schedule calls the model "
                          f"and the loss), and a train_step of your own is not built for it yet; pass loss_fn instead.")
    _check_image_features(cfg, data)
    check_task(cfg, data, user.loss_fn is not None or user.train_step is not None)


SINGLE_ONLY = ("val_accuracy", "val_top5", "val_precision_macro", "val_recall_macro", "val_f1_weighted",
               "val_balanced_accuracy")  # what a validation of several labels an image does not score
MULTI_ONLY = ("val_map", "val_map_micro", "val_f1_micro")


def check_task(cfg, data, own_loss: bool = False) -> None:
    """What one label an image, or several (``data.task``, resolved), does not combine with: one sentence each
    (``own_loss``: a ``loss_fn`` or ``train_step`` of the user's, which label smoothing does not touch)."""
    d, multi = cfg.data, cfg.data.task == "multilabel"
    if cfg.train.calibrate and data.val is None:
        raise ConfigError("train.calibrate fits its temperature on the validation split, and this run has none "
                          "(data.train_on_all, or data of your own without val_data); keep one or turn it off.")
    if multi and not data.multilabel and data.in_memory and data.train.labels is not None and data.train.labels.dim() == 1:
        raise ConfigError("data.task: multilabel takes labels as multi-hot rows (N x tags, 1 where a tag applies); "
                          "this data's labels are one class a sample.")
    if not multi and data.multilabel:
        raise ConfigError("data.task: single takes one class a sample, and this data's labels are multi-hot rows "
                          "(several tags a sample); use data.task: multilabel or auto.")
    monitors = {"checkpoint.monitor": cfg.checkpoint.monitor,
                "schedule.monitor": cfg.schedule.monitor if cfg.schedule.name == "plateau" else "",
                "train.early_stopping_monitor": cfg.train.early_stopping_monitor if cfg.train.early_stopping else ""}
    for key, metric in monitors.items():
        if metric in (SINGLE_ONLY if multi else MULTI_ONLY):
            which = "several labels an image" if multi else "one label an image"
            raise ConfigError(f"{key}: {metric} is not scored for {which}; watch "
                              f"{'val_map, val_f1_macro or val_loss' if multi else 'val_accuracy, val_f1_macro or val_loss'}.")
    if not multi:
        return
    for on, key in ((cfg.optim.label_smoothing > 0 and not own_loss, f"optim.label_smoothing: {cfg.optim.label_smoothing} (it spreads one "
                                                    f"label's share over the others; set it to 0)"),
                    (d.balance, "data.balance (it draws images by their one class; weigh tags with optim.class_weights)"),
                    (cfg.train.calibrate, "train.calibrate (temperature scaling calibrates one softmax over the classes)"),
                    (d.tta != "none", f"data.tta: {d.tta} (its views average class probabilities of one label)")):
        if on:
            raise ConfigError(f"data.task: multilabel does not combine with {key}.")


def _check_image_features(cfg, data) -> None:
    if data.is_images:
        return
    shape = "x".join(str(s) for s in data.sample_shape) or "a scalar"
    d = cfg.data
    for key, on in (("augment", d.augment != "none"), ("rand_augment", bool(d.rand_augment)),
                    ("random_erasing", d.random_erasing > 0), ("cutmix", d.cutmix > 0), ("tta", d.tta != "none")):
        if on:
            raise BrickyardError(f"data.{key}: {getattr(d, key)!r} works on images (N x C x H x W); these inputs are N x {shape}.")


def check_placement(cfg: Config, model: nn.Module, device: torch.device, distributed: bool) -> None:
    """``dist.*`` settings this device cannot honour, as config errors before the process group forms
    (torch would fail later, inside ``init_process_group`` or DDP's wrap, with a message about itself)."""
    if not distributed:
        return
    if cfg.dist.backend == "nccl" and (device.type != "cuda" or not torch.distributed.is_nccl_available()):
        where = f"this run's device is {device.type}" if device.type != "cuda" else "this torch was built without it"
        raise ConfigError(f"dist.backend: nccl runs on CUDA GPUs only and {where}; use gloo or auto.")
    if cfg.dist.sync_bn and device.type != "cuda" and any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError(f"dist.sync_bn: torch's SyncBatchNorm runs on GPUs only and this run's device is {device.type}; "
                          f"turn it off (each process then normalises over its own share of the batch).")


def plan(cfg: Config, data, info, readers: int) -> Plan:
    """The batch plan, steps and schedule for ``readers`` processes reading data."""
    t = cfg.train
    g = step_batch(cfg.data, t.grad_accum, readers)
    batches = BatchPlan(len(data.train), max(1, g // readers), readers, min(info.rank, readers - 1), t.seed,
                        global_batch=g, draw=data.train.draw, drop_last=cfg.data.drop_last)
    per_epoch = batches.steps_per_epoch // t.grad_accum
    if per_epoch == 0:
        raise BrickyardError(f"train.grad_accum: {t.grad_accum} is more than the {batches.steps_per_epoch} batches in an epoch.")
    planned = math.ceil(t.epochs * per_epoch) if t.epochs else t.max_steps  # what the schedule spans
    total = planned  # where the run stops: max_steps and stop_epoch end it early, never reshape the schedule
    if t.max_steps:
        total = min(total, t.max_steps)
    if t.stop_epoch:
        total = min(total, math.ceil(t.stop_epoch * per_epoch))
    peak, schedule = _schedule(cfg, readers, planned, per_epoch)
    return Plan(batches, per_epoch, total, peak, schedule, planned)


LOG_POINTS = 50  # train.log_every: auto reads the loss back about this many times a run
GPU_LOG_EVERY = 10  # and on a GPU at least this many steps apart: each read-back waits for the device


def log_every(setting, total_steps: int, device: torch.device) -> int:
    """``train.log_every`` for a run of ``total_steps``: as set, or (auto) about ``LOG_POINTS`` read-backs, so a short
    run's curves have points and a long one's log is not flooded (Keras logs each epoch, Lightning every 50 steps)."""
    if setting != "auto":
        return int(setting)
    every = max(1, round(total_steps / LOG_POINTS))
    return max(every, GPU_LOG_EVERY) if device.type == "cuda" else every


def _schedule(cfg, readers: int, total: int, per_epoch: int):
    peak, sched_cfg = cfg.schedule.lr_max or cfg.optim.lr, cfg.schedule
    if cfg.dist.scale_lr == "linear" and readers > 1:
        peak *= readers
        if sched_cfg.name != "onecycle" and sched_cfg.warmup_epochs < cfg.dist.scale_warmup_epochs:
            sched_cfg = dataclasses.replace(sched_cfg, warmup_epochs=cfg.dist.scale_warmup_epochs)
    return peak, Schedule(sched_cfg, peak, total, per_epoch)


def auto_batch(cfg, model, data, device, info, log) -> int:
    """``data.batch_size: auto``: probe this device, then take the smallest choice over all ranks."""
    batch, how = memory.auto_batch(cfg, model, data, device, info.world_size, len(data.train))
    agreed = torch.tensor([batch], dtype=torch.float64, device=device)
    if info.distributed:
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    batch = int(agreed.item())
    log.info(f"data.batch_size: auto chose {batch} per device ({how}, agreed by all {info.world_size} rank(s))")
    return batch


def run_dir_of(run_dir, preset: str) -> Path:
    """``run_dir`` as given, else ``runs/PRESET-TIME`` as rank 0 names it (a collective)."""
    return Path(run_dir) if run_dir else Path(dist.broadcast_object(str(default_path(preset))))
