"""``brickyard eval``."""
from __future__ import annotations

import argparse
import json

from brickyard.config.checks import TTA
from brickyard.errors import BrickyardError

EXAMPLES = """examples:
  brickyard eval runs/mnist-20261121-120000/checkpoints/best.pt
  brickyard eval runs/a/checkpoints/step-0000782.pt --split val
  brickyard eval runs/a --tta flip-shift     # the best checkpoint, scored with its mirror and 1-pixel moves
  brickyard eval runs/a --tta five-crop      # ... as the mean of five crops' probabilities
  brickyard eval runs/a --limit 1000         # the first 1,000 test images only: a quick look
"""


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    e = sub.add_parser("eval", help="evaluate a checkpoint", epilog=EXAMPLES, formatter_class=raw)
    e.add_argument("checkpoint", help="a checkpoint file, or a run directory (its best.pt, else its newest step)")
    e.add_argument("--split", choices=("val", "test", "train"), default="test")
    e.add_argument("--device", default="auto")
    e.add_argument("--tta", choices=TTA, default=None,
                   help="test-time augmentation (default: the run's data.tta): flip averages each image's class "
                        "probabilities with its mirror's; flip-shift adds both moved data.shift pixels (1 where the "
                        "run had none) four ways; five-crop: the corners' and centre's crops of 0.875 of each side; "
                        "multi-scale: the image at 0.875, 1 and 1.125 of its size, each with its mirror")
    e.add_argument("--limit", type=int, default=0, metavar="N",
                   help="the first N images of the split only (default 0: all of it, whatever the run's data.eval_limit)")
    e.add_argument("--uncalibrated", action="store_true",
                   help="score the raw outputs, not divided by the temperature the checkpoint keeps (train.calibrate)")


def run(args) -> int:
    if args.limit < 0:
        raise BrickyardError(f"--limit {args.limit}: give a number of images (0: the whole split).")
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard.api import evaluate_checkpoint
    r = evaluate_checkpoint(args.checkpoint, args.split, args.device, args.tta, args.limit, not args.uncalibrated)
    print(json.dumps(r))
    return 0
