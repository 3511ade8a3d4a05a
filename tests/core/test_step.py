"""train_step and shard_optimizer against the one-process step and torch, on real gloo ranks."""

from __future__ import annotations

import os

import chex
import pytest
import torch
import torch.distributed as dist
from helpers import (
    MODELS,
    make_mlp,
    make_transformer,
    max_abs_diff,
    mlp_batch,
    rank_slice,
    stats_bytes,
    train,
    transformer_batch,
)
from zerofn.transforms import shard_optimizer

import zerofn as zf

TRANSFORMS = {"plain": lambda s: s, "shard_optimizer": shard_optimizer}
GLOBAL_BATCH = 24
STEPS = 10


def _optimizer(clip=None, schedule=False):
    lr = zf.optim.warmup_cosine_decay_schedule(0.0, 3e-3, 3, 10) if schedule else 3e-3
    opt = zf.optim.adamw(lr, weight_decay=0.1)
    return zf.optim.chain(zf.optim.clip_by_global_norm(clip), opt) if clip else opt


def _train(model_name, transform, world, rank, *, accumulate=1, clip=None, schedule=False, steps=STEPS):
    make, batch_fn = MODELS[model_name]
    _, apply, loss_fn = make()
    step = TRANSFORMS[transform](zf.train_step(loss_fn, _optimizer(clip, schedule), accumulate))
    state = step.init(apply.params)
    losses = []
    for i in range(steps):
        state, metrics = train(step, state, lambda _, n: batch_fn(i, n), 1, GLOBAL_BATCH, world, rank)  # noqa: B023 (called in this iteration)
        losses.append(float(metrics["loss"]))
    return step.full_params(state), losses, metrics


CASES = [
    # (model, transform, accumulate, clip, schedule)
    ("mlp", "plain", 1, None, False),
    ("mlp", "shard_optimizer", 1, None, False),
    ("transformer", "plain", 1, None, False),
    ("transformer", "shard_optimizer", 1, None, False),
    ("transformer", "shard_optimizer", 2, 0.5, True),
    ("mlp", "plain", 2, 0.1, False),  # GLOBAL_BATCH must split into world x accumulate parts
]


def _rank_run_cases(cases):
    world, rank = dist.get_world_size(), dist.get_rank()
    return [_train(m, t, world, rank, accumulate=k, clip=c, schedule=s)[:2] for m, t, k, c, s in cases]


@pytest.fixture(scope="module")
def references():
    return {case: _train(case[0], "plain", 1, 0, accumulate=1, clip=case[3], schedule=case[4])[:2] for case in CASES}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_faithful_to_one_process(ranks, references, world):
    """Every case on N ranks ends with the parameters of one process fed the whole batch."""
    results = ranks(world).run(_rank_run_cases, CASES)
    for case, *_ in zip(CASES):
        ref_params, ref_losses = references[case]
        for rank, per_case in enumerate(results):
            params, losses = per_case[CASES.index(case)]
            diff = max_abs_diff(params, ref_params)
            assert diff <= 1e-5, f"{case} world={world} rank={rank}: max abs param diff {diff:.3g}"
            if case[2] == 1:  # with accumulation the metric is the last micro-batch's loss
                assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    # the run really trained: parameters moved away from their initial values
    init = MODELS["mlp"][0]()[1].params
    assert max_abs_diff(references[CASES[0]][0], init) > 1e-3


def test_matches_torch_adamw_on_module():
    """train_step's adamw equals torch.optim.AdamW driving the nn.Module itself."""
    model, apply, loss_fn = make_transformer()
    ref_model, _, _ = make_transformer()
    opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)
    step = zf.train_step(loss_fn, zf.optim.adamw(3e-3, weight_decay=0.1))
    state = step.init(apply.params)
    for i in range(STEPS):
        batch = transformer_batch(i, GLOBAL_BATCH)
        state, _ = step(state, batch)
        logits = ref_model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    ref = {k: v.detach() for k, v in ref_model.named_parameters()}
    assert max_abs_diff(step.full_params(state), ref) <= 1e-5
    chex.assert_trees_all_equal_shapes(step.full_params(state), ref)
    chex.assert_trees_all_close(step.full_params(state), ref, atol=1e-5, rtol=0)


