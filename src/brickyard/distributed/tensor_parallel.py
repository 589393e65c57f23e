"""Tensor parallel (``dist.tensor_parallel: N``): each layer's work split across N processes, Megatron-LM's
column then row parallel linear layers (Shoeybi et al., 2019), on torch's ``torch.distributed.tensor.parallel``.

The plan is read from the model (``plan``), so that any model gets one, and applied by torch's
``parallelize_module`` (torch/distributed/tensor/parallel/api.py) as a dict of module name to style:

- a pair of ``nn.Linear`` in an ``nn.Sequential`` with only elementwise activations between them (a ViT block's
  ``mlp``, the ``mlp`` model's ``fc1``/``fc2``) is split as torch's ``ColwiseParallel`` then ``RowwiseParallel``
  (torch/distributed/tensor/parallel/style.py): the first layer's rows (its outputs) and the second's columns
  are split, the hidden activation stays split between them, and the second's output is all-reduced in the
  forward pass; the first's input gradient is all-reduced in the backward pass (``ColwiseParallel
  ._prepare_input_fn``'s ``DTensor.from_local`` of a replicated input: its backward reduces the partial gradient);
- the classifier (the last ``nn.Linear``, as ``models.finetune.find_head`` finds it; a subclass of it is left
  whole, its forward may differ) is ``ColwiseParallel`` with its output gathered (``output_layouts=Replicate()``,
  one all-gather): each rank holds the rows of some classes (N need not divide them: DTensor's shards may differ
  by one row, as ``torch.chunk`` cuts);
- an ``nn.MultiheadAttention`` whose heads N divides (and with no dropout, packed q/k/v, biases) is split by heads
  (``HeadSplitAttention``): ``in_proj_weight`` becomes a DTensor placed ``_StridedShard(0, split_factor=3)``
  (torch/distributed/tensor/placement_types.py, the placement FSDP2 + TP use for a dimension split twice), so
  that rank r holds the q, k and v rows of its heads while the tensor keeps the model's own (3 x dim, dim) layout;
  ``out_proj.weight`` is split by columns (``Shard(1)``). Otherwise attention stays whole on every rank.

Everything else (embeddings, norms, convolutions) is replicated: every rank computes it on the same batch, so
its gradients agree without a sync; ``apply`` broadcasts rank 0's copy once so that they start equal. Collectives
used: all-reduce, all-gather, broadcast and scatter, all of which gloo has (no reduce-scatter: no
``SequenceParallel``). Checkpoints need nothing of their own: ``distributed.fsdp``'s ``full`` gathers a DTensor
and ``like`` places a whole tensor as its DTensor is placed, so a checkpoint holds the model's own tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeGuard

import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

from brickyard.distributed.flat import flatten, load_flat
from brickyard.distributed.fsdp import is_dtensor
from brickyard.distributed.gradsync import GradSync, broadcast_flat, spin_wait
from brickyard.errors import BrickyardError, ConfigError

# modules applied element by element: between a column and a row parallel layer they see a split activation
ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU,
               nn.CELU, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Identity)


@dataclass(frozen=True)
class Plan:
    """What ``apply`` splits, by module name."""
    pairs: list[tuple[str, str]] = field(default_factory=list)  # (column parallel, row parallel)
    head: str | None = None                                     # column parallel, output gathered
    heads_split: list[str] = field(default_factory=list)        # attention split by heads
    heads_kept: list[tuple[str, int]] = field(default_factory=list)  # attention left whole: (name, heads)
    mlps_kept: list[tuple[str, int]] = field(default_factory=list)   # MLPs left whole: (first layer, hidden width)

    def __bool__(self) -> bool:
        return bool(self.pairs or self.head or self.heads_split)

    def describe(self, n: int) -> str:
        """What is split, for the log: e.g. "12 MLPs column/row split, head rows split; attention replicated: 3 heads
        over 2"."""
        parts = [f"{len(self.pairs)} MLP{'s' if len(self.pairs) != 1 else ''} column/row split"] if self.pairs else []
        parts += [f"{self.head} rows split"] if self.head else []
        said = ", ".join(parts)
        if self.heads_split:
            said += f"; attention split by heads ({len(self.heads_split)} modules)"
        if self.heads_kept:
            heads = sorted({h for _, h in self.heads_kept})
            said += f"; attention replicated: {'/'.join(map(str, heads))} heads over {n}"
        if self.mlps_kept:
            widths = sorted({w for _, w in self.mlps_kept})
            said += (f"; {len(self.mlps_kept)} MLP{'s' if len(self.mlps_kept) != 1 else ''} whole: a hidden width of "
                     f"{'/'.join(map(str, widths))} does not split evenly over {n}")
        return said.lstrip("; ")


