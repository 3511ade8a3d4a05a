"""zerofn.collectives: identity at world size 1, real collectives and byte counts on gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from zerofn import collectives as C


def test_identity_without_a_process_group():
    assert C.world_size() == 1 and C.rank() == 0
    x = torch.arange(4.0)
    with C.counting() as c:
        assert C.all_reduce(x, "mean") is x
        out = torch.empty(4)
        C.reduce_scatter(out, x)
        full = torch.empty(4)
        C.all_gather(full, out)
        assert C.all_reduce_tree({"a": x})["a"] is x
    assert torch.equal(full, x) and c.bytes == 0
    assert C.gather_objects("x") == ["x"]


def _rank_collectives():
    n, r = C.world_size(), C.rank()
    out = {}
    with C.counting() as c:
        x = torch.full((6,), float(r + 1))
        C.all_reduce(x, "sum")
        out["sum"] = x.tolist()
        m = torch.full((3,), float(r))
        C.all_reduce(m, "mean")
        out["mean"] = m.tolist()
        full = torch.arange(4.0 * n)
        shard = torch.empty(4)
        C.reduce_scatter(shard, full.clone())
        out["rs"] = shard.tolist()
        gathered = torch.empty(4 * n)
        C.all_gather(gathered, torch.full((4,), float(r)))
        out["ag"] = gathered.tolist()
        inplace = torch.zeros(5 * n)
        inplace[5 * r : 5 * r + 5] = torch.arange(5.0) + 10 * r
        C.all_gather(inplace, inplace[5 * r : 5 * r + 5])
        out["inplace"] = inplace.tolist()
        h = C.all_reduce(torch.ones(2), async_op=True)
        out["async"] = h.wait().tolist()
        tree = {"a": torch.ones(2), "b": [torch.ones(3, dtype=torch.float64)]}
        C.all_reduce_tree(tree)
        out["tree"] = [tree["a"].tolist(), tree["b"][0].tolist()]
    out["bytes"], out["calls"] = c.bytes, dict(c.calls)
    try:
        C.reduce_scatter(torch.empty(3), torch.empty(4 * n + 1))
    except ValueError as e:
        out["bad"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_and_byte_counts(ranks, world):
    results = ranks(world).run(_rank_collectives)
    total = sum(range(1, world + 1))
    for r, out in enumerate(results):
        assert out["sum"] == [float(total)] * 6
        assert out["mean"] == pytest.approx([sum(range(world)) / world] * 3)
        assert out["rs"] == [world * float(v) for v in range(4 * r, 4 * r + 4)]
        assert out["ag"] == [float(k // 4) for k in range(4 * world)]
        assert out["inplace"] == [float(k % 5 + 10 * (k // 5)) for k in range(5 * world)]
        assert out["async"] == [float(world)] * 2
        assert out["tree"] == [[float(world)] * 2, [float(world)] * 3]
        # all-reduce counts 2n, reduce-scatter and all-gather count the full tensor's n
        expect = 2 * 24 + 2 * 12 + 16 * world + 16 * world + 20 * world + 2 * 8 + 2 * (8 + 24)
        assert out["bytes"] == expect
        assert out["calls"] == {"all_reduce": 5, "reduce_scatter": 1, "all_gather": 2}
        assert "pad the full tensor to a multiple of the world size" in out["bad"]


def _rank_debug_mismatch():
    os.environ["ZEROFN_DEBUG"] = "1"
    try:
        tree = {"a": torch.ones(2)} if C.rank() == 0 else {"a": torch.ones(2), "b": torch.ones(1)}
        C.all_reduce_tree(tree)
    except ValueError as e:
        return str(e)
    finally:
        os.environ.pop("ZEROFN_DEBUG")
    return None


def test_debug_mode_catches_ranks_that_disagree_on_a_tree(ranks):
    for msg in ranks(2).run(_rank_debug_mismatch, timeout=60):
        assert msg is not None and "ranks disagree" in msg and "rank 0:" in msg and "rank 1:" in msg


def _rank_pair_reduce_scatter():
    """On two gloo ranks reduce_scatter is one exchange (all_to_all) and a local add; gloo's own
    reduce-scatter is the reference, to the bit, for every dtype and both ops."""
    rank = dist.get_rank()
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        g = torch.Generator().manual_seed(7 + rank)
        full = torch.randn(2 * 1001, generator=g).to(dtype)
        for op in ("sum", "mean"):
            mine = torch.empty(1001, dtype=dtype)
            with C.counting() as c:
                C.reduce_scatter(mine, full.clone(), op, async_op=True).wait()
            ref = torch.empty(1001, dtype=dtype)
            dist.reduce_scatter_tensor(ref, full.clone())
            if op == "mean":
                ref.div_(2)
            out.append((str(dtype), op, torch.equal(mine, ref), c.bytes == full.numel() * full.element_size()))
    return out


def test_reduce_scatter_on_two_gloo_ranks_equals_gloos_to_the_bit(ranks):
    for results in ranks(2).run(_rank_pair_reduce_scatter):
        assert all(same and counted for _, _, same, counted in results), results
