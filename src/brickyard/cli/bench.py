"""``brickyard bench``."""
from __future__ import annotations

import argparse
from pathlib import Path

from brickyard.config import load_config
from brickyard.distributed import env as dist
from brickyard.errors import BrickyardError
from brickyard.launch import torchrun as launch


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
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
    b.add_argument("--profile", metavar="DIR", help="also write torch.profiler traces of the first 5 timed steps (every rank) into DIR")
    b.add_argument("--nnodes", default="1", metavar="N", help="also time each spec across N machines (run the same command on each)")
    b.add_argument("--node-rank", type=int, default=None, help="this machine's index, 0..nnodes-1; node 0 hosts the rendezvous")
    b.add_argument("--master", metavar="HOST:PORT", help="address of node 0 (with --nnodes)")
    b.add_argument("--schedules", nargs="+", choices=("gpipe", "1f1b"), default=("gpipe", "1f1b"),
                   help="with dist.pipeline.stages: the schedules timed, each a job of its own (default both)")
    b.add_argument("--device", help=argparse.SUPPRESS)
    b.add_argument("--result", help=argparse.SUPPRESS)  # a worker job writes rank 0's result here


def launch_job(args, cfg):
    """The machines a bench spans (``--nnodes``, ``--node-rank``, ``--master``), checked once."""
    return launch.Job.from_args(args, cfg.dist.timeout_s, devices="cpu")


def _rounds(args, cfg, specs: list[str], here: bool) -> tuple[list[str], list[dict]]:
    """(the labels of the jobs, each round's results by label): every spec (with a pipeline config, every spec
    and schedule) run in turn ``--rounds`` times, on this machine where it hosts the rendezvous (``here``)."""
    from brickyard.tools import bench  # torch: this command's alone (cli/main.py: start-up time)
    runs: dict[str, list[str]] = {spec: [] for spec in specs}  # label: the spec's settings of its own
    if cfg.dist.pipeline.stages > 1:  # each schedule a job of its own, side by side in the table
        runs = {f"{spec} {s}": [f"dist.pipeline.schedule={s}"] for spec in specs for s in args.schedules}
    labels = list(runs)
    rounds: list[dict] = []
    for k in range(args.rounds if here else 0):  # one machine: node 0 alone, the others wait
        rounds.append({})
        for label in labels if k % 2 == 0 else labels[::-1]:  # in turn, each spec first as often as last
            rounds[-1][label] = r = bench.run_job(args, cfg, label.split(" ")[0], extra=runs[label])
            print(f"--- devices {label}" + (f" (round {k + 1} of {args.rounds})" if args.rounds > 1 else "")
                  + f"\n{bench.format_result(r)}", flush=True)
    return labels, rounds


def run(args) -> int:
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        raise BrickyardError("--steps and --rounds must be at least 1 and --warmup at least 0.")
    if args.profile:  # traced steps: the first 5 timed ones (of every spec's job), into DIR
        first = args.warmup
        args.overrides = list(args.overrides) + [f"train.profile_steps=[{first}, {first + min(5, args.steps)}]",
                                                 f"train.profile_dir={Path(args.profile).expanduser().resolve()}"]
    overrides = list(args.overrides) + ([f"train.device={args.device}"] if args.device else [])
    cfg = load_config(args.config or "mnist", overrides)  # before torch is imported
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard.api import train_config
    from brickyard.files import write_json
    from brickyard.tools import bench
    if args.result:  # a job of one spec: in this process, or one torchrun job whose rank 0 writes the result
        spec = (args.devices or [None])[0]
        if spec is not None:
            job = launch.Job.from_args(args, cfg.dist.timeout_s, devices=spec)
            if job.world > 1:
                worker = ["bench"] + ([args.config] if args.config else []) + [x for o in args.overrides for x in ("--set", o)]
                worker += ["--device", job.device, "--steps", str(args.steps), "--warmup", str(args.warmup), "--result", args.result]
                return launch.run_torchrun(job, ["-m", "brickyard"] + worker, Path(args.result).parent)
            cfg = cfg.replace(**{"train.device": job.device})
        r = bench.measure(cfg, args.steps, args.warmup, Path(args.result).parent / "run", train_config)
        if dist.prints_errors():  # rank 0, and each machine's first worker: every node gets the figures
            write_json(Path(args.result), r)
        return 0
    if args.loader:
        for kind in ("memory", "stream"):
            r = bench.run_local(cfg.replace(**{"data.loader": kind}), args.steps, args.warmup)
            print(f"[{kind}] " + bench.format_result(r))
        return 0
    specs = args.devices or ["cpu" if cfg.dist.pipeline.stages < 2 else f"cpu:{cfg.dist.pipeline.stages}"]
    job = launch_job(args, cfg)
    if args.rounds > 1 and job.nnodes > 1:
        raise BrickyardError("--rounds works on one machine; across machines run each spec once (--rounds 1).")
    labels, rounds = _rounds(args, cfg, specs, job.hosts_rendezvous())
    results = bench.paired(rounds, labels) if rounds else []
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
        write_json(Path(args.out) / "bench.json", {"results": {labels[0]: results[0][1]}})
    return 0
