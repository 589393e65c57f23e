"""Optimisers and learning-rate schedules.

A schedule is a pure function of the optimiser step, so resuming needs no scheduler state:
``lr_at(step)`` is recomputed and written into every parameter group (times its ``lr_mult``).

SGD (plain, momentum, Nesterov), Adam and AdamW are brickyard's own ``Optimizer``: the updates and
the ``state_dict`` layout of ``torch.optim``'s, in foreach ops. Any ``torch.optim`` optimiser
imports ``torch._dynamo`` on its first call, about 1 s of every command on a 2-core CPU.
"""
from __future__ import annotations

import collections
import fnmatch
import math
import sys

import torch

from brickyard.errors import ConfigError

# tensors of optimiser state each parameter's gradient is matched by, by optim.name (momentum: its buffer; Adam:
# the two moments), for the estimates of `brickyard memory` and the pipeline's memory balance
STATE_COPIES = {"sgd": 0, "momentum": 1, "nesterov": 1, "adagrad": 1, "adadelta": 2, "adam": 2, "adamw": 2}


def build_optimizer(cfg, params):
    """``cfg`` is an ``OptimConfig``; ``params`` parameters or groups (each may carry ``lr_mult``)."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    groups = [{k: v for k, v in g.items() if k not in ("names", "label")} for g in groups]
    for g in groups:
        g.setdefault("lr_mult", 1.0)
        g["lr"] = cfg.lr * g["lr_mult"]
    wd, name = cfg.weight_decay, cfg.name
    mixed = len({_sharded(p) for g in groups for p in g["params"]}) > 1  # tensor parallel: DTensors and plain tensors
    if _on_cuda(groups) and not mixed and name in ("sgd", "momentum", "nesterov", "adam", "adamw"):
        return _torch_fused(cfg, groups)
    if name == "sgd":
        return SGD(groups, lr=cfg.lr, weight_decay=wd)
    if name in ("momentum", "nesterov"):
        return SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=name == "nesterov", weight_decay=wd)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=cfg.lr, weight_decay=wd, eps=cfg.eps, **({"foreach": False} if mixed else {}))
    if name == "adadelta":
        return torch.optim.Adadelta(groups, lr=cfg.lr, weight_decay=wd, eps=cfg.eps, **({"foreach": False} if mixed else {}))
    if len(cfg.betas) != 2:
        raise ConfigError(f"optim.betas: {list(cfg.betas)} must be two numbers, e.g. [0.9, 0.999].")
    return Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=wd, decoupled=name == "adamw")


def _on_cuda(groups) -> bool:
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.is_cuda for p in params)


def _torch_fused(cfg, groups):
    """On CUDA, torch's fused kernels (one launch for all parameters); the same updates and state layout
    as brickyard's, so a checkpoint moves between a CPU and a GPU run."""
    wd, name = cfg.weight_decay, cfg.name
    if name in ("adam", "adamw"):
        if len(cfg.betas) != 2:
            raise ConfigError(f"optim.betas: {list(cfg.betas)} must be two numbers, e.g. [0.9, 0.999].")
        kind = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
        return kind(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=wd, fused=True)
    momentum = cfg.momentum if name != "sgd" else 0.0
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=momentum, nesterov=name == "nesterov", weight_decay=wd, fused=True)


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` (torch's LR schedulers and any library that checks the type accept it)
    whose ``step``, ``zero_grad``, ``add_param_group`` and ``state_dict`` are brickyard's own: torch's are
    wrapped in ``torch._disable_dynamo``, which imports ``torch._dynamo`` on the first call (about 1 s of
    every command on a 2-core CPU). ``state_dict`` has ``torch.optim``'s layout: checkpoints written
    with ``torch.optim``'s optimiser of the same kind load, and the other way round."""

    def __init__(self, groups, **defaults):
        super().__init__(groups, defaults)  # calls our add_param_group for each group; state is a defaultdict

    def add_param_group(self, group: dict) -> None:
        """More parameters to train (e.g. layers unfrozen by a callback), with their own settings."""
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.param_groups.append({**self.defaults, **group, "params": params})

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            for params in by_type([p for p in g["params"] if p.grad is not None]):
                self._update(g, params, [p.grad for p in params])
        return loss

    def state_dict(self) -> dict:
        index = {id(p): i for i, p in enumerate(self._params())}
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()},
                "param_groups": [{**g, "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        saved = state["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the parameter groups differ in number or size from this model's")
        params = self._params()
        for g, s in zip(self.param_groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
        self.state = collections.defaultdict(dict, {params[int(i)]: {k: _like(v, params[int(i)], k) for k, v in s.items()}
                                                    for i, s in state["state"].items()})


def _sharded(t) -> bool:
    """Whether ``t`` is a DTensor (none can be before torch.distributed.tensor is imported: it is not imported here,
    as ``distributed.fsdp._loaded`` says why)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(t, dtensor)


def by_type(items: list, key=lambda t: t) -> list[list]:
    """``items`` in groups whose tensors (``key(item)``) are of one type, in their order (none: no group). One
    foreach op takes DTensors or plain tensors, not both ("got mixed torch.Tensor and DTensor"), and tensor
    parallel trains a model of both."""
    kinds: dict[type, list] = {}
    for item in items:
        kinds.setdefault(type(key(item)), []).append(item)
    return list(kinds.values())


def _like(value, param, key):
    if not torch.is_tensor(value) or key == "step":
        return value
    return value.to(param.device, param.dtype if value.is_floating_point() else value.dtype)


class SGD(Optimizer):
    def __init__(self, groups, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
        super().__init__(groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, dampening=0.0)

    def _update(self, g, params, grads):
        if g["weight_decay"]:
            grads = torch._foreach_add(grads, params, alpha=g["weight_decay"])
        m = g["momentum"]
        if m:
            for p in params:  # zeros: after the first step the buffer is the gradient, as torch.optim starts it
                if self.state[p].get("momentum_buffer") is None:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_mul_(bufs, m)
            torch._foreach_add_(bufs, grads)
            grads = torch._foreach_add(grads, bufs, alpha=m) if g["nesterov"] else bufs
        torch._foreach_add_(params, grads, alpha=-g["lr"])


class Adam(Optimizer):
    """Adam, or AdamW with ``decoupled`` (weight decay on the weights, not added to the gradient)."""

    def __init__(self, groups, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled)

    def _update(self, g, params, grads):
        (b1, b2), lr, wd = g["betas"], g["lr"], g["weight_decay"]
        for p in params:
            if "step" not in self.state[p]:  # (a state without it, e.g. SGD's from a checkpoint, starts afresh)
                self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        states = [self.state[p] for p in params]
        avg, sq = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        if wd and g["decoupled"]:
            torch._foreach_mul_(params, 1 - lr * wd)
        elif wd:
            grads = torch._foreach_add(grads, params, alpha=wd)
        torch._foreach_lerp_(avg, grads, 1 - b1)
        torch._foreach_mul_(sq, b2)
        torch._foreach_addcmul_(sq, grads, grads, 1 - b2)
        n = [float(s) for s in steps]
        denom = torch._foreach_sqrt(sq)
        torch._foreach_div_(denom, [(1 - b2 ** k) ** 0.5 for k in n])
        torch._foreach_add_(denom, g["eps"])
        torch._foreach_addcdiv_(params, avg, denom, [-lr / (1 - b1 ** k) for k in n])


class Schedule:
    """Learning rate at each optimiser step (``peak`` is ``schedule.lr_max`` or ``optim.lr``); ``plateau`` is
    constant (with warm-up), lowered by a ``ReduceLROnPlateau`` through ``Run.lr_scale``."""

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
        if c.name in ("constant", "plateau"):
            return peak
        if c.name == "step":
            return peak * c.gamma ** ((step - self.warmup) // self.step_size)
        if c.name == "cosine":
            return _cos(peak, c.lr_end, t)
        return peak + (c.lr_end - peak) * min(1.0, t)  # warmup_linear


def _cos(a: float, b: float, t: float) -> float:
    return b + (a - b) * (1 + math.cos(math.pi * min(1.0, t))) / 2


def set_lr(optimizer, lr: float) -> None:
    """Each group's rate: ``lr`` times its ``lr_mult``; written into the group's tensor where the rate is one
    (a step captured as a CUDA graph reads it on the device: ``training.graphs``)."""
    for g in optimizer.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].fill_(lr * g.get("lr_mult", 1.0))
        else:
            g["lr"] = lr * g.get("lr_mult", 1.0)


_NORM_TYPES = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm)


def param_groups(model: torch.nn.Module, cfg, head: str | None = None, head_lr_mult: float = 1.0) -> list[dict]:
    """Optimiser groups from ``optim.param_groups`` rules (first match wins), ``decay_bias_norm``
    and the trainable parameters of ``model``; ``head``'s parameters get ``head_lr_mult`` unless a
    rule says otherwise. Each group carries ``names`` for printing."""
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
