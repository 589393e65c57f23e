"""The ``brickyard`` command line: argparse at the edge, the Python API underneath.

``main(argv=None)`` returns the exit code: 0 on success, 2 for a user error (printed as one
line starting with ``error:``), 130 when interrupted (after a checkpoint was written).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from brickyard.cli import commands
from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError

EXAMPLES = {
    "train": """examples:
  brickyard train                                   # the default preset (mnist), best device
  brickyard train mnist-course                      # the classic course recipe
  brickyard train my.yaml --set optim.lr=0.05 --set data.batch_size=256
  brickyard train mnist --device cpu --run-dir runs/a --resume auto
  brickyard train mnist --devices cpu:2             # 2 processes, gloo all-reduce
  brickyard train mnist --devices 0,1 --log-dir logs  # one process per listed GPU
""",
    "eval": """examples:
  brickyard eval runs/mnist-20261121-120000/checkpoints/best.pt
  brickyard eval runs/a/checkpoints/step-0000782.pt --split val
""",
    "data": """examples:
  brickyard data fetch mnist
  brickyard data info fashion-mnist
  brickyard data export mnist digits/      # then: --set data.name=imagefolder --set data.root=digits
""",
}


class _Parser(argparse.ArgumentParser):
    """argparse with brickyard's one-line errors (its own print the usage first); subcommands inherit it."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`).\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="brickyard", description="Train image classifiers on one CPU, one GPU, "
                                "the GPUs you pick, or many machines.",
                                epilog="run `brickyard COMMAND --help` for a command's options and examples.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    t = sub.add_parser("train", help="train a model", epilog=EXAMPLES["train"], formatter_class=raw)
    t.add_argument("config", nargs="?", default=None, help="a preset name or a YAML file (default: mnist)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. optim.lr=0.05 (repeatable)")
    t.add_argument("--device", help="auto, cpu, cuda or cuda:N (same as --set train.device=...)")
    t.add_argument("--run-dir", help="run directory (default runs/<preset>-<timestamp>)")
    t.add_argument("--resume", metavar="auto|PATH", help="continue from the newest valid checkpoint or a file")
    t.add_argument("--devices", metavar="SPEC", help="cpu, cpu:N, cuda, all, or GPU ids like 0,1,2,3")
    t.add_argument("--log-dir", help="folder for workerlog.N files (default RUN_DIR/logs)")
    t.add_argument("--max-restarts", type=int, default=0, help="restarts of the worker group after a failure")
    t.add_argument("--nnodes", default="1", metavar="N|MIN:MAX", help="number of machines (MIN:MAX: elastic, needs --max-restarts)")
    t.add_argument("--node-rank", type=int, default=None, help="this machine's index, 0..nnodes-1; node 0 hosts the rendezvous (default: the machine that owns --master's address)")
    t.add_argument("--master", metavar="HOST:PORT", help="address of node 0 (or a rendezvous endpoint)")

    _add_inspection(sub, raw)
    _add_performance(sub, raw)
    _add_run(sub, raw)
    sub.add_parser("models", help="list the model registry with parameter counts")
    sub.add_parser("presets", help="list the shipped presets")
    return p


