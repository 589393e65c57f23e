"""``brickyard export``."""
from __future__ import annotations

import argparse


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    ex = sub.add_parser("export", help="a trained model as safetensors weights or a self-contained inference program",
                        epilog="examples:\n  brickyard export runs/a --format safetensors\n"
                               "  brickyard export runs/a/checkpoints/best.pt --format torchscript --out digits.torchscript.pt\n"
                               "  brickyard predict digits.torchscript.pt digit.png\n", formatter_class=raw)
    ex.add_argument("source", help="a checkpoint file, or a run directory (its best.pt, else its newest step)")
    ex.add_argument("--format", default="safetensors", choices=("safetensors", "torchscript", "torch-export", "onnx"),
                    help="safetensors: weights and metadata; torchscript / torch-export / onnx: a program that takes images in 0..1")
    ex.add_argument("--out", help="file to write (default: beside the checkpoint)")


def run(args) -> int:
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard.tools.export import export
    notes: list[str] = []
    path = export(args.source, args.format, args.out, notes)
    print(f"wrote {path} ({args.format})" + "".join(f"; {n}" for n in notes))
    return 0
