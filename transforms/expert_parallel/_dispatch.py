"""The experts' forward under expert parallelism: routed tokens to the ranks that hold their experts and back.

One MoE layer on one rank of an ``ep`` group of ``P`` ranks, ``E`` experts, ``L = E / P`` of them here
(rank ``r`` holds experts ``r L .. r L + L - 1``), its ``T`` tokens each routed to ``k`` experts:

1. the ``T k`` (token, expert) pairs sorted by expert (stable: a token's pairs keep their order);
2. the sizes first: how many pairs go to each expert, exchanged by one all-to-all of ``E`` integers, so
   that every rank knows how many rows it sends to and receives from each other rank; the row counts are
   read on the host (the one synchronisation a dropless exchange needs: the buffers' sizes);
3. the rows (each pair's token) by one all-to-all of uneven blocks: every pair goes, none is dropped,
   whatever the routing (a rank may send or receive none);
4. the local experts on the rows received, grouped by expert: the model's own experts implementation
   (transformers' ``grouped_mm``, ``torch._grouped_mm`` where the device has it, else a loop over the
   experts; or ``eager``, ``batched_mm``), each row given its local expert and weight 1;
5. the outputs back by the reverse all-to-all, put back in pair order, weighted by the router's weights
   and summed over each token's ``k`` pairs on the rank that routed them.

Backward runs the same exchanges reversed (:class:`_Exchange`): the gradient of a received row goes back
to the rank that sent it. Each exchange counts the bytes this rank sends in ``comm_bytes``: rows x hidden
x dtype size, each way, forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch

from zerofn import collectives as C

__all__ = ["EPLayer", "dispatch_forward"]


class EPLayer:
    """What one experts module needs to run under expert parallelism (kept on the module).

    Attributes:
        group: the group of the ``ep`` ranks the exchanges run on (None: one rank), one of their own
            (``zerofn.mesh.Mesh.own_group``).
        size: its ranks.
        rank: this rank's place in it (which experts it holds).
        experts: the experts of the whole layer.
        inner: the model's own experts implementation's name (``"eager"``, ``"grouped_mm"``, ...).
    """

    def __init__(self, group: Any, size: int, rank: int, experts: int, inner: str | None) -> None:
        self.group, self.size, self.rank, self.experts, self.inner = group, size, rank, experts, inner

    @property
    def local(self) -> int:
        return self.experts // self.size


class _Exchange(torch.autograd.Function):
    """An all-to-all of uneven row blocks; backward sends each row's gradient back where it came from."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list, in_splits: list, group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        C.all_to_all(out, rows.contiguous(), out_splits=out_splits, in_splits=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        C.all_to_all(back, grad.contiguous(), out_splits=in_splits, in_splits=out_splits, group=ctx.group)
        return back, None, None, None


def dispatch_forward(module: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts' forward of ``module`` (a transformers experts module cut by ``expert_parallel``) on this
    rank's tokens ``hidden`` ``[T, H]``, routed to ``top_k_index`` ``[T, k]`` (the layer's expert ids) with
    ``top_k_weights`` ``[T, k]``: ``[T, H]``, as the whole layer on one process gives (see the module)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ep: EPLayer = module._zf_ep
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the pairs by expert
    counts = torch.bincount(flat, minlength=ep.experts)  # pairs per expert of the layer
    if ep.size > 1:
        received = torch.empty_like(counts)
        C.all_to_all(received, counts, group=ep.group)  # block j: what rank j sends to each of my experts
    else:
        received = counts
    per_rank = torch.stack([counts.view(ep.size, ep.local).sum(1), received.view(ep.size, ep.local).sum(1)])
    send, recv = per_rank.tolist()  # the buffers' sizes: the one host read
    rows = hidden[order // k]  # each pair's token, the pairs sorted by expert
    if ep.size > 1:
        rows = _Exchange.apply(rows, recv, send, ep.group)
    # each received row's local expert: from each source rank, its rows grouped by my experts in order
    local = torch.arange(ep.local, device=flat.device).repeat(ep.size)
    ids = torch.repeat_interleave(local, received.view(-1), output_size=rows.shape[0])
    if rows.shape[0]:
        inner = ALL_EXPERTS_FUNCTIONS.get_interface(ep.inner, type(module).forward.__wrapped__)
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = inner(module, rows, ids.unsqueeze(1), ones)
    else:
        # No row came. Still an output of the rows (backward then runs both exchanges on every rank), and of
        # the local experts' parameters, whose gradients are then zeros, as one process's are for experts no
        # token chose: every rank hands every parameter's gradient over at the same point of backward, so
        # the buckets are reduced in one order on every rank.
        touch = sum(p.view(-1)[:1].sum() for p in module.parameters(recurse=False))
        out = rows * 0 + touch * 0
    if ep.size > 1:
        out = _Exchange.apply(out, send, recv, ep.group)
    pairs = out[torch.argsort(order)]  # back in pair order: token-major, k pairs each
    weighted = pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(pairs.dtype)
    return weighted.sum(dim=1).to(hidden.dtype)
