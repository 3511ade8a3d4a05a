"""Ring attention: exact attention over a sequence split across the ranks of a group, one block at a time.

Context parallelism cuts one sequence of ``cp * L`` tokens into ``cp`` parts of ``L`` tokens, one per
rank of ``group``; each rank holds the queries, keys and values of its own tokens (the layout Hugging Face
attention passes: ``q`` ``[B, Hq, L, D]``, ``k`` and ``v`` ``[B, Hkv, L, D]``). Attention needs every
query against every key, so the key/value blocks go around the ring (``zerofn.collectives.ring_shift``,
one exchange each, ``k`` and ``v`` packed into one buffer): after ``cp - 1`` shifts each rank has seen
every block, and the next block's transfer is in flight while the current one is computed (two buffers).
Nothing else travels: ``positions`` (``[cp, L]``, the global position of every rank's tokens) and
``key_valid`` (``[cp, B, L]``, False where a key is padding) are known to every rank.

**The merge.** Softmax over all keys is the softmax over the union of the blocks, so each block ``b``
gives its own normalised output ``O_b`` and log-sum-exp ``lse_b`` (per query row), and two partial
results combine exactly::

    lse = log(exp(lse_1) + exp(lse_2))
    O = O_1 * exp(lse_1 - lse) + O_2 * exp(lse_2 - lse)

accumulated in float32 whatever the input dtype; the output is cast to ``q``'s dtype at the end.

**Masks and skipping.** A query at position ``p`` attends the keys at positions ``<= p`` (``causal``,
the default) and only valid keys (``key_valid``). A rank's tokens are cut into runs of consecutive
positions (one run for contiguous slices; two for the load-balanced causal layout, where the sequence is
cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``), and each pair of a
query run and a key run is classed from the positions alone: *skipped* when causality allows no pair,
*unmasked* when it allows all of them (and no key is padding), *masked* otherwise. With the load-balanced
layout every block but a rank's own computes half its pairs; neighbouring pairs with the same masks
are joined (one matmul). Disallowed scores are set to ``-1e30``, a large finite negative, not ``-inf``:
exp of it underflows to 0, and nothing becomes NaN. A query row with no allowed key anywhere (a
left-padded query under causality, a batch row all padding) outputs zeros, and its saved log-sum-exp is
set to ``+1e30`` so that backward recomputes probabilities of exactly 0 for it: its gradients are zero,
never NaN.

**Grouped-query attention.** Each key/value head serves ``g = Hq / Hkv`` consecutive query heads. The
queries are laid out once as ``[B, Hkv, L * g, D]`` (token-major: row ``t * g + i`` is token ``t`` of
query head ``i`` of the group), so one matmul against a block's ``[B, Hkv, L, D]`` keys scores all of
them, the keys never expanded, and a run of tokens is a contiguous slice of rows.

**Backward** (:class:`_RingAttention`, which saves ``q``, ``k``, ``v``, the output and the log-sum-exp,
nothing of size ``L x L``): the key/value blocks go around the ring again; per block the scores and
probabilities are recomputed from the saved log-sum-exp, with the flash-attention formulas::

    P = exp(S * scale - lse)      dV = P^T dO      dP = dO V^T
    Dsum = rowsum(dO * O)         dS = P * (dP - Dsum)
    dQ = dS K * scale             dK = dS^T Q * scale

``dQ`` stays on the rank; each block's ``dK`` and ``dV`` are added into an accumulator (float32, ``dk``
and ``dv`` packed into one buffer) that travels with its block, so that after the cycle and one last
shift home each rank holds the whole gradient of its own ``k`` and ``v``. The block's contributions are
computed while the accumulator is still in flight. Memory per step: the scores of one pair of runs,
``O(L x L)`` per head, never ``(cp * L)^2``.

**Traffic.** With ``E`` the bytes of an element of ``k`` (and ``v``) and ``n = B * Hkv * L * D``, what
this rank sends (``zerofn.collectives.counting``)::

    forward:  (cp - 1) * 2 * n * E
    backward: (cp - 1) * 2 * n * E + cp * 2 * n * 4

the forward's ``cp - 1`` key/value blocks, then in backward the same again plus ``cp`` trips of the
float32 ``dk``/``dv`` accumulator (``cp - 1`` around the ring and one home). ``group=None`` or a group
of one is plain attention over the local tokens (the same code, one block, nothing sent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from zerofn import collectives as C

_NEG = -1.0e30  # a disallowed score: exp(_NEG - lse) == 0 for any real lse, and never NaN
_NONE = 1.0e30  # the saved lse of a row with no allowed key: backward's probabilities for it are exp(< -1e30) == 0
_MAX_RUNS = 4  # more runs of consecutive positions than this: one run of the whole block, masked

_SKIP, _FULL, _MASK = 0, 1, 2


@dataclass(frozen=True)
class _Pair:
    """One pair of a query run ``[q0, q1)`` and a key run ``[k0, k1)`` (token indices in the blocks) that is
    computed: ``causal_mask`` when causality allows some of its pairs only, ``key_mask`` when padding
    applies."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal_mask: bool
    key_mask: bool


