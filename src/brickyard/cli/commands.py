"""The commands besides ``train``, ``eval`` and ``run``: data, models, presets, bench, memory, boost,
plot, inspect and predict. Each takes the parsed arguments and returns the exit code; a user's
mistake is a ``BrickyardError`` that ``cli.main`` prints as one line."""
from __future__ import annotations

import json
import os

from brickyard.distributed import process as dist
from brickyard.errors import BrickyardError


def cmd_data(args) -> int:
    from brickyard.data import idx
    if args.data_command is None:
        raise BrickyardError("data: say fetch or info, e.g. `brickyard data fetch mnist`.")
    if args.name not in idx.SPECS:
        raise BrickyardError(f"data set {args.name!r} is not one of {', '.join(idx.SPECS)}.")
    if args.data_command == "export":
        from pathlib import Path
        from brickyard.data.export import export_idx
        counts = export_idx(args.name, Path(args.out), args.root, args.limit)
        print(f"wrote {', '.join(f'{n:,} {s}' for s, n in counts.items())} PNG images to {args.out}")
        return 0
    if args.data_command == "fetch":
        arrays = idx.load_idx(args.name, args.root, allow_download=True)
        print(f"{args.name}: {len(arrays['train-labels-idx1-ubyte']):,} train + "
              f"{len(arrays['t10k-labels-idx1-ubyte']):,} test images verified in {idx.locate(args.name, args.root)}")
        return 0
    folder = idx.locate(args.name, args.root)
    print(f"{args.name}: classes {', '.join(idx.classes(args.name))}")
    print(f"looked up in: {', '.join(str(d) for d in idx.candidate_dirs(args.name, args.root))}")
    if folder is None:
        print("not present; `brickyard data fetch` downloads it")
        return 1
    arrays = idx.load_idx(args.name, args.root, allow_download=False)
    tr, te = arrays["train-images-idx3-ubyte"], arrays["t10k-images-idx3-ubyte"]
    print(f"found in {folder}: train {tuple(tr.shape)} uint8, test {tuple(te.shape)} uint8 (checksums verified)")
    print("default split: train 50,000 / val 10,000 / test 10,000 (data.train_on_all: true trains on 60,000)")
    return 0


def cmd_models(args) -> int:
    from brickyard import models
    for name in models.names():
        channels, size = models.natural_input(name)
        n = models.count_parameters(models.create(name, 10, channels, size))
        print(f"{name:<18} {n:>12,} params  ({channels}x{size[0]}x{size[1]}, 10 classes)  {models.describe(name)}")
    return 0


def cmd_presets(args) -> int:
    from brickyard.config import list_presets
    for name, doc in list_presets().items():
        print(f"{name:<18} {doc}")
    return 0


def launch_job(args, cfg):
    """The machines a bench spans (``--nnodes``, ``--node-rank``, ``--master``), checked once."""
    from brickyard.launch import torchrun as launch
    return launch.Job.from_args(args, cfg.dist.timeout_s, devices="cpu")


def cmd_bench(args) -> int:
    from pathlib import Path
    from brickyard.config import load_config
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise BrickyardError("--steps and --rounds must be at least 1 and --warmup at least 0.")
    overrides = list(args.overrides) + ([f"train.device={args.device}"] if args.device else [])
    cfg = load_config(args.config or "mnist", overrides)  # before torch is imported
    from brickyard.tools import bench
    from brickyard.observe.runlog import write_json
    if args.result:  # a job of one spec: in this process, or one torchrun job whose rank 0 writes the result
        from brickyard.launch import torchrun as launch
        spec = (args.devices or [None])[0]
        if spec is not None:
            job = launch.Job.from_args(args, cfg.dist.timeout_s, devices=spec)
            if job.world > 1:
                worker = ["bench"] + ([args.config] if args.config else []) + [x for o in args.overrides for x in ("--set", o)]
                worker += ["--device", job.device, "--steps", str(args.steps), "--warmup", str(args.warmup), "--result", args.result]
                return launch.run_torchrun(job, ["-m", "brickyard"] + worker, Path(args.result).parent)
            cfg = cfg.replace(**{"train.device": job.device})
        r = bench.run_local(cfg, args.steps, args.warmup)
        if dist.prints_errors():  # rank 0, and each machine's first worker: every node gets the figures
            write_json(Path(args.result), r)
        return 0
    if args.loader:
        for kind in ("memory", "stream"):
            r = bench.run_local(cfg.replace(**{"data.loader": kind}), args.steps, args.warmup)
            print(f"[{kind}] " + bench.format_result(r))
        return 0
    specs = args.devices or ["cpu"]
    job = launch_job(args, cfg)
    if args.rounds > 1 and job.nnodes > 1:
        raise BrickyardError("--rounds works on one machine; across machines run each spec once (--rounds 1).")
    rounds = []
    for k in range(args.rounds if job.hosts_rendezvous() else 0):  # one machine: node 0 alone, the others wait
        rounds.append({})
        for spec in specs if k % 2 == 0 else specs[::-1]:  # in turn, each spec first as often as last
            rounds[-1][spec] = r = bench.run_job(args, cfg, spec)
            print(f"--- devices {spec}" + (f" (round {k + 1} of {args.rounds})" if args.rounds > 1 else "")
                  + f"\n{bench.format_result(r)}", flush=True)
    results = bench.paired(rounds, specs) if rounds else []
    for i, spec in enumerate(specs if job.nnodes > 1 else []):  # spec i meets at --master's port + i
        host, _, port = job.master.rpartition(":")
        r = bench.run_job(args, cfg, spec, job.replace(master=f"{host}:{int(port) + i}"))
        results.append((f"{spec} x {job.nnodes} nodes", r))
        print(f"--- devices {spec} on each of {job.nnodes} nodes\n{bench.format_result(r)}", flush=True)
    if len(results) > 1:
        table, rows = bench.scaling_table(results)
        print(table)
        out = Path(args.out) if args.out else Path("runs") / "bench"
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "bench.json", {"results": {s: r for s, r in results}, "scaling": rows})
        bench.plot_scaling(rows, out / "scaling.png")
        print(f"wrote {out / 'bench.json'} and {out / 'scaling.png'}")
    elif args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json(Path(args.out) / "bench.json", {"results": {specs[0]: results[0][1]}})
    return 0


