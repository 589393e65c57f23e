"""Device, precision and thread choices; every refusal is a ``DeviceError`` sentence."""
from __future__ import annotations

import contextlib
import os
import platform
import resource
import sys
from dataclasses import dataclass

import torch

from brickyard.data.loaders import plan_workers
from brickyard.errors import DeviceError


def resolve_device(spec: str, local_rank: int = 0) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``; ``cuda`` means the GPU of this local rank."""
    spec = spec.strip().lower()
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r} asked for, but CUDA is not available on this machine (use --device cpu).")
        count = torch.cuda.device_count()
        index = local_rank if spec == "cuda" else _index(spec)
        if index >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            note = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
            raise DeviceError(f"GPU {index} does not exist; this machine shows {count} GPU(s){note}.")
        return torch.device("cuda", index)
    raise DeviceError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N.")


def _index(spec: str) -> int:
    try:
        return int(spec.split(":", 1)[1])
    except ValueError:
        raise DeviceError(f"device {spec!r}: the part after 'cuda:' must be a GPU number.") from None


def bf16_supported(device: torch.device) -> bool:
    """Whether bf16 runs natively here. ``BRICKYARD_CPU_BF16=0|1`` forces the CPU answer, so the test
    suite can be run as it would run on the other kind of CPU."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    forced = os.environ.get("BRICKYARD_CPU_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:  # without AVX-512 BF16 / AMX, bf16 on CPU is emulated and several times slower
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if bf16_supported(device) else "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise DeviceError("train.precision: 'fp16' needs a CUDA device; use bf16 or fp32 on a CPU.")
    return precision


def resolve_channels_last(value, precision: str, device: torch.device) -> bool:
    """``train.channels_last``; ``auto`` is on (for image data; ``training.trainer.place`` leaves it off for
    other inputs and under FSDP). Why a rule and not a measurement: it was faster for every conv net
    measured, on CPU in fp32 and bf16 (+40-50%, docs/benchmarks.md) and on GPUs, and a net without
    convolutions computes the same either way, so timing both per run would cost a second to confirm
    what the measurements already show."""
    if value == "auto":
        return True
    return bool(value)


COMPILE_MIN_PARAMS = 5_000_000  # ResNet-18 (11.7M), ResNet-50, VGG16, ViT-S; not the MNIST nets (30k-430k)
COMPILE_MIN_STEPS = 15_000


def cudnn_benchmark(n_params: int) -> bool:
    """Whether cuDNN tries every kernel for each convolution shape first (``torch.backends.cudnn.benchmark``):
    for models of ``COMPILE_MIN_PARAMS`` or more. On an H200 (2026-11-27, cProfile of the default MNIST recipe)
    mnist_fast's first four steps took 1.75 s, most of it the search for its three convolutions at each batch
    shape (training, the short last batch; evaluation's too), which a run of a few hundred 0.4 ms steps never
    wins back; without it (and with evaluation's host-side count) the recipe's training loop took 0.9-1.1 s
    instead of 1.9-3.6 s. The plain script it is compared with does not search at all."""
    return n_params >= COMPILE_MIN_PARAMS


def resolve_compile(value, device: torch.device, n_params: int, steps: int) -> bool:
    """``train.compile``. ``auto`` compiles where compilation can pay for itself: on CUDA, for a model of
    at least 5M parameters, in a run of at least 15,000 steps. Never on CPUs: compiled small nets ran
    slower there (docs/benchmarks.md, "Tried and dropped"). The threshold is measured
    (``benchmarks/gpu_check.sh``, ResNet-50 at batch 128, 224 px, bf16, H200, 2026-11-26): a pass of 32
    steps took 0.97 s eager and 0.85 s compiled (1.15x), and compiling cost 44 s more than eager's first
    pass, so compiling pays after about 11,400 steps; 15,000 keeps a margin for the spread of compiled
    steps (0.70-1.04 s a pass). It was 1,000, then 10,000 (below break-even) before the steady speeds were
    read apart from the compile time. Why not measure per run: a trial compile costs the tens of seconds
    it is meant to save, so the answer could only come too late."""
    if value == "auto":
        return device.type == "cuda" and n_params >= COMPILE_MIN_PARAMS and steps >= COMPILE_MIN_STEPS
    return bool(value)


_AUTOCASTS: dict[tuple[str, bool], torch.autocast] = {}


