"""ring_attention on real gloo ranks against scaled_dot_product_attention over the whole sequence: causal
and not, load-balanced and contiguous layouts, grouped-query heads, key padding (a whole batch row of it
too), fp32 and bf16, through torch's fused CPU kernel and through the tiled math (one tile per pair, rows of
queries, blocks of keys); outputs and the gradients of q, k and v (autograd of the reference cut to the
rank's tokens); the bytes each rank sends; the pairs of runs skipped; the plan's cache; the memory of a long
sequence; bad shapes refused."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from zerofn.transforms.context_parallel import _ring
from zerofn.transforms.context_parallel._ring import ring_attention

import zerofn as zf
from zerofn import collectives as C

B, HQ, L, D = 2, 4, 8, 8  # L tokens per rank; the load-balanced layout holds two chunks of L / 2
FP32_TOL = 1e-5
# bf16 inputs, float32 inside, the output and the gradients rounded to bf16 (8 bits of mantissa: 0.4 % of
# values of order 1-4) against a float64 reference on the same bf16-rounded inputs
BF16_TOL = 3e-2

CASES = [
    (causal, layout, hkv, pad, dtype)
    for causal, layout, hkv, pad, dtype in itertools.product(
        (True, False), ("balanced", "contiguous"), (4, 2, 1), ("none", "left", "right"), ("fp32", "bf16")
    )
    if dtype == "fp32" or hkv == 2  # bf16 on one GQA width
]

# how each case is computed: the module's settings for it. fused: torch's CPU kernel where it applies; math:
# the tiled math only, one tile per pair; rows: tiles of 2 query tokens against a whole run of 8 keys (20
# scores per head, B * HQ * 4 = 32 bytes each), square ones (4 x 5) for causal pairs; blocks: tiles of 1
# query token and 3 keys, the last of a run shorter
SCORE_BYTES = 4 * B * HQ
VARIANTS = {
    "fused": {"_FUSED_CPU": True},
    "math": {"_FUSED_CPU": False},
    "rows": {"_FUSED_CPU": False, "_TILE_BYTES": 20 * SCORE_BYTES, "_MIN_TILE_TOKENS": 1},
    "blocks": {"_FUSED_CPU": False, "_TILE_BYTES": 3 * SCORE_BYTES, "_MIN_TILE_TOKENS": 1},
}


def _set(settings: dict) -> dict:
    """Sets the module's ``settings``; returns the ones they replaced."""
    old = {name: getattr(_ring, name) for name in settings}
    for name, value in settings.items():
        setattr(_ring, name, value)
    return old


