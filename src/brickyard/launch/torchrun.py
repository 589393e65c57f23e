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

import contextlib
import dataclasses
import logging
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from brickyard.distributed import errorfile
from brickyard.errors import BrickyardError, DeviceError
from brickyard.launch import nodes


@dataclass(frozen=True)
class Job:
    """How the processes of a job start, built once from the command line (``Job.from_args``)."""
    nproc: int                # processes on this node
    device: str               # each worker's device: cpu or cuda (its local rank's GPU)
    visible: str | None       # CUDA_VISIBLE_DEVICES for the workers, when GPU ids were listed
    nnodes: int = 1           # nodes at most (``--nnodes N`` or ``MIN:MAX``)
    node_rank: int | None = None  # None: decided by the rendezvous (the node owning --master's address hosts it)
    master: str | None = None  # HOST:PORT of the node that hosts the rendezvous
    max_restarts: int = 0
    timeout_s: int = 300
    min_nodes: int = 0        # 0: as many as nnodes (a fixed-size job)

    def replace(self, **changes) -> Job:
        return dataclasses.replace(self, **changes)

    @property
    def world(self) -> int:
        """Processes at most (the whole job when its size is fixed)."""
        return self.nproc * self.nnodes

    def hosts_rendezvous(self) -> bool:
        """Whether this node hosts the job's store: node rank 0, or (no rank given) the owner of --master's address."""
        if self.nnodes == 1 or self.node_rank is not None:
            return not self.node_rank
        return nodes.owns_address(self.master.rpartition(":")[0])

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes

    @classmethod
    def from_args(cls, args, timeout_s: int, devices: str | None = None) -> Job:
        """``--devices``, ``--nnodes``, ``--node-rank``, ``--master``, ``--max-restarts``, checked once."""
        nproc, device, visible = parse_devices(devices if devices is not None else getattr(args, "devices", None))
        min_nodes, nnodes = parse_nnodes(str(getattr(args, "nnodes", 1)))
        node_rank, master = getattr(args, "node_rank", None), getattr(args, "master", None)
        restarts = getattr(args, "max_restarts", 0)
        if restarts < 0:
            raise BrickyardError("--max-restarts must be at least 0.")
        if node_rank is not None and not 0 <= node_rank < nnodes:
            raise BrickyardError(f"--node-rank {node_rank} must be between 0 and {nnodes - 1}.")
        if nnodes > 1 and not master:
            raise BrickyardError("--nnodes > 1 needs --master HOST:PORT, the address of node 0 (the same on every machine).")
        if master:
            host, _, port = master.rpartition(":")
            if not port.isdigit() or not 0 < int(port) < 65536 or (nnodes > 1 and not host):
                raise BrickyardError(f"--master {master!r}: expected HOST:PORT, e.g. 10.0.0.1:29500.")
        if min_nodes < nnodes and not restarts:
            raise BrickyardError(f"--nnodes {min_nodes}:{nnodes} needs --max-restarts K: a node that joins or "
                                 "leaves restarts the group, which resumes from the newest checkpoint.")
        return cls(nproc, device, visible, nnodes, node_rank, master, restarts, timeout_s,
                   min_nodes if min_nodes < nnodes else 0)


def parse_nnodes(spec: str) -> tuple[int, int]:
    """``N`` -> (N, N); ``MIN:MAX`` -> (MIN, MAX), torchrun's elastic range."""
    lo, _, hi = spec.strip().partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        lo_n = hi_n = 0
    if not 1 <= lo_n <= hi_n:
        raise BrickyardError(f"--nnodes {spec!r}: expected N or MIN:MAX with 1 <= MIN <= MAX, e.g. 2 or 1:4.")
    return lo_n, hi_n


def parse_devices(spec: str | None) -> tuple[int, str, str | None]:
    """``SPEC`` -> (processes per node, worker device, CUDA_VISIBLE_DEVICES or None); the one parser of
    ``--devices`` (``train.device`` names one process's device: ``device.resolve_device``)."""
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
    import torch  # lazy: the CLI imports this module before a command runs (start-up time)
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


