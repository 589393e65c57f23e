"""What a run does when PyTorch fails: out of memory, a determinism refusal, a lost peer.

``explain`` turns the ``RuntimeError`` a training process meets into the one sentence a user reads,
or re-raises it when it is a bug of ours (a traceback is then the right answer).
"""
from __future__ import annotations

import faulthandler
import os
import re
import sys
from pathlib import Path

import torch

from brickyard.distributed import env as dist_env
from brickyard.distributed import errorfile
from brickyard.errors import BrickyardError, CollectiveError, is_comm_failure
from brickyard.training import memory


def explain(e: BaseException, cfg, model, data, device: torch.device, info, log, heartbeat, log_dir,
            vote=None) -> BaseException:
    """The ``BrickyardError`` for ``e`` (already written to this rank's log), or ``e`` itself. A collective that
    lost a rank which left its error in the job's store (``vote``: the run's ``StopVote``) is said as that error."""
    if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
        return oom_error(cfg, model, data, device, info)
    refusal = determinism_error(e, device) if cfg.train.deterministic else None
    if refusal:
        log.error(refusal)
        return BrickyardError(refusal)
    if not info.distributed or not is_comm_failure(e):
        return e
    silent = heartbeat.silent_ranks() if heartbeat else []
    if silent is None:
        who = _lost_store()
    else:
        who = f"rank {', '.join(map(str, silent))} stopped answering" if silent else "a peer rank stopped answering or died"
    reason = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", str(e).strip())  # gloo's source file and line
    reason = re.split(r"(?<=[a-z])\. ", reason.splitlines()[0])[0][:200] if reason else type(e).__name__
    lost = "reset" in reason.lower() or "closed" in reason.lower()
    what = "lost a peer" if lost else f"did not complete within dist.timeout_s={cfg.dist.timeout_s}s"
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) - info.restart_count
    then = f"; torchrun restarts the group ({restarts} restart(s) left)" if restarts > 0 else ""
    msg = f"rank {info.rank}: a collective {what}; {who} (see the workerlogs in {log_dir}; {reason}){then}."
    log.error(msg)
    left = vote.cause_left() if vote is not None and silent is not None else None  # None: the store is out of reach
    if left is None:
        return CollectiveError(msg)
    rank, code, message = left
    log.error(f"the cause, left by rank {rank}: {message}")
    said = CollectiveError(errorfile.by_rank(message, rank) + (f" torchrun restarts the group ({restarts} restart(s) left)." if restarts > 0 else ""))
    said.exit_code = code
    return said


def oom_error(cfg, model, data, device, info) -> BrickyardError:
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        est = memory.estimate(cfg, model.cpu(), data, device, info.world_size)
        tips = memory.oom_tips(est, cfg)
        need = f" (estimated {memory.fmt(est['total'])} per device)"
    except Exception:  # noqa: BLE001  the advice must not hide the out-of-memory error itself
        tips, need = "a smaller data.batch_size, train.grad_accum, train.precision=bf16", ""
    return BrickyardError(f"out of memory on {device}{need}; try: {tips}.")


def determinism_error(e: BaseException, device: torch.device) -> str | None:
    """The sentence for PyTorch's refusals under ``torch.use_deterministic_algorithms(True)``."""
    text = str(e)
    if "does not have a deterministic implementation" in text:
        op = text.split(" does not have", 1)[0].strip().split()[-1]
        return (f"train.deterministic: {op} has no deterministic implementation on {device}; "
                f"set train.deterministic=false or use a model without that layer.")
    if "CUBLAS_WORKSPACE_CONFIG" in text:
        return (f"train.deterministic on {device} needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before the "
                f"process starts (`brickyard train` sets it; set it yourself when calling brickyard from Python).")
    return None


def _lost_store() -> str:
    """What a rank says when it no longer reaches the job's store (torchrun's ``MASTER_ADDR:MASTER_PORT``)."""
    store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return f"this node lost its connection to the job's store at {store}, is the network between the nodes down?"


def cut_off(rank: int, log_dir: Path, grace: float):
    """What a brickyard command does when its node lost the job's store and the run had not ended ``grace`` s later
    (``Heartbeat``'s ``on_lost``): it writes every thread's stack to this rank's workerlog (where it waited), says the
    collective error's sentence where this process says errors, and ends with exit code 2. Called on a timer thread,
    so it takes no lock the waiting main thread may hold (the log's handlers)."""
    def end():
        log = Path(log_dir) / f"workerlog.{rank}"
        msg = (f"rank {rank}: {_lost_store()} (training had not ended {grace:g}s later, so this process ended itself; "
               f"the stacks of its threads are in {log})")
        try:
            with open(log, "a") as f:
                f.write(f"error: {msg}\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass
        if dist_env.prints_errors():
            print(f"error: {msg}.", file=sys.stderr, flush=True)
        os._exit(2)
    return end
