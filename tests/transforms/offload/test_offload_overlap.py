"""offload's host update off the critical path: overlapped with the next forward (the same numbers), and
the optional one-step delayed update (ZeRO-Offload's DPU: gradients one update behind, checked against a
torch.optim loop that delays by hand), each read of the state waiting for what is still being written."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
import torch.distributed as dist
from helpers import make_mlp, make_transformer, max_abs_diff, mlp_batch, rank_slice, transformer_batch
from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

import zerofn as zf
import zerofn.storage as S
from zerofn.state import InFlight

LR, WD = 3e-3, 0.1


def _gate():
    """An optimizer transform that holds every host update until the returned event is set."""
    go = threading.Event()

    def update(updates, state, params=None, **extra):
        assert go.wait(30), "the test never released the update"
        return updates, state

    return zf.optim.GradientTransformation(lambda p: zf.optim.EmptyState(), update), go


def _step(loss_fn, *, opt=None, stage=0, bucket_bytes=1024, **kw):
    step = zf.train_step(loss_fn, opt or zf.optim.adamw(LR, weight_decay=WD), bucket_bytes=bucket_bytes)
    step = {0: lambda s: s, 1: shard_optimizer, 2: shard_grads}[stage](step)
    return offload(step, "cpu", **kw)


def _same(a, b) -> bool:
    la, lb = zf.tree.tree_leaves(a), zf.tree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


def _release_later(go, seconds=0.3):
    threading.Timer(seconds, go.set).start()


def _gated(loss_fn, overlap):
    """A step whose host updates wait at a gate, and the gate's event."""
    gate, go = _gate()
    return _step(loss_fn, opt=zf.optim.chain(gate, zf.optim.adamw(LR, weight_decay=WD)), overlap=overlap), go


def _second_update_held(apply, step, go, hold):
    """Two steps; with ``hold``, the second returns with its update waiting at the gate."""
    state = step.init(apply.params)
    go.set()
    state, _ = step(state, transformer_batch(0, 8))
    _ = state.opt_state  # waits for the first update
    if hold:
        go.clear()
    state, _ = step(state, transformer_batch(1, 8))
    return state


# ---------------------------------------------------------------- overlap: the same numbers, reads wait


def _settle_order(step, state, go):
    """Release the held update shortly, run the next step, and return its state and the buckets it waited
    for through the state's in-flight handles, in order, each while it was still in flight."""
    order, real = [], InFlight.wait_bucket

    def spy(self, i):
        if i in self.params:
            order.append(i)
        real(self, i)

    _release_later(go)
    InFlight.wait_bucket = spy
    try:
        state, _ = step(state, transformer_batch(2, 8))
    finally:
        InFlight.wait_bucket = real
        go.set()
    return state, order


def test_a_step_returns_with_its_update_running_and_the_forward_waits_bucket_by_bucket():
    _, apply, loss_fn = make_transformer()
    step, go = _gated(loss_fn, overlap=True)
    state = _second_update_held(apply, step, go, hold=True)
    layout = state.spec.layout
    assert len(layout.buckets) > 3
    assert state.inflight.buckets() == list(range(len(layout.buckets)))
    state, order = _settle_order(step, state, go)
    where = {s.name: i for i, b in enumerate(layout.buckets) for s in b.slots}
    assert order[0] == where["tok.weight"]  # the embedding's bucket first
    assert len(set(order)) >= 3, order  # one bucket at a time, not all at once


@pytest.mark.parametrize("params_on_host", [False, True])
def test_under_shard_params_each_unit_waits_for_its_own_update(params_on_host):
    """ZeRO-3: the next forward waits for each unit's buckets just before it gathers that unit, the first
    unit first, not for the whole update at the first gather; the same numbers as updating first."""
    out = {}
    for overlap in (False, True):
        _, apply, loss_fn = make_transformer(extras=False)
        gate, go = _gate()
        opt = zf.optim.chain(gate, zf.optim.adamw(LR, weight_decay=WD))
        step = offload(
            shard_params(zf.train_step(loss_fn, opt, bucket_bytes=1024)), "cpu", overlap=overlap, params=params_on_host
        )
        state = _second_update_held(apply, step, go, hold=overlap)
        if overlap:
            assert state.inflight.buckets() == list(range(len(state.spec.layout.buckets)))
        state, order = _settle_order(step, state, go)
        out[overlap] = step.full_params(state)
        if overlap:
            units = state.spec.layout.units
            first = [u.buckets for u in units if u.name == ""][0]  # the root (embeddings) runs first
            assert order[: len(first)] == list(first), (order, first)
            assert len(order) == len(state.spec.layout.buckets)  # each bucket waited for once, on its own
    assert _same(out[True], out[False])


