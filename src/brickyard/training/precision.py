"""``train.precision: auto`` on a CPU, decided by measuring, not by the CPU's flags.

A CPU that reports native bf16 (AVX-512-BF16, AMX) is not always faster in bf16: which kernels oneDNN
has for a chip decides it. Measured with ``brickyard bench mnist --devices cpu --steps 150`` (2 cores,
torch 2.13): on an AMD EPYC with AVX-512-BF16, bf16 was the faster one; on an Intel Xeon with
AVX-512-BF16 but no AMX, fp32 ran 18,100-18,300 img/s against bf16's 11,900-12,400. So where both are
possible, ``choose`` times a few training steps (forward and backward) of the run's own model at its
own per-device batch in each precision, alternating, for about half a second each, and takes bf16 only
when it is at least ``MARGIN`` faster (a tie keeps fp32's exact arithmetic). The answer is cached per CPU
model, torch version and model signature (``$BRICKYARD_CACHE/precision.json``), so a machine measures
a model once. ``BRICKYARD_CPU_BF16=0|1`` still forces the answer without measuring; where bf16 is not
native (AVX2 only: emulated, several times slower) nothing is measured and fp32 is the answer. On CUDA
the rule stays: bf16 where the GPU supports it.
"""
from __future__ import annotations

import copy
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from brickyard.data.idx import cache_dir
from brickyard.distributed import process as dist
from brickyard.files import write_json
from brickyard.training import device as dev

MARGIN = 0.10          # bf16 must take at most 90% of fp32's time per step
BUDGET_S = 0.5         # timed seconds per precision (at least MIN_STEPS steps each)
MIN_STEPS, MAX_STEPS = 2, 20
MAX_BATCH = 256        # the measured batch: the run's per-device batch, at most this


def needs_measuring(precision: str, device: torch.device) -> bool:
    forced = os.environ.get("BRICKYARD_CPU_BF16", "").strip() in ("0", "1")
    return precision == "auto" and device.type == "cpu" and not forced and dev.bf16_supported(device)


def decide(setting: str, model, data, batch: int, host, rank: int) -> tuple[str, dict | None]:
    """The precision every rank of a CPU job trains in, and what was measured (None when nothing was):
    rank 0 decides, measuring where its CPU could run either, and hands the answer to every rank, so
    machines of different CPUs in one job agree. A collective on CPU runs with ``auto`` (every rank calls
    it); elsewhere ``host.precision`` as ``training.device`` resolved it."""
    if setting != "auto" or host.device.type != "cpu":
        return host.precision, None
    decided = None
    if rank == 0:
        record = _measured(setting, model, data, batch, host.device, host.threads, host.channels_last)
        decided = (record["chosen"] if record else host.precision, record)
    return dist.broadcast_object(decided)


def for_model(setting: str, model, data, batch: int, device: torch.device, channels_last: bool) -> str:
    """``setting`` resolved outside a training job (``brickyard eval``, the memory estimate) as training
    resolves it on this machine: on a CPU with native bf16, ``auto`` is measured (or recalled from the
    cache, which a run on this machine has filled) for this model at ``batch``; elsewhere the rule."""
    record = _measured(setting, model, data, batch, device, torch.get_num_threads(), channels_last)
    return record["chosen"] if record else dev.resolve_precision(setting, device)


def _measured(setting: str, model, data, batch: int, device: torch.device, threads: int, channels_last: bool) -> dict | None:
    """``choose``'s record where ``setting`` is measured for image data on ``device``; None where the rule decides."""
    if needs_measuring(setting, device) and data.is_images:
        shape = data.sample_shape or (data.in_channels, *data.image_size)
        return choose(model, shape, batch, device, threads, channels_last)
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def signature(model: torch.nn.Module, sample_shape, batch: int, threads: int, channels_last: bool) -> str:
    n = sum(p.numel() for p in model.parameters())
    shape = "x".join(map(str, sample_shape))
    return f"{type(model).__name__}:{n}:{shape}:b{batch}:t{threads}:{'cl' if channels_last else 'cf'}"


def choose(model, sample_shape, batch: int, device: torch.device, threads: int, channels_last: bool,
           clock=time.perf_counter, cache: Path | None = None) -> dict:
    """Measure (or recall) fp32 against bf16 for this model; returns the record ``env.json`` keeps:
    ``chosen``, ``fp32_ms`` and ``bf16_ms`` per step, ``cpu``, ``cached``, and ``how`` (the log's words).
    ``clock`` is injectable (tests force each outcome with a fake one)."""
    batch = max(1, min(batch, MAX_BATCH))
    key = f"{cpu_model()}|torch {torch.__version__}|{signature(model, sample_shape, batch, threads, channels_last)}"
    path = cache or cache_dir("precision") / "precision.json"
    known = _read(path)
    if _whole_record(known.get(key)):
        return {**known[key], "cached": True, "how": _words(known[key], cached=True)}
    try:
        fp32, bf16 = _time(model, sample_shape, batch, device, channels_last, clock)
    except Exception as e:  # noqa: BLE001  a model that cannot run on random input: the rule decides
        chosen = "bf16"
        return {"chosen": chosen, "cpu": cpu_model(), "cached": False,
                "how": f"could not be measured ({type(e).__name__}); bf16, as this CPU reports native bf16"}
    record = {"chosen": "bf16" if bf16 <= (1 - MARGIN) * fp32 else "fp32", "fp32_ms": round(fp32 * 1e3, 3),
              "bf16_ms": round(bf16 * 1e3, 3), "cpu": cpu_model()}
    try:
        write_json(path, {**{k: v for k, v in known.items() if isinstance(v, dict)}, key: record})
    except OSError:
        pass  # a read-only cache: measured again next time
    return {**record, "cached": False, "how": _words(record, cached=False)}


def _whole_record(r) -> bool:
    """A cached measurement as ``choose`` writes it (the cache is a file anyone could have edited)."""
    return (isinstance(r, dict) and r.get("chosen") in ("fp32", "bf16") and isinstance(r.get("cpu"), str)
            and all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) and math.isfinite(r[k])
                    for k in ("fp32_ms", "bf16_ms")))


def _words(r: dict, cached: bool) -> str:
    said = "measured on this machine before" if cached else "measured"
    return (f"{said}: fp32 {r['fp32_ms']:.1f} ms/step, bf16 {r['bf16_ms']:.1f} ms/step on {r['cpu']}; bf16 is taken "
            f"when at least {MARGIN:.0%} faster")


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _time(model, sample_shape, batch, device, channels_last, clock) -> tuple[float, float]:
    """Median seconds per forward+backward step in fp32 and in bf16, alternating, on a copy of ``model``."""
    m = copy.deepcopy(model).to(device)
    x = torch.randn(batch, *sample_shape, device=device)
    if channels_last and x.dim() == 4:
        m = m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    m.train()

    def step(precision: str) -> float:
        start = clock()
        with dev.autocast(device, precision):
            out = m(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.float().square().mean().backward()
        m.zero_grad(set_to_none=True)
        return clock() - start

    step("fp32"), step("bf16")  # warm-up: first-call allocations and kernel choices
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    spent = 0.0
    while len(times["bf16"]) < MAX_STEPS and (len(times["bf16"]) < MIN_STEPS or spent < 2 * BUDGET_S):
        for precision in ("fp32", "bf16"):
            t = step(precision)
            times[precision].append(t)
            spent += t
    return tuple(sorted(v)[len(v) // 2] for v in (times["fp32"], times["bf16"]))
