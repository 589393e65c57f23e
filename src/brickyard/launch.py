"""Hand a multi-process job to torchrun (``torch.distributed.run``), in this process.

``--devices`` is translated into torchrun's arguments: ``cpu:N`` gives N gloo processes,
``cuda``/``all`` one process per visible GPU, ``0,2`` one process per listed GPU (through
``CUDA_VISIBLE_DEVICES``, so each worker's ``cuda`` is its local rank). Each worker runs
``python -m brickyard train ...`` with the same config and overrides, without ``--devices``; with
``--max-restarts K`` the workers get ``--resume auto`` so a restarted group continues from the
newest checkpoint. torchrun is the process manager, rendezvous and elastic agent; brickyard adds
only the checks that turn its failures into one sentence.
"""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from brickyard.errors import BrickyardError, DeviceError


def parse_devices(spec: str | None) -> tuple[int, str, str | None]:
    """``SPEC`` -> (processes per node, worker device, CUDA_VISIBLE_DEVICES or None)."""
    spec = (spec or "cpu").strip().lower()
    if spec == "cpu":
        return 1, "cpu", None
    if spec.startswith("cpu:"):
        try:
            n = int(spec[4:])
        except ValueError:
            n = 0
        if n < 1:
            raise BrickyardError(f"--devices {spec!r}: expected cpu:N with N >= 1, e.g. cpu:2.")
        return n, "cpu", None
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec in ("cuda", "all"):
        if count == 0:
            raise DeviceError(f"--devices {spec}: no CUDA GPU is visible on this machine (use --devices cpu:N).")
        return count, "cuda", None
    try:
        ids = [int(s) for s in spec.split(",") if s.strip() != ""]
    except ValueError:
        raise BrickyardError(f"--devices {spec!r} is not one of cpu, cpu:N, cuda, all, or GPU ids like 0,1.") from None
    if not ids or len(set(ids)) != len(ids):
        raise BrickyardError(f"--devices {spec!r}: list each GPU id once, e.g. 0,1.")
    if count == 0:
        raise DeviceError(f"--devices {spec}: GPU ids given, but CUDA is not available on this machine.")
    missing = [i for i in ids if i >= count]
    if missing:
        raise DeviceError(f"--devices {spec}: GPU {missing[0]} does not exist; this machine shows {count} GPU(s).")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # ids refer to the GPUs the user already made visible
        physical = [s.strip() for s in visible.split(",")]
        return len(ids), "cuda", ",".join(physical[i] for i in ids)
    return len(ids), "cuda", ",".join(map(str, ids))


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host if host not in ("localhost", "") else "127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_argv(args, run_dir: Path, log_dir: Path, device: str) -> list[str]:
    argv = ["train"] + ([args.config] if args.config else [])
    for item in args.overrides:
        argv += ["--set", item]
    argv += ["--device", device, "--run-dir", str(run_dir), "--log-dir", str(log_dir)]
    resume = args.resume or ("auto" if args.max_restarts > 0 else None)
    if resume:
        argv += ["--resume", resume]
    return argv


def torchrun_argv(args, nproc: int, timeout_s: int) -> list[str]:
    out = [f"--nproc-per-node={nproc}", f"--max-restarts={args.max_restarts}", "--monitor-interval=0.5"]
    if args.nnodes > 1:
        if not args.master:
            raise BrickyardError("--nnodes > 1 needs --master HOST:PORT, the address of node 0 (the same on every machine).")
        host, _, port = args.master.rpartition(":")
        if not host or not port.isdigit():
            raise BrickyardError(f"--master {args.master!r}: expected HOST:PORT, e.g. 10.0.0.1:29500.")
        if not 0 <= args.node_rank < args.nnodes:
            raise BrickyardError(f"--node-rank {args.node_rank} must be between 0 and {args.nnodes - 1}.")
        if args.node_rank == 0 and not _port_free(host, int(port)) and _is_local(host):
            raise BrickyardError(f"--master {args.master}: port {port} is already in use on this machine; pick another.")
        out += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={args.master}", "--rdzv-id=brickyard",
                f"--rdzv-conf=join_timeout={timeout_s},read_timeout={timeout_s}"]
    else:
        if args.master:
            host, _, port = args.master.rpartition(":")
            if not port.isdigit():
                raise BrickyardError(f"--master {args.master!r}: expected HOST:PORT.")
            if not _port_free(host or "127.0.0.1", int(port)):
                raise BrickyardError(f"--master {args.master}: port {port} is already in use on this machine; pick another.")
        else:
            host, port = "127.0.0.1", str(_free_port())
        out += ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={host or '127.0.0.1'}:{port}"]
    return out


