"""offload(early=True): each bucket's host update starts during backward, as soon as its gradient is on
the host, before the global norm and the skip decision are known; kept when the step's norm does not
clip, restored on a skipped step or an error, redone when it clips. The same numbers as updating after
backward, checked against it bit for bit; and every offloaded step copies gradients to the host bucket by
bucket while backward goes on."""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist
from helpers import make_transformer, max_abs_diff, rank_slice, transformer_batch
from zerofn.transforms import amp, offload, shard_grads, shard_optimizer

import zerofn as zf
from zerofn.reduction import GradSink

PENDING = sys.modules["zerofn.transforms.offload._pending"]  # pending updates and the worker
LR, WD = 3e-3, 0.1
STAGES = {0: lambda s: s, 1: shard_optimizer, 2: shard_grads}


def _step(loss_fn, *, stage=0, use_amp=False, clip=None, extra_opt=None, **kw):
    opt = zf.optim.adamw(LR, weight_decay=WD)
    if clip is not None:
        opt = zf.optim.chain(zf.optim.clip_by_global_norm(clip), opt)
    if extra_opt is not None:
        opt = zf.optim.chain(extra_opt, opt)
    step = STAGES[stage](zf.train_step(loss_fn, opt, bucket_bytes=1024))
    step = offload(step, "cpu", **kw)
    return amp(step, torch.bfloat16) if use_amp else step


def _run(steps=4, world=1, rank=0, loss_wrap=None, **kw):
    _, apply, loss_fn = make_transformer(extras=False)
    step = _step(loss_wrap(loss_fn) if loss_wrap else loss_fn, **kw)
    state = step.init(apply.params)
    metrics = []
    for i in range(steps):
        state, m = step(state, rank_slice(transformer_batch(i, 8), rank, world))
        metrics.append((float(m["loss"]), float(m["grad_norm"]), bool(m["skipped"])))
    inner = [t.clone() for t in zf.tree.tree_leaves(state.opt_state.inner)]
    return step.full_params(state), inner, metrics


def _equal(a, b) -> bool:
    """Parameters, optimizer state and metrics alike (a skipped step's NaN loss equal to itself)."""
    return (
        max_abs_diff(a[0], b[0]) == 0 and all(torch.equal(x, y) for x, y in zip(a[1], b[1])) and str(a[2]) == str(b[2])
    )


class _Spy:
    """Counts the worker's bucket updates (speculative or not) and restores, and makes each step's
    decision wait until every landed bucket has been updated speculatively (so the tests do not depend
    on how fast the worker thread is)."""

    def __init__(self, monkeypatch):
        self.spec = self.plain = self.restored = 0
        update, restore, decide = PENDING.BucketRun.update, PENDING.BucketRun.restore, PENDING.Speculation.decide
        spy = self

        def counted_update(run, k, extra, speculative=False):
            if speculative:
                spy.spec += 1
            else:
                spy.plain += 1
            return update(run, k, extra, speculative)

        def counted_restore(run, k):
            spy.restored += 1
            return restore(run, k)

        def patient_decide(pending, decision):
            deadline = time.monotonic() + 30
            while not pending.failed and len(pending.run.updated) < len(pending.copied):
                assert time.monotonic() < deadline, "the worker never updated the landed buckets"
                time.sleep(0.001)
            return decide(pending, decision)

        monkeypatch.setattr(PENDING.BucketRun, "update", counted_update)
        monkeypatch.setattr(PENDING.BucketRun, "restore", counted_restore)
        monkeypatch.setattr(PENDING.Speculation, "decide", patient_decide)


# ---------------------------------------------------------------- the same numbers


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_early_updates_change_no_number(stage, monkeypatch):
    """With and without amp, unclipped, clipping every step, and clipping never: equal to updating after
    backward, to the bit; kept when the norm does not clip, redone when it does."""
    spy = _Spy(monkeypatch)
    for use_amp in (False, True):
        for clip, kept in ((None, True), (1e-3, False), (100.0, True)):
            spy.spec = spy.plain = spy.restored = 0
            late = _run(stage=stage, use_amp=use_amp, clip=clip, overlap=True)
            updates_after = spy.plain
            spy.spec = spy.plain = spy.restored = 0
            early = _run(stage=stage, use_amp=use_amp, clip=clip, overlap=True, early=True)
            assert _equal(late, early), (use_amp, clip)
            assert spy.spec == updates_after > 0  # every bucket of every step started during backward
            assert (spy.plain, spy.restored) == ((0, 0) if kept else (updates_after, updates_after))