def _runs(row: list[int], split: bool) -> list[tuple[int, int]]:
    """The runs of consecutive positions in ``row`` as ``[start, end)`` indices (one run when ``split`` is
    False, or when there are more than :data:`_MAX_RUNS`)."""
    n = len(row)
    if n == 0:
        return []
    if not split:
        return [(0, n)]
    cuts = [i for i in range(1, n) if row[i] != row[i - 1] + 1]
    if len(cuts) + 1 > _MAX_RUNS:
        return [(0, n)]
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


def _classify(q_pos: list[int], k_pos: list[int], causal: bool) -> int:
    """Whether causality allows none (:data:`_SKIP`), all (:data:`_FULL`) or some (:data:`_MASK`) of the
    pairs of queries at ``q_pos`` and keys at ``k_pos``."""
    if not causal:
        return _FULL
    if min(k_pos) > max(q_pos):
        return _SKIP
    if max(k_pos) <= min(q_pos):
        return _FULL
    return _MASK


def _plan(positions: list[list[int]], me: int, causal: bool, padded: bool) -> list[list[_Pair]]:
    """For each step ``s`` of the ring (the block of rank ``(me - s) % cp``), the pairs of runs to compute;
    the same in forward and backward. ``positions``: the ``[cp, L]`` positions as lists."""
    cp = len(positions)
    q_runs = _runs(positions[me], causal)
    steps = []
    for s in range(cp):
        src = (me - s) % cp
        pairs = []
        for q0, q1 in q_runs:
            for k0, k1 in _runs(positions[src], causal):
                kind = _classify(positions[me][q0:q1], positions[src][k0:k1], causal)
                if kind != _SKIP:
                    pairs.append(_Pair(q0, q1, k0, k1, kind == _MASK, padded))
        steps.append(_merged(pairs))
    return steps


def _merged(pairs: list[_Pair]) -> list[_Pair]:
    """``pairs`` with neighbours of the same masks joined (one matmul instead of two): adjacent key runs
    against the same query run, then adjacent query runs against the same key run."""
    for along_keys in (True, False):
        out: list[_Pair] = []
        for p in sorted(pairs, key=(lambda p: (p.q0, p.k0)) if along_keys else (lambda p: (p.k0, p.q0))):
            last = out[-1] if out else None
            same = last is not None and (last.causal_mask, last.key_mask) == (p.causal_mask, p.key_mask)
            if same and along_keys and (last.q0, last.q1, last.k1) == (p.q0, p.q1, p.k0):
                out[-1] = _Pair(p.q0, p.q1, last.k0, p.k1, p.causal_mask, p.key_mask)
            elif same and not along_keys and (last.k0, last.k1, last.q1) == (p.k0, p.k1, p.q0):
                out[-1] = _Pair(last.q0, p.q1, p.k0, p.k1, p.causal_mask, p.key_mask)
            else:
                out.append(p)
        pairs = out
    return pairs


