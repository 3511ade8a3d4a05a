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
are joined (one call). The plan is made on the host from ``positions`` once and kept while the same
tensor, unchanged, comes again (every attention layer of a step passes the same one). Disallowed scores are set to ``-1e30``, a large finite negative, not ``-inf``:
exp of it underflows to 0, and nothing becomes NaN. A query row with no allowed key anywhere (a
left-padded query under causality, a batch row all padding) outputs zeros, and its saved log-sum-exp is
set to ``+1e30`` so that backward recomputes probabilities of exactly 0 for it: its gradients are zero,
never NaN.

**Grouped-query attention.** Each key/value head serves ``g = Hq / Hkv`` consecutive query heads; the keys
are never expanded. The fused kernel takes ``[B, Hq, ., D]`` queries against ``[B, Hkv, ., D]`` keys as they
are; the tiled math lays a tile of ``T`` query tokens out as ``[B, Hkv, g * T, D]`` (row ``i * T + t``:
query head ``i`` of the group, token ``t``), so that one matmul against the keys scores the whole group.

**Compute: the fused kernel and the tiled math.** On the CPU, for float32 and bfloat16, torch's fused
flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) computes the
pairs it computes exactly: an unmasked pair, and a diagonal one (query and key runs holding the same
increasing positions: ``is_causal``), key padding as an additive mask of ``-1e30`` (finite: a row all
padding gets a log-sum-exp of about ``-1e30``, weighted 0 by the merge, where ``-inf`` would give 0). Its
forward returns the pair's normalised output and log-sum-exp, merged as above in float32 (bfloat16 inputs:
the kernel accumulates in float32 and returns the log-sum-exp in float32). Its backward, given the *final*
output and log-sum-exp, computes exactly the pair's part of the formulas below (``P`` from the global
log-sum-exp, ``Dsum`` from the final output), so the parts of all pairs and blocks add up to the gradient.
Every other pair (a causal mask that is not the diagonal's; float16, float64; and every pair on CUDA, whose
fused kernels are not used) is computed by the tiled math in float32: the pair is cut into tiles of at most
:data:`_TILE_BYTES` of float32 scores (all heads): rows of query tokens against the whole key run, or,
where such rows would be thinner than :data:`_MIN_TILE_TOKENS` tokens, or the pair has a causal mask,
blocks of keys too (square ones under causality, the tiles it forbids skipped, those it allows whole
unmasked); each tile's partial output and log-sum-exp are merged into the rows' as blocks are.

**Backward** (:class:`_RingAttention`, which saves ``q``, ``k``, ``v``, the output and the log-sum-exp,
nothing of size ``L x L``): the key/value blocks go around the ring again; per block the scores and
probabilities are recomputed from the saved log-sum-exp, with the flash-attention formulas::

    P = exp(S * scale - lse)      dV = P^T dO      dP = dO V^T
    Dsum = rowsum(dO * O)         dS = P * (dP - Dsum)
    dQ = dS K * scale             dK = dS^T Q * scale

``dQ`` stays on the rank; each block's ``dK`` and ``dV`` are added into an accumulator (float32, ``dk``
and ``dv`` packed into one buffer) that travels with its block, so that after the cycle and one last
shift home each rank holds the whole gradient of its own ``k`` and ``v``. The block's contributions are
computed while the accumulator is still in flight.

**Memory.** Nothing of size ``L x L``: per step, the tiled math holds one tile of float32 scores in forward
and two in backward (``P`` and ``dP``; ``dS`` is written over ``P``), each at most :data:`_TILE_BYTES`, and
the fused kernel its own per-thread tiles; besides, ``O(L)`` per head: the float32 output and log-sum-exp
accumulators, ``dq``, the block in flight and the ``dk``/``dv`` accumulator, a pair's partial output.

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
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from zerofn import collectives as C

_NEG = -1.0e30  # a disallowed score: exp(_NEG - lse) == 0 for any real lse, and never NaN
_NONE = 1.0e30  # the saved lse of a row with no allowed key: backward's probabilities for it are exp(< -1e30) == 0
_MAX_RUNS = 4  # more runs of consecutive positions than this: one run of the whole block, masked
_TILE_BYTES = 32 * 2**20  # the most bytes of one float32 score or probability temporary of the tiled math
_MIN_TILE_TOKENS = 64  # a query tile thinner than this against a whole key run: the keys are tiled too
_FUSED_CPU = True  # torch's fused CPU attention kernel for the pairs it computes exactly (see the module)
_PLANS_KEPT = 16  # plans cached, the latest (one positions tensor serves every layer of a step)