def test_a_skipped_step_restores_what_the_speculation_updated(monkeypatch):
    spy = _Spy(monkeypatch)

    def nan_at_step_two(loss_fn):
        calls = []

        def wrapped(p, b):
            calls.append(1)
            loss = loss_fn(p, b)
            return loss * float("nan") if len(calls) == 2 else loss

        return wrapped

    late = _run(loss_wrap=nan_at_step_two, overlap=False)
    early = _run(loss_wrap=nan_at_step_two, early=True)
    assert [m[2] for m in early[2]] == [False, True, False, False]
    assert _equal(late, early)
    assert spy.restored > 0


def test_an_error_in_backward_leaves_the_state_as_it_was(monkeypatch):
    """Backward raises after some buckets were updated speculatively: the step raises, the state is not
    donated and holds the numbers from before, and the run goes on as if the failed call never was."""
    spy = _Spy(monkeypatch)

    class FailOnce(torch.autograd.Function):
        armed = False

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            if FailOnce.armed:
                FailOnce.armed = False
                deadline = time.monotonic() + 30
                while spy.spec == 0:  # a bucket landed before the embedding is being updated already
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                raise RuntimeError("backward failed")
            return g

    def failing(loss_fn):
        return lambda p, b: loss_fn({**p, "tok.weight": FailOnce.apply(p["tok.weight"])}, b)

    reference = _run(steps=3, loss_wrap=failing, overlap=False)
    _, apply, loss_fn = make_transformer(extras=False)
    step = _step(failing(loss_fn), early=True)
    state = step.init(apply.params)
    state, _ = step(state, transformer_batch(0, 8))
    before = step.full_params(state, master=True)
    FailOnce.armed = True
    with pytest.raises(RuntimeError, match="backward failed"):
        step(state, transformer_batch(1, 8))
    assert spy.restored > 0
    assert max_abs_diff(step.full_params(state, master=True), before) == 0
    for i in (1, 2):
        state, _ = step(state, transformer_batch(i, 8))
    assert max_abs_diff(step.full_params(state), reference[0]) == 0


def test_an_optimizer_that_reads_the_norm_as_a_number_is_updated_once_the_norm_is_known(monkeypatch):
    """A transform written without PendingNorm in mind: its first speculative update fails, is
    restored and redone after backward; the speculation is then off for good. The same numbers."""
    spy = _Spy(monkeypatch)

    def update(updates, state, params=None, **extra):
        factor = 1.0 / (1.0 + float(extra["grad_norm"]))
        return zf.tree.tree_map(lambda u: u * factor, updates), state

    by_norm = zf.optim.GradientTransformation(lambda p: zf.optim.EmptyState(), update)
    late = _run(extra_opt=by_norm, overlap=True)
    updates_after, spy.spec, spy.plain = spy.plain, 0, 0
    early = _run(extra_opt=by_norm, overlap=True, early=True)
    assert _equal(late, early)
    assert spy.spec == 1  # the first bucket of the first step tried, and nothing after it
    assert spy.plain == updates_after


def _early_on_ranks():
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for stage in (0, 1, 2):
        for use_amp in (False, True):
            for clip in (None, 2e-2):
                runs = [
                    _run(world=world, rank=rank, stage=stage, use_amp=use_amp, clip=clip, overlap=True, early=e)
                    for e in (False, True)
                ]
                out[stage, use_amp, clip] = _equal(*runs)
    return out


def test_early_updates_change_no_number_on_two_ranks(ranks):
    """A speculation kept on one rank is kept on every rank: the norm and the skip are global."""
    for r in ranks(2).run(_early_on_ranks):
        assert all(r.values()), r


# ---------------------------------------------------------------- during backward