def worker_argv(args, run_dir: Path, log_dir: Path, job: Job) -> list[str]:
    argv = ["train"] + ([args.config] if args.config else [])
    for item in args.overrides:
        argv += ["--set", item]
    argv += ["--device", job.device, "--run-dir", str(run_dir), "--log-dir", str(log_dir)]
    resume = args.resume or ("auto" if job.max_restarts > 0 else None)
    if resume:
        argv += ["--resume", resume]
    return argv


def resume_flags(args, job: Job) -> str:
    """The launch flags a resume of this job repeats (``--devices``, and the nodes of a job across machines), for
    the sentence a stopped run ends with: a pipeline's or tensor-parallel group's run resumes on its layout or a
    layout its config names, so `--resume auto` alone would start one process that its stages do not divide."""
    flags = ["--devices", args.devices] if getattr(args, "devices", None) else []
    if job.nnodes > 1:
        flags += ["--nnodes", str(args.nnodes), "--master", str(job.master)]
    return shlex.join(flags)


def torchrun_argv(job: Job) -> list[str]:
    out = [f"--nproc-per-node={job.nproc}", f"--max-restarts={job.max_restarts}", "--monitor-interval=0.5"]
    if job.nnodes > 1:
        return out + nodes.torchrun_argv(job)
    if job.master:
        host, _, port = job.master.rpartition(":")
        if not nodes.port_free(host or "127.0.0.1", int(port)):
            raise BrickyardError(f"--master {job.master}: port {port} is already in use on this machine; pick another.")
        return out + ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={host or '127.0.0.1'}:{port}"]
    # torchrun's store binds port 0 and the OS picks a free one while it is bound: no window in which
    # another process can take a port chosen for it (as a port checked here and handed on later had)
    return out + ["--standalone"]


def process_env(cfg) -> None:
    """What the training processes need in their environment before torch starts CUDA; torchrun's
    workers inherit it. Deterministic cuBLAS matmuls need ``CUBLAS_WORKSPACE_CONFIG``, read when the
    first cuBLAS handle is made."""
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def launch(args, cfg) -> int:
    """Run the training job under torchrun (one process: in this process); returns the exit code."""
    # lazy: these import torch, and the CLI imports this module before a command runs (start-up time)
    from brickyard.data.loaders import check_readers, device_batches, readers_of
    from brickyard.training.rundir import RunDir, default_path
    job = Job.from_args(args, cfg.dist.timeout_s)
    check_readers(cfg, job.world)
    if not job.min_nodes:  # a job of a fixed size: its layout is refused here, before any worker starts
        from brickyard.distributed.env import DistInfo
        from brickyard.training import ways  # lazy: imports torch, as the checks above
        ways.choose(cfg, DistInfo(world_size=job.world)).check_layout()
    run_dir = Path(args.run_dir) if args.run_dir else default_path(cfg.preset)
    if job.hosts_rendezvous():  # before any worker starts: the directory is free and may take this run
        RunDir(run_dir, owner=True).probe(args.resume, restarting=bool(job.max_restarts))
    log_dir = Path(args.log_dir) if args.log_dir else run_dir / "logs"
    if cfg.dist.mode == "ps":
        from brickyard.distributed.parameter_server import NO_RESUME, check_layout  # lazy: imports torch
        check_layout(cfg, job.world)
        if args.resume or job.max_restarts:  # a restarted group would resume
            raise BrickyardError(NO_RESUME)
    if job.world == 1 and not job.max_restarts:
        from brickyard import api  # lazy: the training engine, for this one-process job only
        from brickyard.observe.runlog import print_result
        summary = api.train_config(cfg.replace(**{"train.device": job.device}), run_dir, args.resume, log_dir=log_dir)
        print_result(summary)
        return 0
    worker = ["-m", "brickyard"] + worker_argv(args, run_dir, log_dir, job)
    os.environ["BRICKYARD_RESUME_FLAGS"] = resume_flags(args, job)  # the workers' "resume with" names this layout
    parts = device_batches(cfg.data, cfg.train.grad_accum, max(1, readers_of(cfg, job.world)))
    return run_torchrun(job, worker, log_dir, f"global batch {sum(parts) * cfg.train.grad_accum}, "
                                              f"{max(parts)} per device; ")


