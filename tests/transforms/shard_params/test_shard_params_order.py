"""shard_params' forward follows the order of units the last step recorded without agreeing on each unit, on 2
gloo ranks: a step whose forward ran one model call, each unit once, no read from outside a unit before its end,
lets the next step's forward post no agreement but the one at its end. Ranks that all leave that order alike
(a block skipped, repeated or swapped, a read from outside a unit, a forward that ends early) agree on it where
they left and go on, equal to torch on the concatenated batch; a rank that leaves it alone raises the agreement's
error with the other in seconds, the process groups still in step after it."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import agreements, groups_in_step, rank_slice
from torch import nn
from zerofn.transforms import shard_params

import zerofn as zf
from zerofn import collectives as C

GLOBAL_BATCH, LR, LIMIT_S = 8, 0.05, 10.0

# Each step's blocks, the same on both ranks, and what the forward's agreements must be: "first" (no order
# recorded yet: each unit agreed on, waiting), "blind" (the order followed: no agreement on a unit), "left" (the
# order left alike: one agreement where, then each unit's in flight), "inflight" (the last step left its order,
# repeated a unit or read from outside one: each unit's agreement in flight, settled at the next).
STEPS = [
    ([0, 1, 2, 3], False, "first"),
    ([0, 1, 2, 3], False, "blind"),
    ([0, 2, 3], False, "left"),  # skips blocks.1
    ([0, 2, 3], False, "inflight"),
    ([0, 2, 3], False, "blind"),
    ([0, 2, 3, 2], False, "left"),  # repeats blocks.2 after the order's end
    ([0, 2, 3, 2], False, "inflight"),
    ([0, 2, 3, 2], False, "inflight"),  # a repeated unit: never followed blind
    ([0], False, "inflight"),
    ([0], False, "blind"),
    ([0, 3], False, "left"),  # blocks.3 after the order's end
    ([0, 3], False, "inflight"),
    ([0, 3], False, "blind"),
    ([0], False, "left"),  # ends before the order does
    ([0], False, "inflight"),
    ([0], True, "left"),  # reads blocks.3's weight before the model call
    ([0], False, "inflight"),
    ([0], False, "blind"),
]


class Routed(nn.Module):
    """Four blocks run in the order ``self.route``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.route = [0, 1, 2, 3]

    def forward(self, x):
        for i in self.route:
            x = torch.tanh(self.blocks[i](x))
        return x


def _model() -> Routed:
    torch.manual_seed(0)
    return Routed().double()


def _loss(out_of_unit: list[bool], run):
    """The loss: the model's output squared, plus blocks.3's weight squared (read before the model call) where
    ``out_of_unit[0]``."""

    def loss_fn(params, x):
        reg = params["blocks.3.weight"].square().sum() * 1e-2 if out_of_unit[0] else 0.0
        return run(params, x).square().mean() + reg

    return loss_fn


def _kind(points: list) -> str:
    forward = [p for p in points if p[0] in ("OPEN", "LEFT", "OUTSIDE")]
    if any(p[0] == "LEFT" for p in forward):
        assert [p for p in forward if p[0] == "LEFT"] == [("LEFT", "waited")], points
        return "left"
    if not forward:
        return "blind"
    if all(p == ("OPEN", "posted") for p in forward):
        return "inflight"
    if all(p == ("OPEN", "waited") for p in forward):
        return "first"
    return f"other: {forward}"


def _rank_alike(gather_dtype: str | None) -> dict:
    """Every step of STEPS on both ranks alike, and torch on the concatenated batch beside it."""
    model, ref = _model(), _model()
    out_of_unit = [False]
    apply = zf.functional(model)
    step = shard_params(zf.train_step(_loss(out_of_unit, apply), zf.optim.sgd(LR)), gather_dtype=gather_dtype)
    state = step.init(apply.params)
    params = dict(ref.named_parameters())
    ref_loss = _loss(out_of_unit, lambda p, x: ref(x))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    data = torch.randn(GLOBAL_BATCH, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    kinds, losses, ref_losses = [], [], []
    for route, read, _ in STEPS:
        model.route = ref.route = route
        out_of_unit[0] = read
        with agreements() as points:
            state, metrics = step(state, rank_slice(data, C.rank(), C.world_size()))
        kinds.append(_kind(points))
        losses.append(float(metrics["loss"]))
        opt.zero_grad()
        loss = ref_loss(params, data)
        loss.backward()
        loss = loss.detach()
        opt.step()
        ref_losses.append(float(loss))
    full = step.full_params(state)
    diff = max(float((full[n] - p.detach()).abs().max()) for n, p in params.items())
    return dict(kinds=kinds, losses=losses, ref_losses=ref_losses, diff=diff)


@pytest.mark.parametrize("gather_dtype", [None, "int8"])
def test_ranks_that_leave_the_order_alike_go_on_equal_to_torch(ranks, gather_dtype):
    for rank, r in enumerate(ranks(2).run(_rank_alike, gather_dtype)):
        assert r["kinds"] == [kind for _, _, kind in STEPS], rank
        if gather_dtype is None:
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6), rank  # the metric is float32
            assert r["diff"] < 1e-12, (rank, r["diff"])
        else:  # the weights travel as int8 blocks: within the quantization's error of torch's
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=2e-2), rank
            assert r["diff"] < 2e-2, (rank, r["diff"])


# Rank 1's second step, rank 0 following the order [0, 1, 2, 3] the first step recorded on both.
ALONE = {
    "skips a block": ([0, 2, 3], False),
    "repeats a block": ([0, 1, 2, 3, 1], False),
    "ends early": ([0, 1], False),
    "reads from outside a unit": ([0, 1, 2, 3], True),
}


def _rank_alone(gather_dtype: str | None) -> list:
    """For each case of ALONE: the error, seconds until it was raised, and whether both process groups pair this
    rank's collectives with the other's after it."""
    out = []
    for n, (route, read) in enumerate(ALONE.values()):
        model = _model()
        out_of_unit = [False]
        apply = zf.functional(model)
        step = shard_params(
            zf.train_step(_loss(out_of_unit, apply), zf.optim.sgd(LR)), prefetch=1, gather_dtype=gather_dtype
        )
        x = torch.randn(4, 6, dtype=torch.float64)
        state, _ = step(step.init(apply.params), x)
        if C.rank() == 1:
            model.route, out_of_unit[0] = route, read
        C.barrier()
        start = time.monotonic()
        try:
            step(state, x)
            msg = None
        except RuntimeError as err:
            msg = str(err)
        out.append((msg, time.monotonic() - start, groups_in_step(n)))
    return out


@pytest.mark.parametrize("gather_dtype", [None, "int8"])
def test_a_rank_that_leaves_the_order_alone_raises_with_the_other(ranks, gather_dtype):
    for rank, outcomes in enumerate(ranks(2).run(_rank_alone, gather_dtype, timeout=120)):
        for case, (msg, seconds, in_step) in zip(ALONE, outcomes, strict=True):
            assert msg is not None and msg.startswith("shard_params: ranks gathered different units"), (case, rank)
            if rank == 0:
                assert "rank 0 ended the model's forward while another rank " in msg, (case, msg)
            else:
                assert "rank 1 " in msg and "the order the last step ran" in msg, (case, msg)
            assert seconds < LIMIT_S, (case, rank, seconds)
            assert in_step, (case, rank)