def test_the_first_bucket_is_updated_while_backward_goes_on(monkeypatch):
    """Backward waits, at the embedding (the last gradient to land), until the worker has updated a bucket
    that landed before it: the update cannot be waiting for backward to end."""
    spy = _Spy(monkeypatch)

    class WaitForWorker(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            deadline = time.monotonic() + 30
            while spy.spec == 0:
                assert time.monotonic() < deadline, "no bucket was updated during backward"
                time.sleep(0.001)
            return g

    _, apply, loss_fn = make_transformer(extras=False)
    step = _step(lambda p, b: loss_fn({**p, "tok.weight": WaitForWorker.apply(p["tok.weight"])}, b), early=True)
    state = step.init(apply.params)
    step(state, transformer_batch(0, 8))
    assert spy.spec > 0


def test_every_offloaded_step_copies_gradients_to_the_host_during_backward(monkeypatch):
    """Without early too: each bucket's gradient goes to the host as soon as it is reduced, before the
    step's sink is finished (DeepSpeed's overlap of the gradient copy with backward)."""
    seen = []
    grad, finish = PENDING.Landing.grad, GradSink.finish

    def spy_grad(pending, key, g):
        seen.append(key)
        return grad(pending, key, g)

    def spy_finish(sink):
        seen.append("finish")
        return finish(sink)

    monkeypatch.setattr(PENDING.Landing, "grad", spy_grad)
    monkeypatch.setattr(GradSink, "finish", spy_finish)
    _, apply, loss_fn = make_transformer(extras=False)
    step = _step(loss_fn, stage=2, overlap=False)
    state = step.init(apply.params)
    n = len(state.spec.layout.buckets)
    step(state, transformer_batch(0, 8))
    assert seen.index("finish") >= n - 2  # all but the last one or two while backward ran
    assert sorted(k for k in seen if k != "finish") == sorted(f"b{i}" for i in range(n))


@pytest.mark.parametrize("stage, use_amp", [(0, False), (0, True), (2, False)])
def test_a_landed_gradient_leaves_the_device_before_the_next_lands(stage, use_amp, monkeypatch):
    """Once a bucket's gradient is on the host nothing holds it on the device: at most the bucket filling
    and the one landing are alive, whatever the stage (stage 0 too), and none at the update."""
    import gc
    import weakref

    alive_at_landing, refs = [], []
    grad, commit = PENDING.Landing.grad, PENDING.Landing.commit

    def spy_grad(pending, key, g):
        gc.collect()
        alive_at_landing.append(sum(r() is not None for r in refs))
        refs.append(weakref.ref(g))
        return grad(pending, key, g)

    def spy_commit(pending, **extra):
        gc.collect()
        assert all(r() is None for r in refs), "a landed gradient is still held at the update"
        return commit(pending, **extra)

    monkeypatch.setattr(PENDING.Landing, "grad", spy_grad)
    monkeypatch.setattr(PENDING.Landing, "commit", spy_commit)
    _, apply, loss_fn = make_transformer(extras=False)
    step = _step(loss_fn, stage=stage, use_amp=use_amp, overlap=False)
    state = step.init(apply.params)
    n = len(state.spec.layout.buckets)
    step(state, transformer_batch(0, 8))
    assert len(refs) == n > 3
    assert max(alive_at_landing) == 0


# ---------------------------------------------------------------- memory and refusals


def test_early_keeps_a_second_copy_of_the_host_optimizer_state_and_says_so():
    """The spare holds the optimizer state (moments; amp's masters too), not the host parameters, which the
    device holds too until the update commits; zf.memory counts it on the host."""
    _, apply, loss_fn = make_transformer(extras=False)
    plain, early = (_step(loss_fn, early=e).init(apply.params) for e in (False, True))
    assert plain.opt_state.spare is None
    held = sum(t.nbytes for t in zf.tree.tree_leaves(early.opt_state.inner) if t.dim())  # not the counters
    spare = sum(t.nbytes for t in zf.tree.tree_leaves(early.opt_state.spare))
    assert spare == held
    grown = zf.memory.state_bytes(early)["by_placement"]["cpu"] - zf.memory.state_bytes(plain)["by_placement"]["cpu"]
    assert grown == spare


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(device="nvme"), 'device="cpu", params=False and delay=0'),
        (dict(params=True), "params=False"),
        (dict(delay=1), "delay=0"),
    ],
)
def test_early_is_refused_where_it_cannot_run(kw, match, tmp_path):
    _, apply, loss_fn = make_transformer(extras=False)
    step = zf.train_step(loss_fn, zf.optim.adamw(LR))
    device = kw.pop("device", "cpu")
    with pytest.raises(ValueError, match=match):
        offload(step, device, path=tmp_path if device == "nvme" else None, early=True, **kw)
