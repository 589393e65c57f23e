"""The update interface: how a step's gradients change the weights.

``Update.__call__(run, loss_sum, batch)`` runs once per optimiser step, after the gradients of every
micro-batch are summed and synced across ranks and the learning rate is set. ``loss_sum`` is this
rank's summed loss of the last micro-batch (a 0-dim tensor) and ``batch`` its ``(inputs, targets,
n_global)``. Three strategies implement it: ``OptimizerUpdate`` here, ``distributed.parameter_server.
ParameterServerUpdate`` and ``boost.dim_reduce.DimReduceUpdate``.
"""
from __future__ import annotations


class Update:
    """An update strategy. Besides ``__call__`` the rest have defaults: no state to checkpoint, nothing
    to add to the log line, nothing to end."""

    def __call__(self, run, loss_sum, batch) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> str:
        return ""

    def finish(self) -> None:
        pass


class OptimizerUpdate(Update):
    """The optimiser's step, through the loss scaler (a no-op unless fp16)."""

    def __init__(self, scaler):
        self.scaler = scaler

    def __call__(self, run, loss_sum, batch) -> None:
        self.scaler.step(run.optimizer)
        self.scaler.update()