def _linear(m: nn.Module | None) -> TypeGuard[nn.Linear]:
    return type(m) is nn.Linear  # not a subclass (attention's out_proj, a user's layer) whose forward may differ


def _pairs(model: nn.Module, head: str | None, n: int) -> tuple[list[tuple[str, str]], list[tuple[str, int]]]:
    """Linear, elementwise modules, Linear: in a Sequential, whose children run in that order on each other; the
    hidden width split evenly (``RowwiseParallel`` reads its input's shape as N equal shards: ``DTensor.from_local``).
    Returns (the pairs split, (first layer, hidden width) of those whose width ``n`` does not divide)."""
    found, kept = [], []
    for prefix, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        items = [(f"{prefix}.{c}" if prefix else c, m) for c, m in seq.named_children()]
        i = 0
        while i < len(items):
            j = i + 1
            while j < len(items) and type(items[j][1]) in ELEMENTWISE:
                j += 1
            first, second = items[i][1], items[j][1] if j < len(items) else None
            if (_linear(first) and _linear(second) and items[j][0] != head
                    and first.out_features == second.in_features):
                if first.out_features % n == 0:
                    found.append((items[i][0], items[j][0]))
                    i = j + 1
                    continue
                kept.append((items[i][0], first.out_features))
            i += 1
    return found, kept


def _strided_shard() -> bool:
    """Whether this torch has the placement the head split needs (``_StridedShard``, private to torch: where it is
    missing or moved, attention stays whole and the log says so)."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard  # noqa: F401
    except ImportError:
        return False
    return True


def _splits_heads(m: nn.MultiheadAttention, n: int) -> bool:
    """The self-attention ``HeadSplitAttention`` computes: packed q/k/v with biases, no dropout, heads N divides."""
    return _strided_shard() and (m.in_proj_weight is not None and m.in_proj_bias is not None and m.out_proj.bias is not None
            and m.bias_k is None and not m.add_zero_attn and m.dropout == 0.0 and m.num_heads % n == 0)


def plan(model: nn.Module, n: int, head: bool = True) -> Plan:
    """The layers of ``model`` split across ``n`` processes (see the module docstring); empty: nothing to split.
    ``head``: whether ``model`` ends in the classifier (a pipeline's earlier stages do not: their last linear layer
    is a block's, paired or left whole)."""
    linears = [name for name, m in model.named_modules() if _linear(m)]
    classifier = linears[-1] if linears and head else None
    attention = [(name, m) for name, m in model.named_modules() if type(m) is nn.MultiheadAttention]
    pairs, kept = _pairs(model, classifier, n)
    return Plan(pairs, classifier, [a for a, m in attention if _splits_heads(m, n)],
                [(a, m.num_heads) for a, m in attention if not _splits_heads(m, n)], kept)


def require_plan(model: nn.Module, n: int) -> None:
    """One sentence for a model with nothing ``plan`` can split across ``n`` ranks (no ``nn.Linear``)."""
    if not plan(model, n):
        raise ConfigError(f"dist.tensor_parallel: {type(model).__name__} has no layer tensor parallel can split (an "
                          f"nn.Linear); train it with dist.tensor_parallel: 1.")


def apply(model: nn.Module, the_plan: Plan, mesh) -> None:
    """Split ``model`` in place as ``the_plan`` says over the 1-D ``mesh`` (rank 0's weights for the parts, which
    ``distribute_tensor`` scatters), and give every rank rank 0's copy of what stays whole. Before the optimiser
    is built: the split parameters are replaced by DTensors."""
    # lazy: torch.distributed.tensor takes 0.6 s to import (distributed.fsdp: _loaded), and only this way needs it
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
    styles: dict[str, ParallelStyle] = {}
    for col, row in the_plan.pairs:
        styles[col], styles[row] = ColwiseParallel(), RowwiseParallel()
    if the_plan.head:
        styles[the_plan.head] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, styles)
    modules = dict(model.named_modules())
    for name in the_plan.heads_split:
        parent, _, child = name.rpartition(".")
        setattr(modules[parent] if parent else model, child, HeadSplitAttention(modules[name], mesh))
    group = mesh.get_group()
    src = tdist.get_global_rank(group, 0)
    for t in [*model.parameters(), *model.buffers()]:
        if not is_dtensor(t):
            tdist.broadcast(t.data, src, group=group)


