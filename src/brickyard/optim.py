"""Optimisers and learning-rate schedules.

A schedule is a pure function of the optimiser step, so resuming needs no scheduler state:
``lr_at(step)`` is recomputed and written into every parameter group (times its ``lr_mult``).
"""
from __future__ import annotations

import math

import torch

from brickyard.errors import ConfigError


def build_optimizer(cfg, params) -> torch.optim.Optimizer:
    """``cfg`` is an ``OptimConfig``; ``params`` parameters or groups (each may carry ``lr_mult``)."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [{k: v for k, v in g.items() if k not in ("names", "label")} for g in groups]
    for g in groups:
        g.setdefault("lr_mult", 1.0)
        g["lr"] = cfg.lr * g["lr_mult"]
    wd, name = cfg.weight_decay, cfg.name
    if name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, weight_decay=wd)
    if name in ("momentum", "nesterov"):
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=name == "nesterov", weight_decay=wd)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=cfg.lr, weight_decay=wd, eps=cfg.eps)
    if name == "adadelta":
        return torch.optim.Adadelta(groups, lr=cfg.lr, weight_decay=wd, eps=cfg.eps)
    if len(cfg.betas) != 2:
        raise ConfigError(f"optim.betas: {list(cfg.betas)} must be two numbers, e.g. [0.9, 0.999].")
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return cls(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=wd)


class Schedule:
    """Learning rate at each optimiser step (``peak`` is ``schedule.lr_max`` or ``optim.lr``)."""

    def __init__(self, cfg, peak: float, total_steps: int, steps_per_epoch: int):
        self.cfg, self.peak = cfg, peak
        self.total = max(1, total_steps)
        self.warmup = int(round(cfg.warmup_epochs * steps_per_epoch))
        self.step_size = max(1, int(round(cfg.step_epochs * steps_per_epoch)))

    def __call__(self, step: int) -> float:
        c, peak = self.cfg, self.peak
        if c.name == "onecycle":
            rise = max(1, int(c.pct_start * self.total))
            start = c.lr_init or peak / 25
            if step < rise:
                return _cos(start, peak, step / rise)
            return _cos(peak, c.lr_end, (step - rise) / max(1, self.total - rise))
        if step < self.warmup:
            return c.lr_init + (peak - c.lr_init) * step / self.warmup
        t = (step - self.warmup) / max(1, self.total - self.warmup)
        if c.name == "constant":
            return peak
        if c.name == "step":
            return peak * c.gamma ** ((step - self.warmup) // self.step_size)
        if c.name == "cosine":
            return _cos(peak, c.lr_end, t)
        return peak + (c.lr_end - peak) * min(1.0, t)  # warmup_linear


def _cos(a: float, b: float, t: float) -> float:
    return b + (a - b) * (1 + math.cos(math.pi * min(1.0, t))) / 2


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_mult", 1.0)


_NORM_TYPES = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm)


def param_groups(model: torch.nn.Module, cfg, head: str | None = None, head_lr_mult: float = 1.0) -> list[dict]:
    """Optimiser groups from ``optim.param_groups`` rules (first match wins), ``decay_bias_norm``
    and the trainable parameters of ``model``; ``head``'s parameters get ``head_lr_mult`` unless a
    rule says otherwise. Each group carries ``names`` for printing."""
    import fnmatch
    norm_params = {id(p) for m in model.modules() if isinstance(m, _NORM_TYPES) for p in m.parameters(recurse=False)}
    rules = list(cfg.param_groups)
    used = [False] * len(rules)
    groups: dict[tuple, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        wd, mult, label = cfg.weight_decay, 1.0, "default"
        if not cfg.decay_bias_norm and (name.endswith("bias") or id(p) in norm_params):
            wd, label = 0.0, "no-decay (bias/norm)"
        if head and head_lr_mult != 1.0 and name.startswith(head + "."):
            mult, label = head_lr_mult, f"head {head}"
        for i, rule in enumerate(rules):
            if fnmatch.fnmatchcase(name, rule.match):
                used[i] = True
                wd = rule.weight_decay if rule.weight_decay is not None else wd
                mult, label = rule.lr_mult, f"match {rule.match!r}"
                break
        g = groups.setdefault((label, wd, mult), {"params": [], "names": [], "weight_decay": wd, "lr_mult": mult, "label": label})
        g["params"].append(p)
        g["names"].append(name)
    for rule, hit in zip(rules, used):
        if not hit:
            names = [n for n, _ in model.named_parameters()]
            raise ConfigError(f"optim.param_groups: pattern {rule.match!r} matches no parameter; names look like {', '.join(names[:4])}, ...")
    return list(groups.values())


def describe_groups(groups: list[dict], base_lr: float) -> list[str]:
    out = []
    for g in groups:
        n = sum(p.numel() for p in g["params"])
        shown = ", ".join(g["names"][:3]) + (", ..." if len(g["names"]) > 3 else "")
        out.append(f"param group {g['label']}: {len(g['names'])} tensors ({n:,} values), lr {base_lr * g['lr_mult']:g} "
                   f"(x{g['lr_mult']:g}), weight decay {g['weight_decay']:g}: {shown}")
    return out


def l1_penalty(groups: list[dict]) -> torch.Tensor:
    """Sum of |w| over the parameters that are weight-decayed."""
    return sum(p.abs().sum() for g in groups if g["weight_decay"] > 0 for p in g["params"])