def test_hard_shapes_layout():
    """Tied weights appear once, frozen and integer-free params get no optimizer state, dtypes keep."""
    _, apply, loss_fn = make_transformer()
    assert "head.weight" not in apply.params and "tok.weight" in apply.params
    assert apply.params["frozen_proj"].requires_grad is False
    frozen_before = apply.params["frozen_proj"].clone()
    tok_before = apply.params["tok.weight"].clone()
    step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(apply.params)
    layout = state.spec.layout
    assert layout.frozen == ("frozen_proj",)
    dtypes = {b.dtype for b in layout.buckets}
    assert dtypes == {torch.float32, torch.float64}
    # adamw's two moments cover the trainable parameters only (tied once, frozen none), plus its int64 count
    trainable_bytes = sum(p.numel() * p.element_size() for p in apply.params.values() if p.requires_grad)
    assert zf.memory.state_bytes(state)["optimizer"] == 2 * trainable_bytes + 8
    state, _ = step(state, transformer_batch(0, 4))
    full = step.full_params(state)
    assert full["gate64"].dtype == torch.float64 and full["temperature"].shape == ()
    assert torch.equal(full["frozen_proj"], frozen_before)
    assert not torch.equal(full["tok.weight"], tok_before)  # while the trainable ones moved
    assert torch.equal(full["tok.weight"], apply.params["tok.weight"])  # and the module reads the state's values


def _rank_bytes():
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    out = {}
    for transform in TRANSFORMS:
        _, apply, loss_fn = make_transformer()
        step = TRANSFORMS[transform](zf.train_step(loss_fn, zf.optim.adamw(1e-3), bucket_bytes=2048))
        state = step.init(apply.params)
        state, first = step(state, rank_slice(transformer_batch(0, GLOBAL_BATCH), rank, world))
        state, metrics = step(state, rank_slice(transformer_batch(1, GLOBAL_BATCH), rank, world))
        layout = state.spec.layout
        out[transform] = dict(
            state_bytes=zf.memory.state_bytes(state),
            comm=metrics["comm_bytes"],
            first_comm=first["comm_bytes"],
            padded_bytes=sum(b.nbytes for b in layout.buckets),
            param_bytes=sum(b.numel * b.nbytes // b.padded for b in layout.buckets),
            buckets=[(b.numel, b.padded, b.shards, str(b.dtype)) for b in layout.buckets],
            frozen_bytes=sum(v.numel() * v.element_size() for v in state.frozen.values()),
        )
    return out


@pytest.mark.parametrize("world", [1, 3, 4])
def test_state_bytes_and_comm_bytes_formulas(ranks, world):
    results = ranks(world).run(_rank_bytes) if world > 1 else [_rank_bytes()]
    _, apply, _ = make_transformer()
    trainable = [p for p in apply.params.values() if p.requires_grad]
    psi_bytes = sum(p.numel() * p.element_size() for p in trainable)
    for r in results:
        plain, sharded = r["plain"], r["shard_optimizer"]
        assert plain["param_bytes"] == psi_bytes
        # adamw holds two moments per element; sharded: 1/N of them, plus padding per bucket
        counters = 8  # adam's int64 step count
        assert plain["state_bytes"]["optimizer"] == 2 * psi_bytes + counters
        shard_bytes = sharded["padded_bytes"] // world
        assert sharded["state_bytes"]["optimizer"] == 2 * shard_bytes + counters
        pad = max(len(sharded["buckets"]) * (world - 1) * 8, 0)
        assert 2 * psi_bytes // world <= 2 * shard_bytes <= 2 * psi_bytes // world + 2 * pad
        # each bucket is padded to the next multiple of N elements, and only that
        assert all(s == 1 and p == n for n, p, s, _ in plain["buckets"])
        assert all(s == world and p == -(-n // world) * world for n, p, s, _ in sharded["buckets"])
        assert sharded["padded_bytes"] == world * shard_bytes
        for s in (plain, sharded):
            assert s["state_bytes"]["params"] == s["padded_bytes"] + s["frozen_bytes"]
            assert s["state_bytes"]["total"] == s["state_bytes"]["params"] + s["state_bytes"]["optimizer"]
        # traffic: all-reduce = 2 x bytes; reduce-scatter + all-gather = 2 x (padded) bytes; plus scalars
        if world == 1:
            assert plain["comm"] == 0 and sharded["comm"] == 0
        else:
            # the stats all-reduce (loss, sumsq, ranks lacking a gradient, the batch digest and its square,
            # which ranks gave each parameter a gradient); a step's first call also agrees on the batch shapes
            # (2 x int64)
            scalars = stats_bytes(len(trainable), world)
            assert plain["comm"] == 2 * psi_bytes + scalars
            assert sharded["comm"] == 2 * sharded["padded_bytes"] + scalars
            assert plain["first_comm"] == plain["comm"] + 2 * 16 and sharded["first_comm"] == sharded["comm"] + 2 * 16


def test_donate_false_leaves_input_untouched():
    _, apply, loss_fn = make_mlp()
    step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-2), donate=False))
    state = step.init(apply.params)
    state, _ = step(state, mlp_batch(0, 8))
    before = zf.tree.tree_map(lambda t: t.clone(), state)
    new, _ = step(state, mlp_batch(1, 8))
    zf.testing.assert_trees_all_equal(state, before)
    assert max_abs_diff(step.full_params(new), step.full_params(state)) > 0
    again, _ = step(state, mlp_batch(1, 8))  # the same input gives the same output
    assert max_abs_diff(step.full_params(again), step.full_params(new)) == 0


