"""How often a step reads a tensor on the host (``Tensor.item()``, ``tolist()``, ``numpy()``, ``float(t)``...):
each such read waits for the device to drain. A step makes none: whether an update applies (finite, the
batches agreed) is decided on the device and the optimizer skips there (fused Adam's ``found_inf``), the loss
scale is adjusted there, the counts advance there; its metrics are device tensors until the user reads one,
which costs exactly that read. An optimizer that cannot skip on the device costs one read per update.
Counted over 5 steps of every composition at world size 1 and on 2 gloo ranks, with a skipped fp16 step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import counting, make_transformer, rank_slice, transformer_batch
from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

import zerofn as zf

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
    "donate=False": lambda s: s.replace(donate=False),
}
STEPS = 5


def _batch(i: int) -> torch.Tensor:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank_slice(transformer_batch(i, 8), rank, world)


def _token_mean(apply):
    """A token-weighted loss (zf.Mean): the count travels in the statistics and divides on the device."""

    def loss_fn(params, batch):
        logits = apply(params, batch[:, :-1])
        target = batch[:, 1:].reshape(-1)
        losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, reduction="none")
        keep = target % 3 != 0
        return zf.Mean((losses * keep).sum(), keep.sum())

    return loss_fn


LOSSES = {"zf.Mean": _token_mean, "zf.Mean accumulate 2": _token_mean}


def _reads(name: str, read_loss: bool = False) -> dict:
    """Host reads over STEPS steps after a first one (which agrees on the batch shapes), and the updates
    among them."""
    _, apply, loss_fn = make_transformer(extras=False)
    if name in LOSSES:
        loss_fn = LOSSES[name](apply)
    compose = COMPOSITIONS.get(name) or (lambda s: s.replace(accumulate_steps=2 if "accumulate" in name else 1))
    step = compose(zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.1)))
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
    out = {name: _reads(name) for name in (*COMPOSITIONS, *LOSSES)}
    out["read loss"] = _reads("shard_optimizer", read_loss=True)
    return out


@pytest.fixture(scope="module")
def two_ranks(ranks):
    return ranks(2).run(_cases)


@pytest.mark.parametrize("name", [*COMPOSITIONS, *LOSSES])
def test_no_read_at_world_size_1(name):
    r = _reads(name)
    assert r["reads"] == 0 and r["updates"] > 0, r


@pytest.mark.parametrize("name", [*COMPOSITIONS, *LOSSES])
def test_no_read_on_two_ranks(two_ranks, name):
    for r in two_ranks:
        assert r[name]["reads"] == 0 and r[name]["updates"] > 0, (name, r[name])


def test_a_metric_read_costs_exactly_that_read(two_ranks):
    for r in two_ranks:
        assert r["read loss"]["reads"] == STEPS, r["read loss"]
    assert _reads("plain", read_loss=True)["reads"] == STEPS


def test_an_optimizer_that_cannot_skip_on_the_device_reads_once_per_update():
    """LAMB's bias corrections and trust ratios are host numbers: the step reads its decision on the host."""
    _, apply, loss_fn = make_transformer(extras=False)
    step = zf.train_step(loss_fn, zf.optim.lamb(1e-2))
    state = step.init(apply.params)
    state, _ = step(state, _batch(0))
    with counting() as c:
        for i in range(STEPS):
            state, _ = step(state, _batch(i + 1))
    assert c.n == STEPS


def test_metrics_are_device_tensors_until_read():
    _, apply, loss_fn = make_transformer(extras=False)
    step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(apply.params)
    state, m = step(state, _batch(0))
    assert isinstance(m["loss"], torch.Tensor) and isinstance(m["grad_norm"], torch.Tensor)
    assert m["loss"].dtype == torch.float32 and isinstance(m["skipped"], torch.Tensor) and not m["skipped"]


def test_a_skipped_fp16_step_reads_nothing_and_keeps_the_state_bit_for_bit():
    """An inf loss under fp16 dynamic scaling: the step is skipped on the device (no read), the parameters
    and optimizer state are exactly as before it, and the scale backs off (after hysteresis)."""
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
    assert c.n == 0
    assert bool(m["skipped"])
    after = [*state.params, *zf.tree.tree_leaves(state.opt_state)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert float(state.loss_scale.scale) == scale / 2 and int(state.count) == 1
    poison["on"] = False
    with counting() as c:
        state, m = step(state, _batch(2))
    assert c.n == 0
    assert not bool(m["skipped"]) and int(state.count) == 2


def _optimizer(kind: str):
    lr = zf.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10)
    return {
        "adamw": lambda: zf.optim.adamw(lr, weight_decay=0.1),
        "sgd": lambda: zf.optim.sgd(lr, momentum=0.9, weight_decay=0.01),
        "sgd nesterov masked": lambda: zf.optim.sgd(
            0.05, momentum=0.9, nesterov=True, weight_decay=0.01, mask=zf.optim.decay_mask()
        ),
        "clip + adam": lambda: zf.optim.chain(zf.optim.clip_by_global_norm(0.5), zf.optim.adam(lr)),
    }[kind]()


def _run_with_skips(env: str | None, kind: str = "adamw") -> tuple:
    """8 updates under amp fp16, two of them poisoned (skipped), with the decision made on the device (env
    None) or read on the host (ZEROFN_CHECK_EACH_UPDATE=1)."""
    import os

    _, apply, loss_fn = make_transformer(extras=False)
    poison = {"on": False}

    def maybe_inf(params, batch):
        loss = loss_fn(params, batch)
        return loss * torch.inf if poison["on"] else loss

    step = amp(zf.train_step(maybe_inf, _optimizer(kind)), torch.float16, hysteresis=1)
    state = step.init(apply.params)
    if env is not None:
        os.environ["ZEROFN_CHECK_EACH_UPDATE"] = env
    try:
        skipped = []
        for i in range(8):
            poison["on"] = i in (2, 5)
            state, m = step(state, _batch(i))
            skipped.append(bool(m["skipped"]))
    finally:
        os.environ.pop("ZEROFN_CHECK_EACH_UPDATE", None)
    leaves = [t.clone() for t in (*state.params, *zf.tree.tree_leaves(state.opt_state))]
    return leaves, skipped, int(state.count), float(state.loss_scale.scale)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "sgd nesterov masked", "clip + adam"])
def test_the_device_decides_as_the_host_does_bit_for_bit(kind):
    """Skipped updates, a learning-rate schedule read through the device's count (its values tabled on the
    device), the loss scale adjusted there, SGD's momentum kept by a select: the same bits as the host path,
    which reads every decision; and no read on the device path."""
    with counting() as c:
        on_device, skipped, count, scale = _run_with_skips(None, kind)
    assert c.n == 8 + 2  # the run's own reads (each metrics["skipped"], then the count and the scale), no more
    on_host, skipped_h, count_h, scale_h = _run_with_skips("1", kind)
    assert skipped == skipped_h == [False, False, True, False, False, True, False, False]
    assert count == count_h == 6 and scale == scale_h
    assert all(torch.equal(a, b) for a, b in zip(on_device, on_host, strict=True))
