"""The learning-rate range test (``brickyard lr-find``, ``optim.lr: find``).

Follows Lightning's ``Tuner.lr_find`` (``src/lightning/pytorch/tuner/lr_finder.py``: ``_lr_find``'s
defaults ``min_lr=1e-8``, ``max_lr=1``, ``num_training=100``, exponential mode,
``early_stop_threshold=4.0``; ``_LRCallback``'s smoothing ``beta=0.98`` with bias correction and its
stop rule, smoothed loss > 4 x the best after step 1; ``_LRFinder.suggestion``: the point of steepest
negative gradient of the smoothed loss, skipping the first 10 and the last point). The model,
optimiser, data order, augmentation and precision are the run's own (built as ``brickyard bench``
builds them); the rate rises exponentially step by step.

Where it differs from Lightning, and why:

- Lightning takes the gradient against the rate itself (``torch.gradient(losses, spacing=[lrs])``).
  On an exponential sweep that divides the flat start's noise by rates of 1e-7 and so picks the
  noise: for the ``mnist`` preset it suggested 1.35e-07 (2026-11-24). brickyard takes it against
  log10 of the rate (the axis the sweep is even on, as fastai's ``steep``): 0.029 there, against the
  preset's tuned 0.02.
- Under DDP each of Lightning's ranks smooths its own loss
and rank 0's stop decision is broadcast, so ranks record different curves (users report the
suggestion breaking under DDP, Lightning #19912, #19611); here each step's loss is the global batch's
mean, all-reduced, so every rank records the same curve and agrees on when to stop and on the
suggestion. Nothing is saved: the weights it trained are thrown away and no run directory is touched.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError
from brickyard.optim import set_lr
from brickyard.training import device as dev

MIN_LR, MAX_LR, STEPS, STOP_FACTOR, BETA, SKIP_BEGIN, SKIP_END = 1e-8, 1.0, 100, 4.0, 0.98, 10, 1
RULE = "steepest descent of the smoothed loss against log10(lr), the first 10 points and the last skipped"


def suggest(lrs: list[float], losses: list[float]) -> tuple[float | None, int | None]:
    """The rate where the smoothed loss falls fastest against log10 of the rate (Lightning's ``suggestion``
    on the log axis: see the module's docstring)."""
    idx = list(range(len(losses)))[SKIP_BEGIN:-SKIP_END or None]
    idx = [i for i in idx if math.isfinite(losses[i])]
    if len(idx) < 2:
        return None, None
    grads = torch.gradient(torch.tensor([losses[i] for i in idx], dtype=torch.float64),
                           spacing=[torch.tensor([math.log10(lrs[i]) for i in idx], dtype=torch.float64)])[0]
    best = idx[int(torch.argmin(grads))]
    return lrs[best], best


def check_range(min_lr: float, max_lr: float, steps: int) -> None:
    """The sweep's range, checked before anything runs: finite rates (``--max-lr inf`` swept to inf and then
    advised a lower --min-lr), ``0 < min_lr < max_lr``, a ratio a float holds, enough steps."""
    for flag, value in (("--min-lr", min_lr), ("--max-lr", max_lr)):
        if not math.isfinite(value):
            raise BrickyardError(f"lr-find: {flag} {value} is not a finite number; give a rate such as 1e-8 or 10.")
    if not 0 < min_lr < max_lr or steps < SKIP_BEGIN + SKIP_END + 2:
        raise BrickyardError(f"lr-find: needs 0 < --min-lr < --max-lr and at least {SKIP_BEGIN + SKIP_END + 2} steps.")
    if not math.isfinite(max_lr / min_lr):
        raise BrickyardError(f"lr-find: --max-lr / --min-lr is {max_lr / min_lr}, past what a float holds; narrow the range.")


def sweep(cfg, min_lr: float = MIN_LR, max_lr: float = MAX_LR, steps: int = STEPS, log=print) -> dict:
    """Run the range test in this process (one rank of a job under torchrun); every rank returns the same."""
    from brickyard.tools.bench import _job  # tools import each other lazily: bench imports the launch machinery
    check_range(min_lr, max_lr, steps)
    info = dist.from_env()
    host = dev.setup(cfg.train, info.local_rank, info.local_world_size)
    dist.init(info, cfg.dist.backend, host.device, cfg.dist.timeout_s)
    try:
        job, _ = _job(cfg, info, host)
        lrs, losses, raw = [], [], []
        avg, best, stopped = 0.0, math.inf, None
        for step in range(steps):
            lr = min_lr * (max_lr / min_lr) ** (step / (steps - 1))
            set_lr(job.optimizer, lr)
            x, y, n_global, offset = next(job.batches)
            x, y = job.prep.train(x, y, step, n_global, offset)
            with dev.autocast(job.device, job.precision):
                out = job.fwd(x)
            loss = F.cross_entropy(out.float(), y, label_smoothing=cfg.optim.label_smoothing)
            (loss * len(y) * info.world_size / n_global).backward()  # the global batch's mean gradient
            job.sync()
            job.optimizer.step()
            job.optimizer.zero_grad(set_to_none=True)
            total = dist.all_reduce_sum(loss.detach().double() * len(y)) / n_global  # the same number on every rank
            value = float(total)
            avg = BETA * avg + (1 - BETA) * value
            smoothed = avg / (1 - BETA ** (step + 1))
            lrs.append(lr)
            raw.append(value)
            losses.append(smoothed)
            if not math.isfinite(smoothed) or (step > 1 and smoothed > STOP_FACTOR * best):
                stopped = step
                break
            best = min(best, smoothed)
        job.loader.close()
        lr, index = suggest(lrs, losses)
        return {"lrs": lrs, "losses": losses, "raw_losses": raw, "suggested_lr": lr, "index": index,
                "stopped_at": stopped, "steps": len(lrs), "rule": RULE, "configured_lr": cfg.optim.lr,
                "optimizer": cfg.optim.name, "world_size": info.world_size, "precision": job.precision}
    finally:
        dist.shutdown()


def line(result: dict) -> str:
    """The one line the command prints."""
    if result["suggested_lr"] is None:
        return (f"lr-find: no suggestion: only {result['steps']} steps before the loss diverged "
                f"(lower --min-lr, or check the data)")
    stop = (f", stopped at step {result['stopped_at']} (smoothed loss above {STOP_FACTOR:g}x its best)"
            if result["stopped_at"] is not None else "")
    configured = result.get("configured_lr")
    has = f" (the config has {configured:g})" if isinstance(configured, (int, float)) else ""
    return (f"lr-find: suggested optim.lr {result['suggested_lr']:.3g} for {result['optimizer']}{has}; rule: {RULE}; {result['steps']} steps from "
            f"{result['lrs'][0]:.0e} to {result['lrs'][-1]:.2g}{stop}; {result['world_size']} process(es)")


def plot(result: dict, path: Path) -> Path:
    from brickyard.observe.plots import lr_finder  # Pillow's drawing, only when a plot is asked for
    return lr_finder(result["lrs"], result["losses"], result["index"], path)
