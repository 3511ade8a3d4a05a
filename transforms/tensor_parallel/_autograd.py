"""The autograd collectives of the split layers, each a ``torch.autograd.Function`` over a group.

- :class:`Copy`: identity in forward, the gradient all-reduced in backward (an input entering a
  tensor-parallel region); :class:`Reduce`: all-reduce in forward, identity in backward (a row-wise
  layer's partial output leaving it); :class:`SumGrad`: identity in forward, the gradient summed in
  backward (a parameter the ranks hold alike, each computing part of its gradient);
- with sequence parallelism, over the sequence (dimension 1): :class:`GatherSeq` (all-gather,
  reduce-scatter of the gradient), :class:`ReduceScatterSeq` (the reverse) and :class:`ScatterSeq` (this
  rank's slice of a sequence held whole, the gradient all-gathered).

:func:`copy_in` and :func:`leave` pick among them for a layer; :func:`copy_in` makes one copy per input
tensor while a step runs (:data:`COPIES`, set by the batch check's context around the step), so the layers
reading the same input share one all-reduce in backward. Every collective goes through
:mod:`zerofn.collectives` (counted in ``comm_bytes``, bounded by zerofn's timeouts).
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
import torch.distributed as dist

from zerofn import collectives as C


class SumGrad(torch.autograd.Function):
    """Identity in forward; the gradient summed over ``group`` in backward (a parameter held alike by the
    ranks of ``group``, each of which computes part of its gradient)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous(), group=ctx.group), None


def _seq_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole sequence (dimension 1) from every rank's consecutive slice of it."""
    n = dist.get_world_size(group)
    local = x.transpose(0, 1).contiguous()
    full = local.new_empty((local.shape[0] * n, *local.shape[1:]))
    C.all_gather(full.view(-1), local.view(-1), group=group)  # flat: the rows lie back to back
    return full.transpose(0, 1).contiguous()  # one copy the layers reading it save, not one each


def _seq_reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's slice of the sequence (dimension 1) of the sum over the ranks."""
    n = _splits_sequence(x, group)
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    C.reduce_scatter(out.view(-1), full.view(-1), group=group)
    return out.transpose(0, 1).contiguous()


def _seq_slice(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x.chunk(_splits_sequence(x, group), dim=1)[dist.get_rank(group)].contiguous()


def _splits_sequence(x: torch.Tensor, group: Any) -> int:
    """The ranks of ``group``, which must split ``x``'s sequence (dimension 1) evenly."""
    n = dist.get_world_size(group)
    if x.shape[1] % n:
        raise ValueError(
            f"tensor_parallel(sequence_parallel=True): the sequence has {x.shape[1]} positions, which {n} "
            "ranks cannot split evenly; pad the batch's sequence to a multiple of the tensor-parallel size"
        )
    return n


class GatherSeq(torch.autograd.Function):
    """All-gather over the sequence in forward; reduce-scatter of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_reduce_scatter(grad, ctx.group), None


class ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter over the sequence in forward; all-gather of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_gather(grad.contiguous(), ctx.group), None


class ScatterSeq(torch.autograd.Function):
    """This rank's slice of a sequence every rank holds whole; the gradient all-gathered in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_gather(grad.contiguous(), ctx.group), None


class Copy(torch.autograd.Function):
    """Identity in forward; the gradient all-reduced over the tensor-parallel group in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous(), group=ctx.group), None


class Reduce(torch.autograd.Function):
    """All-reduce over the tensor-parallel group in forward; identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x.contiguous(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


COPIES: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "zerofn_tp_copies", default=None
)  # (id(x), id(group)) -> (x, its copy): a step's copies


def leave(y: torch.Tensor, group: Any, seq: bool) -> torch.Tensor:
    """A row-wise layer's partial output leaving the region: summed over the ranks (all-reduce), or with
    sequence parallelism reduce-scattered over the sequence (dimension 1)."""
    return ReduceScatterSeq.apply(y, group) if seq else Reduce.apply(y, group)


def copy_in(x: torch.Tensor, group: Any, seq: bool = False) -> torch.Tensor:
    """``x`` entering a tensor-parallel region (with sequence parallelism: all-gathered over the sequence,
    its gradient reduce-scattered): once per tensor while a step runs, so the layers that read
    the same input (attention's q, k and v; the MLP's gate and up) share one copy, whose gradient autograd
    sums over them before the one all-reduce (Megatron's count: one per region in backward, not one per
    layer). The step's copies are kept (with their inputs, which backward keeps anyway) until it ends."""
    enter = GatherSeq.apply if seq else Copy.apply
    copies = COPIES.get()
    if not x.requires_grad and not seq:
        return x
    if copies is None:
        return enter(x, group)
    found = copies.get((id(x), id(group)))
    if found is not None and found[0] is x:
        return found[1]
    copied = enter(x, group)
    copies[(id(x), id(group))] = (x, copied)
    return copied


def gather_last(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole of a tensor split over ``group`` along its last dimension (a vocabulary-parallel head's
    logits outside training), through zerofn's collectives (counted, timed)."""
    n = dist.get_world_size(group)
    rows = local.movedim(-1, 0).contiguous()
    full = rows.new_empty((rows.shape[0] * n, *rows.shape[1:]))
    C.all_gather(full.view(-1), rows.view(-1), group=group)
    return full.movedim(0, -1)