class _Enter(torch.autograd.Function):
    """Identity forward; the backward sums the ranks' partial input gradients (Megatron-LM's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        tdist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Leave(torch.autograd.Function):
    """Sums the ranks' partial outputs in the forward; identity backward (Megatron-LM's ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        tdist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class HeadSplitAttention(nn.Module):
    """An ``nn.MultiheadAttention``'s self-attention over this rank's heads; its parameters keep the names and
    whole shapes of the module it replaces (``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``,
    ``out_proj.bias``): DTensors of q/k/v rows split by heads and of ``out_proj``'s columns, and its bias, whole on
    every rank, a plain tensor. The math of ``F.multi_head_attention_forward`` (torch/nn/functional.py) without
    masks or dropout, with one all-reduce in the forward pass (the heads' outputs) and one in the backward (their
    input gradients)."""

    def __init__(self, attn: nn.MultiheadAttention, mesh):
        super().__init__()
        # lazy: see apply
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard
        n = mesh.size()
        self.batch_first, self.heads, self.head_dim = attn.batch_first, attn.num_heads // n, attn.head_dim
        # what nn.TransformerEncoderLayer reads of its attention in evaluation mode (its fast path: off, as for
        # q, k, v of different sizes): torch/nn/modules/transformer.py, TransformerEncoderLayer.forward
        self.num_heads, self.embed_dim, self._qkv_same_embed_dim = attn.num_heads, attn.embed_dim, False
        self.group = mesh.get_group()
        strided = [_StridedShard(0, split_factor=3)]  # q, k, v each split in n: rank r's rows of each
        self.in_proj_weight = nn.Parameter(distribute_tensor(attn.in_proj_weight.detach(), mesh, strided))
        self.in_proj_bias = nn.Parameter(distribute_tensor(attn.in_proj_bias.detach(), mesh, strided))
        self.out_proj = attn.out_proj
        self.out_proj.weight = nn.Parameter(distribute_tensor(attn.out_proj.weight.detach(), mesh, [Shard(1)]))

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if key is not query or value is not query or key_padding_mask is not None or attn_mask is not None \
                or need_weights or is_causal:
            raise BrickyardError("dist.tensor_parallel splits this attention by heads, which computes self-attention "
                                 "without masks or attention weights (need_weights=False); this model asks for more.")
        x = query if self.batch_first else query.transpose(0, 1)
        b, t, _ = x.shape
        qkv = F.linear(_Enter.apply(x, self.group), self.in_proj_weight.to_local(), self.in_proj_bias.to_local())
        q, k, v = qkv.view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x B x heads x T x d
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        out = _Leave.apply(F.linear(o, self.out_proj.weight.to_local()), self.group) + self.out_proj.bias
        return (out if self.batch_first else out.transpose(0, 1)), None


