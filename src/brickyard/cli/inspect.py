"""``brickyard inspect``."""
from __future__ import annotations

import argparse
import json
import os

from brickyard.errors import BrickyardError


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    ins = sub.add_parser("inspect", help="one batch forward and backward: a row of statistics per layer",
                         epilog="examples:\n  brickyard inspect mnist\n  brickyard inspect runs/a/checkpoints/best.pt --batch 64 --json\n",
                         formatter_class=raw)
    ins.add_argument("source", metavar="CONFIG|PRESET|CHECKPOINT")
    ins.add_argument("--batch", type=int, default=32)
    ins.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    import torch

    from brickyard import api
    from brickyard.data import build_data
    from brickyard.data.augment import DevicePrep
    from brickyard.observe.inspection import format_table, layer_table
    if args.batch < 1:
        raise BrickyardError(f"--batch {args.batch}: must be at least 1.")
    if args.source.endswith((".pt", ".pth")) or os.path.isdir(args.source):  # a checkpoint or a run directory
        model, _, cfg = api.load_checkpoint_model(args.source)
    else:
        cfg = api.resolve_config(args.source, args.overrides)
        model = None
    data = build_data(cfg.data)
    if model is None:
        torch.manual_seed(cfg.train.seed)
        model = api.build_model(cfg, data)
    from brickyard.data.loaders import eval_batches
    x, y = next(eval_batches(data.train, args.batch, torch.device("cpu")))  # tensors or files (an image folder)
    x = DevicePrep(data.mean, data.std)(x)
    model.train()
    rows = layer_table(model, x, y)
    if args.json:
        print(json.dumps(rows))
    else:
        print(format_table(rows))
    return 0
