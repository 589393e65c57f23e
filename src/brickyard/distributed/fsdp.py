"""Sharded data parallel (``dist.strategy: fsdp``): each rank keeps 1/world of every parameter, its
gradient and its optimiser state, and gathers a block's full parameters only while it computes.

Built on PyTorch's FSDP2, ``torch.distributed.fsdp.fully_shard`` (torch/distributed/fsdp/_fully_shard/
_fully_shard.py): parameters become ``DTensor``s sharded on dim 0; each ``fully_shard``-ed module is one
unit of communication (one all-gather before its forward and backward, one reduce-scatter of its
gradients after). ``shard`` applies it to the model family's repeated blocks (``models.BLOCKS``, or
``dist.fsdp.blocks`` patterns), then to the root, which takes the remaining parameters (stem, head).
``reshard_after_forward`` is left to FSDP2's default (``None``: True for the blocks, False for the root,
whose parameters the backward pass needs at once) unless ``dist.fsdp.reshard_after_forward: false``.

Precision follows ``train.precision``: bf16/fp16 runs gather and compute with parameters in that dtype
(``MixedPrecisionPolicy(param_dtype=...)``) and reduce gradients in fp32; the sharded parameters and the
optimiser state stay fp32. ``dist.fsdp.offload`` keeps the shards in host memory (``CPUOffloadPolicy``);
on a CPU run they are there already.

Checkpoints hold full (unsharded) tensors in the same layout as a DDP run's: ``full_state`` gathers them
(a collective: every rank calls it) and ``load_model_state`` and ``load_optimizer_state`` shard them
again, so a run saved under FSDP resumes under DDP or on another world size, and ``eval``, ``predict``
and ``export`` read it as any other. All three leave plain tensors as they are, so the rest of
brickyard calls them for every run.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from brickyard.distributed.gradsync import GradSync
from brickyard.models import find_blocks

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shard(model: nn.Module, d, precision: str, device: torch.device, mesh=None, root: nn.Module | None = None) -> list[str]:
    """``fully_shard`` the blocks ``d.fsdp.blocks`` picks, then the root (``d`` is the config's ``dist``);
    returns the blocks' names. Call it before the optimiser is built: the parameters are replaced. ``root``: a
    part of ``model`` (a pipeline's stage) whose blocks and itself are sharded, over ``mesh`` (its replicas)."""
    # start-up: see _loaded
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    names = find_blocks(model, d.fsdp.blocks, "dist.fsdp.blocks")
    low = _DTYPES.get(precision)
    kwargs = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None),
        "offload_policy": CPUOffloadPolicy() if d.fsdp.offload and device.type == "cuda" else OffloadPolicy(),
        "reshard_after_forward": None if d.fsdp.reshard_after_forward else False,
    }
    if mesh is not None:
        kwargs["mesh"] = mesh
    modules = dict(model.named_modules())
    if root is not None:
        inside = {id(m) for m in root.modules()}
        names = [n for n in names if id(modules[n]) in inside]
    for name in names:
        fully_shard(modules[name], **kwargs)
    fully_shard(model if root is None else root, **kwargs)
    return names


def group_mesh(group, device: torch.device):
    """A one-dimensional ``DeviceMesh`` of the processes of ``group`` (a pipeline stage's replicas)."""
    from torch.distributed.device_mesh import DeviceMesh  # start-up: see _loaded
    return DeviceMesh.from_group(group, device.type)


class FSDPSync(GradSync):
    """FSDP reduce-scatters each block's gradients inside the backward pass (averaged over the ranks, as
    DDP); ``skip`` turns that off for the micro-batches whose gradients only accumulate."""
    name = "fsdp"

    def __init__(self, model):
        super().__init__()
        self.model = model

    @contextlib.contextmanager
    def skip(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)


def _loaded(module: str, name: str):
    """``module.name`` when that module is imported already, else None. Every function here but ``shard``
    is called on every run; torch.distributed.fsdp and .tensor take 0.6 s to import (DTensor's operator
    tables, sympy), and no tensor can be a DTensor, nor a module an FSDPModule, before they are."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def is_dtensor(t) -> bool:
    dtensor = _loaded("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(t, dtensor)


def is_sharded(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def full(t):
    """The whole tensor of a shard (an all-gather: every rank calls it), or ``t`` itself."""
    return t.full_tensor() if is_dtensor(t) else t


def like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor) laid out as ``ref``: this rank's shard when ``ref`` is sharded (taken
    locally: every rank holds the full value), else ``value`` on ``ref``'s device."""
    if is_dtensor(ref):
        from torch.distributed.tensor import distribute_tensor  # loaded already: ref is a DTensor
        return distribute_tensor(value.to(ref.device, ref.dtype), ref.device_mesh, ref.placements, src_data_rank=None)
    return value.to(ref.device)


def full_state(model: nn.Module, optimizer) -> tuple[dict, dict]:
    """The model's and the optimiser's ``state_dict`` with every shard gathered: the layout of a run
    without sharding (the optimiser's state keyed by parameter index)."""
    model_state = {k: full(v) for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    opt["state"] = {i: {k: full(v) for k, v in s.items()} for i, s in opt["state"].items()}
    return model_state, opt


def load_model_state(model: nn.Module, model_state: dict) -> None:
    """Load full tensors (``full_state``'s, or any run's) into a model that may be sharded."""
    own = model.state_dict()
    model.load_state_dict({k: like(v, own[k]) if k in own and isinstance(v, torch.Tensor) else v
                           for k, v in model_state.items()})


def load_optimizer_state(optimizer, opt_state: dict) -> None:
    """Load an optimiser ``state_dict`` of full tensors into an optimiser whose parameters may be sharded."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for i, s in opt_state["state"].items():
        p = params[int(i)] if int(i) < len(params) else None
        state[i] = {k: like(v, p) if p is not None and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                    for k, v in s.items()}
    optimizer.load_state_dict({**opt_state, "state": state})


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (its shard of a sharded one)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if is_dtensor(t) else t
            total += local.numel() * local.element_size()
    return total


def held_bytes(model: nn.Module, optimizer) -> dict:
    """What this rank holds, measured from its tensors: parameters and optimiser state (gradients,
    between the backward pass and the update, take the parameters' layout)."""
    fsdp_module = _loaded("torch.distributed.fsdp", "FSDPModule")
    if fsdp_module is not None and isinstance(model, fsdp_module):  # FSDP's root keeps its gathered parameters after an evaluation's forward
        model.reshard()
    return {"parameters": local_bytes(model.parameters()),
            "optimizer_state": local_bytes(v for s in optimizer.state.values() for v in s.values())}