def _add_inspection(sub, raw) -> None:
    """eval, data, plot, inspect, predict."""
    e = sub.add_parser("eval", help="evaluate a checkpoint", epilog=EXAMPLES["eval"], formatter_class=raw)
    e.add_argument("checkpoint", help="a checkpoint file, or a run directory (its best.pt, else its newest step)")
    e.add_argument("--split", choices=("val", "test", "train"), default="test")
    e.add_argument("--device", default="auto")

    d = sub.add_parser("data", help="fetch or describe a data set", epilog=EXAMPLES["data"], formatter_class=raw)
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION")
    for name, doc in (("fetch", "download and verify a data set"), ("info", "where a data set is and what it holds"),
                      ("export", "write a data set as a PNG image folder (train/, val/, test/)")):
        a = dsub.add_parser(name, help=doc)
        a.add_argument("name", help="mnist or fashion-mnist")
        if name == "export":
            a.add_argument("out", metavar="DIR", help="folder to write")
            a.add_argument("--limit", type=int, default=0, help="only the first N images of each class in each split")
        a.add_argument("--root", help="folder holding the data set's files")

    pl = sub.add_parser("plot", help="PNG curves (several runs overlay), confusion matrix, misclassified images",
                        epilog="examples:\n  brickyard plot runs/a\n  brickyard plot runs/a runs/b --out compare/\n", formatter_class=raw)
    pl.add_argument("runs", nargs="+", metavar="RUN_DIR")
    pl.add_argument("--out", help="folder for the PNG files (default: the first run directory)")

    ins = sub.add_parser("inspect", help="one batch forward and backward: a row of statistics per layer",
                         epilog="examples:\n  brickyard inspect mnist\n  brickyard inspect runs/a/checkpoints/best.pt --batch 64 --json\n",
                         formatter_class=raw)
    ins.add_argument("source", metavar="CONFIG|PRESET|CHECKPOINT")
    ins.add_argument("--batch", type=int, default=32)
    ins.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")

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



    ex = sub.add_parser("export", help="a trained model as safetensors weights or a self-contained inference program",
                        epilog="examples:\n  brickyard export runs/a --format safetensors\n"
                               "  brickyard export runs/a/checkpoints/best.pt --format torchscript --out digits.torchscript.pt\n"
                               "  brickyard predict digits.torchscript.pt digit.png\n", formatter_class=raw)
    ex.add_argument("source", help="a checkpoint file, or a run directory (its best.pt, else its newest step)")
    ex.add_argument("--format", default="safetensors", choices=("safetensors", "torchscript", "torch-export"),
                    help="safetensors: weights and metadata; torchscript / torch-export: a program that takes images in 0..1")
    ex.add_argument("--out", help="file to write (default: beside the checkpoint)")


def _add_performance(sub, raw) -> None:
    """bench, memory, boost."""
    b = sub.add_parser("bench", help="throughput, step-time breakdown and scaling over device specs",
                       epilog="examples:\n  brickyard bench mnist --steps 50\n  brickyard bench mnist --devices cpu:1 cpu:2 --out runs/bench\n"
                              "  brickyard bench mnist --devices cpu cpu:2 --rounds 8   (in turn; median of paired ratios)\n"
                              "  brickyard bench mnist --devices 0 0,1 0,1,2,3\n  brickyard bench mnist --loader\n"
                              "  brickyard bench mnist --devices cpu:1 --nnodes 2 --node-rank 0 --master 10.0.0.1:29500   (and rank 1 on node 1)\n", formatter_class=raw)
    b.add_argument("config", nargs="?", default=None, help="a preset name or a YAML file (default: mnist)")
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument("--steps", type=int, default=50, help="timed steps per pass (default 50)")
    b.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    b.add_argument("--devices", nargs="+", metavar="SPEC", help="one or more specs: cpu, cpu:N, cuda, 0,1 ...")
    b.add_argument("--rounds", type=int, default=1, help="run the specs in turn this many times; speed-ups are the median of "
                   "the rounds' ratios, which the host's drift between runs moves less (default 1)")
    b.add_argument("--out", help="folder for bench.json and scaling.png (several specs)")
    b.add_argument("--loader", action="store_true", help="compare the in-memory and streaming loaders")
    b.add_argument("--nnodes", default="1", metavar="N", help="also time each spec across N machines (run the same command on each)")
    b.add_argument("--node-rank", type=int, default=None, help="this machine's index, 0..nnodes-1; node 0 hosts the rendezvous")
    b.add_argument("--master", metavar="HOST:PORT", help="address of node 0 (with --nnodes)")
    b.add_argument("--device", help=argparse.SUPPRESS)
    b.add_argument("--result", help=argparse.SUPPRESS)  # a worker job writes rank 0's result here

    mem = sub.add_parser("memory", help="memory per device before a run, and the largest batch that fits",
                         epilog="examples:\n  brickyard memory mnist\n  brickyard memory fashion-resnet18 --device-memory 16GiB --devices 0,1\n",
                         formatter_class=raw)
    mem.add_argument("config", nargs="?", default=None, help="a preset name or a YAML file (default: mnist)")
    mem.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    mem.add_argument("--device-memory", help="memory per device, e.g. 16GiB (default: the GPU's, or none on CPU)")
    mem.add_argument("--devices", default="cpu", help="cpu, cpu:N, cuda, or GPU ids (world size and device)")

    bo = sub.add_parser("boost", help="dimension-reduction training: stage 1 with snapshots, then P-BFGS in their subspace",
                        epilog="examples:\n  brickyard boost dim-reduce mnist-course --stage1-epochs 5 --stage2-epochs 2\n"
                               "  brickyard boost dim-reduce mnist-course --stage1-epochs 5 --stage2-epochs 2 --from-init\n",
                        formatter_class=raw)
    bsub = bo.add_subparsers(dest="boost_command", metavar="METHOD")
    dr = bsub.add_parser("dim-reduce", help="stage 1 (normal training, snapshots), PCA, stage 2 (P-BFGS)")
    dr.add_argument("config", nargs="?", default=None, help="a preset name or a YAML file (default: mnist-course)")
    dr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    dr.add_argument("--stage1-epochs", type=float, required=True)
    dr.add_argument("--stage2-epochs", type=float, required=True)
    dr.add_argument("--from-init", action="store_true", help="stage 2 starts from the initial weights, not stage 1's end")
    dr.add_argument("--run-dir", help="run directory (stage1/ and stage2/ inside)")
    dr.add_argument("--device", help="auto, cpu, cuda or cuda:N")