def cmd_memory(args) -> int:
    from brickyard.config import load_config
    cfg = load_config(args.config or "mnist", args.overrides)  # before torch is imported
    import torch
    from brickyard import api
    from brickyard.launch import torchrun as launch
    from brickyard.tools import memory as mem
    from brickyard.data import build_data
    nproc, kind, _ = launch.parse_devices(args.devices)
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    data = build_data(cfg.data)
    torch.manual_seed(cfg.train.seed)
    model = api.build_model(cfg, data)
    est = mem.estimate(cfg, model, data, device, nproc)
    budget = mem.parse_size(args.device_memory) if args.device_memory else (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
    print(mem.report(est, budget, str(device)))
    if device.type == "cuda":
        measured = mem.measure_cuda_step(cfg, data, device)
        err = (est["total"] - measured) / measured
        print(f"real step on {torch.cuda.get_device_name(device)}: torch.cuda.max_memory_allocated {mem.fmt(measured)}; "
              f"estimate error {100 * err:+.1f}%")
    return 0


def cmd_boost(args) -> int:
    from pathlib import Path
    from brickyard.config import load_config
    if args.boost_command != "dim-reduce":
        raise BrickyardError("boost: say dim-reduce, e.g. `brickyard boost dim-reduce mnist-course --stage1-epochs 5 --stage2-epochs 2`.")
    if args.stage1_epochs <= 0 or args.stage2_epochs <= 0:
        raise BrickyardError("--stage1-epochs and --stage2-epochs must be positive.")
    overrides = list(args.overrides) + ([f"train.device={args.device}"] if args.device else [])
    cfg = load_config(args.config or "mnist-course", overrides)  # before torch is imported
    from brickyard import api
    from brickyard.training.checkpoint import step_checkpoints
    from brickyard.observe.runlog import default_run_dir
    run = Path(args.run_dir) if args.run_dir else default_run_dir(f"{cfg.preset}-dimreduce")
    s1 = api.train_config(cfg.replace(**{"train.epochs": args.stage1_epochs, "boost.snapshots.enabled": True}), run / "stage1")
    print(f"stage 1: test accuracy {s1['test_accuracy']:.4f} after {s1['epochs']:g} epochs ({s1['train_seconds']:.1f}s)")
    changes = {"train.epochs": args.stage2_epochs, "boost.dim_reduce.enabled": True,
               "boost.dim_reduce.snapshots_dir": str(run / "stage1" / "snapshots")}
    if not args.from_init:
        changes["finetune.init_from"] = str(step_checkpoints(run / "stage1" / "checkpoints")[-1])
    s2 = api.train_config(cfg.replace(**changes), run / "stage2")
    print(f"stage 2: test accuracy {s2['test_accuracy']:.4f} after {s2['epochs']:g} more epochs ({s2['train_seconds']:.1f}s)")
    from brickyard.observe.runlog import print_result
    print_result(s2)
    return 0


def cmd_plot(args) -> int:
    from brickyard.observe.plots import plot_runs
    for path in plot_runs(args.runs, args.out):
        print(path)
    return 0


def cmd_inspect(args) -> int:
    import torch
    from brickyard import api
    from brickyard.data.augment import DevicePrep
    from brickyard.data import build_data
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


def cmd_export(args) -> int:
    from brickyard.tools.export import export
    path = export(args.source, args.format, args.out)
    print(f"wrote {path} ({args.format})")
    return 0


def cmd_predict(args) -> int:
    from pathlib import Path
    from brickyard.api import load_checkpoint_model
    from brickyard.tools.export import is_exported, load_exported
    from brickyard.tools.predict import load_inputs, predict, write
    if is_exported(args.checkpoint):
        _, meta = load_exported(args.checkpoint)
    else:
        meta = load_checkpoint_model(args.checkpoint)[1]["meta"]
    outputs = [o for o in args.outputs.split(",") if o]
    x, names = load_inputs(args.inputs, meta["in_channels"], meta["image_size"])
    result = predict(args.checkpoint, x, outputs, args.device)
    text = write(result, names, outputs, args.format, Path(args.out) if args.out else None)
    if text:
        print(text)
    return 0
