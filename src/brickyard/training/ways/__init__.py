"""Ways of training: how the processes of a job share the work. Each is one class on the ``Way`` interface,
registered under the name its config selects, and chosen in one place (``choose``); nothing else in the
training package asks which one is running (``tests/test_layout.py``; config rules across sections still name
them, as does ``ReduceLROnPlateau``'s check that the parameter servers, which apply the schedule, see no
validations).

===================  ==========================================  =========================================
name                 selected by                                 what each rank holds and does
===================  ==========================================  =========================================
``collective``       ``dist.mode: collective`` (the default)     the whole model; gradients all-reduced
                                                                 (one flat buffer or DDP)
``fsdp``             ``dist.strategy: fsdp``                     1/N of the parameters, gradients and
                                                                 optimiser state (torch's ``fully_shard``)
``ps``               ``dist.mode: ps``                           trainers push gradients to servers that
                                                                 hold the parameters and the optimiser
``dim_reduce``       ``boost.dim_reduce.enabled``                P-BFGS in a subspace of the weights
                                                                 instead of the optimiser
``pipeline``         ``dist.pipeline.stages`` above 1            one stage of the model and its optimiser
                                                                 state (torch's ``pipelining``); FSDP or
                                                                 tensor parallel inside a stage
``tensor_parallel``  ``dist.tensor_parallel`` above 1            1/N of each layer it splits (MLPs, the
                                                                 classifier, attention heads); a group's
                                                                 batch
===================  ==========================================  =========================================

A new way is a module here with a ``Way`` subclass, one entry in ``WAYS`` and one line in ``name_of``; the
trainer (``training.trainer``) calls only the interface.
"""
from __future__ import annotations

from brickyard.training.ways.base import Way
from brickyard.training.ways.collective import Collective
from brickyard.training.ways.dim_reduce import DimReduceWay
from brickyard.training.ways.fsdp import FSDPWay
from brickyard.training.ways.parameter_server import ParameterServer
from brickyard.training.ways.pipeline import PipelineWay
from brickyard.training.ways.tensor_parallel import TensorParallelWay

__all__ = ["WAYS", "Way", "choose", "name_of"]

WAYS: dict[str, type[Way]] = {"collective": Collective, "fsdp": FSDPWay, "ps": ParameterServer,
                              "dim_reduce": DimReduceWay, "pipeline": PipelineWay, "tensor_parallel": TensorParallelWay}


def name_of(cfg) -> str:
    """The way ``cfg`` selects (the config refuses combinations of them: ``config.checks``)."""
    if cfg.dist.mode == "ps":
        return "ps"
    if cfg.boost.dim_reduce.enabled:
        return "dim_reduce"
    if cfg.dist.pipeline.stages > 1:
        return "pipeline"
    if cfg.dist.tensor_parallel > 1:
        return "tensor_parallel"
    return "fsdp" if cfg.dist.strategy == "fsdp" else "collective"


def choose(cfg, info, groups=None) -> Way:
    """This run's way of training, for this process's place in the job (``DistInfo``); ``groups``: what an earlier
    way's ``groups()`` made (the process groups are made once a job, and the way a run trains with takes them)."""
    return WAYS[name_of(cfg)](cfg, info, groups)
