"""remat: the same numbers as without it, for every composition; activation memory of one block."""

from __future__ import annotations

import pytest
import torch
from helpers import compositions, max_abs_diff, train
from torch import nn
from zerofn.transforms import amp, remat, shard_params

import zerofn as zf

COMPOSITIONS = compositions()


class Net(nn.Module):
    """Blocks with dropout and wide hidden activations; parameters are small next to them."""

    def __init__(self, width=32, depth=8, hidden=4, p=0.1):
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden * width), nn.GELU(), nn.Dropout(p), nn.Linear(hidden * width, width))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    model = Net(**kw)
    apply = zf.functional(model)

    def loss_fn(params, batch):
        return (apply(params, batch["x"]) - batch["y"]).square().mean()

    return model, apply, loss_fn


def batch(i, n, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + i)
    x = torch.randn(n, 7, generator=g)
    return {"x": x, "y": torch.sin(x[:, :3])}


def _run(name, with_remat, world, rank, steps=3):
    _, apply, loss_fn = make()
    step = COMPOSITIONS[name](zf.train_step(loss_fn, zf.optim.adamw(1e-2), accumulate_steps=2))
    step = remat(step) if with_remat else step
    torch.manual_seed(100 + rank)  # dropout draws the same on both runs
    state, metrics = train(step, step.init(apply.params), batch, steps, 8, world, rank)
    return step.full_params(state), float(metrics["loss"])


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_remat_changes_no_number_on_one_process(name):
    with_remat, loss = _run(name, True, 1, 0)
    without, loss_ref = _run(name, False, 1, 0)
    assert max_abs_diff(with_remat, without) == 0 and loss == loss_ref
    assert remat(shard_params(zf.train_step(make()[2], zf.optim.sgd(0.1)))).name == "remat(shard_params(train_step))"


def _rank_pair(names):
    rank, world = zf.collectives.rank(), zf.collectives.world_size()
    return {n: max_abs_diff(_run(n, True, world, rank)[0], _run(n, False, world, rank)[0]) for n in names}


def test_remat_on_two_and_four_ranks(ranks):
    for diffs in ranks(2).run(_rank_pair, ["shard_grads", "shard_params"]):
        assert all(d <= 1e-6 for d in diffs.values()), diffs
    for diffs in ranks(4).run(_rank_pair, ["plain", "shard_params"]):
        assert all(d <= 1e-6 for d in diffs.values()), diffs


def test_remat_in_either_order_and_with_selective_saving():
    _, apply, loss_fn = make()
    base = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    assert remat(amp(base)).name == amp(remat(base)).name == "remat(amp(train_step))"
    saving = remat(base, policy=[torch.ops.aten.mm.default, torch.ops.aten.addmm.default])
    state = saving.init(apply.params, keep_module=True)  # the reference starts from the same module
    ref = base.init(apply.params)
    torch.manual_seed(5)
    state, _ = saving(state, batch(0, 8))
    torch.manual_seed(5)
    ref, _ = base(ref, batch(0, 8))
    assert max_abs_diff(saving.full_params(state), base.full_params(ref)) == 0
    with pytest.raises(TypeError, match="policy must be a predicate"):
        remat(base, policy="mm")


def _activation_peak(with_remat, depth, save=None):
    """Peak live bytes of a step at batch 256 less that at batch 8: what activations add."""
    peaks = []
    for n in (8, 256):
        _, apply, loss_fn = make(depth=depth, hidden=8)
        step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
        step = remat(step, policy=save) if with_remat else step
        state = step.init(apply.params)
        state, _ = step(state, batch(0, n))  # the first step allocates what later steps reuse
        with zf.memory.track() as t:
            state, _ = step(state, batch(0, n))
        peaks.append(t.peak)
    return peaks[1] - peaks[0]


def test_remat_keeps_about_one_block_of_activations():
    plain, rematted = _activation_peak(False, 8), _activation_peak(True, 8)
    one_block = _activation_peak(False, 1)  # a whole block's forward and backward, with the model's ends
    assert rematted <= plain / 8 + one_block, (plain, rematted, one_block)
    assert rematted < plain / 3  # and far below keeping every block's activations
    # saving the matmuls keeps their outputs: more than plain remat, still less than no remat
    saved = _activation_peak(True, 8, save=[torch.ops.aten.mm.default, torch.ops.aten.addmm.default])
    assert rematted < saved < plain
