"""``brickyard sweep``: hyperparameter search on Optuna (``brickyard.sweep``)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from brickyard.errors import BrickyardError, ConfigError

EXAMPLES = """examples:
  brickyard sweep fashion --space space.yaml --trials 20               # TPE, median pruning, sweeps/fashion-<time>
  brickyard sweep mnist --space space.yaml --metric val_loss --sampler random --dir sweeps/a
  brickyard sweep mnist --space space.yaml --dir sweeps/a --resume     # continue it after Ctrl-C or a crash
  brickyard sweep mnist --space space.yaml --devices 0,1,2,3 --parallel 2   # two trials side by side, 2 GPUs each
  brickyard sweep mnist --space space.yaml --storage postgresql://u:p@db/sweeps --dir sweeps/a  # on every machine
  brickyard sweep mnist --space space.yaml --folds 3                   # each trial: the mean of 3 folds
  brickyard sweep --show sweeps/a                                      # the answer: best, table, plots, best.yaml

space.yaml:
  optim.lr: {log_uniform: [1.0e-4, 0.1]}
  optim.weight_decay: {uniform: [0.0, 0.001]}
  model.name: [mnist_fast, lenet5]
"""


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser("sweep", help="search hyperparameters with Optuna (pip install 'brickyard[sweep]')",
                       epilog=EXAMPLES, formatter_class=raw)
    s.add_argument("config", nargs="?", default=None, help="a preset name or a YAML file (default: mnist)")
    s.add_argument("--space", help="YAML file: config keys and what a trial draws for each")
    s.add_argument("--trials", type=int, default=20, help="finished trials the sweep ends with (default 20)")
    s.add_argument("--metric", default="auto", help="the validation metric a trial is scored by, lowest for a loss, "
                   "highest for a score (auto: val_map for several labels an image, else val_accuracy)")
    s.add_argument("--sampler", choices=("tpe", "random", "grid"), default="tpe")
    s.add_argument("--pruner", choices=("median", "hyperband", "none"), default="median")
    s.add_argument("--prune-startup", type=int, default=5, metavar="N", help="trials before the median pruner prunes (5)")
    s.add_argument("--prune-warmup", default="auto", metavar="EPOCHS", help="epochs of a trial before the median "
                   "pruner may stop it (auto: half the config's train.epochs; 0: from the first validation, Optuna's "
                   "default): a one-cycle schedule's early accuracy favours the higher rates")
    s.add_argument("--seed", type=int, default=None, help="the sampler's seed (default: none)")
    s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key every trial sets (repeatable)")
    s.add_argument("--dir", help="the sweep's directory: a run directory a trial (default sweeps/<config>-<time>)")
    s.add_argument("--storage", metavar="URL", help="a database URL Optuna takes, shared by several machines "
                   "(default: a journal file in the sweep's directory)")
    s.add_argument("--resume", action="store_true", help="continue the sweep in --dir (or --storage)")
    s.add_argument("--devices", metavar="SPEC", help="each trial's devices, as brickyard train's --devices")
    s.add_argument("--parallel", type=int, default=1, metavar="K", help="trials side by side, each on its share of "
                   "--devices (GPU ids) or of the CPU's cores")
    s.add_argument("--folds", type=int, default=0, metavar="K", help="score each trial as the mean of K folds")
    s.add_argument("--show", metavar="DIR", help="print a sweep's answer and write its files; trains nothing "
                   "(with --storage for a sweep on a database)")


def run(args) -> int:
    # Optuna and torch load here, for this command only (cli/main.py: start-up time)
    from brickyard.sweep import answer, driver, space, study
    if args.show:
        return _show(Path(args.show), args.storage, study, answer)
    sweep = _checked(args, space, study, driver)
    if args.parallel > 1:
        return _side_by_side(args, sweep, study, answer, driver)
    storage = study.open_storage(sweep.storage)
    s, made = study.open_study(sweep.name, storage, sweep.settings(),
                               study.sampler_of(args.sampler, sweep.params, None), study.pruner_of(*sweep.pruner),
                               args.resume)
    if args.seed is not None:  # the seed and the trials already drawn: a resumed sweep draws new start-up trials
        s.sampler = study.sampler_of(args.sampler, sweep.params, args.seed + len(s.get_trials(deepcopy=False)))
    said = driver.baseline(sweep, s) if made else ""  # by the process that made the study: once
    c = study.counts(s)
    print(f"sweep {sweep.name}: {sweep.trials} trials of {sweep.config}, {sweep.metric} "
          f"({'lowest' if sweep.metric.endswith('loss') else 'highest'} best), {args.sampler} sampler, {args.pruner} "
          f"pruner; {c.get('complete', 0) + c.get('pruned', 0)} finished already; in {sweep.dir}", flush=True)
    if said:
        print(f"sweep {sweep.name}: {said}", flush=True)
    try:
        driver.run(sweep, s)
    except KeyboardInterrupt:
        print(f"sweep {sweep.name}: interrupted; its finished trials are kept: continue with --resume --dir {sweep.dir}",
              flush=True)
        return 130
    print(answer.table(s, sweep.metric))
    _said(s, sweep.dir, sweep.metric, answer)
    return 0


def _checked(args, space, study, driver):
    """The sweep the command asks for, every part checked before any trial starts."""
    from brickyard.config import load_config  # torch-free, as every command's parser is
    if not args.space:
        raise ConfigError("brickyard sweep needs --space SPACE.yaml (the values a trial draws), or --show DIR.")
    for flag, v, low in (("--trials", args.trials, 1), ("--parallel", args.parallel, 1), ("--prune-startup", args.prune_startup, 0)):
        if v < low:
            raise ConfigError(f"{flag} {v} must be at least {low}.")
    if args.folds == 1 or args.folds < 0:
        raise ConfigError(f"--folds {args.folds}: cross-validation takes 2 folds or more (0: none).")
    if args.resume and not args.dir:
        raise ConfigError("--resume continues the sweep of --dir DIR; say which.")
    if args.storage and not args.dir:
        raise ConfigError("--storage needs --dir DIR: its name is the study's, the same on every machine of the sweep.")
    if args.storage and "://" not in args.storage:
        raise ConfigError(f"--storage {args.storage!r} is not a database URL (postgresql://user:password@host/db, "
                          f"sqlite:///path.db); without --storage the sweep keeps its study in --dir.")
    if args.devices:
        from brickyard.launch.torchrun import parse_devices  # once, before any trial: a bad spec is one sentence
        parse_devices(args.devices)
    config = args.config or "mnist"
    cfg = load_config(config, args.overrides)
    params = space.read_space(args.space)
    space.check(params, config, args.overrides)
    metric = args.metric
    if metric == "auto":
        metric = "val_map" if driver.task_of(cfg) == "multilabel" else "val_accuracy"
    stem = Path(config).stem if config.endswith((".yaml", ".yml")) else config
    where = Path(args.dir or Path("sweeps") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.storage is None:
        where.mkdir(parents=True, exist_ok=True)
    sweep = driver.Sweep(config, list(args.overrides), params, metric, args.trials, where,
                         study.storage_spec(where, args.storage), where.resolve().name, args.folds, args.devices,
                         (args.pruner, args.prune_startup, _warmup(args.prune_warmup, cfg), *_span(cfg, params)))
    driver.check(sweep)
    if args.sampler == "grid":
        [p.grid() for p in params]  # a continuous range has no grid: one sentence now
    return sweep


def _span(cfg, params) -> tuple[float, float | None]:
    """The epochs of a trial's first validation and of its end (the longest in the space), for Hyperband's rungs;
    None for a run measured in steps."""
    epochs = [p.values for p in params if p.key == "train.epochs"]
    last = max([cfg.train.epochs, *[float(v) for values in epochs for v in values if isinstance(v, (int, float))]])
    if not last:
        return 1.0, None
    every = cfg.train.eval_every
    return (float(min(every, last)) if every else last), float(last)


def _warmup(given: str, cfg) -> float:
    """``--prune-warmup`` in epochs: a number of 0 or more, or auto (half the config's train.epochs)."""
    if given == "auto":
        return cfg.train.epochs / 2 if cfg.train.epochs else 0.0
    try:
        value = float(given)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"--prune-warmup {given!r} must be a number of epochs, 0 or more, or auto.")
    return value