def _op(name: str, needs: str):
    """The aten op ``name`` if this torch has it with an argument ``needs``, else None."""
    op = getattr(torch.ops.aten, name, None)
    if op is None or needs not in [a.name for a in op.default._schema.arguments]:
        return None
    return op


_FLASH = _op("_scaled_dot_product_flash_attention_for_cpu", "attn_mask")
_FLASH_BACKWARD = _op("_scaled_dot_product_flash_attention_for_cpu_backward", "attn_mask")

_SKIP, _FULL, _MASK = 0, 1, 2


@dataclass(frozen=True)
class _Pair:
    """One pair of a query run ``[q0, q1)`` and a key run ``[k0, k1)`` (token indices in the blocks) that is
    computed: ``causal_mask`` when causality allows some of its pairs only, ``key_mask`` when padding
    applies; ``diagonal`` when the two runs hold the same increasing positions (causality is then query
    ``i`` against keys ``<= i``, what the fused kernel's ``is_causal`` masks)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal_mask: bool
    key_mask: bool
    diagonal: bool = False


def _runs(row: torch.Tensor, split: bool) -> list[tuple[int, int]]:
    """The runs of consecutive positions in ``row`` (a host tensor) as ``[start, end)`` indices (one run when
    ``split`` is False, or when there are more than :data:`_MAX_RUNS`)."""
    n = row.numel()
    if n == 0:
        return []
    if not split:
        return [(0, n)]
    cuts = (torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1).tolist()
    if len(cuts) + 1 > _MAX_RUNS:
        return [(0, n)]
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


def _classify(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> int:
    """Whether causality allows none (:data:`_SKIP`), all (:data:`_FULL`) or some (:data:`_MASK`) of the
    pairs of queries at ``q_pos`` and keys at ``k_pos`` (host tensors)."""
    if not causal:
        return _FULL
    q_min, q_max = (int(x) for x in q_pos.aminmax())
    k_min, k_max = (int(x) for x in k_pos.aminmax())
    if k_min > q_max:
        return _SKIP
    if k_max <= q_min:
        return _FULL
    return _MASK


def _plan(positions, me: int, causal: bool, padded: bool) -> list[list[_Pair]]:
    """For each step ``s`` of the ring (the block of rank ``(me - s) % cp``), the pairs of runs to compute;
    the same in forward and backward. ``positions``: the ``[cp, L]`` positions (a host tensor, or lists)."""
    positions = torch.as_tensor(positions)
    cp = positions.shape[0]
    q_row = positions[me]
    q_runs = _runs(q_row, causal)
    steps = []
    for s in range(cp):
        k_row = positions[(me - s) % cp]
        pairs = []
        for q0, q1 in q_runs:
            for k0, k1 in _runs(k_row, causal):
                kind = _classify(q_row[q0:q1], k_row[k0:k1], causal)
                if kind != _SKIP:
                    pairs.append(_Pair(q0, q1, k0, k1, kind == _MASK, padded))
        steps.append([replace(p, diagonal=_diagonal(p, q_row, k_row)) for p in _merged(pairs)])
    return steps


def _diagonal(p: _Pair, q_row: torch.Tensor, k_row: torch.Tensor) -> bool:
    """Whether causal ``p``'s query and key runs hold the same strictly increasing positions."""
    if not p.causal_mask or p.q1 - p.q0 != p.k1 - p.k0:
        return False
    q, k = q_row[p.q0 : p.q1], k_row[p.k0 : p.k1]
    return bool(torch.equal(q, k) and (q[1:] > q[:-1]).all())


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


