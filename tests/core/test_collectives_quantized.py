"""zerofn.collectives' block-quantized collectives (ZeRO++'s qwZ and qgZ): the blocks' error bound, and
the all-gather and reduce-scatter on gloo ranks against the unquantized ones, within the bound computed
from the data, with their byte counts."""

from __future__ import annotations

import pytest
import torch

from zerofn import collectives as C

# A block that divides neither the shard (1000 = 2 x 384 + 232) nor the chunks, so every piece ends short.
BLOCK, K = 384, 1000


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block's absmax (blocks of ``block`` along the last dim, the last one shorter)."""
    k = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.float32)
    for a in range(0, k, block):
        out[..., a : a + block] = x[..., a : a + block].float().abs().amax(-1, keepdim=True)
    return out


def _within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, dtype_eps: float = 0.0) -> bool:
    """|got - ref| <= bound, with room for fp32 rounding (1e-4 of the bound, 1e-6 of the value) and the
    final cast's half ulp (``dtype_eps`` of the value)."""
    ref = ref.double()
    err = (got.double() - ref).abs()
    slack = bound.double() * 1e-4 + ref.abs() * (1e-6 + dtype_eps)
    return bool((err <= bound.double() + slack).all())


def _data(seed: int, n: int, dtype=torch.float32) -> torch.Tensor:
    """Values over several orders of magnitude, with a block of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n).roll(seed)
    x[BLOCK : 2 * BLOCK] = 0.0
    return x.to(dtype)


# ---------------------------------------------------------------- blocks and world size 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [BLOCK, 2048, 1, 1000])
def test_blocks_are_within_half_a_step(dtype, block):
    x = _data(3, K, dtype)
    q, s = C.quantize_blocks(x, block)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.shape == (K,) and s.shape == (-(-K // block),)
    assert int(q.abs().max()) <= 127
    back = C.dequantize_blocks(q, s, block)
    assert back.dtype == torch.float32 and _within(back, x, _block_absmax(x, block) / 254)
    assert torch.equal(back[BLOCK : 2 * BLOCK], torch.zeros(BLOCK)) or block > BLOCK
    into = torch.empty(K, dtype=dtype)
    assert C.dequantize_blocks(q, s, block, out=into) is into
    assert torch.equal(into, back.to(dtype))


def test_representable_values_come_back_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (K,), generator=g).float() * 2.0**-5
    x[::BLOCK] = 127 * 2.0**-5  # every block's absmax 127 x 2^-5: its scale 2^-5, its values integers of it
    q, s = C.quantize_blocks(x, BLOCK)
    assert torch.equal(s, torch.full_like(s, 2.0**-5)) and torch.equal(C.dequantize_blocks(q, s, BLOCK), x)
    q, s = C.quantize_blocks(torch.zeros(K), BLOCK)
    assert torch.equal(s, torch.zeros_like(s)) and torch.equal(C.dequantize_blocks(q, s, BLOCK), torch.zeros(K))


def test_world_size_one_is_an_exact_copy_and_counts_nothing():
    x = _data(1, K)
    full, out = torch.empty(K), torch.empty(K)
    with C.counting() as c:
        assert C.all_gather_quantized(full, x) is full
        assert C.reduce_scatter_quantized(out, x, async_op=True).wait() is out
    assert torch.equal(full, x) and torch.equal(out, x) and c.bytes == 0
    with pytest.raises(ValueError, match="full tensor has 7 elements, expected world_size 1 x 6 = 6"):
        C.all_gather_quantized(torch.empty(7), torch.empty(6))
    with pytest.raises(ValueError, match="quantizes float32, bfloat16 or float16"):
        C.reduce_scatter_quantized(torch.empty(6, dtype=torch.int64), torch.empty(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="block=0"):
        C.all_gather_quantized(torch.empty(6), torch.empty(6), block=0)


# ---------------------------------------------------------------- on gloo ranks


def _rank_quantized(block: int, k: int):
    n, r = C.world_size(), C.rank()
    out: dict = {}
    nb = -(-k // block)
    wire = n * (k + 4 * nb)  # int8 payload and scales, the same for both collectives

    # all-gather (qwZ): every rank's shard, against the unquantized gather of the same shards
    shard = _data(10 + r, k)
    keep = shard.clone()
    ref = torch.empty(n * k)
    with C.counting() as plain:
        C.all_gather(ref, shard)
    full = torch.empty(n * k)
    with C.counting() as c:
        assert C.all_gather_quantized(full, shard, block=block) is full
    out["ag_within"] = _within(full, ref, _block_absmax(ref.view(n, k), block).view(-1) / 254)
    out["ag_kept"] = torch.equal(shard, keep)
    out["ag_bytes"] = (c.bytes, wire, plain.bytes, dict(c.calls))
    gathered = [torch.empty(n * k) for _ in range(2)]
    handles = [C.all_gather_quantized(f, shard, block=block, async_op=True) for f in gathered]
    out["ag_async"] = all(torch.equal(h.wait(), full) for h in handles)
    inplace = torch.zeros(n * k)
    inplace[r * k : (r + 1) * k] = shard
    C.all_gather_quantized(inplace, inplace[r * k : (r + 1) * k], block=block)  # this rank's slice of full
    out["ag_inplace"] = torch.equal(inplace, full)

    # exactly: integers in [-127, 127] times 2^-3 with absmax 127 x 2^-3 in every block, and zeros
    exact = (torch.arange(k) % 255 - 127 + r).clamp(-127, 127).float() * 0.125
    exact[::block] = 127 * 0.125
    into = torch.empty(n * k)
    C.all_gather_quantized(into, exact, block=block)
    C.all_gather(ref, exact)
    out["ag_exact"] = torch.equal(into, ref)
    C.all_gather_quantized(into, torch.zeros(k), block=block)
    out["ag_zeros"] = torch.equal(into, torch.zeros(n * k))

    # bf16: the unquantized gather is the reference, within the bound and bf16's half ulp
    half = shard.to(torch.bfloat16)
    ref16, got16 = torch.empty(n * k, dtype=torch.bfloat16), torch.empty(n * k, dtype=torch.bfloat16)
    C.all_gather(ref16, half)
    with C.counting() as c16:
        C.all_gather_quantized(got16, half, block=block)
    bound16 = _block_absmax(ref16.view(n, k), block).view(-1) / 254
    out["ag_bf16"] = (_within(got16, ref16, bound16, 2.0**-8), c16.bytes == wire)

    # reduce-scatter (qgZ): each rank's own data; the bound sums every rank's block absmax
    mine = _data(20 + r, n * k)
    everyone = torch.stack([_data(20 + j, n * k) for j in range(n)])  # every rank's full, for the bound
    ref = torch.empty(k)
    with C.counting() as plain:
        C.reduce_scatter(ref, mine.clone(), "sum")
    got = torch.empty(k)
    keep = mine.clone()
    with C.counting() as c:
        assert C.reduce_scatter_quantized(got, mine, block=block) is got
    absmax = _block_absmax(everyone.view(n, n, k), block)  # [rank, chunk, element]: each chunk on its own
    bound = absmax[:, r, :].sum(0) / 254
    out["rs_within"] = _within(got, ref, bound)
    some = bound > 0
    out["rs_tight"] = float(((got - ref).abs()[some] / bound[some]).max())  # met, not loose by orders
    out["rs_kept"] = torch.equal(mine, keep)
    out["rs_bytes"] = (c.bytes, wire, plain.bytes, dict(c.calls))
    h = C.reduce_scatter_quantized(torch.empty(k), mine, block=block, async_op=True)
    out["rs_async"] = torch.equal(h.wait(), got)

    exact = (torch.arange(n * k) % 255 - 127).float() * 0.25
    exact.view(n, k)[:, ::block] = 127 * 0.25
    C.reduce_scatter_quantized(got, exact, block=block)
    out["rs_exact"] = torch.equal(got, n * exact.view(n, k)[r])

    # bf16: against the exact sum of the bf16 values, within their bound and bf16's half ulp of the sum
    g16 = torch.empty(k, dtype=torch.bfloat16)
    C.reduce_scatter_quantized(g16, mine.to(torch.bfloat16), block=block)
    every16 = everyone.to(torch.bfloat16).view(n, n, k)
    bound16 = _block_absmax(every16, block)[:, r, :].sum(0) / 254
    out["rs_bf16"] = _within(g16, every16[:, r, :].double().sum(0), bound16, 2.0**-8)

    try:
        C.reduce_scatter_quantized(torch.empty(k), torch.empty(n * k + 1), block=block)
    except ValueError as e:
        out["bad"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_quantized_collectives_on_gloo_ranks(ranks, world):
    for r, out in enumerate(ranks(world).run(_rank_quantized, BLOCK, K, timeout=120)):
        assert out["ag_within"] and out["ag_kept"] and out["ag_async"] and out["ag_inplace"], r
        assert out["ag_exact"] and out["ag_zeros"], r
        assert out["ag_bf16"] == (True, True), r
        assert out["rs_within"] and out["rs_kept"] and out["rs_async"] and out["rs_exact"] and out["rs_bf16"], r
        assert 0.3 < out["rs_tight"] <= 1.0001, out["rs_tight"]
        for kind, key in (("all_gather", "ag_bytes"), ("reduce_scatter", "rs_bytes")):
            counted, formula, unquantized, calls = out[key]
            assert counted == formula == world * (K + 4 * 3) and calls == {kind: 1}
            assert unquantized == 4 * world * K and 0.25 <= counted / unquantized <= 0.3
        assert out["bad"] == (
            f"reduce_scatter_quantized: full tensor has {world * K + 1} elements, expected world_size {world} x "
            f"{K} = {world * K}; pad the full tensor to a multiple of the world size"
        )


def _rank_alone():
    x = _data(1, K)
    full, out = torch.empty(K), torch.empty(K)
    with C.counting() as c:
        C.all_gather_quantized(full, x, block=BLOCK)
        C.reduce_scatter_quantized(out, x, block=BLOCK, async_op=True).wait()
    return torch.equal(full, x) and torch.equal(out, x), c.bytes


def test_a_process_group_of_one_is_an_exact_copy(ranks):
    assert ranks(1).run(_rank_alone, timeout=60) == [(True, 0)]
