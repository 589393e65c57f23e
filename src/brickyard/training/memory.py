"""Memory estimate per device before a run, and the largest batch that fits.

Parameters, gradients and optimiser state are counted from the model; activations are measured:
a real forward and backward at two small batch sizes with ``saved_tensors_hooks`` counting the
bytes autograd keeps for backward, fitted to ``fixed + per_sample x batch`` and extrapolated.
The in-memory data set lives on the device too. Not counted: allocator fragmentation and
framework workspaces (cuDNN), which is why the GPU check below compares against a real step.

Per rank, for each way to train (``strategies``): DDP holds everything whole. FSDP
(``dist.strategy: fsdp``) holds 1/world of the parameters, gradients and optimiser state, plus
what it gathers while it computes: the root's own parameters (stem, head: kept gathered from the
forward to the backward), the block being computed and the next one (FSDP2 prefetches one), in the
compute precision, and the unsharded gradients of a block and the root before their reduce-scatter.
With ``dist.fsdp.offload`` (GPUs) the shards live in host memory; the device keeps the gathered
parts. Activation checkpointing keeps the blocks' inputs instead of their activations (measured).
"""
from __future__ import annotations

import copy as copy_module
import re

import torch
import torch.nn.functional as F

from brickyard import models
from brickyard.data.augment import DevicePrep
from brickyard.data.loaders import device_batches, readers_of, stream_workers
from brickyard.errors import BrickyardError
from brickyard.models import find_blocks
from brickyard.observe.metrics import fmt
from brickyard.optim import STATE_COPIES, build_optimizer, param_groups
from brickyard.training import activation_checkpointing, ways
from brickyard.training import device as dev
from brickyard.training.precision import MAX_BATCH, for_model, needs_measuring
from brickyard.training.ways.pipeline import stage_shards

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text or "")
    if not m or m.group(2).lower() not in _UNITS:
        raise BrickyardError(f"memory size {text!r}: expected a number with a unit, e.g. 16GiB, 512MiB or 8GB.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def activation_bytes(model, x: torch.Tensor, y: torch.Tensor, device: torch.device, precision: str,
                     checkpointed=()) -> int:
    """Bytes autograd saves for backward in one forward pass of ``x`` (counted once per storage), and the
    inputs that ``checkpointed`` modules (activation checkpointing) keep for their recomputation."""
    seen: dict[int, int] = {}

    def pack(t):
        try:
            key = t.untyped_storage().data_ptr()
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
        except RuntimeError:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    def keep_inputs(module, args):
        for a in args:
            if isinstance(a, torch.Tensor):
                pack(a)

    hooks = [m.register_forward_pre_hook(keep_inputs) for m in checkpointed]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with dev.autocast(device, precision):
                loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    model.zero_grad(set_to_none=True)
    return sum(v for k, v in seen.items() if k not in params)


def _activations_per_batch(model, data, channels_last: bool, precision: str, checkpointed=()) -> tuple[float, float]:
    """(fixed, per sample) bytes of activations, measured on the CPU at two small batches, fitted linearly."""
    probe = torch.device("cpu")
    c, (h, w) = data.in_channels, data.image_size
    sizes, acts = (2, 4), []
    for b in sizes:
        x = torch.randn(b, c, h, w)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        acts.append(activation_bytes(model, x, torch.zeros(b, dtype=torch.long), probe,
                                     precision if precision != "fp16" else "bf16", checkpointed))
    per_sample = max(0.0, (acts[1] - acts[0]) / (sizes[1] - sizes[0]))
    return max(0.0, acts[0] - per_sample * sizes[0]), per_sample


def _room_to_measure(model, data, batch: int, channels_last: bool) -> bool:
    """Whether ``precision: auto``'s measurement (real fp32 and bf16 steps at ``batch``, where it is measured) fits
    in half of the host's available memory: the estimate must not take the memory it is asked about (ResNet-18 at
    224 px and a batch of 256 would hold about 28 GiB). Judged by the fp32 activations of two small batches."""
    if not data.is_images:
        return True
    probe = copy_module.deepcopy(model).to(torch.device("cpu")).train()
    fixed, per_sample = _activations_per_batch(probe, data, channels_last, "fp32")
    return fixed + per_sample * min(batch, MAX_BATCH) <= _available_host_memory() // 2


def _units(model, cfg) -> tuple[int, int]:
    """(bytes of the root's own parameters, of the largest block's) as FSDP would shard them, in fp32."""
    modules = dict(model.named_modules())
    blocks = [sum(p.numel() * p.element_size() for p in modules[n].parameters())
              for n in find_blocks(model, cfg.dist.fsdp.blocks, "dist.fsdp.blocks")]
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - sum(blocks), max(blocks, default=0)


