"""Ulysses (DeepSpeed's sequence parallelism): attention on the whole sequence for ``heads / cp`` heads.

Each rank enters attention with q, k, v for all heads on its slice of the sequence (``[B, H, L, D]``,
``L = S / cp``). One all-to-all each turns them into all ``S`` tokens for this rank's ``H / cp`` heads
(:class:`SeqToHeads`); attention runs as one process's would on those heads (causal, the padding mask,
a sliding window); one all-to-all brings the output back to this rank's tokens for all heads
(:class:`HeadsToSeq`). Each all-to-all's backward is the other's forward, so a layer moves four
activation-sized tensors each way in forward and four in backward, each ``1 / cp`` of the layer's
activations per rank (its own block included): ``comm_bytes`` counts ``bytes(q) + bytes(k) + bytes(v) +
bytes(out)`` per layer and direction.

Grouped-query attention: key/value heads fewer than the ranks (a divisor of ``cp``) are repeated to ``cp``
before the exchange, so each rank receives the one its query heads read; more (a multiple of ``cp``) are
split like the query heads, whose consecutive groups they serve.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zerofn import collectives as C


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    return C.all_to_all(torch.empty(x.shape, dtype=x.dtype, device=x.device), x, group=group)


def seq_to_heads(x: torch.Tensor, cp: int, group: Any) -> torch.Tensor:
    """``[B, H, L, D]`` on this rank's tokens -> ``[B, H / cp, cp L, D]`` on the whole sequence."""
    b, h, n, d = x.shape
    blocks = x.view(b, cp, h // cp, n, d).transpose(0, 1)  # [cp (heads' owner), B, H/cp, L, D]
    got = _exchange(blocks, group)  # [cp (tokens' owner), B, H/cp, L, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def heads_to_seq(x: torch.Tensor, cp: int, group: Any) -> torch.Tensor:
    """``[B, H / cp, cp L, D]`` -> ``[B, H, L, D]`` on this rank's tokens (the inverse of :func:`seq_to_heads`)."""
    b, h, s, d = x.shape
    blocks = x.view(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # [cp (tokens' owner), B, H/cp, L, D]
    got = _exchange(blocks, group)  # [cp (heads' owner), B, H/cp, L, D]
    return got.transpose(0, 1).reshape(b, h * cp, s // cp, d)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, group):
        ctx.cp, ctx.group = cp, group
        return seq_to_heads(x, cp, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.cp, ctx.group), None, None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp, group):
        ctx.cp, ctx.group = cp, group
        return heads_to_seq(x, cp, group)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.cp, ctx.group), None, None


def check_heads(q_heads: int, kv_heads: int, cp: int) -> None:
    """Raises unless ``cp`` ranks can split the query heads and split or share the key/value heads."""
    if q_heads % cp or (kv_heads % cp and cp % kv_heads):
        raise ValueError(
            f"context_parallel: method='ulysses' splits attention's heads over the cp {cp} ranks, but this layer "
            f"has {q_heads} query and {kv_heads} key/value heads (on this rank): the query heads must be a "
            f"multiple of {cp} and the key/value heads a multiple or a divisor of it. Pick a cp that divides "
            f"{q_heads}, or method='ring', which splits the sequence and keeps every head."
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp: int,
    group: Any,
    causal: bool,
    scale: float | None,
    key_valid: torch.Tensor | None,
    window: int | None,
    dropout: float,
) -> torch.Tensor:
    """Attention of this rank's tokens against the whole sequence by Ulysses' exchange; returns
    ``[B, Hq, L, D]`` on this rank's tokens. ``key_valid``: ``[B, S]`` (False on padding) or None."""
    hq, hkv = q.shape[1], k.shape[1]
    check_heads(hq, hkv, cp)
    if hkv < cp:  # each rank receives the key/value head its query heads read
        k, v = k.repeat_interleave(cp // hkv, 1), v.repeat_interleave(cp // hkv, 1)
    q, k, v = (SeqToHeads.apply(t, cp, group) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    seq = q.shape[2]
    mask = None
    if key_valid is not None or window is not None:
        i = torch.arange(seq, device=q.device)
        allowed = (i[:, None] >= i[None, :]) if causal else torch.ones(seq, seq, dtype=torch.bool, device=q.device)
        if window is not None:
            allowed = allowed & (i[:, None] - i[None, :] < window)
        allowed = allowed.unsqueeze(0)
        if key_valid is not None:
            allowed = allowed & key_valid[:, None, :]
        # a query whose every key is padding gets zeros, as torch's SDPA gives it (and transformers' sdpa)
        mask = allowed.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None, scale=scale
    )
    return HeadsToSeq.apply(out, cp, group)
