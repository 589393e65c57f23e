"""``brickyard train``."""
from __future__ import annotations

import argparse
import os

from brickyard.config import load_config, resume_config
from brickyard.distributed import env as dist
from brickyard.distributed import slurm
from brickyard.errors import BrickyardError
from brickyard.launch import torchrun as launch
from brickyard.training.rundir import default_path

EXAMPLES = """examples:
  brickyard train                                   # the default preset (mnist), best device
  brickyard train mnist-course                      # the classic course recipe
  brickyard train my.yaml --set optim.lr=0.05 --set data.batch_size=256
  brickyard train mnist --device cpu --run-dir runs/a --resume auto
  brickyard train mnist --devices cpu:2             # 2 processes, gloo all-reduce
  brickyard train mnist --devices 0,1 --log-dir logs  # one process per listed GPU
"""


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    t = sub.add_parser("train", help="train a model", epilog=EXAMPLES, formatter_class=raw)
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


def config_of(args, overrides: list[str]):
    """The command's config: a resumed run's saved one with the overrides (checked against it, not against the
    default preset's: a split of the run's 2 stages is no error), else the named config's."""
    if args.resume and args.run_dir:
        return resume_config(args.run_dir, args.config, overrides, auto=args.resume == "auto")  # a file: its run's config
    notes: list[str] = []
    cfg = load_config(args.config or "mnist", overrides, notes=notes)
    if dist.from_env().is_main and "LOCAL_RANK" not in os.environ:  # said once, by the command the user typed
        for note in notes:
            print(f"config: {note}", flush=True)
    return cfg


def run(args) -> int:
    overrides = list(args.overrides)
    if args.device:
        overrides.append(f"train.device={args.device}")
    cfg = config_of(args, overrides)
    launch.process_env(cfg)
    if args.devices and slurm.task_of_a_step():
        raise BrickyardError(f"--devices {args.devices} starts processes of its own, but srun has already started "
                             f"{os.environ['SLURM_NTASKS']} tasks, each one process: drop --devices "
                             f"(srun -n N brickyard train ... trains on N processes).")
    tasks = slurm.batch_script_of_several_tasks()
    if tasks and not args.devices:
        raise BrickyardError(f"this is the batch script of a Slurm allocation of {tasks} tasks, but brickyard was not "
                             f"started by srun: write `srun brickyard train ...` to train on {tasks} processes (one per "
                             f"task), or pass --devices (--devices cpu: one process; cpu:{tasks} or GPU ids: processes "
                             f"brickyard starts itself).")
    if tasks:
        slurm.leave_the_allocation_tasks()
    if args.devices and str(cfg.finetune.init_from).startswith("torchvision:"):
        from brickyard.models import pretrained  # lazy: imports torch (cli/main.py: start-up time)
        pretrained.fetch(cfg.finetune.init_from)  # once, before the workers start: each then finds it in the cache
    if args.devices or launch.parse_nnodes(args.nnodes)[1] > 1:
        from brickyard.models import check_name  # lazy: imports torch, which the launcher imports anyway
        check_name(cfg.model.name)  # before the workers start: a mistyped name is one line in a second, not ten
        return launch.launch(args, cfg)
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard import api
    run_dir = args.run_dir or str(default_path(cfg.preset))
    summary = api.train_config(cfg, run_dir, args.resume, log_dir=args.log_dir, callbacks=_trial_report())
    if dist.from_env().is_main:
        from brickyard.observe.runlog import print_result
        print_result(summary)
    return 0


def _trial_report() -> list:
    """A sweep trial's ``Report`` where this process trains one (a torchrun worker of ``brickyard sweep --devices``,
    which sets ``BRICKYARD_TRIAL``); nothing otherwise."""
    if not os.environ.get("BRICKYARD_TRIAL"):
        return []
    from brickyard.sweep.trial import from_env  # only a sweep's trials load it (and, through it, Optuna)
    return from_env()