def _positions(cp: int, layout: str) -> torch.Tensor:
    """[cp, L]: contiguous slices, or the load-balanced causal layout (2 * cp chunks, rank r holding chunks r
    and 2 * cp - 1 - r)."""
    if layout == "contiguous":
        return torch.arange(cp * L).view(cp, L)
    chunks = torch.arange(cp * L).view(2 * cp, L // 2)
    return torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def _valid(n: int, pad: str) -> torch.Tensor | None:
    """[B, n], False where a key is padding. left: 5 and n / 2 + 1 tokens padded at the start (rank 0's whole
    slice in the contiguous layout); right: 6 at the end, and the whole second row."""
    if pad == "none":
        return None
    valid = torch.ones(B, n, dtype=torch.bool)
    if pad == "left":
        valid[0, :5] = False
        valid[1, : n // 2 + 1] = False
    else:
        valid[0, -6:] = False
        valid[1] = False
    return valid


def _reference(q, k, v, dout, causal, valid):
    """Attention over the whole sequence in float64 (scaled_dot_product_attention), a query with no allowed
    key giving zeros; the output and the gradients of q, k and v."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    n, g = q.shape[2], q.shape[1] // k.shape[1]
    allowed = torch.ones(B, 1, n, n, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    if valid is not None:
        allowed &= valid[:, None, None, :]
    some = allowed.any(-1, keepdim=True)  # [B, 1, n, 1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=allowed | ~some) * some  # no NaN, zeros
    return (out, *torch.autograd.grad(out, (q, k, v), dout.double())), some[:, 0, :, 0]


def _err(got: torch.Tensor, ref: torch.Tensor, mine: torch.Tensor) -> float:
    """The largest difference of this rank's result from the reference cut to its tokens."""
    return (got.double() - ref[:, :, mine]).abs().max().item()


def _cases(cases) -> dict:
    group = dist.group.WORLD
    cp, me = group.size(), group.rank()
    results = {}
    for case in cases:
        causal, layout, hkv, pad, dtype = case
        dt = torch.float32 if dtype == "fp32" else torch.bfloat16
        gen = torch.Generator().manual_seed(1234 + CASES.index(case))  # the same inputs on every rank
        n = cp * L
        q, k, v, dout = (
            torch.randn(shape, generator=gen).to(dt)
            for shape in ((B, HQ, n, D), (B, hkv, n, D), (B, hkv, n, D), (B, HQ, n, D))
        )
        positions, valid = _positions(cp, layout), _valid(n, pad)
        (ref, rdq, rdk, rdv), some = _reference(q, k, v, dout, causal, valid)
        mine = positions[me]
        key_valid = None if valid is None else valid[:, positions].permute(1, 0, 2).contiguous()  # [cp, B, L]
        empty = ~some[:, mine]  # [B, L]: this rank's queries with no allowed key
        for variant, settings in VARIANTS.items():
            ql, kl, vl = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
            old = _set(settings)
            try:
                with C.counting(group) as fwd:
                    out = ring_attention(
                        ql, kl, vl, group=group, positions=positions, causal=causal, key_valid=key_valid
                    )
                with C.counting(group) as bwd:
                    dq, dk, dv = torch.autograd.grad(out, (ql, kl, vl), dout[:, :, mine])
            finally:
                _set(old)
            results[case, variant] = {
                "out": _err(out, ref, mine),
                "dq": _err(dq, rdq, mine),
                "dk": _err(dk, rdk, mine),
                "dv": _err(dv, rdv, mine),
                "dtype": (out.dtype, dq.dtype, dk.dtype, dv.dtype),
                "finite": all(bool(t.isfinite().all()) for t in (out, dq, dk, dv)),
                "empty_rows": int(empty.sum()),
                "empty_zero": bool((out.permute(0, 2, 1, 3)[empty] == 0).all()),
                "fwd_bytes": fwd.bytes,
                "bwd_bytes": bwd.bytes,
            }
    return results


def _check(results: list[dict], cp: int) -> None:
    for case in CASES:
        causal, layout, hkv, pad, dtype = case
        tol = FP32_TOL if dtype == "fp32" else BF16_TOL
        dt = torch.float32 if dtype == "fp32" else torch.bfloat16
        elems = 2 * B * hkv * L * D  # a k and v block, or a dk and dv accumulator
        kv_bytes = elems * dt.itemsize
        for (rank, r), variant in itertools.product(enumerate(results), VARIANTS):
            got = r[case, variant]
            where = (cp, rank, case, variant)
            for key in ("out", "dq", "dk", "dv"):
                assert got[key] <= tol, (key, got[key], where)
            assert got["dtype"] == (dt,) * 4, where
            assert got["finite"] and got["empty_zero"], where
            assert got["fwd_bytes"] == (cp - 1) * kv_bytes, (got["fwd_bytes"], where)
            assert got["bwd_bytes"] == (cp - 1) * kv_bytes + cp * elems * 4, (got["bwd_bytes"], where)
        # queries with no allowed key: the whole padded row's, on every rank; under causality, the left
        # padding's (5 + n / 2 + 1 of the n = cp * L tokens), wherever the layout put them
        empty = [r[case, "fused"]["empty_rows"] for r in results]
        if pad == "right":
            assert empty == [L] * cp, (empty, cp, case)
        want = {"none": 0, "left": (5 + cp * L // 2 + 1) if causal else 0, "right": cp * L}[pad]
        assert sum(empty) == want, (empty, want, cp, case)


def test_ring_attention_on_two_ranks_matches_the_whole_sequence(ranks):
    _check(ranks(2).run(_cases, CASES), 2)


def test_ring_attention_on_four_ranks_matches_the_whole_sequence(ranks):
    _check(ranks(4).run(_cases, CASES), 4)


def test_one_rank_is_plain_attention_over_hugging_face_layouts():
    # as Hugging Face attention passes them: [B, L, H, D] projections transposed to [B, H, L, D] (not
    # contiguous), and the output's gradient arriving through a transpose too
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, L, h, D).transpose(1, 2) for h in (HQ, 2, 2))
    dout = torch.randn(B, L, HQ, D).transpose(1, 2)
    valid = _valid(L, "right")
    for causal, kv in itertools.product((True, False), (None, valid)):
        ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))
        key_valid = None if kv is None else kv[None]
        out = ring_attention(
            ql, kl, vl, group=None, positions=torch.arange(L)[None], causal=causal, key_valid=key_valid
        )
        grads = torch.autograd.grad(out, (ql, kl, vl), dout)
        (ref, *rgrads), _ = _reference(q, k, v, dout, causal, kv)
        for a, b in zip((out, *grads), (ref, *rgrads)):
            assert (a.double() - b).abs().max().item() <= FP32_TOL, (causal, kv is None)