def test_a_step_is_a_value_and_its_run_keeps_what_it_derives():
    """Nothing is cached on a Step: the bound optimizer and the model live in the run's states, made by
    init and carried from state to state; a copy of the step with other settings shares them."""
    _, apply, loss_fn = make_mlp()
    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    fields = dict(vars(step))
    state = step.init(apply.params, keep_module=True)
    run, entries = state.run, dict(state.run.entries)
    for i in range(2):
        state, _ = step(state, mlp_batch(i, 8))
    assert vars(step) == fields
    assert state.run is run and all(state.run.entries[k] is v for k, v in entries.items())
    longer = step.replace(accumulate_steps=2)
    state, _ = longer(state, mlp_batch(2, 8))
    assert all(state.run.entries[k] is v for k, v in entries.items())  # the same optimizer, bound once
    other = step.init(apply.params, keep_module=True)
    assert other.run is not run and other.run == run  # another run; not part of the state's value


def test_donated_state_raises():
    _, apply, loss_fn = make_mlp()
    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    state = step.init(apply.params)
    new, _ = step(state, mlp_batch(0, 8))
    with pytest.raises(zf.DonatedStateError, match="donated to a step"):
        step(state, mlp_batch(1, 8))
    with pytest.raises(zf.DonatedStateError, match="donate=False"):
        state.params  # noqa: B018 (the read is what raises)
    with pytest.raises(zf.DonatedStateError):
        zf.tree.tree_leaves(state)
    assert "donated" in repr(state)
    # the new state reuses the old buffers: no second copy of the parameters or the optimizer state.
    # The donated input cannot be read after the step, so note where its buffers live before it.
    params_in = [t.data_ptr() for t in zf.tree.tree_leaves(new.params)]
    opt_in = [t.data_ptr() for t in zf.tree.tree_leaves(new.opt_state) if isinstance(t, torch.Tensor) and t.dim()]
    assert params_in and len(opt_in) >= 2  # adamw: a first and a second moment per bucket
    new2, _ = step(new, mlp_batch(1, 8))
    assert [t.data_ptr() for t in zf.tree.tree_leaves(new2.params)] == params_in
    assert [
        t.data_ptr() for t in zf.tree.tree_leaves(new2.opt_state) if isinstance(t, torch.Tensor) and t.dim()
    ] == opt_in
    assert int(new2.count) == 2  # and it did update them


