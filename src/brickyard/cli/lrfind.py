"""``brickyard lr-find``: the learning-rate range test, on the devices you pick; nothing of any run changes."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from brickyard.config import load_config
from brickyard.distributed import env as dist
from brickyard.errors import BrickyardError
from brickyard.launch import torchrun as launch


def add(sub) -> None:
    f = sub.add_parser("lr-find", help="the learning-rate range test: a suggested optim.lr and a plot",
                       epilog="examples:\n  brickyard lr-find mnist --out runs/lr\n"
                              "  brickyard lr-find my.yaml --devices cpu:2 --set optim.name=nesterov\n",
                       formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    f.add_argument("config", nargs="?", default=None, help="a preset name or a YAML file (default: mnist)")
    f.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    f.add_argument("--out", help="folder for lr_find.png and lr_find.json")
    f.add_argument("--devices", help="cpu, cpu:N, cuda, or GPU ids like 0,1 (several: one job, the ranks agree on the loss)")
    f.add_argument("--min-lr", type=float, default=1e-8)
    f.add_argument("--max-lr", type=float, default=1.0)
    f.add_argument("--steps", type=int, default=100)
    f.add_argument("--result", help=__import__("argparse").SUPPRESS)  # a worker job writes rank 0's result here


def run(args) -> int:
    cfg = load_config(args.config or "mnist", args.overrides)  # before torch is imported
    from brickyard.files import write_json
    from brickyard.tools import lrfind
    lrfind.check_range(args.min_lr, args.max_lr, args.steps)  # before a job of several processes starts
    job = launch.Job.from_args(args, cfg.dist.timeout_s, devices=args.devices)
    if job.world > 1 and not args.result:
        with tempfile.TemporaryDirectory() as d:
            result = Path(d) / "result.json"
            argv = ["-m", "brickyard", "lr-find"] + ([args.config] if args.config else [])
            for item in args.overrides + [f"train.device={job.device}"]:
                argv += ["--set", item]
            argv += ["--min-lr", str(args.min_lr), "--max-lr", str(args.max_lr), "--steps", str(args.steps),
                     "--devices", args.devices, "--result", str(result)]
            code = launch.run_torchrun(job, argv, Path(d))
            if code != 0 or not result.is_file():
                raise BrickyardError(f"lr-find --devices {args.devices} failed (exit code {code}).")
            r = json.loads(result.read_text())
    else:
        if job.world == 1 and args.devices:
            cfg = cfg.replace(**{"train.device": job.device})
        r = lrfind.sweep(cfg, args.min_lr, args.max_lr, args.steps)
        if args.result:
            if dist.rank_from_env() == 0:
                write_json(Path(args.result), r)
            return 0
    print(lrfind.line(r))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "lr_find.json", r)
        print(f"plot: {lrfind.plot(r, out / 'lr_find.png')}")
    return 0