@pytest.mark.parametrize("fused", [True, False])
def test_the_fused_kernel_computes_unmasked_and_diagonal_pairs_and_the_math_the_rest(monkeypatch, fused):
    # one rank, its tokens out of order: positions 0, 2, .., 14, then 1, 3, .., 15 (two runs of 8 tokens
    # of non-consecutive positions: more than _MAX_RUNS runs, one pair, masked, not diagonal); then in
    # order (one diagonal pair) and not causal (one unmasked pair); the reference attends in position order
    calls = {"forward": 0, "backward": 0}

    def counted(op, name):
        def call(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)

        return call

    monkeypatch.setattr(_ring, "_FUSED_CPU", fused)
    monkeypatch.setattr(_ring, "_FLASH", counted(_ring._FLASH, "forward"))
    monkeypatch.setattr(_ring, "_FLASH_BACKWARD", counted(_ring._FLASH_BACKWARD, "backward"))
    monkeypatch.setattr(_ring, "_TILE_BYTES", 5 * 4 * B * HQ)  # tiles of 2 x 2 scores: causal ones skipped
    n = 2 * L
    gen = torch.Generator().manual_seed(7)
    q, dout = (torch.randn(B, HQ, n, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, 2, n, D, generator=gen) for _ in range(2))
    valid = _valid(n, "right")
    for order, causal in (("shuffled", True), ("in order", True), ("in order", False)):
        pos = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]) if order == "shuffled" else torch.arange(n)
        back = pos.argsort()  # position -> token
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        out = ring_attention(ql, kl, vl, group=None, positions=pos[None], causal=causal, key_valid=valid[:, pos][None])
        grads = torch.autograd.grad(out, (ql, kl, vl), dout[:, :, pos])
        (ref, *rgrads), _ = _reference(q, k, v, dout, causal, valid)
        for a, b in zip((out, *grads), (ref, *rgrads)):
            assert (a[:, :, back].double() - b).abs().max().item() <= FP32_TOL, (order, causal, fused)
    assert calls == ({"forward": 2, "backward": 2} if fused else {"forward": 0, "backward": 0}), calls


def test_the_plan_is_kept_while_the_same_positions_come_again():
    positions = _positions(2, "balanced")
    plan = _ring._plan_for(positions, 1, True, False)
    assert _ring._plan_for(positions, 1, True, False) is plan
    assert _ring._plan_for(positions, 0, True, False) is not plan  # another rank, another plan
    assert _ring._plan_for(positions.clone(), 1, True, False) is not plan  # another tensor
    assert _ring._plan_for(positions, 1, True, False).steps == _ring._plan(positions, 1, True, False)
    positions[1] = positions[1].flip(0)  # changed in place: planned again
    assert _ring._plan_for(positions, 1, True, False) is not plan


def test_tiles_cover_each_pair_once_and_skip_only_what_causality_forbids(monkeypatch):
    # balanced layout, cp 2, rank 0 (chunks 0 and 3 of 4): every pair cut in tiles of at most 6 scores per
    # head; the allowed (query, key) pairs are exactly those of the tiles, each once
    positions = _positions(2, "balanced")
    plan = _ring._Plan(positions, 0, True, False)
    for s, (cap, min_tokens) in itertools.product(range(2), ((6, 64), (6, 1), (3, 1), (64, 64))):
        src = (0 - s) % 2
        seen = torch.zeros(L, L, dtype=torch.int64)
        for pair in plan.steps[s]:
            monkeypatch.setattr(_ring, "_MIN_TILE_TOKENS", min_tokens)
            tiles = plan.tiles(pair, src, cap)
            for t0, t1, c0, c1, masked in tiles:
                assert (t1 - t0) * (c1 - c0) <= cap, (t0, t1, c0, c1)
                seen[t0:t1, c0:c1] += 1
                allowed = positions[src, c0:c1][None, :] <= positions[0, t0:t1][:, None]
                assert masked == (not bool(allowed.all())) and bool(allowed.any()), (t0, t1, c0, c1, masked)
            assert tiles
        allowed = positions[src][None, :] <= positions[0][:, None]
        assert bool((seen <= 1).all()) and bool((seen[allowed] == 1).all()), (s, cap, seen)


