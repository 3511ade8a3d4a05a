"""How often a step reads a tensor on the host (``Tensor.item()``, ``tolist()``, ``numpy()``, ``float(t)``...):
each such read waits for the device to drain. A step makes exactly one per update, the decision whether the
update is finite (a skipped step) and what it updates, and none on the micro-steps between updates; its
counters (the step count, the micro-step, the optimizer's count, the loss scale's) carry their values on
the host; its metrics are device tensors until the user reads one, which costs exactly that read.
Counted over 5 steps of every composition at world size 1 and on 2 gloo ranks, with a skipped fp16 step."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from helpers import make_transformer, rank_slice, transformer_batch
from torch.utils._python_dispatch import TorchDispatchMode
from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

import zerofn as zf

READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


class _Reads(TorchDispatchMode):
    """Counts host reads of tensors: ``_local_scalar_dense`` (item, float(t), int(t), bool(t)) through
    the dispatcher, and ``tolist``/``numpy``, which do not go through it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.n += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    mode, patched = _Reads(), {}
    for name in ("tolist", "numpy"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, **k):
            mode.n += 1
            return _real(self, *a, **k)

        patched[name] = real
        setattr(torch.Tensor, name, spy)
    try:
        with mode:
            yield mode
    finally:
        for name, real in patched.items():
            setattr(torch.Tensor, name, real)


COMPOSITIONS = {
    "plain": lambda s: s,
    "shard_optimizer": shard_optimizer,
    "shard_grads": shard_grads,
    "shard_params": shard_params,
    "amp bf16": lambda s: amp(s, torch.bfloat16),
    "amp fp16": lambda s: amp(s, torch.float16),
    "amp(shard_params)": lambda s: amp(shard_params(s), torch.bfloat16),
    "remat(shard_params)": lambda s: remat(shard_params(s)),
    "offload cpu": lambda s: offload(shard_optimizer(s), "cpu"),
    "accumulate 2": lambda s: s.replace(accumulate_steps=2),
}
STEPS = 5


def _batch(i: int) -> torch.Tensor:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank_slice(transformer_batch(i, 8), rank, world)


def _reads(name: str, read_loss: bool = False) -> dict:
    """Host reads over STEPS steps after a first one (which agrees on the batch shapes), and the updates
    among them."""
    _, apply, loss_fn = make_transformer(extras=False)
    step = COMPOSITIONS[name](zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.1)))
    state = step.init(apply.params)
    state, _ = step(state, _batch(0))
    updates = 0
    with counting() as c:
        for i in range(STEPS):
            state, m = step(state, _batch(i + 1))
            updates += (i + 2) % step.accumulate_steps == 0
            if read_loss:
                float(m["loss"])
    return {"reads": c.n, "updates": updates}


def _cases() -> dict:
    out = {name: _reads(name) for name in COMPOSITIONS}
    out["read loss"] = _reads("shard_optimizer", read_loss=True)
    return out


@pytest.fixture(scope="module")
def two_ranks(ranks):
    return ranks(2).run(_cases)


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_one_read_per_update_at_world_size_1(name):
    r = _reads(name)
    assert r["reads"] == r["updates"], r


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_one_read_per_update_on_two_ranks(two_ranks, name):
    for r in two_ranks:
        assert r[name]["reads"] == r[name]["updates"], (name, r[name])


def test_a_metric_read_costs_exactly_that_read(two_ranks):
    for r in two_ranks:
        got = r["read loss"]
        assert got["reads"] == got["updates"] + STEPS, got
    alone = _reads("plain", read_loss=True)
    assert alone["reads"] == alone["updates"] + STEPS


def test_metrics_are_device_tensors_until_read():
    _, apply, loss_fn = make_transformer(extras=False)
    step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(apply.params)
    state, m = step(state, _batch(0))
    assert isinstance(m["loss"], torch.Tensor) and isinstance(m["grad_norm"], torch.Tensor)
    assert m["loss"].dtype == torch.float32 and m["skipped"] is False


def test_a_skipped_fp16_step_reads_once_and_keeps_the_state_bit_for_bit():
    """An inf loss under fp16 dynamic scaling: the step is skipped (one read, as every update), the
    parameters and optimizer state are exactly as before it, and the scale backs off (after hysteresis)."""
    _, apply, loss_fn = make_transformer(extras=False)
    poison = {"on": False}

    def maybe_inf(params, batch):
        loss = loss_fn(params, batch)
        return loss * torch.inf if poison["on"] else loss

    step = amp(zf.train_step(maybe_inf, zf.optim.adamw(1e-3, weight_decay=0.1)), torch.float16, hysteresis=1)
    state = step.init(apply.params)
    state, _ = step(state, _batch(0))
    before = [t.clone() for t in (*state.params, *zf.tree.tree_leaves(state.opt_state))]
    scale = float(state.loss_scale.scale)
    poison["on"] = True
    with counting() as c:
        state, m = step(state, _batch(1))
    assert c.n == 1 and m["skipped"] is True
    after = [*state.params, *zf.tree.tree_leaves(state.opt_state)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert float(state.loss_scale.scale) == scale / 2 and int(state.count) == 1
    poison["on"] = False
    with counting() as c:
        state, m = step(state, _batch(2))
    assert c.n == 1 and m["skipped"] is False and int(state.count) == 2