def _tile_shape(nq: int, nk: int, cap: int, square: bool) -> tuple[int, int]:
    """Query tokens and keys of the tiles of an ``nq x nk`` pair, at most ``cap`` scores per head each:
    rows of queries against all the keys, or, when such a row would be thinner than
    :data:`_MIN_TILE_TOKENS` tokens (or ``square``: a causal pair, whose tiles above the diagonal are
    skipped), blocks of keys too."""
    if nq * nk <= cap:
        return nq, nk
    if square:
        tq = min(nq, max(1, math.isqrt(cap)))
        return tq, min(nk, max(1, cap // tq))
    tq = cap // nk
    if tq >= min(nq, _MIN_TILE_TOKENS):
        return min(nq, tq), nk
    tq = max(1, min(nq, _MIN_TILE_TOKENS, cap))
    return tq, min(nk, max(1, cap // tq))


class _Plan:
    """What depends on the positions alone (cached per positions tensor, see :func:`_plan_for`): the pairs of
    every step, the tiles of the pairs computed by the tiled math, the positions on each device."""

    def __init__(self, positions: torch.Tensor, me: int, causal: bool, padded: bool):
        self.host = positions.detach().cpu().clone()  # its own copy: later changes to positions are not its
        self.me = me
        self.steps = _plan(self.host, me, causal, padded)
        self._tiles: dict = {}
        self._on: dict = {}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            self._on[device] = self.host.to(device)
        return self._on[device]

    def tiles(self, pair: _Pair, src: int, cap: int) -> list[tuple[int, int, int, int, bool]]:
        """The tiles ``(t0, t1, c0, c1, causal)`` of ``pair`` (the block of rank ``src``) with at most ``cap``
        scores per head each, those causality skips left out, ``causal`` when the tile needs the mask."""
        key = (pair, src, cap, _MIN_TILE_TOKENS)
        if key not in self._tiles:
            tq, tk = _tile_shape(pair.q1 - pair.q0, pair.k1 - pair.k0, cap, pair.causal_mask)
            q_row, k_row = self.host[self.me], self.host[src]
            out = []
            for t0 in range(pair.q0, pair.q1, tq):
                t1 = min(t0 + tq, pair.q1)
                for c0 in range(pair.k0, pair.k1, tk):
                    c1 = min(c0 + tk, pair.k1)
                    kind = _classify(q_row[t0:t1], k_row[c0:c1], pair.causal_mask)
                    if kind != _SKIP:
                        out.append((t0, t1, c0, c1, kind == _MASK))
            self._tiles[key] = out
        return self._tiles[key]


_PLANS: dict[tuple, tuple[weakref.ref, int, _Plan]] = {}


def _plan_for(positions: torch.Tensor, me: int, causal: bool, padded: bool) -> _Plan:
    """The :class:`_Plan` of ``positions``, reused while the same tensor, unchanged, comes again (every
    attention layer of a step passes the same one)."""
    try:
        version = positions._version
    except RuntimeError:  # an inference tensor keeps no version counter: planned at every call
        return _Plan(positions, me, causal, padded)
    key = (id(positions), me, causal, padded)
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is positions and hit[1] == version:
        return hit[2]
    plan = _Plan(positions, me, causal, padded)
    if len(_PLANS) >= _PLANS_KEPT:
        del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = (weakref.ref(positions), version, plan)
    return plan


class _Ring:
    """What forward and backward share: the group, the plan, the masks, and one pair's computation."""

    def __init__(self, group, positions, key_valid, causal, scale, q, k):
        self.group = group
        self.cp = 1 if group is None else group.size()
        self.me = 0 if group is None else group.rank()
        self.scale = scale
        self.plan = _plan_for(positions, self.me, causal, key_valid is not None)
        self.positions = self.plan.on(q.device)
        self.key_valid = None if key_valid is None else key_valid.to(q.device)
        B, hq = q.shape[:2]
        self.hkv = k.shape[1]
        self.g = hq // self.hkv
        self.cap = max(1, _TILE_BYTES // (4 * B * hq))  # scores of one (query token, key) pair: B * Hq
        self.fused = (
            _FUSED_CPU
            and _FLASH is not None
            and _FLASH_BACKWARD is not None
            and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16)
            and k.dtype == q.dtype
        )
        self._bias: tuple[int, torch.Tensor] | None = None  # the block's kernel mask

    @property
    def steps(self) -> list[list[_Pair]]:
        return self.plan.steps

    def source(self, step: int) -> int:
        return (self.me - step) % self.cp

    def shift(self, buf: torch.Tensor):
        """Start sending ``buf`` to the next rank; the handle's ``wait()`` returns the previous rank's."""
        return C.ring_shift(torch.empty_like(buf), buf, async_op=True, group=self.group)

    # -- the fused kernel ---------------------------------------------------------------------------

    def kernel(self, pair: _Pair) -> bool:
        """Whether the fused kernel computes ``pair``: no causal mask, or the diagonal one (``is_causal``)."""
        return self.fused and (not pair.causal_mask or pair.diagonal)

    def bias(self, pair: _Pair, src: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The kernel's additive key-padding mask of ``pair``: ``[B, 1, 1, keys]``, :data:`_NEG` on padding
        (a finite value: a row all padding gets ``lse`` about ``_NEG``, weighted 0 by the merge, where
        ``-inf`` would give it ``lse`` 0)."""
        if not pair.key_mask:
            return None
        if self._bias is None or self._bias[0] != src:  # one block's at a time
            valid = self.key_valid[src][:, None, None, :]
            bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill_(~valid, _NEG)
            self._bias = (src, bias)
        return self._bias[1][..., pair.k0 : pair.k1]

    # -- the tiled math -----------------------------------------------------------------------------

    def tiles(self, pair: _Pair, src: int):
        return self.plan.tiles(pair, src, self.cap)

    def rows(self, x: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
        """Tokens ``[t0, t1)`` of ``[B, Hq, L, D]`` ``x`` as float32 ``[B, Hkv, g * T, D]`` (row ``i * T + t``:
        query head ``i`` of the key/value head's group, token ``t``), for one matmul against the keys."""
        B, _, _, D = x.shape
        return x[:, :, t0:t1].float().reshape(B, self.hkv, self.g * (t1 - t0), D)

    def scores(self, qt, kf, src: int, tile, key_mask: bool) -> torch.Tensor:
        """The scaled, masked float32 scores of ``tile``: ``[B, Hkv, g * T, keys]``."""
        t0, t1, c0, c1, causal = tile
        s = torch.matmul(qt, kf[:, :, c0:c1].transpose(-1, -2)).mul_(self.scale)
        allowed = None
        if causal:
            allowed = self.positions[src, c0:c1][None, :] <= self.positions[self.me, t0:t1][:, None]  # [T, keys]
        if key_mask:
            valid = self.key_valid[src, :, c0:c1][:, None, None, None, :]  # [B, 1, 1, 1, keys]
            allowed = valid if allowed is None else allowed & valid
        if allowed is not None:
            B, hkv, _, keys = s.shape
            s.view(B, hkv, self.g, t1 - t0, keys).masked_fill_(~allowed, _NEG)
        return s


def _merge(out: torch.Tensor, lse: torch.Tensor, t0: int, t1: int, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merges a partial result of tokens ``[t0, t1)`` (``out_b`` float32, overwritten; ``lse_b``) into the
    float32 accumulators ``out`` ``[B, Hq, L, D]`` and ``lse`` ``[B, Hq, L]``."""
    lse_old = lse[:, :, t0:t1]
    lse_new = torch.logaddexp(lse_old, lse_b)
    o = out[:, :, t0:t1]
    o.mul_(torch.exp(lse_old - lse_new)[..., None]).add_(out_b.mul_(torch.exp(lse_b - lse_new)[..., None]))
    lse_old.copy_(lse_new)


class _RingAttention(torch.autograd.Function):
    """Ring attention forward and backward; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, positions, key_valid, group, scale, causal):
        ring = _Ring(group, positions, key_valid, causal, scale, q, k)
        B, hq, L, D = q.shape
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((B, hq, L), _NEG, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # this rank's block, k and v in one buffer
        for s in range(ring.cp):
            pending = ring.shift(kv) if s < ring.cp - 1 else None  # the next block travels meanwhile
            src = ring.source(s)
            kvf = None  # the block in float32, for the tiled math
            for pair in ring.steps[s]:
                if ring.kernel(pair):
                    keys = slice(pair.k0, pair.k1)
                    out_b, lse_b = _FLASH(
                        q[:, :, pair.q0 : pair.q1],
                        kv[0][:, :, keys],
                        kv[1][:, :, keys],
                        0.0,
                        pair.diagonal,
                        attn_mask=ring.bias(pair, src, q.dtype),
                        scale=scale,
                    )
                    _merge(out, lse, pair.q0, pair.q1, out_b.float(), lse_b)
                    continue
                kvf = kv.float() if kvf is None else kvf
                for tile in ring.tiles(pair, src):
                    t0, t1 = tile[:2]
                    p = ring.scores(ring.rows(q, t0, t1), kvf[0], src, tile, pair.key_mask)
                    m = p.amax(-1, keepdim=True)
                    total = p.sub_(m).exp_().sum(-1, keepdim=True)  # p: exp(S - max), in the scores' memory
                    out_b = torch.matmul(p, kvf[1][:, :, tile[2] : tile[3]]).div_(total)
                    del p
                    _merge(out, lse, t0, t1, out_b.view(B, hq, t1 - t0, D), m.add_(total.log_()).view(B, hq, t1 - t0))
            if pending is not None:
                kv = pending.wait()
        empty = lse < _NEG / 2  # no allowed key anywhere: zeros out, and zero probabilities in backward
        out.masked_fill_(empty[..., None], 0.0)
        lse.masked_fill_(empty, _NONE)
        result = out.to(q.dtype)
        ring._bias = None
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring = ring
        return result

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        B, hq, L, D = q.shape
        hkv, g = ring.hkv, ring.g
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dsum = None  # rowsum(dO * O), float32 [B, Hq, L], for the tiled math
        kv = torch.stack([k, v])
        acc, acc_pending = None, None  # the float32 dk/dv accumulator of the block held, and its transfer
        for s in range(ring.cp):
            pending = ring.shift(kv) if s < ring.cp - 1 else None
            src = ring.source(s)
            part = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)  # this block's dk, dv
            kvf = None
            for pair in ring.steps[s]:
                queries, keys = slice(pair.q0, pair.q1), slice(pair.k0, pair.k1)
                if ring.kernel(pair):
                    dq_b, dk_b, dv_b = _FLASH_BACKWARD(
                        grad_out[:, :, queries],
                        q[:, :, queries],
                        kv[0][:, :, keys],
                        kv[1][:, :, keys],
                        out[:, :, queries],
                        lse[:, :, queries],
                        0.0,
                        pair.diagonal,
                        attn_mask=ring.bias(pair, src, q.dtype),
                        scale=ring.scale,
                    )
                    dq[:, :, queries] += dq_b
                    part[0][:, :, keys] += dk_b
                    part[1][:, :, keys] += dv_b
                    continue
                kvf = kv.float() if kvf is None else kvf
                if dsum is None:
                    dsum = (grad_out.float() * out.float()).sum(-1)
                for tile in ring.tiles(pair, src):
                    t0, t1, c0, c1, _ = tile
                    rows = g * (t1 - t0)
                    qt, dot = ring.rows(q, t0, t1), ring.rows(grad_out, t0, t1)
                    p = ring.scores(qt, kvf[0], src, tile, pair.key_mask)
                    p.sub_(lse[:, :, t0:t1].reshape(B, hkv, rows, 1)).exp_()
                    part[1][:, :, c0:c1] += torch.matmul(p.transpose(-1, -2), dot)
                    dp = torch.matmul(dot, kvf[1][:, :, c0:c1].transpose(-1, -2))
                    ds = p.mul_(dp.sub_(dsum[:, :, t0:t1].reshape(B, hkv, rows, 1))).mul_(ring.scale)  # in p's memory
                    del dp
                    dq[:, :, t0:t1] += torch.matmul(ds, kvf[0][:, :, c0:c1]).view(B, hq, t1 - t0, D)
                    part[0][:, :, c0:c1] += torch.matmul(ds.transpose(-1, -2), qt)
                    del p, ds  # before the next tile's scores
            acc = part if acc_pending is None else acc_pending.wait().add_(part)
            if ring.cp > 1:
                acc_pending = ring.shift(acc)  # to the next rank; after the last step, home
            if pending is not None:
                kv = pending.wait()
        if acc_pending is not None:
            acc = acc_pending.wait()
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None, None


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
