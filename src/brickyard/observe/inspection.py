"""Looking inside a model: per-layer tables, watched layers, non-finite hunting, layer outputs.

All of it works through forward hooks on named modules, so any ``nn.Module`` can be inspected
without changing it.
"""
from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F
from torch import nn

from brickyard.errors import BrickyardError


def layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Named leaf modules (and modules with their own parameters), in registration order."""
    out = []
    for name, m in model.named_modules():
        if not name:
            continue
        if not list(m.children()) or list(m.parameters(recurse=False)):
            out.append((name, m))
    return out


def _stats(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().float()
    return torch.stack([t.mean(), t.std() if t.numel() > 1 else t.new_zeros(()), t.min(), t.max()])


def layer_table(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """One forward and backward pass; a row per layer with output and parameter statistics."""
    outputs: dict[str, tuple] = {}
    handles = []
    for name, m in layers(model):
        def hook(mod, inp, out, name=name):
            if isinstance(out, torch.Tensor):
                outputs[name] = (tuple(out.shape), _stats(out))
        handles.append(m.register_forward_hook(hook))
    model.zero_grad(set_to_none=True)
    try:
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    rows = []
    for name, m in layers(model):
        params = list(m.parameters(recurse=False))
        shape, st = outputs.get(name, (None, torch.full((4,), float("nan"))))
        mean, std, lo, hi = st.tolist()
        grads = [p.grad for p in params if p.grad is not None]
        rows.append({
            "name": name, "type": type(m).__name__, "output_shape": list(shape) if shape else None,
            "mean": mean, "std": std, "min": lo, "max": hi, "params": sum(p.numel() for p in params),
            "weight_norm": float(torch.sqrt(sum((p.detach().float() ** 2).sum() for p in params))) if params else None,
            "grad_norm": float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads))) if grads else None,
        })
    return rows


def format_table(rows: list[dict], loss: float | None = None) -> str:
    head = f"{'layer':<22} {'type':<18} {'output shape':<18} {'mean':>9} {'std':>9} {'min':>9} {'max':>9} {'params':>10} {'|w|':>9} {'|grad|':>9}"
    lines = [head, "-" * len(head)]

    def f(v):
        return f"{v:9.4f}" if isinstance(v, float) else f"{'-':>9}"
    for r in rows:
        shape = "x".join(map(str, r["output_shape"])) if r["output_shape"] else "-"
        lines.append(f"{r['name']:<22} {r['type']:<18} {shape:<18} {f(r['mean'])} {f(r['std'])} {f(r['min'])} {f(r['max'])} "
                     f"{r['params']:>10,} {f(r['weight_norm'])} {f(r['grad_norm'])}")
    return "\n".join(lines)


def first_nonfinite(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_sum=None) -> str:
    """Name the first layer whose output, or else whose gradient, is not finite on this batch
    (``loss_sum(outputs, targets)``: the run's loss, default cross-entropy)."""
    bad_out: list[str] = []
    handles = []
    for name, m in layers(model):
        def hook(mod, inp, out, name=name):
            if isinstance(out, torch.Tensor) and not bad_out and not torch.isfinite(out).all():
                bad_out.append(f"output of layer '{name}' ({type(mod).__name__})")
        handles.append(m.register_forward_hook(hook))
    try:
        model.zero_grad(set_to_none=True)
        out = model(x)
        loss = loss_sum(out, y) if loss_sum is not None else F.cross_entropy(out.float(), y)
        if bad_out:
            return bad_out[0]
        if not torch.isfinite(loss):
            return "the loss itself (finite logits; check the labels and label smoothing)"
        loss.backward()
        for name, m in layers(model):
            for pname, p in m.named_parameters(recurse=False):
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    return f"gradient of '{name}.{pname}' ({type(m).__name__})"
        for name, m in layers(model):
            for pname, p in m.named_parameters(recurse=False):
                if not torch.isfinite(p).all():
                    return f"weights of '{name}.{pname}'"
        return "no layer on this batch (the non-finite value came from an earlier batch)"
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)


class Watcher:
    """Activation and gradient statistics of the modules matching ``patterns``, for one step."""

    def __init__(self, model: nn.Module, patterns):
        self.model = model
        self.targets = [(n, m) for n, m in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if patterns and not self.targets:
            names = [n for n, _ in layers(model)]
            raise BrickyardError(f"train.watch: {list(patterns)} matches no layer; layers are {', '.join(names)}.")
        self.handles, self.found = [], {}

    def attach(self) -> None:
        for name, m in self.targets:
            def hook(mod, inp, out, name=name):
                if isinstance(out, torch.Tensor):
                    self.found[name] = {"act": _stats(out)}
                    if out.requires_grad:
                        out.register_hook(lambda g, name=name: self.found[name].__setitem__("grad", _stats(g)))
            self.handles.append(m.register_forward_hook(hook))

    def collect(self) -> dict:
        """Detach hooks and read the statistics back (a host sync, on watch steps only)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        out = {}
        for name, d in self.found.items():
            row = dict(zip(("act_mean", "act_std", "act_min", "act_max"), d["act"].tolist()))
            if "grad" in d:
                row.update(zip(("grad_mean", "grad_std", "grad_min", "grad_max"), d["grad"].tolist()))
            out[name] = row
        self.found = {}
        return out


def forward_with_outputs(model: nn.Module, x: torch.Tensor, outputs=()) -> dict[str, torch.Tensor]:
    """Logits plus the output of each named layer in ``outputs``, each its own tensor."""
    named = dict(model.named_modules())
    unknown = [o for o in outputs if o not in named or not o]
    if unknown:
        valid = ", ".join(n for n in named if n)
        raise BrickyardError(f"layer {unknown[0]!r} does not exist; valid names: {valid}.")
    found: dict[str, torch.Tensor] = {}
    handles = [named[o].register_forward_hook(lambda m, i, out, o=o: found.__setitem__(o, out.detach())) for o in outputs]
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        for h in handles:
            h.remove()
    return {"logits": logits.detach(), **{o: found[o] for o in outputs}}