class _Ring:
    """What forward and backward share: the group, the plan and the masks of every pair."""

    def __init__(self, group, positions, key_valid, causal, scale, g, device):
        self.group = group
        self.cp = 1 if group is None else group.size()
        self.me = 0 if group is None else group.rank()
        self.scale, self.g = scale, g
        self.plan = _plan(positions.tolist(), self.me, causal, key_valid is not None)  # one host read
        self.positions = positions.to(device)
        self.key_valid = None if key_valid is None else key_valid.to(device)

    def source(self, step: int) -> int:
        return (self.me - step) % self.cp

    def disallowed(self, pair: _Pair, src: int) -> torch.Tensor | None:
        """True where a score of ``pair`` (of the block of rank ``src``) is not allowed, broadcastable to
        its ``[B, Hkv, (q1 - q0) * g, k1 - k0]`` scores; None when every score is."""
        allowed = None
        if pair.causal_mask:
            q_pos = self.positions[self.me, pair.q0 : pair.q1].repeat_interleave(self.g)
            k_pos = self.positions[src, pair.k0 : pair.k1]
            allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, rows, keys]
        if pair.key_mask:
            valid = self.key_valid[src, :, pair.k0 : pair.k1][:, None, None, :]  # [B, 1, 1, keys]
            allowed = valid if allowed is None else allowed & valid
        return None if allowed is None else ~allowed

    def scores(self, q_rows, kb, pair: _Pair, src: int) -> torch.Tensor:
        """The scaled, masked float32 scores of ``pair``: ``[B, Hkv, (q1 - q0) * g, k1 - k0]``."""
        qs = q_rows[:, :, pair.q0 * self.g : pair.q1 * self.g]
        s = torch.matmul(qs, kb[:, :, pair.k0 : pair.k1].transpose(-1, -2)).mul_(self.scale)
        bad = self.disallowed(pair, src)
        if bad is not None:
            s.masked_fill_(bad, _NEG)
        return s

    def shift(self, buf: torch.Tensor):
        """Start sending ``buf`` to the next rank; the handle's ``wait()`` returns the previous rank's."""
        return C.ring_shift(torch.empty_like(buf), buf, async_op=True, group=self.group)


