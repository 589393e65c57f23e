"""``brickyard predict``."""
from __future__ import annotations

import argparse
from pathlib import Path

from brickyard.config.checks import TTA

# what `main` advises when the host's memory runs out during this command (it trains nothing: no batch size)
MEMORY_ADVICE = "give fewer or smaller inputs at a time (every input is read before the model runs)"


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    pr = sub.add_parser("predict", help="classes, probabilities and chosen layers' outputs for images or an .npy array",
                        epilog="examples:\n  brickyard predict runs/a/checkpoints/best.pt digit.png\n"
                               "  brickyard predict best.pt x.npy --outputs 0,3 --format npz --out out.npz\n", formatter_class=raw)
    pr.add_argument("checkpoint", help="a checkpoint file, a run directory (its best.pt, else its newest step), "
                                       "or a file from `brickyard export`")
    pr.add_argument("inputs", nargs="+", metavar="INPUT")
    pr.add_argument("--outputs", default="", help="comma-separated layer names, e.g. 0,3 or layer1.0.conv1")
    pr.add_argument("--format", choices=("json", "npz"), default="json")
    pr.add_argument("--out", help="write to this file instead of printing")
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--tta", choices=TTA, default="none",
                    help="test-time augmentation: each image's probabilities are the mean over its views (flip, "
                         "flip-shift, five-crop, multi-scale: as brickyard eval's --tta)")
    pr.add_argument("--uncalibrated", action="store_true",
                    help="probabilities of the raw outputs, not divided by the temperature the checkpoint keeps "
                         "(train.calibrate)")
    pr.add_argument("--trust-code", action="store_true",
                    help="load a TorchScript or .pt2 program, which can run code it brings: only files from a source you "
                         "trust (checkpoints and safetensors files hold weights only and need no trust)")


def run(args) -> int:
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard.api import load_checkpoint_model
    from brickyard.tools.export import is_exported, load_exported
    from brickyard.tools.predict import load_inputs, predict, write
    if is_exported(args.checkpoint):
        _, meta = load_exported(args.checkpoint, args.trust_code)
    else:
        meta = load_checkpoint_model(args.checkpoint)[1]["meta"]
    outputs = [o for o in args.outputs.split(",") if o]
    x, names = load_inputs(args.inputs, meta["in_channels"], meta["image_size"])
    result = predict(args.checkpoint, x, outputs, args.device, trust_code=args.trust_code, tta=args.tta,
                     calibrated=not args.uncalibrated)
    text = write(result, names, outputs, args.format, Path(args.out) if args.out else None)
    if text:
        print(text)
    return 0
