"""Fully sharded data parallel (``dist.strategy: fsdp``): each rank holds 1/N of the parameters, gradients
and optimiser state (torch's ``fully_shard``, ``distributed.fsdp``); saving and evaluating are collectives."""
from __future__ import annotations

from brickyard.distributed import fsdp
from brickyard.distributed.gradsync import GradSync
from brickyard.models import find_blocks
from brickyard.training.ways.base import Way


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


class FSDPWay(Way):
    name = "fsdp"
    shards_state = True

    def capture_refusal(self) -> str | None:
        return "dist.strategy: fsdp gathers and shards the parameters around each step, which is not captured"

    def __init__(self, cfg, info, groups=None):
        super().__init__(cfg, info, groups)
        self.keeps_layout = not info.distributed  # sharded, or one process with nothing to shard

    def check(self, model, resume):
        find_blocks(model, self.cfg.dist.fsdp.blocks, "dist.fsdp.blocks")

    def shard(self, model, host, log, sample=()):
        """Shard the parameters across the ranks before the optimiser sees them."""
        if not self.info.distributed:
            log.info("dist.strategy: fsdp on one process: nothing to shard, the model trains whole")
            return
        d = self.cfg.dist
        blocks = fsdp.shard(model, d, host.precision, host.device)
        where = f"{len(blocks)} blocks ({_some(blocks)}) and the root" if blocks else "the whole model as one unit"
        offload = ""
        if d.fsdp.offload:
            offload = (", shards offloaded to host memory" if host.device.type == "cuda" else
                       "; dist.fsdp.offload has nothing to do on a CPU run (the shards are in host memory already)")
        self.sharded = fsdp.is_sharded(model)
        log.info(f"FSDP: {where} sharded across {self.info.world_size} ranks{offload}")

    def grad_sync(self, model, device, group, own_cores):
        if not self.sharded:  # one process: nothing was sharded
            return model, GradSync()
        return model, fsdp.FSDPSync(model)  # FSDP reduce-scatters inside the backward pass

    def summary_name(self, world):
        return "fsdp" if self.sharded else "none" if world == 1 else "ddp"