def launch_script(args) -> int:
    """``brickyard run``: a user's script under torchrun with ``--devices``, the run and log folders
    handed over as ``BRICKYARD_RUN_DIR`` / ``BRICKYARD_LOG_DIR`` (``brickyard.fit``'s defaults), and
    ``BRICKYARD_RESUME=auto`` when restarts are allowed, so a restarted script continues its run."""
    script = Path(args.script)
    if not script.is_file():
        raise BrickyardError(f"script {script} {'is a folder, not a Python file' if script.is_dir() else 'does not exist'}.")
    job = Job.from_args(args, args.timeout)
    run_dir = args.run_dir
    if not run_dir and job.max_restarts:  # a restarted script must find the run it resumes
        from brickyard.training.rundir import default_path  # lazy: the launcher's imports stay light
        run_dir = str(default_path(script.stem))
    if run_dir:
        os.environ["BRICKYARD_RUN_DIR"] = str(Path(run_dir).resolve())
    log_dir = args.log_dir or (Path(run_dir) / "logs" if run_dir else None)  # None: fit's RUN_DIR/logs
    if log_dir is not None:
        os.environ["BRICKYARD_LOG_DIR"] = str(Path(log_dir).resolve())
    os.environ["BRICKYARD_DEVICE"] = job.device
    if job.max_restarts:
        os.environ["BRICKYARD_RESUME"] = "auto"
    return run_torchrun(job, [str(script), *args.script_args], Path(log_dir) if log_dir else None)


class WorkerCrashed(BrickyardError):
    """A worker ended by a crash (not a user error, not an interruption): the command exits 1, as the worker did."""

    exit_code = 1


class WorkerSaid(BrickyardError):
    """A worker's one-sentence error (from its error file), said by the launcher; exits as the worker did."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def run_torchrun(job: Job, worker: list[str], log_dir: Path | None, note: str = "") -> int:
    """``torchrun ... WORKER...`` in this process (``-m brickyard train ...`` or a script); failures
    become one sentence."""
    env_threads = max(1, (os.cpu_count() or 1) // job.nproc) if job.device == "cpu" else 1
    os.environ.setdefault("OMP_NUM_THREADS", str(env_threads))  # silences torchrun's warning; set before it starts
    # one machine: a worker's error comes back in its error file and is said below; across machines each
    # node's first worker says it (the agent of a node cut off from the store never hands failures back)
    os.environ[errorfile.LAUNCHER_SAYS] = "1" if job.nnodes == 1 else "0"
    if job.visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = job.visible
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torchrun logs each worker's exit and its own shutdown; brickyard says what matters in one sentence
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:  # torch sets levels per module
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    targv = torchrun_argv(job) + worker
    roll = nodes.RollCall(job) if job.nnodes > 1 else None
    if job.nnodes > 1:  # torchrun's agent can wait forever on a store the network no longer reaches
        nodes.AgentWatch(grace=3 if not job.max_restarts else job.timeout_s + 10).start()
    print(f"launching {job.world} processes ({job.nproc} per node x {job.nnodes} node(s), {job.device}) with torchrun; "
          f"{note}logs in {log_dir or 'the run directory'}", flush=True)
    try:
        with nodes.workers_say_a_lost_store() if job.nnodes > 1 else contextlib.nullcontext():
            torchrun.run(torchrun.parse_args(targv))
    except SignalException:  # the launcher was stopped (SIGTERM, SIGHUP): torchrun passed the signal to the
        return 130             # workers, and rank 0 has said where it saved
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code == 130:
            return code  # an interruption: rank 0 has said where it saved
        said = errorfile.cause(e.failures)
        if said is not None:  # the workers' errors, each in its error file: the cause, from whichever rank
            raise WorkerSaid(*said) from None
        if code == 2:
            return code  # a user error said by the worker itself (one without an error file)
        where = f"{log_dir}/workerlog.{rank}" if log_dir else "its output above and the run directory's logs"
        raise WorkerCrashed(f"worker rank {rank} failed with exit code {code}; see {where} "
                            f"(restarts used: {job.max_restarts}).") from None
    except Exception as e:  # rendezvous failures and timeouts come as several torch exception types
        name = type(e).__name__
        if roll is not None and ("Rendezvous" in name or "timeout" in str(e).lower()):
            raise BrickyardError(roll.failure()) from None
        raise
    finally:
        if roll is not None:
            roll.close()
    return 0