def estimate(cfg, model, data, device: torch.device, world_size: int = 1, compare: bool = True) -> dict:
    """``compare``: also measure the activations with checkpointing where it is off (the report's
    comparison; ``batch_size: auto`` needs only the configured run's)."""
    channels_last = dev.resolve_channels_last(cfg.train.channels_last, cfg.train.precision, device)
    # as training resolves it here: auto measured on a CPU with native bf16 (the report; recalled once a run
    # has measured), by the rule where nothing is known yet of the batch (batch_size: auto, an error's tips)
    batch = device_batch(cfg, max(1, readers_of(cfg, world_size)))  # a pipeline's stages share one batch
    measure = (compare and batch > 1 and needs_measuring(cfg.train.precision, device)
               and _room_to_measure(model, data, batch, channels_last))
    precision = for_model(cfg.train.precision, model, data, batch, device, channels_last) if measure \
        else dev.resolve_precision(cfg.train.precision, device)
    tp_n, param_b, grad_b = _held(cfg, model)
    copies = STATE_COPIES[cfg.optim.name]
    state_b = copies * grad_b
    # activations: measured on the CPU at two small batches, fitted linearly; with activation
    # checkpointing on, on a copy of the model with it applied, and without it for comparison
    m = model.to(torch.device("cpu"), memory_format=torch.channels_last if channels_last else torch.preserve_format).train()
    plain = _activations_per_batch(m, data, channels_last, precision)
    act_fixed, per_sample = plain
    checkpointing, setting = None, cfg.train.activation_checkpointing or ("auto" if compare else ())
    if activation_checkpointing.choose(m, setting):
        copy = copy_module.deepcopy(m)
        names = activation_checkpointing.apply(copy, setting)
        modules = dict(copy.named_modules())
        with_ac = _activations_per_batch(copy, data, channels_last, precision, [modules[n] for n in names])
        checkpointing = {"blocks": len(names), "without_per_sample": plain[1], "without_fixed": plain[0],
                         "with_fixed": with_ac[0], "with_per_sample": with_ac[1], "on": bool(cfg.train.activation_checkpointing)}
        if checkpointing["on"]:
            act_fixed, per_sample = with_ac
    c, (h, w) = data.in_channels, data.image_size
    act_b = act_fixed + per_sample * batch
    in_memory = data.in_memory and cfg.data.loader != "stream"
    data_b = sum(s.images.numel() * s.images.element_size() for s in (data.train, data.val, data.test) if s is not None and s.images is not None) \
        if in_memory else 0
    sample_b = c * h * w  # uint8 batches from the loader
    batch_b = batch * sample_b * 4 * 3  # the float batch, its normalised copy and the augmented one
    loader_b = 0 if in_memory else stream_workers(cfg.data.num_workers, device, max(world_size, 1)) * cfg.data.prefetch * batch * sample_b
    world = max(world_size, 1)
    root_b, block_b = _units(m, cfg)
    low = 0.5 if precision in ("bf16", "fp16") else 1.0  # FSDP gathers in the compute precision
    sharded = {"parameters": -(-param_b // world), "gradients": -(-grad_b // world), "optimizer_state": -(-state_b // world)}
    gathered = low * (root_b + 2 * block_b) + root_b + block_b  # root + block + prefetched one; their unsharded grads
    fsdp = ways.WAYS[ways.name_of(cfg)].shards_state and world > 1
    offload = fsdp and cfg.dist.fsdp.offload and device.type == "cuda"
    held = (0 if offload else sum(sharded.values())) + gathered if fsdp else param_b + grad_b + state_b
    fixed = held + act_fixed + data_b
    total = fixed + per_sample * batch + batch_b
    return {
        "parameters": param_b, "gradients": grad_b, "optimizer_state": state_b, "optimizer_copies": copies,
        "activations": act_b, "activations_per_sample": per_sample, "batch_buffers": batch_b, "data_on_device": data_b,
        "loader_host_buffers": loader_b, "total": total, "batch": batch, "precision": precision,
        "per_sample_total": per_sample + 12 * sample_b, "fixed": fixed, "world_size": world_size,
        "activation_checkpointing": checkpointing, "activations_fixed": act_fixed,
        "strategy": ("fsdp + offload" if offload else "fsdp") if fsdp else "tensor_parallel" if tp_n > 1 else "ddp",
        "sharded": sharded,
        "gathered": gathered, "whole": param_b + grad_b + state_b, "data_fixed": data_b, "sample_buffers": 12 * sample_b,
        "host_offloaded": sum(sharded.values()) if offload else 0,
        "stages": stage_estimates(cfg, m, data, precision, batch, world_size),
    }


def _held(cfg, model) -> tuple[int, int, int]:
    """(tensor-parallel ranks, the bytes of parameters a rank holds, of their gradients): the whole model's, or with
    ``dist.tensor_parallel`` rank 0's shards of the split layers and the rest whole (the largest any rank holds).
    Inside pipeline stages tensor parallel is not counted yet."""
    params = list(model.parameters())
    tp_n = cfg.dist.tensor_parallel if cfg.dist.pipeline.stages < 2 else 1
    if tp_n > 1:
        from brickyard.distributed import tensor_parallel as tp  # lazy: tensor-parallel runs only
        the_plan, size = tp.plan(model, tp_n), params[0].element_size() if params else 4
        return tp_n, size * tp.planned_held(model, the_plan, tp_n), size * tp.planned_held(model, the_plan, tp_n, True)
    return 1, sum(p.numel() * p.element_size() for p in params), \
        sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def stage_estimates(cfg, model, data, precision: str, batch: int, world: int = 0) -> list[dict] | None:
    """Per pipeline stage (``dist.pipeline.stages`` above 1, cut where the run cuts it: ``pipeline.planned_cuts``),
    what each of its ranks holds: the stage's parameters, gradients and optimiser state, counted, and its activations
    (on a copy of the model), measured on one microbatch (the inputs it
    receives made by the stages before it) times the microbatches in flight at once: all of them under GPipe
    (every forward before the first backward), at most ``stages - i`` on stage i under 1F1B. With FSDP inside the
    stages (``dist.strategy: fsdp`` on ``world`` processes), parameters, gradients and optimiser state are divided
    over a stage's world / stages replicas."""
    p = cfg.dist.pipeline
    if p.stages < 2:
        return None
    from brickyard.distributed import pipeline as pp  # lazy: pipeline runs only
    copies, out = STATE_COPIES[cfg.optim.name], []
    shards = stage_shards(cfg, world)
    probe = copy_module.deepcopy(model)  # its batch norm statistics move: the model's are left as they were
    m = p.microbatch_count(batch)
    with torch.random.fork_rng():
        x = torch.randn(max(1, batch // m), data.in_channels, *data.image_size)
        with dev.autocast(torch.device("cpu"), precision):
            starts = pp.planned_cuts(model, p, x, copies, shards, m)
        for i in range(p.stages):
            out.append(_stage_estimate(p, probe, starts, i, x, precision, copies, shards, m))
            x = out[-1].pop("output")
    return out


def _stage_estimate(p, model, starts: list[int], i: int, x: torch.Tensor, precision: str, copies: int,
                    shards: int = 1, microbatches: int = 0) -> dict:
    """Stage ``i``'s row of ``stage_estimates``, with its output (the next stage's input) under ``output``."""
    from brickyard.distributed import pipeline as pp  # lazy: pipeline runs only
    stage = pp.stage_module(model, starts, i).train()
    params = -(-sum(q.numel() * q.element_size() for q in stage.parameters()) // shards)
    grads = -(-sum(q.numel() * q.element_size() for q in stage.parameters() if q.requires_grad) // shards)
    with dev.autocast(torch.device("cpu"), precision):
        act, y = pp.saved_bytes(stage, x.detach().requires_grad_(i > 0))
    flight = pp.in_flight(p.schedule, microbatches or p.microbatch_count(), p.stages, i)
    return {"stage": i, "first": pp.pieces(model)[starts[i]][0], "parameters": params, "gradients": grads,
            "optimizer_state": copies * grads, "activations_per_microbatch": act, "in_flight": flight,
            "total": params + grads + copies * grads + act * flight, "output": y.float()}


def strategies(est: dict) -> list[tuple[str, float, float]]:
    """(label, fixed bytes, bytes per sample) per rank for DDP, FSDP, FSDP with offload, each with and
    without activation checkpointing (where the model has blocks to checkpoint)."""
    ac = est["activation_checkpointing"]
    acts = [("", ac["without_fixed"] if ac else est["activations_fixed"],
             ac["without_per_sample"] if ac else est["activations_per_sample"])]
    if ac:
        acts.append((" + activation checkpointing", ac["with_fixed"], ac["with_per_sample"]))
    holds = [("ddp", est["whole"])]
    if est["world_size"] > 1:
        holds += [("fsdp", sum(est["sharded"].values()) + est["gathered"]), ("fsdp + offload (GPU)", est["gathered"])]
    return [(name + label, held + a_fixed + est["data_fixed"], a_per + est["sample_buffers"])
            for name, held in holds for label, a_fixed, a_per in acts]


def largest_batch(est: dict, device_memory: int, headroom: float = 0.9) -> int:
    room = device_memory * headroom - est["fixed"]
    return max(0, int(room // max(est["per_sample_total"], 1)))


def report(est: dict, device_memory: int | None, device_label: str) -> str:
    lines = [f"memory per device ({device_label}, batch {est['batch']} per device, precision {est['precision']}, "
             f"world size {est['world_size']}, {est['strategy']}):"]
    copies = f"optimiser state ({est['optimizer_copies']} cop{'y' if est['optimizer_copies'] == 1 else 'ies'})"
    if est["strategy"] in ("ddp", "tensor_parallel"):  # tensor parallel: rank 0's shards and its whole layers
        mine = " (rank 0's)" if est["strategy"] == "tensor_parallel" else ""
        rows = [(f"parameters{mine}", est["parameters"]), (f"gradients{mine}", est["gradients"]),
                (f"{copies}{mine}", est["optimizer_state"])]
    else:
        where = "in host memory" if est["host_offloaded"] else f"1/{est['world_size']}"
        rows = [(f"parameters ({where})", 0 if est["host_offloaded"] else est["sharded"]["parameters"]),
                (f"gradients ({where})", 0 if est["host_offloaded"] else est["sharded"]["gradients"]),
                (f"{copies} ({where})", 0 if est["host_offloaded"] else est["sharded"]["optimizer_state"]),
                ("gathered while computing", est["gathered"])]
    rows += [
            (f"activations ({fmt(est['activations_per_sample'])}/sample)", est["activations"]),
            ("batch buffers", est["batch_buffers"]), ("in-memory data set", est["data_on_device"]),
            ("total", est["total"])]
    for name, v in rows:
        lines.append(f"  {name:<38} {fmt(v):>14}")
    ac = est.get("activation_checkpointing")
    if ac and ac["on"]:
        without = {**est, "fixed": est["fixed"] - est["activations_fixed"] + ac["without_fixed"],
                   "per_sample_total": est["per_sample_total"] - est["activations_per_sample"] + ac["without_per_sample"]}
        lines.append(f"  activation checkpointing on {ac['blocks']} blocks: activations {fmt(est['activations_per_sample'])}"
                     f"/sample; without it {fmt(ac['without_per_sample'])}/sample "
                     f"({fmt(ac['without_fixed'] + ac['without_per_sample'] * est['batch'])} at this batch)")
        if device_memory:
            lines.append(f"  largest batch that fits without checkpointing: {largest_batch(without, device_memory):,}")
    for st in est.get("stages") or ():
        lines.append(f"  pipeline stage {st['stage']} (from {st['first']}): parameters {fmt(st['parameters'])}, gradients "
                     f"{fmt(st['gradients'])}, optimiser state {fmt(st['optimizer_state'])}, activations "
                     f"{fmt(st['activations_per_microbatch'])} x {st['in_flight']} microbatches in flight: "
                     f"{fmt(st['total'])} a rank")
    if est["loader_host_buffers"]:
        lines.append(f"  {'(host) streaming loader buffers':<38} {fmt(est['loader_host_buffers']):>14}")
    if device_memory:
        fits = largest_batch(est, device_memory)
        verdict = "fits" if est["total"] <= device_memory * 0.9 else "does NOT fit"
        lines.append(f"with {fmt(device_memory)} per device (90% usable): batch {est['batch']} {verdict}; "
                     f"largest batch that fits: {fits:,}")
    lines.append(f"per rank, world size {est['world_size']}, batch {est['batch']}"
                 + (f" (largest batch that fits in {fmt(device_memory)})" if device_memory else "") + ":")
    for label, fixed, per in strategies(est):
        fits = f"  {largest_batch({'fixed': fixed, 'per_sample_total': per}, device_memory):>9,}" if device_memory else ""
        lines.append(f"  {label:<50} {fmt(fixed + per * est['batch']):>14}{fits}")
    return "\n".join(lines)


def device_batch(cfg, world: int) -> int:
    """The largest per-device batch a step of ``cfg`` takes on ``world`` processes (1 for ``auto``)."""
    if cfg.data.batch_size == "auto" and not cfg.data.global_batch_size:
        return 1
    return max(device_batches(cfg.data, cfg.train.grad_accum, world))


def oom_tips(est: dict, cfg) -> str:
    """Concrete ways out of an out-of-memory error for this model."""
    b = est["batch"]
    half = max(1, b // 2)
    saved_opt = est["optimizer_state"]
    accum = ([f"train.grad_accum={2 * cfg.train.grad_accum} (the global batch stays, each step in smaller parts)"]
             if cfg.data.global_batch_size else
             [f"train.grad_accum={2 * cfg.train.grad_accum} with data.batch_size={half} keeps the global batch"])
    tips = [f"data.batch_size={half} (saves about {fmt(est['activations_per_sample'] * (b - half))})"] + accum
    if est["precision"] == "fp32":
        tips.append(f"train.precision=bf16 (activations about {fmt(est['activations'] / 2)} instead of {fmt(est['activations'])})")
    if saved_opt:
        tips.append(f"optim.name=sgd (no optimiser state: saves {fmt(saved_opt)})")
    return "; ".join(tips)


def _available_host_memory() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


CPU_BATCH = 256  # `auto` on a CPU: the cores are busy well before this for the nets here
MIN_STEPS = 20   # `auto` never makes an epoch shorter than this many steps


def auto_batch(cfg, model, data, device: torch.device, world: int, train_size: int) -> tuple[int, str]:
    """The largest per-device batch that fits, and how it was found.

    On a GPU: real forward/backward steps at doubling batch sizes, with the optimiser state's bytes
    held in reserve, until one runs out of memory; on a CPU: the estimate against half of the
    available RAM, and at most ``CPU_BATCH``: there memory rarely binds, and a larger batch buys no
    speed but fewer steps. Always capped so an epoch has at least ``MIN_STEPS`` steps per rank."""
    cap = max(1, min(4096, train_size // (max(world, 1) * MIN_STEPS)))
    if device.type != "cuda":
        est = estimate(cfg, model, data, device, world, compare=False)
        budget = _available_host_memory() // 2
        fits = largest_batch(est, budget, headroom=1.0)
        return max(1, min(cap, CPU_BATCH, fits)), (f"at most {CPU_BATCH} on a CPU and {MIN_STEPS} steps an epoch; "
                                                   f"{fits:,} would fit in half of {fmt(2 * budget)} available RAM")
    est = estimate(cfg, model, data, torch.device("cpu"), world, compare=False)
    precision = dev.resolve_precision(cfg.train.precision, device)
    model = model.to(device)
    reserve = torch.empty(int(est["optimizer_state"]) // 4 + 1, device=device)  # optimiser state comes later
    best, b = 0, 8
    c, (h, w) = data.in_channels, data.image_size
    while b <= cap:
        try:
            x = torch.randn(b, c, h, w, device=device)
            with dev.autocast(device, precision):
                loss = F.cross_entropy(model(x).float(), torch.zeros(b, dtype=torch.long, device=device))
            loss.backward()
            model.zero_grad(set_to_none=True)
            best, b = b, b * 2
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            break
        finally:
            torch.cuda.empty_cache()
    del reserve
    if best == 0:
        raise BrickyardError(f"data.batch_size: auto found that even a batch of 8 does not fit on {device}; {oom_tips(est, cfg)}.")
    best = max(1, int(best * 0.9)) if best < cap else best  # the allocator needs some slack
    return best, "probing real steps"


def measure_cuda_step(cfg, data, device) -> int:
    """Peak ``max_memory_allocated`` of two real training steps at the configured batch."""
    torch.cuda.reset_peak_memory_stats(device)
    precision = dev.resolve_precision(cfg.train.precision, device)
    cl = dev.resolve_channels_last(cfg.train.channels_last, precision, device)
    model = models.build(cfg, data).to(device, memory_format=torch.channels_last if cl else torch.preserve_format)
    opt = build_optimizer(cfg.optim, param_groups(model, cfg.optim))
    images = data.train.images.to(device) if data.in_memory else None
    b = device_batch(cfg, 1)
    for _ in range(2):
        x = images[:b] if images is not None else torch.randint(
            0, 255, (b, data.in_channels, *data.image_size), dtype=torch.uint8, device=device)
        x = DevicePrep(data.mean, data.std, channels_last=cl, device=device)(x)
        with dev.autocast(device, precision):
            loss = F.cross_entropy(model(x).float(), torch.zeros(len(x), dtype=torch.long, device=device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)