def _said(s, sweep_dir: Path, metric: str, answer) -> None:
    try:
        best = s.best_trial
        print(f"best: trial {best.number}, {metric} {best.value:.4f}, "
              + ", ".join(f"{k}={v}" for k, v in best.params.items()))
    except ValueError:
        print("best: none (no trial completed)")
    for path in answer.write(s, sweep_dir, metric):
        print(path)


def _show(sweep_dir: Path, url: str | None, study, answer) -> int:
    journal = sweep_dir / study.JOURNAL
    if url is None and not journal.is_file():
        raise BrickyardError(f"--show {sweep_dir}: no sweep there (no {study.JOURNAL}); a sweep on a database is shown "
                             f"with --show DIR --storage URL.")
    storage = study.open_storage(url or str(journal.resolve()))
    optuna = study.optuna_module()
    name = sweep_dir.resolve().name
    try:
        s = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        raise BrickyardError(f"--show {sweep_dir}: its storage holds no sweep {name!r}.") from None
    metric = s.user_attrs.get("settings", {}).get("metric", "value")
    print(answer.table(s, metric))
    _said(s, sweep_dir, metric, answer)
    return 0


def _side_by_side(args, sweep, study, answer, driver) -> int:
    """``--parallel K``: K sweep processes on the same study (made here first), each with its share of the devices and
    its own seed; this one waits for them and writes the answer."""
    storage = study.open_storage(sweep.storage)
    s, made = study.open_study(sweep.name, storage, sweep.settings(),
                               study.sampler_of(args.sampler, sweep.params, None), None, args.resume)
    study.fail_stale(s)  # here, once: the processes below would race to fail the same trials
    said = driver.baseline(sweep, s) if made else ""
    if said:
        print(f"sweep {sweep.name}: {said}", flush=True)
    common = ["sweep", sweep.config, "--space", args.space, "--trials", str(sweep.trials), "--metric", sweep.metric,
              "--sampler", args.sampler, "--pruner", args.pruner, "--prune-startup", str(args.prune_startup),
              "--prune-warmup", str(sweep.pruner[2]),
              "--dir", str(sweep.dir), "--folds", str(sweep.folds),
              *(["--storage", args.storage] if args.storage else []), *(f"--set={o}" for o in sweep.overrides)]
    procs = []
    for i, (devices, threads) in enumerate(_shares(args.devices, args.parallel)):
        extra = (["--devices", devices] if devices else []) + ([f"--set=train.threads={threads}"] if threads else [])
        seed = ["--seed", str(args.seed + i)] if args.seed is not None else []
        procs.append(subprocess.Popen([sys.executable, "-m", "brickyard", *common, *extra, *seed]))
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:  # each process had the signal too, and says what it kept
        for p in procs:
            p.wait()
        return 130
    print(answer.table(s, sweep.metric))
    _said(s, sweep.dir, sweep.metric, answer)
    return next((c for c in codes if c), 0)


def _shares(devices: str | None, k: int) -> list[tuple[str | None, int]]:
    """Each process's ``(--devices, train.threads)``: GPU ids split in K groups, or the CPU's cores split K ways."""
    if devices in ("cuda", "all"):  # every GPU: listed, so that each process gets its own
        import torch  # the GPUs this machine shows
        devices = ",".join(str(i) for i in range(torch.cuda.device_count())) or devices
    if devices and devices.replace(",", "").isdigit():
        ids = devices.split(",")
        if len(ids) % k:
            raise ConfigError(f"--parallel {k}: --devices {devices} lists {len(ids)} GPUs, which do not split into {k} "
                              f"equal shares.")
        n = len(ids) // k
        return [(",".join(ids[i * n:(i + 1) * n]), 0) for i in range(k)]
    per = devices.partition(":")[2] if devices and devices.startswith("cpu:") else "1"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // (k * int(per or 1)))
    return [(devices, threads) for _ in range(k)]
