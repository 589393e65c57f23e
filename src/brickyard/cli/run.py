"""``brickyard run``."""
from __future__ import annotations

import argparse
import sys

from brickyard.errors import BrickyardError
from brickyard.launch import torchrun as launch


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    ru = sub.add_parser("run", help="run your own script (that calls brickyard.fit) on the devices you pick",
                        epilog="examples:\n  brickyard run --devices cpu:2 my_script.py --epochs 3\n"
                               "  brickyard run --devices 0,1 --run-dir runs/mine train_mine.py\n\n"
                               "Each process runs the script with torchrun's RANK, WORLD_SIZE, ... set; brickyard.fit() in it\n"
                               "trains its share. BRICKYARD_DEVICE is cpu or cuda; --run-dir and --log-dir reach fit() as\n"
                               "BRICKYARD_RUN_DIR and BRICKYARD_LOG_DIR.\n", formatter_class=raw)
    ru.add_argument("--devices", metavar="SPEC", default="cpu", help="cpu, cpu:N, cuda, all, or GPU ids like 0,1,2,3")
    ru.add_argument("--run-dir", help="the run directory fit() uses (default: fit's own)")
    ru.add_argument("--log-dir", help="folder for workerlog.N files (default RUN_DIR/logs)")
    ru.add_argument("--max-restarts", type=int, default=0, help="restarts after a failure (fit resumes from the newest checkpoint)")
    ru.add_argument("--nnodes", default="1", metavar="N|MIN:MAX", help="number of machines (MIN:MAX: elastic, needs --max-restarts)")
    ru.add_argument("--node-rank", type=int, default=None, help="this machine's index, 0..nnodes-1; node 0 hosts the rendezvous")
    ru.add_argument("--master", metavar="HOST:PORT", help="address of node 0")
    ru.add_argument("--timeout", type=int, default=300, help="seconds to wait for all nodes (default 300)")
    ru.add_argument("script", help="a Python file")
    ru.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


OWN = ("--devices", "--run-dir", "--log-dir", "--max-restarts", "--nnodes", "--node-rank", "--master", "--timeout")


def run(args) -> int:
    if args.max_restarts < 0 or args.timeout < 1:
        raise BrickyardError("--max-restarts must be at least 0 and --timeout at least 1.")
    misplaced = [a.partition("=")[0] for a in args.script_args if a.partition("=")[0] in OWN]
    if misplaced:  # torchrun's rule too; said, not refused: a script may have a --devices of its own
        print(f"note: {', '.join(misplaced)} after {args.script} went to the script; brickyard run's own options come "
              f"before it (brickyard run {misplaced[0]} ... {args.script} ...)", file=sys.stderr)
    return launch.launch_script(args)