def test_donation_keeps_peak_below_two_optimizer_states():
    """A donated step updates in place: peak live bytes stay below two copies of the optimizer state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    apply = zf.functional(model)

    def loss_fn(params, x):
        return apply(params, x).square().mean()

    for donate, bound_ok in ((True, True), (False, False)):
        step = zf.train_step(loss_fn, zf.optim.adamw(1e-3), donate=donate)
        state = step.init(apply.params)
        state, _ = step(state, torch.randn(2, 256))
        opt_bytes = zf.memory.state_bytes(state)["optimizer"]
        with zf.memory.track() as t:
            state, _ = step(state, torch.randn(2, 256))
        # in place: gradients (1/2 optimizer state) + Adam's temporaries; a functional update would add a whole copy
        assert (t.peak < 2 * opt_bytes) == bound_ok, (donate, t.peak, opt_bytes)


def test_loss_not_scalar_and_bad_state():
    _, apply, loss_fn = make_mlp()
    step = zf.train_step(lambda p, b: (apply(p, b["x"]) - b["y"]) ** 2, zf.optim.sgd(0.1))
    state = step.init(apply.params)
    with pytest.raises(ValueError, match=r"scalar \(0-dim\).*shape \[8, 3\].*loss.mean\(\)"):
        step(state, mlp_batch(0, 8))
    good = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    other = shard_optimizer(good)
    with pytest.raises(ValueError, match=r"made by train_step on world size 1, but this step is shard_optimizer"):
        other(good.init(apply.params), mlp_batch(0, 8))
    with pytest.raises(TypeError, match="TrainState made by this step's init"):
        good(apply.params, mlp_batch(0, 8))


def test_non_finite_loss_skips_update():
    _, apply, loss_fn = make_mlp()
    step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
    state = step.init(apply.params)
    state, m = step(state, mlp_batch(0, 8))
    before = step.full_params(state)
    opt_before = zf.tree.tree_map(torch.clone, state.opt_state)
    bad = mlp_batch(1, 8)
    bad["x"][0, 0] = float("nan")
    state, m = step(state, bad)
    assert bool(m["skipped"]) and not torch.isfinite(m["loss"])
    assert max_abs_diff(step.full_params(state), before) == 0
    zf.testing.assert_trees_all_equal(state.opt_state, opt_before)
    assert int(state.count) == 1
    state, m = step(state, mlp_batch(2, 8))  # training goes on
    assert not bool(m["skipped"]) and int(state.count) == 2


def _rank_bad_batches():
    rank = dist.get_rank()
    _, apply, loss_fn = make_mlp()
    step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
    state = step.init(apply.params)
    before = step.full_params(state)

    def error(batch):  # the step's ValueError on batch, None if it stepped
        try:
            step(state, batch)
        except ValueError as e:
            return str(e)
        return None

    msg = error(mlp_batch(0, 4 + rank))
    # the state was not lost: it still steps with agreeing batches
    state, _ = step(state, mlp_batch(0, 4))
    stepped = max_abs_diff(step.full_params(state), before) > 0
    # later calls compare the shapes inside the update's statistics, on the device: the update is skipped
    # there and the error raised by the next wait (block_until_ready, a checkpoint), not by the call
    kept = step.full_params(state)
    state, m = step(state, mlp_batch(1, 4 + rank))
    skipped = bool(m["skipped"])
    try:
        zf.block_until_ready(state)
        later = None
    except ValueError as e:
        later = str(e)
    moved = max_abs_diff(step.full_params(state), kept)
    zf.block_until_ready(state)  # read once: the state goes on
    state, m = step(state, mlp_batch(2, 4))
    goes_on = not bool(m["skipped"]) and int(state.count) == 2
    # the debugging switch reads every update's decision: the call itself raises, with the shapes
    os.environ["ZEROFN_CHECK_EACH_UPDATE"] = "1"
    try:
        at_once = error(mlp_batch(3, 4 + rank))
    finally:
        del os.environ["ZEROFN_CHECK_EACH_UPDATE"]
    return msg, stepped, later, moved, skipped, goes_on, at_once


def test_batches_of_different_shapes_raise_on_every_rank(ranks):
    results = ranks(2).run(_rank_bad_batches, timeout=60)
    for rank, (msg, stepped, later, moved, skipped, goes_on, at_once) in enumerate(results):
        for m in (msg, at_once):
            assert m is not None, f"rank {rank} did not raise"
            assert "different shapes" in m and "rank 0: {'x': 'float32[4, 7]'" in m and "drop_last" in m
        assert later is not None and "different shapes" in later and "ZEROFN_CHECK_EACH_UPDATE" in later
        assert stepped and skipped and moved == 0.0 and goes_on


def _rank_state_sharded():
    _, apply, loss_fn = make_mlp()
    step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
    state = step.init(apply.params)
    return state, zf.memory.state_bytes(state), repr(state)


def test_state_from_other_world_size(ranks):
    """A state made on 2 ranks is refused on 1 with the reshard hint."""
    _, apply, loss_fn = make_mlp()
    step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
    made_on_two, sizes, text = ranks(2).run(_rank_state_sharded)[0]
    with pytest.raises(ValueError, match=r"on world size 2, but this step is .* on world size 1(.|\n)*full_params"):
        step(made_on_two, mlp_batch(0, 8))
    assert "sharded 1/2" in text and "opt_state" in text
    # what rank 0 holds: the whole parameters, half of adamw's two moments (+ the int64 count)
    numel = sum(p.numel() for p in apply.params.values())
    assert sizes["params"] == 4 * numel
    assert sizes["optimizer"] == 2 * 4 * -(-numel // 2) + 8


def _rank_nan_on_one_rank(transform):
    rank = dist.get_rank()
    _, apply, loss_fn = make_mlp()
    step = TRANSFORMS[transform](zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
    state = step.init(apply.params)
    before = step.full_params(state)
    batch = mlp_batch(0, 4)
    if rank == 1:
        batch["x"][0, 0] = float("inf")
    state, m = step(state, batch)
    unchanged = max_abs_diff(step.full_params(state), before) == 0
    state, m2 = step(state, mlp_batch(1, 4))
    return bool(m["skipped"]), unchanged, bool(m2["skipped"]), int(state.count)


@pytest.mark.parametrize("transform", ["plain", "shard_optimizer"])  # the statistics beside or after the gradients
def test_non_finite_gradient_on_one_rank_skips_everywhere(ranks, transform):
    for skipped, unchanged, later_skipped, count in ranks(2).run(_rank_nan_on_one_rank, transform, timeout=60):
        assert skipped is True and unchanged and later_skipped is False and count == 1


def _rank_aux():
    world, rank = dist.get_world_size(), dist.get_rank()
    _, apply, _ = make_mlp()

    def loss_fn(params, batch):
        out = apply(params, batch["x"])
        loss = ((out - batch["y"]) ** 2).mean()
        return loss, {"rank_plus_one": torch.tensor(rank + 1.0), "tag": "local", "out_mean": out.mean()}

    step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    # each rank its own slice: the local loss and out_mean differ from rank to rank
    state, metrics = step(step.init(apply.params), rank_slice(mlp_batch(0, 12), rank, world))
    return {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}


def test_aux_values_are_averaged_over_ranks(ranks):
    results = ranks(3).run(_rank_aux)
    # the mean over 3 equal slices is the mean over the whole batch: one process's values on it
    _, apply, _ = make_mlp()
    batch = mlp_batch(0, 12)
    with torch.no_grad():
        out = apply(apply.params, batch["x"])
        whole_loss, whole_out_mean = float(((out - batch["y"]) ** 2).mean()), float(out.mean())
        local_losses = [float(((o - y) ** 2).mean()) for o, y in zip(out.chunk(3), batch["y"].chunk(3))]
    assert max(local_losses) - min(local_losses) > 1e-3  # so a rank's own loss would not pass for the mean
    for m in results:
        assert m["rank_plus_one"] == pytest.approx(2.0)  # mean of 1, 2, 3
        assert m["tag"] == "local" and not m["skipped"]
        assert m["loss"] == pytest.approx(whole_loss, rel=1e-6)
        assert m["out_mean"] == pytest.approx(whole_out_mean, rel=1e-6, abs=1e-7)


def _rank_init_from_unseeded_models():
    torch.manual_seed(zf.collectives.rank())  # each rank a different model, as an unseeded script gets
    apply = zf.functional(torch.nn.Linear(3, 2))
    step = zf.train_step(lambda p, x: apply(p, x).sum(), zf.optim.sgd(0.1))
    try:
        step.init(apply.params)
    except ValueError as e:
        return str(e)
    return None


def test_init_refuses_ranks_that_start_from_different_parameters(ranks):
    for msg in ranks(2).run(_rank_init_from_unseeded_models):
        assert msg is not None and "the ranks passed different values for 2 parameter(s) (['bias', 'weight'])" in msg
        assert "torch.manual_seed(0)" in msg


def _rank_collective_order(transform):
    """The second step's all-reduce launches (with their dtype) and collective waits (with their kind), in order."""
    from zerofn.collectives._handle import Handle

    _, apply, loss_fn = make_mlp()
    step = TRANSFORMS[transform](zf.train_step(loss_fn, _optimizer(clip=0.5)))
    state, _ = step(step.init(apply.params), rank_slice(mlp_batch(0, 8), dist.get_rank(), dist.get_world_size()))
    log, launch, wait = [], dist.all_reduce, Handle.wait

    def launching(t, *args, **kwargs):
        log.append(("launch all_reduce", str(t.dtype)))
        return launch(t, *args, **kwargs)

    def waiting(self):
        if self._work is not None:
            log.append(("wait", self._kind))
        return wait(self)

    dist.all_reduce, Handle.wait = launching, waiting
    try:
        step(state, rank_slice(mlp_batch(1, 8), dist.get_rank(), dist.get_world_size()))
    finally:
        dist.all_reduce, Handle.wait = launch, wait
    return log


def test_the_statistics_all_reduce_starts_before_replicated_gradients_are_waited_for(ranks):
    """Replicated gradients are the same on every rank once all-reduced, so each rank takes their norm itself and
    the statistics (loss, finiteness, batch digest) start reducing beside the gradients instead of after them;
    sharded ones (shard_optimizer's reduce-scatter) bring their norm in the statistics, which wait for them."""
    for log in ranks(2).run(_rank_collective_order, "plain"):
        stats = log.index(("launch all_reduce", "torch.float64"))
        grads = log.index(("launch all_reduce", "torch.float32"))
        assert grads < stats < log.index(("wait", "all_reduce")), log
    for log in ranks(2).run(_rank_collective_order, "shard_optimizer"):
        stats = log.index(("launch all_reduce", "torch.float64"))
        assert ("wait", "reduce_scatter") in log[:stats], log
