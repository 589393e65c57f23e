"""The ``dist`` section: how a run spreads over processes (data parallel, FSDP, the parameter server, pipeline
stages, tensor parallel); the rules it shares with other sections are in ``config/rules.py``."""
from __future__ import annotations

from dataclasses import dataclass, field

from brickyard.config.fields import Section, _opt
from brickyard.errors import ConfigError


@dataclass(frozen=True)
class PSConfig(Section):
    servers: int = _opt(1, min=1)
    sync: bool = _opt(True)
    max_staleness: int = _opt(2, min=0)


@dataclass(frozen=True)
class FSDPConfig(Section):
    blocks: tuple | str = _opt("auto", choices_str=("auto",), names=True, doc="modules sharded one by one (name patterns); auto: the model family's blocks (ViT blocks.*, ResNet layer?.*, VGG features); the rest is sharded with the root")
    offload: bool = _opt(False, doc="keep the sharded parameters, gradients and optimiser state in host memory (GPUs; a CPU run already does)")
    reshard_after_forward: bool = _opt(True, doc="free the gathered parameters after each block's forward (false: keep them until the backward, more memory and less communication)")


@dataclass(frozen=True)
class PipelineConfig(Section):
    stages: int = _opt(1, min=1, doc="pipeline stages: the model split at block boundaries into this many parts, one a process (1: off); docs/distributed.md")
    schedule: str = _opt("gpipe", choices=("gpipe", "1f1b"), doc="torch.distributed.pipelining's ScheduleGPipe or Schedule1F1B")
    microbatches: int | str = _opt("auto", min=1, choices_str=("auto",), doc="microbatches a device's batch is cut into (a number must divide it); auto: the divisor of the device's batch nearest 2 x stages")
    split: tuple = _opt((), names=True, doc="module names each later stage begins at, e.g. [layer3] (stages - 1 of them); empty: balanced as dist.pipeline.balance says")
    balance: str = _opt("params", choices=("params", "time", "memory"), doc="where the stages are cut without a split: params (each stage near 1/N of the parameters), time (of each block's forward and backward, measured on rank 0) or memory (the largest stage's parameters, gradients, optimiser state and activations in flight as small as it can be; `brickyard memory` shows each stage's)")

    def microbatch_count(self, batch: int = 0) -> int:
        """Microbatches a device's ``batch`` is cut into. A number is kept (the way refuses one that does not divide
        the batch). auto: 2 x stages, so each stage has a second microbatch to work on, or for a ``batch`` the
        divisor of it nearest that (the larger on a tie: a batch of 50 on 2 stages is 5 microbatches of 10, a prime
        batch one microbatch). The loss is a sum over the batch, so any count trains the weights of one process."""
        if self.microbatches != "auto":
            return int(self.microbatches)
        want = 2 * self.stages
        if batch < 1:
            return want
        return min((d for d in range(1, batch + 1) if batch % d == 0), key=lambda d: (abs(d - want), -d))


@dataclass(frozen=True)
class DistConfig(Section):
    mode: str = _opt("collective", choices=("collective", "ps"))
    strategy: str = _opt("ddp", choices=("ddp", "fsdp"), doc="ddp: every rank holds the whole model; fsdp: each holds 1/world of the parameters, gradients and optimiser state (FSDP2); docs/distributed.md")
    backend: str = _opt("auto", choices=("auto", "nccl", "gloo"))
    scale_lr: str = _opt("none", choices=("none", "linear"))
    scale_warmup_epochs: float = _opt(0.5, min=0.0, doc="warm-up used with scale_lr: linear")
    timeout_s: int = _opt(300, min=1, max=7 * 86400, doc="seconds a rank waits for the others (joining, a collective) before the job ends")
    grad_sync: str = _opt("auto", choices=("auto", "ddp", "flat"), doc="ddp, or flat: one all-reduce after backward (auto: flat on CPUs, ddp on GPUs)")
    sync_bn: bool = _opt(False, doc="batch norm over the global batch (torch's SyncBatchNorm; GPUs only)")
    tensor_parallel: int = _opt(1, min=1, doc="processes each layer's work is split across (Megatron-style column then row parallel linear layers, torch.distributed.tensor.parallel); 1: off; docs/distributed.md")
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ps: PSConfig = field(default_factory=PSConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def check(self) -> None:
        if self.grad_sync == "flat" and self.sync_bn:
            raise ConfigError("dist.grad_sync: flat does not run SyncBatchNorm (dist.sync_bn: true); use dist.grad_sync: ddp or auto.")
