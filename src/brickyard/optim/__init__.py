"""Optimisers (``torch.optim.Optimizer`` subclasses), learning-rate schedules, parameter groups, and
the update interface through which a step changes the weights (the optimiser, the parameter server
and dimension reduction's P-BFGS all implement it)."""
from brickyard.optim.optimizers import (  # noqa: F401  (re-exported)
    SGD,
    STATE_COPIES,
    Adam,
    Schedule,
    build_optimizer,
    describe_groups,
    l1_penalty,
    param_groups,
    set_lr,
)
from brickyard.optim.updates import OptimizerUpdate, Update  # noqa: F401
