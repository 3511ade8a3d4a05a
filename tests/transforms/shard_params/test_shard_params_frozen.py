"""shard_params with blocks that mix frozen and trainable weights (LoRA): a block stays gathered until
backward has computed its inputs' gradients, which its frozen weights take part in, not only until its
last trainable gradient is in; so each block is gathered at most twice a step (forward, backward), and
the training equals one process's."""

from __future__ import annotations

import torch
from helpers import rank_slice
from torch import nn
from zerofn.transforms import shard_params
from zerofn.transforms.shard_params._runner import Runner

import zerofn as zf

LAYERS, DIM, RANK = 4, 32, 4


class LoraLinear(nn.Module):
    """A frozen Linear and a trainable low-rank path added to it, in peft's order: the frozen one runs
    first, so backward reaches it (for the input's gradient) after the adapters' gradients are in."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(DIM, DIM).requires_grad_(False)
        self.a = nn.Linear(DIM, RANK, bias=False)
        self.b = nn.Linear(RANK, DIM, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = LoraLinear(), LoraLinear()

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, DIM), *[Block() for _ in range(LAYERS)], nn.Linear(DIM, 1))
    model[0].requires_grad_(False)  # the first block's input needs no gradient: it releases on its adapters
    return model


def _batch(i: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(i))


def _train(sharded: bool) -> tuple[dict, list]:
    rank, world = zf.collectives.rank(), zf.collectives.world_size()
    model = _model()
    apply = zf.functional(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-2))
    if sharded:
        step = shard_params(step)
    gathers: list = []
    if sharded:
        real = Runner.gather

        def counted(self, unit):
            if unit.idle and unit.fulls:
                gathers[-1][unit.spec.name] = gathers[-1].get(unit.spec.name, 0) + 1
            return real(self, unit)

        Runner.gather = counted
    try:
        state = step.init(apply.params)
        for i in range(3):
            gathers.append({})
            x = _batch(i) if not sharded else rank_slice(_batch(i), rank, world)
            state, _ = step(state, x)
    finally:
        if sharded:
            Runner.gather = real
    return step.full_params(state), gathers


def test_lora_blocks_are_gathered_once_in_forward_and_once_in_backward(ranks):
    ref, _ = _train(False)
    for params, gathers in ranks(2).run(_train, True):
        assert all(torch.allclose(params[k], ref[k], atol=1e-6, rtol=0) for k in ref)
        for per_unit in gathers[1:]:  # after the first step, which records the order
            # each block twice; the forward's last unit (the head) once, kept into backward; the frozen input
            # layer once: backward never runs through it (its input and output need no gradient)
            assert per_unit == {"0": 1, **{str(i): 2 for i in range(1, LAYERS + 1)}, str(LAYERS + 1): 1}, per_unit