def _to_rows(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[B, Hq, L, D]`` as float32 ``[B, Hkv, L * g, D]``, token-major within each key/value head's group."""
    B, hq, L, D = x.shape
    g = hq // hkv
    if g == 1:
        return x.float().contiguous()
    return x.reshape(B, hkv, g, L, D).transpose(2, 3).reshape(B, hkv, L * g, D).float()


def _from_rows(x: torch.Tensor, hq: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`_to_rows`, cast to ``dtype``."""
    B, hkv, rows, D = x.shape
    g = hq // hkv
    L = rows // g
    return x.reshape(B, hkv, L, g, D).transpose(2, 3).reshape(B, hq, L, D).to(dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention forward and backward; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, positions, key_valid, group, scale, causal):
        hq = q.shape[1]
        hkv = k.shape[1]
        ring = _Ring(group, positions, key_valid, causal, scale, hq // hkv, q.device)
        q_rows = _to_rows(q, hkv)
        out = torch.zeros_like(q_rows)  # float32 [B, Hkv, L * g, D]
        lse = torch.full(q_rows.shape[:-1], _NEG, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # this rank's block, k and v in one buffer
        for s in range(ring.cp):
            pending = ring.shift(kv) if s < ring.cp - 1 else None  # the next block travels meanwhile
            src = ring.source(s)
            kb, vb = kv[0].float(), kv[1].float()
            for pair in ring.plan[s]:
                sc = ring.scores(q_rows, kb, pair, src)
                lse_b = torch.logsumexp(sc, dim=-1)
                out_b = torch.matmul(torch.exp(sc.sub_(lse_b[..., None])), vb[:, :, pair.k0 : pair.k1])
                rows = slice(pair.q0 * ring.g, pair.q1 * ring.g)
                lse_old = lse[:, :, rows]
                lse_new = torch.logaddexp(lse_old, lse_b)
                o = out[:, :, rows]
                o.mul_(torch.exp(lse_old - lse_new)[..., None]).add_(out_b * torch.exp(lse_b - lse_new)[..., None])
                lse[:, :, rows] = lse_new
            if pending is not None:
                kv = pending.wait()
        empty = lse < _NEG / 2  # no allowed key anywhere: zeros out, and zero probabilities in backward
        out.masked_fill_(empty[..., None], 0.0)
        lse.masked_fill_(empty, _NONE)
        result = _from_rows(out, hq, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring = ring
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        hq, hkv = q.shape[1], k.shape[1]
        q_rows, do_rows = _to_rows(q, hkv), _to_rows(grad_out, hkv)
        dsum = (do_rows * _to_rows(out, hkv)).sum(-1)  # rowsum(dO * O)
        dq_rows = torch.zeros_like(q_rows)
        kv = torch.stack([k, v])
        acc, acc_pending = None, None  # the float32 dk/dv accumulator of the block held, and its transfer
        for s in range(ring.cp):
            pending = ring.shift(kv) if s < ring.cp - 1 else None
            src = ring.source(s)
            kb, vb = kv[0].float(), kv[1].float()
            part = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # this block's dk, dv
            for pair in ring.plan[s]:
                rows = slice(pair.q0 * ring.g, pair.q1 * ring.g)
                keys = slice(pair.k0, pair.k1)
                p = torch.exp(ring.scores(q_rows, kb, pair, src).sub_(lse[:, :, rows, None]))
                do = do_rows[:, :, rows]
                part[1][:, :, keys] += torch.matmul(p.transpose(-1, -2), do)
                dp = torch.matmul(do, vb[:, :, keys].transpose(-1, -2))
                ds = p.mul_(dp.sub_(dsum[:, :, rows, None])).mul_(ring.scale)  # dS * scale, in p's memory
                dq_rows[:, :, rows] += torch.matmul(ds, kb[:, :, keys])
                part[0][:, :, keys] += torch.matmul(ds.transpose(-1, -2), q_rows[:, :, rows])
            acc = part if acc_pending is None else acc_pending.wait().add_(part)
            if ring.cp > 1:
                acc_pending = ring.shift(acc)  # to the next rank; after the last step, home
            if pending is not None:
                kv = pending.wait()
        if acc_pending is not None:
            acc = acc_pending.wait()
        dq = _from_rows(dq_rows, hq, q.dtype)
        return dq, acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: Any,
    positions: torch.Tensor,
    scale: float | None = None,
    causal: bool = True,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of every rank of ``group``, in ``q``'s dtype.

    Args:
        q: ``[B, Hq, L, D]``, this rank's queries.
        k, v: ``[B, Hkv, L, D]``, this rank's keys and values; ``Hq`` a multiple of ``Hkv`` (each key/value
            head serves ``Hq / Hkv`` consecutive query heads).
        group: the context-parallel group (``cp = group.size()`` ranks, each holding ``L`` tokens of the
            sequence); ``None`` or a group of one: plain attention over the local tokens.
        positions: integer ``[cp, L]``, row ``j`` the global positions of rank ``j``'s tokens, the same on
            every rank (it never travels; on the CPU it costs no device read).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        causal: a query at position ``p`` attends the keys at positions ``<= p``; False: every key.
        key_valid: optional bool ``[cp, B, L]``, False where rank ``j``'s key is padding, the same on
            every rank.

    A query with no allowed key gets zeros (and zero gradients). Traffic and the method: the module
    docstring.
    """
    _check(q, k, v, group, positions, key_valid)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, positions, key_valid, group, scale, bool(causal))


def _check(q, k, v, group, positions, key_valid) -> None:
    cp = 1 if group is None else group.size()
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"ring_attention: q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} must each have 4 "
            "dimensions, [batch, heads, tokens, head_dim]; pass attention's inputs as Hugging Face lays them out"
        )
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"ring_attention: k {list(k.shape)} {k.dtype} and v {list(v.shape)} {v.dtype} must have one shape "
            "and dtype (they travel in one buffer); pass the key and value states of one layer"
        )
    B, hq, L, D = q.shape
    if k.shape[0] != B or k.shape[2] != L or k.shape[3] != D:
        raise ValueError(
            f"ring_attention: q {list(q.shape)} and k {list(k.shape)} must agree on batch, tokens and head_dim "
            "(dimensions 0, 2 and 3); pass this rank's queries and keys for the same tokens"
        )
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"ring_attention: {hq} query heads are not a multiple of {hkv} key/value heads; with grouped-query "
            "attention each key/value head serves the same number of query heads"
        )
    if positions.shape != (cp, L) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(
            f"ring_attention: positions is {positions.dtype} {list(positions.shape)}, expected an integer "
            f"tensor [cp, L] = [{cp}, {L}]: row j the global positions of the {L} tokens rank j of the "
            f"{cp}-rank group holds"
        )
    if key_valid is not None and (key_valid.shape != (cp, B, L) or key_valid.dtype != torch.bool):
        raise ValueError(
            f"ring_attention: key_valid is {key_valid.dtype} {list(key_valid.shape)}, expected bool "
            f"[cp, B, L] = [{cp}, {B}, {L}]: row j rank j's keys, False where one is padding; pass None "
            "when no key is padding"
        )