def autocast(device: torch.device, precision: str, cache: bool = True):
    """The autocast context of ``precision`` (none for fp32); ``cache``: its cache of cast weights (off inside a
    CUDA graph, as torch's notes on graphs ask). On CUDA made once a precision and copied for each use:
    ``torch.autocast.__init__`` asks CUDA whether the GPU has bf16 (``is_bf16_supported``), about 0.7 ms of every
    step on an H200 (docs/benchmarks.md, "GPU"); a copy holds its own saved state, so nesting stays safe. On a
    CPU a new one is cheaper than the copy."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if device.type != "cuda":
        return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)
    made = _AUTOCASTS.get((precision, cache))
    if made is None:
        made = _AUTOCASTS[(precision, cache)] = torch.autocast("cuda", dtype=dtype, cache_enabled=cache)
    fresh = object.__new__(torch.autocast)
    fresh.__dict__.update(made.__dict__)
    return fresh


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (``taskset``, cgroups, Slurm), all of them where that is unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def set_threads(requested: int, local_world_size: int) -> int:
    """Intra-op threads for this process: N processes on C usable cores get C // N each (at least 1)."""
    n = requested or max(1, len(usable_cpus()) // max(1, local_world_size))
    torch.set_num_threads(n)
    return n


def pin_cpus(local_rank: int, local_world_size: int, threads: int) -> tuple[int, ...] | None:
    """Keep local rank r on its own ``threads`` CPUs (the r-th slice of the usable ones), it and every
    thread it starts later (OpenMP, gloo); None when there is one process or the slices do not fit.

    Measured on 2 cores (``benchmarks/cpu_scaling.py``): +1-3% with DDP, -1-3% with the flat sync,
    whose spinning wait then shares one core with gloo's thread; so it is not a default."""
    cpus = usable_cpus()
    if local_world_size < 2 or not hasattr(os, "sched_setaffinity") or threads * local_world_size > len(cpus):
        return None
    mine = tuple(cpus[local_rank * threads:(local_rank + 1) * threads])
    os.sched_setaffinity(0, mine)
    return mine


# mallopt(3) parameters of glibc
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_allocator() -> bool:
    """Keep freed host memory for reuse instead of handing it back to the kernel.

    glibc serves large blocks (a batch of activations) with mmap and returns them on free, so every
    training step page-faults and zeroes them again: measured here as most of the system time and a
    1.1-1.4x slower CPU step. Raising the mmap and trim thresholds and padding the heap keeps them;
    the cost is that the process's resident memory stays at its peak. Linux with glibc only."""
    import ctypes  # only for glibc's mallopt, on Linux
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(k, v) == 1 for k, v in (
            (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False


@dataclass(frozen=True)
class Host:
    """This process's device and the speed settings chosen for it (the first log line, ``env.json``)."""
    device: torch.device
    threads: int
    allocator: str
    precision: str
    channels_last: bool
    pinned: tuple[int, ...] | None = None  # the CPUs this process is kept on
    own_cores: bool = True  # no other process of this machine's job shares this one's CPUs
    workers: int = 0        # the training loader's worker processes (``data.num_workers``, planned)


def setup(t, local_rank: int = 0, local_world_size: int = 1, workers=0, streams: bool = False) -> Host:
    """Resolve ``train.device``/``precision``/``channels_last`` and set this process's CPU threads and
    allocator; ``t`` is the config's ``train`` section, ``workers`` its ``data.num_workers`` and
    ``streams`` whether the training data is read by a streaming loader. The loader's workers are
    planned with the threads (``data.loaders.plan_workers``): on a CPU, workers the user did not ask
    for take cores from the threads, so the process never has more busy threads than cores."""
    device = resolve_device(t.device, local_rank)
    cpu = device.type == "cpu"
    cores = max(1, len(usable_cpus()) // max(1, local_world_size))
    n_workers = plan_workers(workers, streams, cpu, cores)
    planned = workers == "auto" and cpu and not t.threads
    threads = set_threads(max(1, cores - n_workers) if planned else t.threads, local_world_size) if cpu else torch.get_num_threads()
    pinned = pin_cpus(local_rank, local_world_size, threads) if cpu and t.pin_cpus else None
    allocator = "glibc heap kept" if cpu and t.tune_allocator and tune_allocator() else "default"
    precision = resolve_precision(t.precision, device)
    own = not cpu or pinned is not None or threads * local_world_size <= len(usable_cpus())
    return Host(device, threads, allocator, precision, resolve_channels_last(t.channels_last, precision, device), pinned, own,
                n_workers)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()})"


def rss_mib() -> float:
    """This process's resident memory now, in MiB (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_memory(device: torch.device) -> dict:
    """The peak of the device's allocations (GPU), or of this process's resident memory (CPU), in MiB."""
    if device.type == "cuda":
        return {"peak_device_memory_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)}
    return {"peak_host_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
