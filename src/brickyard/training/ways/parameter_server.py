"""The parameter server (``dist.mode: ps``): the last ``dist.ps.servers`` ranks hold the parameters and the
optimiser, the others train and push their gradients (``distributed.parameter_server``)."""
from __future__ import annotations

import torch

from brickyard.distributed import parameter_server as ps
from brickyard.errors import BrickyardError
from brickyard.training.ways.base import Way


class ParameterServer(Way):
    name = "ps"

    def capture_refusal(self) -> str | None:
        return "dist.mode: ps sends the gradients to a server, which is not captured"

    def __init__(self, cfg, info, groups=None):
        super().__init__(cfg, info, groups)
        self.layout = ps.check_layout(cfg, info.world_size)
        self.stops_early = not cfg.dist.ps.sync  # the servers count the steps of a synchronous run

    def check(self, model, resume):
        if resume:
            raise BrickyardError(ps.NO_RESUME)

    @property
    def readers(self) -> int:
        return self.layout.trainers

    def serves(self, rank):
        return self.layout.is_server(rank)

    def groups(self):
        """The trainers' process group and the messages' group (every rank makes both, in this order)."""
        if not self.info.distributed:
            return None, None
        return torch.distributed.new_group(list(range(self.layout.trainers))), ps.message_group()

    def serve(self, params, plan, messages, log) -> None:
        """A server's whole part in the job: hold its share of the parameters and apply the trainers'
        pushes until they are done."""
        ps.serve(params, self.layout, self.info.rank, self.cfg, plan.total_steps, plan.schedule, log, messages)

    def update(self, run, param_groups, loss_sum, scaler, group, messages):
        params = [p for g in param_groups for p in g["params"]]
        return ps.ParameterServerUpdate(ps.Client(params, self.layout, self.cfg.dist.ps.sync, messages))

    def summary_name(self, world):
        return "none" if world == 1 else "ps"  # the servers sync the gradients: no all-reduce among trainers