@pytest.mark.parametrize("fused", [True, False])
def test_memory_of_a_long_sequence_is_the_tile_plus_linear_in_its_length(monkeypatch, fused):
    # one process, 4096 tokens: the untiled scores of all heads would be 128 MiB of float32; forward and
    # backward together stay within two tiles (backward's probabilities and their gradient) and 12 times
    # q's bytes (q, k, v, the output and the gradients in float32, the accumulators, a tile's rows). The
    # fused kernel's own workspace (flash-tiled, per thread) is made inside the op: not counted here.
    Bm, H, Lm, Dm = 1, 2, 4096, 64
    monkeypatch.setattr(_ring, "_FUSED_CPU", fused)
    monkeypatch.setattr(_ring, "_TILE_BYTES", 4 * 2**20)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(Bm, H, Lm, Dm, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(Bm, H, Lm, Dm, generator=gen)
    with zf.memory.track() as t:
        out = ring_attention(q, k, v, group=None, positions=torch.arange(Lm)[None])
        grads = torch.autograd.grad(out, (q, k, v), dout)
    del out, grads
    q_bytes = q.numel() * 4
    untiled = Bm * H * Lm * Lm * 4
    assert t.peak <= 2 * _ring._TILE_BYTES + 12 * q_bytes, (t.peak, fused)
    assert t.peak <= untiled / 4, (t.peak, untiled, fused)


def _work(pairs) -> tuple[int, int]:
    """The scores a block's pairs compute, and how many of them under a causal mask."""
    return sum((p.q1 - p.q0) * (p.k1 - p.k0) for p in pairs), sum(
        (p.q1 - p.q0) * (p.k1 - p.k0) for p in pairs if p.causal_mask
    )


def test_pairs_of_runs_skipped_and_unmasked_follow_causality():
    half = L // 2
    # load-balanced, cp 4: a rank's own block computes 3/4 of its scores, the two diagonal chunks masked
    # (rank 3's chunks 3 and 4 are one run: its whole block, masked); every other block half of them,
    # unmasked, whichever rank and block
    for me in range(4):
        plan = _ring._plan(_positions(4, "balanced").tolist(), me, True, False)
        assert _work(plan[0]) == ((3 * half * half, 2 * half * half) if me < 3 else (L * L, L * L)), (me, plan[0])
        assert all(_work(pairs) == (L * L // 2, 0) for pairs in plan[1:]), (me, plan)
        assert all(len(pairs) == 1 for pairs in plan[1:]), (me, plan)  # neighbouring runs joined
    # contiguous, cp 4, rank 2: its own block masked, ranks 1 and 0 whole, rank 3's block skipped
    plan = _ring._plan(_positions(4, "contiguous").tolist(), 2, True, False)
    assert [_work(pairs) for pairs in plan] == [(L * L, L * L), (L * L, 0), (L * L, 0), (0, 0)]
    assert all(len(pairs) <= 1 for pairs in plan)
    # not causal: one pair per block, whole, masked only for padding
    plan = _ring._plan(_positions(4, "balanced").tolist(), 1, False, True)
    assert all(len(pairs) == 1 and _work(pairs) == (L * L, 0) and pairs[0].key_mask for pairs in plan)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "q": a["q"][0]}, "must each have 4 dimensions"),
        (lambda a: {**a, "v": a["v"][:, :, :4]}, "must have one shape and dtype"),
        (lambda a: {**a, "v": a["v"].double()}, "must have one shape and dtype"),
        (lambda a: {**a, "k": a["k"][..., :4], "v": a["v"][..., :4]}, "must agree on batch, tokens and head_dim"),
        (lambda a: {**a, "k": torch.randn(B, 3, L, D), "v": torch.randn(B, 3, L, D)}, "not a multiple of 3"),
        (lambda a: {**a, "positions": torch.arange(2 * L).view(2, L)}, "expected an integer tensor [cp, L] = [1, 8]"),
        (lambda a: {**a, "positions": torch.arange(L)[None].float()}, "expected an integer tensor"),
        (lambda a: {**a, "key_valid": torch.ones(1, L, dtype=torch.bool)}, "expected bool [cp, B, L] = [1, 2, 8]"),
        (lambda a: {**a, "key_valid": torch.ones(1, B, L)}, "expected bool [cp, B, L]"),
    ],
)
def test_bad_shapes_are_refused(change, message):
    args = {
        "q": torch.randn(B, HQ, L, D),
        "k": torch.randn(B, 2, L, D),
        "v": torch.randn(B, 2, L, D),
        "positions": torch.arange(L)[None],
        "key_valid": None,
    }
    a = change(args)
    with pytest.raises(ValueError, match="ring_attention: ") as err:
        ring_attention(a["q"], a["k"], a["v"], group=None, positions=a["positions"], key_valid=a["key_valid"])
    assert message in str(err.value), str(err.value)
