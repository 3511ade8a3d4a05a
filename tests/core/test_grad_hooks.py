"""A step (plain, stage 2 or stage 3) hands each bucket's gradients to its reduction with one Python hook call
per bucket once it has seen the order they arrive in (the bucket's last gradient, its closer, is the only one
hooked), not one per parameter; and it loses none where the order changes (a gradient arriving after the
closer's) or the closer gets no gradient (its layer skipped): the parameters stay those of torch's AdamW on the
concatenated batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import max_abs_diff, rank_slice
from torch import nn
from zerofn.transforms import shard_grads, shard_params

import zerofn as zf

# The middle layers each step runs, in order: the same route twice (the closers learnt, then followed), the
# first layer skipped (the one bucket's closer, its first parameter, gets no gradient), the order reversed (the
# closer's gradient arrives before the others'), back.
ROUTES = ["abc", "abc", "abc", "bc", "bc", "bc", "cba", "cba", "abc", "abc"]
STEADY = {1, 2, 5, 7, 9}  # steps that repeat the route of the step before, whose order a step learnt
SKIPPED_CLOSER = 3  # "bc" after "abc": the closer (a parameter of layer a) gets no gradient
LR = 1e-2


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x, route):
        for name in route:
            x = torch.tanh(getattr(self, name)(x))
        return self.head(x)


def _batch(i: int, n: int = 8) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(n, 6, generator=g), "y": torch.randn(n, 2, generator=g)}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _compose(transform: str, step):
    if transform == "shard_params":  # two units: the head, and the root holding the routed layers' buckets
        return shard_params(step, units=["head"])
    return shard_grads(step) if transform == "shard_grads" else step


def _rank_routes(transform: str, bucket_bytes: int | None):
    from zerofn.storage import Closers

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Routed()
    apply = zf.functional(model)
    route = [ROUTES[0]]

    def loss_fn(params, batch):
        return _loss(apply(params, batch["x"], route[0]), batch["y"])

    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    step = zf.train_step(loss_fn, zf.optim.adamw(LR, weight_decay=0.0), **kw)
    step = _compose(transform, step)
    state = step.init(apply.params)
    calls, arrive = [0], Closers._arrive

    def counted(self, *args):
        calls[0] += 1
        return arrive(self, *args)

    Closers._arrive = counted
    hooks, used = [], []  # per step: hook calls, buckets that got a gradient
    where = state.spec.layout.bucket_of
    try:
        for i, r in enumerate(ROUTES):
            route[0], calls[0] = r, 0
            state, _ = step(state, rank_slice(_batch(i), rank, world))
            hooks.append(calls[0])
            used.append(len({b for n, b in where.items() if n.split(".")[0] in (*r, "head")}))
    finally:
        Closers._arrive = arrive
    return {k: v.detach().clone() for k, v in step.full_params(state).items()}, hooks, used


def _torch_routes() -> dict:
    torch.manual_seed(0)
    model = Routed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for i, r in enumerate(ROUTES):
        batch = _batch(i)
        _loss(model(batch["x"], r), batch["y"]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("transform", ["plain", "shard_grads", "shard_params"])
@pytest.mark.parametrize("bucket_bytes", [None, 200])  # one bucket; a bucket per layer
def test_one_hook_call_per_bucket_and_no_gradient_lost_when_the_order_changes(ranks, world, transform, bucket_bytes):
    want = _torch_routes()
    for params, hooks, used in ranks(world).run(_rank_routes, transform, bucket_bytes):
        assert max_abs_diff(params, want) < 1e-6
        assert hooks[0] == len(want)  # the first step: a hook on every leaf, learning the order
        assert all(hooks[i] == used[i] for i in STEADY), (hooks, used)
        # the step whose closer got no gradient: its bucket's gradients were taken after backward
        assert hooks[SKIPPED_CLOSER] < used[SKIPPED_CLOSER], (hooks, used)
        assert hooks[6] > used[6], (hooks, used)  # the reversed order: gradients after their closer's, hooked then


def _rank_micro_routes(transform: str):
    """Two micro-steps per update, the second running the first's route reversed: the closers learnt over one
    micro-step meet the other order in the next, every step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    apply = zf.functional(Routed())
    route = [ROUTES[0]]

    def loss_fn(params, batch):
        return _loss(apply(params, batch["x"], route[0]), batch["y"])

    step = zf.train_step(loss_fn, zf.optim.adamw(LR, weight_decay=0.0), 2, bucket_bytes=200)
    step = _compose(transform, step)
    state = step.init(apply.params)
    for i, r in enumerate(ROUTES):
        local = rank_slice(_batch(i), rank, world)
        for m in range(2):
            route[0] = r if m == 0 else r[::-1]
            state, _ = step(state, rank_slice(local, m, 2))
    return {k: v.detach().clone() for k, v in step.full_params(state).items()}


def _torch_micro_routes(world: int) -> dict:
    """torch on the same parts: each rank's slice of the batch in two micro-batches, each with its route, the
    loss the mean over all of them."""
    torch.manual_seed(0)
    model = Routed()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for i, r in enumerate(ROUTES):
        batch = _batch(i)
        for rank in range(world):
            local = rank_slice(batch, rank, world)
            for m in range(2):
                part = rank_slice(local, m, 2)
                (_loss(model(part["x"], r if m == 0 else r[::-1]), part["y"]) / (2 * world)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("transform", ["plain", "shard_grads", "shard_params"])
def test_micro_steps_in_different_orders_lose_no_gradient(ranks, transform):
    want = _torch_micro_routes(2)
    for params in ranks(2).run(_rank_micro_routes, transform):
        assert max_abs_diff(params, want) < 1e-6
