"""``brickyard memory``."""
from __future__ import annotations

import argparse

from brickyard.config import load_config
from brickyard.launch import torchrun as launch


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    mem = sub.add_parser("memory", help="memory per device before a run, and the largest batch that fits",
                         epilog="examples:\n  brickyard memory mnist\n  brickyard memory fashion-resnet18 --device-memory 16GiB --devices 0,1\n",
                         formatter_class=raw)
    mem.add_argument("config", nargs="?", default=None, help="a preset name or a YAML file (default: mnist)")
    mem.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    mem.add_argument("--device-memory", help="memory per device, e.g. 16GiB (default: the GPU's, or none on CPU)")
    mem.add_argument("--devices", default="cpu", help="cpu, cpu:N, cuda, or GPU ids (world size and device)")


def run(args) -> int:
    cfg = load_config(args.config or "mnist", args.overrides)  # before torch is imported
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    import torch

    from brickyard import api
    from brickyard.data import build_data
    from brickyard.training import memory as mem
    nproc, kind, _ = launch.parse_devices(args.devices)
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    data = build_data(cfg.data)
    torch.manual_seed(cfg.train.seed)
    model = api.build_model(cfg, data)
    est = mem.estimate(cfg, model, data, device, nproc)
    budget = mem.parse_size(args.device_memory) if args.device_memory else (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
    print(mem.report(est, budget, str(device)))
    if device.type == "cuda":
        measured = mem.measure_cuda_step(cfg, data, device)
        err = (est["total"] - measured) / measured
        print(f"real step on {torch.cuda.get_device_name(device)}: torch.cuda.max_memory_allocated {mem.fmt(measured)}; "
              f"estimate error {100 * err:+.1f}%")
    return 0
