"""The interface every way of training implements (``training.ways``). ``check`` runs before anything is
written, ``groups`` with the logs (every rank), then ``serves``/``serve`` on a serving rank, or ``shard``,
``update``, ``callbacks`` and ``grad_sync`` as the trainer builds its parts; ``readers`` is read throughout."""
from __future__ import annotations

from torch import nn

from brickyard.distributed import fsdp
from brickyard.distributed.gradsync import GradSync
from brickyard.optim import OptimizerUpdate
from brickyard.optim.updates import Update


class Way:
    """A way of training; the defaults are one process training the whole model with its optimiser."""

    name = "none"
    sharded = False        # saving and evaluating are collectives every rank takes part in (FSDP)
    keeps_layout = True    # the model may be put in channels_last (FSDP shards contiguous parameters only)
    stops_early = True     # a callback may end the run before its last step
    shards_state = False   # each of N ranks holds 1/N of the parameters, gradients and optimiser state

    def __init__(self, cfg, info, groups=None):
        """``groups``: what ``groups()`` made once for the job, which a way with process groups of its own keeps
        (a pipeline, tensor parallel); None before they are made."""
        self.cfg, self.info = cfg, info

    def check(self, model, resume: str | None) -> None:
        """What this way refuses of the run, in one sentence, before anything is written."""

    def check_layout(self) -> None:
        """What this way refuses of the job's layout (its processes, precision and batch) without a model: the
        launcher asks before any worker starts; ``check`` asks it again in each process."""

    @property
    def readers(self) -> int:
        """Processes that read data and train (all but a parameter server's servers)."""
        return self.info.world_size

    @property
    def reader_index(self) -> int:
        """Which of the ``readers`` shares of each global batch (and of each evaluation) this process reads."""
        return min(self.info.rank, self.readers - 1)

    def serves(self, rank: int) -> bool:
        """Whether ``rank`` serves the others instead of training (a parameter server)."""
        return False

    def serve(self, params, plan, messages, log) -> None:
        """A serving rank's whole part in the job (``messages``: the second group of ``groups``)."""
        raise NotImplementedError

    def shard(self, model: nn.Module, host, log, sample: tuple = ()) -> nn.Module | None:
        """After the model is on its device: split it across the ranks where this way does (FSDP, in place); the
        module this rank trains instead of ``model`` where it holds a part of it (a pipeline's stage), else None.
        ``sample``: the shape of one input image (C, H, W), where the inputs are images."""
        return None

    def groups(self):
        """(the readers' process group, a group of this way's own messages): made in the same order on
        every rank (``new_group`` is collective); None for all ranks / none."""
        return None, None

    def vote_group(self, readers_group):
        """The process group whose ranks agree on a stop step (``StopVote``): every rank that trains, which
        is the readers' group unless some ranks train without reading (a pipeline's later stages: None, all)."""
        return readers_group

    def held_groups(self, groups: list[dict], module: nn.Module) -> list[dict]:
        """The optimiser groups of this rank's ``module``, from the whole model's ``groups`` (named and ordered as one
        process makes them: ``optim.param_groups``): all of them, unless a rank holds part of the model."""
        return groups

    def whole_model(self, model: nn.Module) -> nn.Module:
        """The model a checkpoint holds, for ``model`` as this rank trains it (a pipeline's stage: the whole model)."""
        return model

    def update(self, run, param_groups, loss_sum, scaler, group, messages) -> Update:
        """What a step's gradients do to the weights (``group``: the readers' process group, ``messages``: this
        way's own, from ``groups``)."""
        return OptimizerUpdate(scaler)

    def grad_sync(self, model: nn.Module, device, group, own_cores: bool) -> tuple[nn.Module, GradSync]:
        """(the model to call, how the ranks' gradients meet)."""
        return model, GradSync()

    def clip(self, optimizer, max_norm: float) -> None:
        """Scale the gradients to a norm of at most ``max_norm`` over the whole model (``train.grad_clip``; after
        the loss scaler's unscale)."""
        nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], max_norm)

    def step_function(self):
        """This way's own optimiser step, ``step(trainer, batches) -> StepResult`` (``training.step.optimizer_step``'s
        contract), or None: the trainer's."""
        return None

    def full_state(self, model: nn.Module, optimizer) -> tuple[dict, dict]:
        """(the model's state, the optimiser's) as a checkpoint holds them: whole, as one process writes them."""
        return fsdp.full_state(model, optimizer)

    def load_state(self, model: nn.Module, optimizer, state: dict) -> None:
        """``full_state``'s tensors back into this rank's model and optimiser (``ValueError``, ``KeyError``,
        ``IndexError``: an optimiser state that does not fit)."""
        fsdp.load_model_state(model, state["model"])
        fsdp.load_optimizer_state(optimizer, state["optimizer"])

    def callbacks(self, run, update, writer) -> list:
        """brickyard's behaviours this way adds (after the trainer's own)."""
        return []

    def capture_refusal(self) -> str | None:
        """Why this way's step cannot be captured as a CUDA graph (``train.cuda_graphs``); None: it can."""
        if self.info.world_size > 1:
            return f"{self.info.world_size} processes train, and the gradient sync between them is not captured"
        return None

    def summary_name(self, world: int) -> str:
        """The summary's ``strategy``."""
        return "none" if world == 1 else self.name
