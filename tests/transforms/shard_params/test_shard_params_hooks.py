"""How shard_params watches the model's calls, on 2 gloo ranks: through torch's global module hooks for the step
(two registered per step whatever the model's size, none left after it), so that a module's own pre-hook, which
runs after them, sees its unit gathered; and against the same model trained by torch on the concatenated batch."""

from __future__ import annotations

import torch
from helpers import rank_slice
from torch import nn
from zerofn.transforms import shard_params

import zerofn as zf

STEPS, GLOBAL_BATCH, LR = 3, 8, 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 2)).double()


def _rank_case() -> dict:
    model, ref = _model(), _model()
    seen = []  # what a pre-hook of the middle layer read of its weight, every call: its kind and its sum

    def peek(m, args):
        seen.append((type(m.weight).__name__, float(m.weight.detach().sum())))

    model[2].register_forward_pre_hook(peek)
    apply = zf.functional(model)
    step = shard_params(
        zf.train_step(lambda p, b: apply(p, b[:, :5]).sub(b[:, 5:]).square().mean(), zf.optim.adamw(LR))
    )
    state = step.init(apply.params)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    data = torch.randn(GLOBAL_BATCH, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    counts, expected = [], []
    real = (nn.Module.register_forward_pre_hook, nn.Module.register_forward_hook)
    registered = [0]

    def counting(fn):
        def wrapper(*args, **kwargs):
            registered[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    for _ in range(STEPS):
        expected.append(float(ref[2].weight.detach().sum()))
        nn.Module.register_forward_pre_hook, nn.Module.register_forward_hook = map(counting, real)
        try:
            registered[0] = 0
            state, _ = step(state, rank_slice(data, zf.collectives.rank(), zf.collectives.world_size()))
        finally:
            nn.Module.register_forward_pre_hook, nn.Module.register_forward_hook = real
        counts.append(registered[0])
        opt.zero_grad()
        ref(data[:, :5]).sub(data[:, 5:]).square().mean().backward()
        opt.step()
    params = step.full_params(state)  # the params tree: name -> tensor
    diff = max(float((params[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    hooks = (nn.modules.module._global_forward_pre_hooks, nn.modules.module._global_forward_hooks)
    return dict(seen=seen, expected=expected, counts=counts, diff=diff, global_hooks_after=sum(map(len, hooks)))


def test_global_hooks_watch_the_step_and_a_modules_own_pre_hook_sees_its_unit_gathered(ranks):
    for out in ranks(2).run(_rank_case):
        assert out["counts"] == [0] * STEPS, out["counts"]  # no hook on any module per step
        assert out["global_hooks_after"] == 0
        # the unit's own leaf (not a placeholder, which a read would gather a copy for), as torch's weight
        assert [kind for kind, _ in out["seen"]] == ["Tensor"] * STEPS, out["seen"]
        for (_, got), want in zip(out["seen"], out["expected"]):
            assert abs(got - want) <= 1e-12, (out["seen"], out["expected"])
        assert out["diff"] <= 1e-12, out["diff"]