READERS = {  # each the first read after a step whose update is held back
    "state.params": lambda model, step, state: step.full_params(state),
    "state.opt_state": lambda model, step, state: [t.clone() for t in zf.tree.tree_leaves(state.opt_state)],
    "block_until_ready": lambda model, step, state: [
        t.clone() for t in zf.tree.tree_leaves(zf.block_until_ready(state).arriving_opt_state())
    ],
    "pickle": lambda model, step, state: pickle.loads(pickle.dumps(state)).arriving_params(),
    "checkpoint": None,
}


@pytest.mark.parametrize("reader", READERS)
def test_every_read_of_the_state_waits_for_the_update(reader, tmp_path):
    out = {}
    for held in (False, True):
        model, apply, loss_fn = make_transformer(extras=False)
        step, go = _gated(loss_fn, overlap=held)
        state = _second_update_held(apply, step, go, hold=held)
        if held:
            assert state.inflight
            _release_later(go)
        if reader == "checkpoint":
            path = tmp_path / f"ck{held}"
            zf.checkpoint.save(state, path)
            fresh_model, fresh_apply, fresh_loss = make_transformer(seed=1, extras=False)
            fresh = _gated(fresh_loss, overlap=False)[0]
            loaded = zf.checkpoint.load(path, fresh, params=fresh_apply.params)
            out[held] = [fresh.full_params(loaded), [t.clone() for t in zf.tree.tree_leaves(loaded.opt_state)]]
        else:
            out[held] = READERS[reader](model, step, state)
        go.set()
    assert _same(out[True], out[False])


def _compare_overlap_on_ranks():
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage in (0, 1, 2):
        for use_amp in (False, True):
            res = {}
            for overlap in (False, True):
                _, apply, loss_fn = make_transformer(extras=False)
                step = _step(loss_fn, stage=stage, overlap=overlap)
                if use_amp:
                    step = amp(step, torch.bfloat16)
                state = step.init(apply.params)
                for i in range(3):
                    state, _ = step(state, rank_slice(transformer_batch(i, 8), rank, world))
                res[overlap] = step.full_params(state)
            out[stage, use_amp] = max_abs_diff(res[True], res[False])
    return out


def test_overlapped_update_changes_no_number_on_two_ranks(ranks):
    """Stages 0, 1 and 2, with and without amp: a sharded bucket is gathered once its update is done."""
    for r in ranks(2).run(_compare_overlap_on_ranks):
        assert all(d == 0 for d in r.values()), r


def test_a_failed_host_update_is_raised_on_the_next_read():
    _, apply, loss_fn = make_transformer(extras=False)
    calls, buckets = [], []

    def update(updates, state, params=None, **extra):
        calls.append(1)
        if len(calls) > buckets[0]:  # the second step's first bucket
            raise MemoryError("no room on the host")
        return updates, state

    broken = zf.optim.GradientTransformation(lambda p: zf.optim.EmptyState(), update)
    step = _step(loss_fn, opt=zf.optim.chain(broken, zf.optim.adamw(LR)), overlap=True)
    state = step.init(apply.params)
    buckets.append(len(state.spec.layout.buckets))
    state, _ = step(state, transformer_batch(0, 8))
    state, _ = step(state, transformer_batch(1, 8))
    with pytest.raises(RuntimeError, match="host update running alongside the next step failed.*MemoryError"):
        step.full_params(state)


# ---------------------------------------------------------------- the delayed update


def _delayed_reference(steps, batch_fn, n):
    """torch.optim.AdamW with the delay by hand: each gradient is taken on the parameters from before
    the last update, which the forward uses while the host computes the next ones."""
    model, _, _ = make_mlp()
    host, _, _ = make_mlp()
    opt = torch.optim.AdamW(host.parameters(), lr=LR, weight_decay=WD)
    for i in range(steps):
        batch = batch_fn(i, n)
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, h in zip(model.parameters(), host.parameters()):
                p.copy_(h)  # what the host finished last step, for the next forward
        for h, g in zip(host.parameters(), grads):
            h.grad = g
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}, {k: v.detach() for k, v in host.named_parameters()}


def _delayed(steps, world=1, rank=0, stage=0, **kw):
    _, apply, loss_fn = make_mlp()
    step = _step(loss_fn, stage=stage, delay=1, **kw)
    state = step.init(apply.params)
    for i in range(steps):
        state, _ = step(state, rank_slice(mlp_batch(i, 16), rank, world))
    return step, state


def _host_params(step, state):
    layout = state.spec.layout
    out = {}
    for i, t in enumerate(state.opt_state.params.values()):
        out.update(layout.bucket_views(i, S.gathered(t, layout.buckets[i])))
    return out


