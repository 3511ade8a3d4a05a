"""Model buffers are state: bound into the model for each step, kept equal across ranks, picklable."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import compositions, rank_slice
from torch import nn

import zerofn as zf


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh()) for _ in range(2)])
        self.blocks[1][0] = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 6, generator=g) * 2 + 1


def _train(name, world, rank, steps=3):
    torch.manual_seed(0)
    model = Normed()
    apply = zf.functional(model)
    step = compositions()[name](zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-2)))
    state = step.init(apply.params)
    for i in range(steps):
        state, _ = step(state, rank_slice(_batch(i), rank, world))
    model.eval()
    out = step.apply(state, _batch(99))
    return {k: v.clone() for k, v in state.buffers.items()}, out, state


def _rank_buffers(names):
    rank, world = zf.collectives.rank(), zf.collectives.world_size()
    return {n: (*_train(n, world, rank)[:2], _train(n, world, rank, steps=1)[0]) for n in names}


def test_buffers_are_equal_on_every_rank_and_average_the_local_updates(ranks):
    names = list(compositions())
    per_rank = ranks(2).run(_rank_buffers, names)
    for name in names:
        (b0, out0, first0), (b1, out1, _) = per_rank[0][name], per_rank[1][name]
        assert sorted(b0) == [
            "blocks.0.1.num_batches_tracked",
            "blocks.0.1.running_mean",
            "blocks.0.1.running_var",
            "blocks.1.1.num_batches_tracked",
            "blocks.1.1.running_mean",
            "blocks.1.1.running_var",
        ]
        for k in b0:
            assert torch.equal(b0[k], b1[k]), (name, k)  # every rank holds the same statistics
        torch.testing.assert_close(out0, out1, rtol=0, atol=0)  # so evaluation agrees
        # Averaging equal-sized local updates gives the running mean of the whole batch on one process.
        # (Only where the inputs agree: the first BatchNorm in the first step. After it, each rank
        # normalises with its own batch's statistics, as under DDP, and the runs part.)
        ref, _, _ = _train(name, 1, 0, steps=1)
        k = "blocks.0.1.running_mean"
        torch.testing.assert_close(first0[k], ref[k], rtol=1e-6, atol=1e-6 if name != "amp" else 1e-3)
        assert int(b0["blocks.0.1.num_batches_tracked"]) == 3


def test_the_state_holds_the_buffers_and_pickles():
    buffers, out, state = _train("plain", 1, 0)
    assert not torch.equal(buffers["blocks.0.1.running_mean"], torch.zeros(16))  # training moved them
    assert "buffers" in repr(state) and zf.memory.state_bytes(state)["buffers"] == sum(
        b.numel() * b.element_size() for b in buffers.values()
    )
    back = pickle.loads(pickle.dumps(state))
    zf.testing.assert_trees_all_close(back.buffers, state.buffers, rtol=0, atol=0)


@pytest.mark.parametrize("donate", [True, False])
def test_each_state_keeps_its_own_buffers(donate):
    torch.manual_seed(0)
    model = Normed()
    apply = zf.functional(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(0.1), donate=donate)
    state = step.init(apply.params)
    before = {k: v.clone() for k, v in state.buffers.items()}
    new, _ = step(state, _batch(0))
    assert not torch.equal(new.buffers["blocks.0.1.running_mean"], before["blocks.0.1.running_mean"])
    if not donate:  # the input state is untouched, its buffers included
        for k, v in before.items():
            assert torch.equal(state.buffers[k], v), k
