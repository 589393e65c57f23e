"""``brickyard plot``."""
from __future__ import annotations

import argparse

# what `main` advises when the host's memory runs out during this command (it trains nothing: no batch size)
MEMORY_ADVICE = "the plots read the run's metrics.jsonl and test_errors.pt whole; check that they are a run's own"


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    pl = sub.add_parser("plot", help="PNG curves (several runs overlay), confusion matrix, misclassified images",
                        epilog="examples:\n  brickyard plot runs/a\n  brickyard plot runs/a runs/b --out compare/\n", formatter_class=raw)
    pl.add_argument("runs", nargs="+", metavar="RUN_DIR")
    pl.add_argument("--out", help="folder for the PNG files (default: the first run directory)")


def run(args) -> int:
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard.observe.plots import plot_runs
    for path in plot_runs(args.runs, args.out):
        print(path)
    return 0