def planned_held(model: nn.Module, the_plan: Plan, n: int, trainable: bool = False) -> int:
    """The parameters (elements) rank 0 of ``n`` will hold once ``the_plan`` splits ``model`` (the most any rank holds:
    DTensor's uneven shards give the first ranks the larger ones), counted on the whole model before any split, as
    ``brickyard memory`` needs it; ``trainable``: those that take gradients only."""
    cols = {c for c, _ in the_plan.pairs} | ({the_plan.head} if the_plan.head else set())
    rows, heads = {r for _, r in the_plan.pairs}, set(the_plan.heads_split)
    total = 0
    for name, p in model.named_parameters():
        if trainable and not p.requires_grad:
            continue
        owner, _, leaf = name.rpartition(".")
        shape, part = list(p.shape), -(-p.shape[0] // n) if p.dim() else 1
        if owner in cols or (owner in heads and leaf.startswith("in_proj")):  # rows (q, k, v each by heads)
            shape[0] = part if owner in cols else 3 * -(-(p.shape[0] // 3) // n)
        elif (owner in rows or (owner.endswith(".out_proj") and owner.rpartition(".")[0] in heads)) and leaf == "weight":
            shape[1] = -(-p.shape[1] // n)  # columns; the bias stays whole
        total += math.prod(shape)
    return total


def held(model: nn.Module) -> tuple[int, int]:
    """(the parameters this rank holds, counted from its shards; the whole model's)."""
    params = list(model.parameters())
    split, whole = local_parts(params)
    return sum(t.numel() for t in split + whole), sum(p.numel() for p in params)


def local_parts(tensors) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(this rank's shards of the split tensors, the whole ones: plain tensors and replicated DTensors' copies)."""
    split, whole = [], []
    for t in tensors:
        if is_dtensor(t):
            (whole if all(p.is_replicate() for p in t.placements) else split).append(t.to_local())
        else:
            whole.append(t)
    return split, whole


def clip_grad_norm_(params, max_norm: float, group) -> torch.Tensor:
    """``nn.utils.clip_grad_norm_`` over split and whole gradients together (torch's fails on a list that mixes
    DTensors and plain tensors: ``aten._foreach_norm`` refuses it): the squares of the shards summed over the
    ranks (one all-reduce), those of the whole gradients counted once. Returns the total norm."""
    split, whole = local_parts([p.grad for p in params if p.grad is not None])
    sq = torch.zeros((), dtype=torch.float32, device=(split + whole)[0].device if split or whole else None)
    for g in split:
        sq += g.detach().float().pow(2).sum()
    tdist.all_reduce(sq, group=group)
    for g in whole:
        sq += g.detach().float().pow(2).sum()
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in split + whole:
        g.detach().mul_(coef.to(g.dtype))  # a DTensor's local tensor is its storage: the gradient itself
    return total


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local tensor (its storage: writing it writes the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]  # a DTensor (is_dtensor is no TypeGuard: DTensor loads lazily)


class ReplicaGrads(GradSync):
    """The gradients of tensor-parallel groups that read different data (``dist.tensor_parallel`` replicas), averaged
    over ``group``: the ranks that hold the same shards (the same place in their groups). One all-reduce of the
    gradients' local parts, copied into one flat buffer and back (``gradsync.FlatGrads`` keeps its gradients as views
    into its buffer, which a DTensor's gradient cannot be). As DDP: times 1/world before the sum, the ranks'
    weights made equal to the group's first rank's at the start, and its floating buffers given to the others after
    each step."""
    name = "replicas"

    def __init__(self, model: nn.Module, group, spin: bool = True):
        super().__init__()
        self.group, self.world = group, tdist.get_world_size(group)
        self.spin_s = 0.02 if spin else 0.0  # as FlatGrads: awake only on cores of its own
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        with torch.no_grad():
            broadcast_flat([local(p.detach()) for p in model.parameters()] + self.buffers, group)

    def __call__(self) -> None:
        grads = [local(p.grad) for p in self.params if p.grad is not None]  # the same parameters on every replica
        if grads:
            flat = flatten(grads).mul_(1.0 / self.world)
            if flat.device.type == "cpu":
                spin_wait(tdist.all_reduce(flat, group=self.group, async_op=True), self.spin_s)
            else:
                tdist.all_reduce(flat, group=self.group)
            load_flat(grads, flat)
        if self.buffers:
            broadcast_flat(self.buffers, self.group)