def _add_run(sub, raw) -> None:
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


def run() -> None:
    """The console-script entry point: ``main()``, then leave without the interpreter's teardown.

    With torch, torch._dynamo and matplotlib loaded, Python spends 0.5-1 s destroying modules at
    exit. After a successful command everything brickyard wrote is closed (logs, metrics, event
    files, checkpoints, the loader's workers), so only the standard streams need flushing."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0:
        os._exit(0)
    raise SystemExit(code)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except BrickyardError as e:
        if dist.prints_errors():  # other ranks hit the same error; theirs is in their workerlog
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # a run or output folder that cannot be made or written, a full disk
        if dist.prints_errors():
            where = f"{e.filename}: " if e.filename else ""
            print(f"error: {where}{e.strerror or e}.", file=sys.stderr)
        return 1


def cmd_train(args) -> int:
    from brickyard.launch import torchrun as launch
    from brickyard.config import load_config  # before torch is imported: a bad key or value is an instant error
    overrides = list(args.overrides)
    if args.device:
        overrides.append(f"train.device={args.device}")
    cfg = load_config(args.config or "mnist", overrides)
    if args.resume and args.run_dir:
        from brickyard.config import resume_config
        cfg = resume_config(args.run_dir, args.config, overrides)
    launch.process_env(cfg)
    if args.devices or launch.parse_nnodes(args.nnodes)[1] > 1:
        return launch.launch(args, cfg)
    from brickyard import api
    run_dir = args.run_dir or str(_default_run_dir(cfg))
    summary = api.train_config(cfg, run_dir, args.resume, log_dir=args.log_dir)
    if dist.from_env().is_main:
        from brickyard.observe.runlog import print_result
        print_result(summary)
    return 0


def _default_run_dir(cfg):
    from brickyard.observe.runlog import default_run_dir
    return default_run_dir(cfg.preset)


def cmd_eval(args) -> int:
    from brickyard.api import evaluate_checkpoint
    r = evaluate_checkpoint(args.checkpoint, args.split, args.device)
    print(json.dumps(r))
    return 0


def cmd_run(args) -> int:
    from brickyard.launch import torchrun as launch
    if args.max_restarts < 0 or args.timeout < 1:
        raise BrickyardError("--max-restarts must be at least 0 and --timeout at least 1.")
    return launch.launch_script(args)


COMMANDS = {"run": cmd_run, "train": cmd_train, "eval": cmd_eval, "boost": commands.cmd_boost,
            "memory": commands.cmd_memory, "bench": commands.cmd_bench, "plot": commands.cmd_plot,
            "inspect": commands.cmd_inspect, "predict": commands.cmd_predict, "export": commands.cmd_export, "data": commands.cmd_data,
            "models": commands.cmd_models, "presets": commands.cmd_presets}
