"""``brickyard boost``."""
from __future__ import annotations

import argparse
from pathlib import Path

from brickyard.config import load_config
from brickyard.errors import BrickyardError
from brickyard.training.rundir import default_path


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
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
    dr.add_argument("--from-init", action="store_true", help="stage 2 starts from the initial weights (among the PCA's snapshots), not stage 1's end")
    dr.add_argument("--method", choices=("dldr", "mindspore"), help="stage 2 as the paper's authors (default) or MindSpore do it")
    dr.add_argument("--run-dir", help="run directory (stage1/ and stage2/ inside)")
    dr.add_argument("--device", help="auto, cpu, cuda or cuda:N")


def run(args) -> int:
    if args.boost_command != "dim-reduce":
        raise BrickyardError("boost: say dim-reduce, e.g. `brickyard boost dim-reduce mnist-course --stage1-epochs 5 --stage2-epochs 2`.")
    if args.stage1_epochs <= 0 or args.stage2_epochs <= 0:
        raise BrickyardError("--stage1-epochs and --stage2-epochs must be positive.")
    overrides = list(args.overrides) + ([f"train.device={args.device}"] if args.device else [])
    overrides += [f"boost.dim_reduce.method={args.method}"] if args.method else []
    cfg = load_config(args.config or "mnist-course", overrides)  # before torch is imported
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard import api
    from brickyard.training.checkpoint import step_checkpoints
    run = Path(args.run_dir) if args.run_dir else default_path(f"{cfg.preset}-dimreduce")
    stage1 = {"train.epochs": args.stage1_epochs, "boost.snapshots.enabled": True}
    if args.from_init:  # the authors' PCA includes the initial weights, where stage 2 then starts
        stage1["boost.snapshots.include_init"] = True
    s1 = api.train_config(cfg.replace(**stage1), run / "stage1")
    print(f"stage 1: test accuracy {s1['test_accuracy']:.4f} after {s1['epochs']:g} epochs ({s1['train_seconds']:.1f}s)")
    changes = {"train.epochs": args.stage2_epochs, "boost.dim_reduce.enabled": True,
               # where stage 1 wrote them: a snapshots_dir of the user's, else its run's snapshots/
               "boost.dim_reduce.snapshots_dir": cfg.boost.dim_reduce.snapshots_dir or str(run / "stage1" / "snapshots")}
    if cfg.boost.dim_reduce.batch_size:  # a stage-2 batch of its own (the authors: 1024 for CIFAR)
        changes["data.global_batch_size"] = cfg.boost.dim_reduce.batch_size
    if not args.from_init:
        changes["finetune.init_from"] = str(step_checkpoints(run / "stage1" / "checkpoints")[-1])
    s2 = api.train_config(cfg.replace(**changes), run / "stage2")
    print(f"stage 2: test accuracy {s2['test_accuracy']:.4f} after {s2['epochs']:g} more epochs ({s2['train_seconds']:.1f}s)")
    from brickyard.observe.runlog import print_result
    print_result(s2)
    return 0