def _is_local(host: str) -> bool:
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False
    return addr.startswith("127.") or addr in socket.gethostbyname_ex(socket.gethostname())[2]


def process_env(cfg) -> None:
    """What the training processes need in their environment before torch starts CUDA; torchrun's
    workers inherit it. Deterministic cuBLAS matmuls need ``CUBLAS_WORKSPACE_CONFIG``, read when the
    first cuBLAS handle is made."""
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def launch(args, cfg) -> int:
    """Run the training job under torchrun (one process: in this process); returns the exit code."""
    from brickyard.runlog import default_run_dir, refuse_reuse
    nproc, device, visible = parse_devices(args.devices)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg.preset)
    if not args.resume and not args.max_restarts and args.node_rank == 0:
        refuse_reuse(run_dir)  # before any worker starts
    log_dir = Path(args.log_dir) if args.log_dir else run_dir / "logs"
    if cfg.dist.mode == "ps":
        from brickyard.ps import NO_RESUME, check_layout
        check_layout(cfg, nproc * args.nnodes)
        if args.resume or args.max_restarts:  # a restarted group would resume
            raise BrickyardError(NO_RESUME)
    if nproc * args.nnodes == 1 and not args.max_restarts:
        from brickyard import api
        from brickyard.runlog import print_result
        summary = api.train_config(cfg.replace(**{"train.device": device}), run_dir, args.resume, log_dir=log_dir)
        print_result(summary)
        return 0
    worker = ["-m", "brickyard"] + worker_argv(args, run_dir, log_dir, device)
    return run_torchrun(args, nproc, device, visible, worker, log_dir, cfg.dist.timeout_s,
                        f"per-device batch {cfg.data.batch_size}; ")


def launch_script(args) -> int:
    """``brickyard run``: a user's script under torchrun with ``--devices``, the run and log folders
    handed over as ``BRICKYARD_RUN_DIR`` / ``BRICKYARD_LOG_DIR`` (``brickyard.fit``'s defaults), and
    ``BRICKYARD_RESUME=auto`` when restarts are allowed, so a restarted script continues its run."""
    script = Path(args.script)
    if not script.is_file():
        raise BrickyardError(f"script {script} does not exist.")
    nproc, device, visible = parse_devices(args.devices)
    if args.run_dir:
        os.environ["BRICKYARD_RUN_DIR"] = str(Path(args.run_dir).resolve())
    log_dir = Path(args.log_dir or (Path(args.run_dir) / "logs" if args.run_dir else "runs/logs")).resolve()
    os.environ["BRICKYARD_LOG_DIR"] = str(log_dir)
    os.environ["BRICKYARD_DEVICE"] = device
    if args.max_restarts:
        os.environ["BRICKYARD_RESUME"] = "auto"
    return run_torchrun(args, nproc, device, visible, [str(script), *args.script_args], log_dir, args.timeout)


def run_torchrun(args, nproc: int, device: str, visible: str | None, worker: list[str], log_dir: Path,
                 timeout_s: int, note: str = "") -> int:
    """``torchrun ... WORKER...`` in this process (``-m brickyard train ...`` or a script); failures
    become one sentence."""
    env_threads = max(1, (os.cpu_count() or 1) // nproc) if device == "cpu" else 1
    os.environ.setdefault("OMP_NUM_THREADS", str(env_threads))  # silences torchrun's warning; set before it starts
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    # torchrun logs each worker's exit and its own shutdown; brickyard says what matters in one sentence
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:  # torch sets levels per module
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    targv = torchrun_argv(args, nproc, timeout_s) + worker
    world = nproc * args.nnodes
    print(f"launching {world} processes ({nproc} per node x {args.nnodes} node(s), {device}) with torchrun; "
          f"{note}logs in {log_dir}", flush=True)
    try:
        torchrun.run(torchrun.parse_args(targv))
    except SignalException:  # the launcher was stopped (SIGTERM, SIGHUP): torchrun passed the signal to the
        return 130             # workers, and rank 0 has said where it saved
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code in (2, 130):
            return code  # a user error or an interruption: rank 0 has already said it in one line
        raise BrickyardError(f"worker rank {rank} failed with exit code {code}; see {log_dir}/workerlog.{rank} "
                             f"(restarts used: {args.max_restarts}).") from None
    except Exception as e:  # rendezvous failures and timeouts come as several torch exception types
        name = type(e).__name__
        if "Rendezvous" in name or "timeout" in str(e).lower():
            raise BrickyardError(f"not all {args.nnodes} nodes joined the job at {args.master or 'localhost'} "
                                 f"within {timeout_s}s ({name}).") from None
        raise
    return 0