def test_the_delayed_update_takes_each_gradient_one_update_behind():
    step, state = _delayed(5)
    used, newest = _delayed_reference(5, mlp_batch, 16)
    assert type(state.opt_state).__name__ == "DelayedHostState"
    assert max_abs_diff(step.full_params(state), used) <= 1e-6
    assert max_abs_diff(_host_params(step, state), newest) <= 1e-6
    _, apply, loss_fn = make_mlp()  # the same run without the delay ends elsewhere: the test tells them apart
    undelayed = _step(loss_fn, overlap=False)
    s = undelayed.init(apply.params)
    for i in range(5):
        s, _ = undelayed(s, mlp_batch(i, 16))
    assert max_abs_diff(undelayed.full_params(s), newest) > 1e-4


def test_a_delayed_run_resumes_from_a_checkpoint_exactly(tmp_path):
    step, whole = _delayed(6)
    step, half = _delayed(3)
    zf.checkpoint.save(half, tmp_path / "ck")
    _, apply, loss_fn = make_mlp(seed=1)
    again = _step(loss_fn, delay=1)
    state = zf.checkpoint.load(tmp_path / "ck", again, params=apply.params)
    for i in range(3, 6):
        state, _ = again(state, mlp_batch(i, 16))
    assert max_abs_diff(again.full_params(state), step.full_params(whole)) == 0
    assert max_abs_diff(_host_params(again, state), _host_params(step, whole)) == 0


def test_checkpoints_move_between_delayed_and_undelayed_steps(tmp_path):
    """A step that does not delay takes a delayed run's newest parameters; a delayed step loads an
    undelayed checkpoint with nothing pending (its first update then runs on the saved parameters)."""
    step, delayed = _delayed(3)
    zf.checkpoint.save(delayed, tmp_path / "delayed")
    _, apply, loss_fn = make_mlp(seed=1)
    plain = _step(loss_fn, overlap=False)
    state = zf.checkpoint.load(tmp_path / "delayed", plain, params=apply.params)
    assert max_abs_diff(plain.full_params(state), _host_params(step, delayed)) == 0
    zf.checkpoint.save(state, tmp_path / "plain")
    _, apply, loss_fn = make_mlp(seed=2)
    again = _step(loss_fn, delay=1)
    back = zf.checkpoint.load(tmp_path / "plain", again, params=apply.params)
    assert max_abs_diff(again.full_params(back), plain.full_params(state)) == 0
    assert max_abs_diff(_host_params(again, back), plain.full_params(state)) == 0


def _delayed_on_ranks():
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage in (0, 1, 2):
        step, state = _delayed(4, world, rank, stage)
        out[stage] = (step.full_params(state), _host_params(step, state))
    return out


def test_the_delayed_update_on_two_ranks_matches_the_reference(ranks):
    used, newest = _delayed_reference(4, mlp_batch, 16)
    for r in ranks(2).run(_delayed_on_ranks):
        for stage, (params, host) in r.items():
            assert max_abs_diff(params, used) <= 1e-6, stage
            assert max_abs_diff(host, newest) <= 1e-6, stage


def test_by_default_the_update_overlaps_only_when_the_forward_runs_elsewhere():
    """On the CPU the update and the forward would share the cores: the default updates before the
    step returns there (on the step's own thread); overlap=True runs it on the worker anyway."""
    where = {}
    for overlap in (None, True):
        _, apply, loss_fn = make_mlp()

        def update(updates, state, params=None, _overlap=overlap, **extra):
            where[_overlap] = threading.current_thread().name
            return updates, state

        spy = zf.optim.GradientTransformation(lambda p: zf.optim.EmptyState(), update)
        step = _step(loss_fn, opt=zf.optim.chain(spy, zf.optim.adamw(LR)), overlap=overlap)
        state = step.init(apply.params)
        state, _ = step(state, mlp_batch(0, 8))
        step.full_params(state)
    assert where[None] == threading.main_thread().name
    assert where[True].startswith("zerofn-offload")


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(delay=2), "delay must be 0"),
        (dict(delay=True), "delay must be 0"),
        (dict(device="nvme", delay=1), "delay=1 runs the host update alongside"),
        (dict(delay=1, params=True), "no room for"),
    ],
)
def test_bad_delays_are_refused(kw, match, tmp_path):
    _, apply, loss_fn = make_mlp()
    step = zf.train_step(loss_fn, zf.optim.adamw(LR))
    device = kw.pop("device", "cpu")
    with pytest.raises(ValueError, match=match):
        offload(step, device, path=tmp_path if device == "nvme" else None, **kw)
