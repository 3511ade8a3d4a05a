"""Tests for zerofn.memory.track: live and peak bytes of storages made inside a block."""

from __future__ import annotations

import gc
import os
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerofn import memory

KiB = 1 << 10
MiB = 1 << 20


def f32(nbytes: int) -> torch.Tensor:
    """A float32 tensor of exactly ``nbytes`` bytes."""
    return torch.empty(nbytes // 4, dtype=torch.float32)


def grad_bytes(model: torch.nn.Module) -> int:
    return sum(p.grad.untyped_storage().nbytes() for p in model.parameters())


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


# -- basics -------------------------------------------------------------------


def test_one_mib_counted_then_freed():
    with memory.track() as t:
        x = f32(MiB)
        assert t.current == MiB
        del x
        assert t.current == 0
    assert t.peak >= MiB
    assert t.peak == MiB
    assert t.current == 0
    assert t.allocated == MiB
    assert t.peak_by_device == {"cpu": MiB}


def test_known_peak_pattern_is_exact():
    with memory.track() as t:
        a = f32(4 * MiB)
        b = f32(4 * MiB)
        del a
        c = f32(2 * MiB)
    assert t.peak == 8 * MiB
    assert t.current == 6 * MiB
    assert t.allocated == 10 * MiB
    del b, c
    assert t.current == 0  # still valid after exit


def test_views_and_inplace_ops_add_nothing():
    with memory.track() as t:
        x = f32(MiB)
        v1 = x.view(4, -1)
        v2 = x[10:]
        v3 = v1.t()
        x.add_(1.0)
        v2.mul_(2.0)
        x.zero_()
        torch.add(x, 1.0, out=x)
        assert t.current == MiB
        del x, v1, v2  # v3 still holds the whole storage
        assert t.current == MiB
        del v3
        assert t.current == 0
    assert t.peak == MiB


def test_temporary_shows_in_peak_not_current():
    with memory.track() as t:
        x = f32(MiB)
        y = (x * 2).sum()  # x * 2 is a 1 MiB temporary that dies in the line
    assert t.peak == 2 * MiB + 4
    assert t.current == MiB + 4
    del x, y


def test_factory_functions_are_counted():
    with memory.track() as t:
        a = torch.tensor([1.0, 2.0, 3.0, 4.0])  # made outside dispatch, then lifted
        b = torch.arange(8, dtype=torch.int64)
        c = torch.zeros(2, 2, dtype=torch.float64)
        d = a.to(torch.float64)
    assert t.current == 16 + 64 + 32 + 32
    del a, b, c, d


def test_mark_records_current():
    with memory.track() as t:
        x = f32(KiB)
        assert t.mark("x") == KiB
        y = f32(2 * KiB)
        t.mark("x+y")
        del x
        t.mark("y")
    assert t.marks == {"x": KiB, "x+y": 3 * KiB, "y": 2 * KiB}
    del y


# -- backward -----------------------------------------------------------------


def test_backward_gradients_are_counted():
    model = mlp()
    x = torch.randn(32, 64)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with memory.track() as t:
        loss = model(x).square().mean()
        t.mark("forward")
        loss.backward()
        t.mark("backward")
        assert grad_bytes(model) == params
        loss_bytes = loss.untyped_storage().nbytes()
        model.zero_grad(set_to_none=True)
        del loss
    assert t.marks["forward"] >= 32 * 128 * 4  # activations saved for backward: at least the hidden layer's
    assert t.marks["backward"] == params + loss_bytes  # the gradients, made by the engine (activations freed)
    assert t.peak > t.marks["backward"]  # during backward, gradients and saved activations were alive at once
    assert t.current == 0


def test_backward_intermediate_grads_raise_the_peak():
    # A chain of wide elementwise ops: backward must hold intermediate
    # gradients of the activation size on top of the leaf's gradient.
    w = torch.randn(256, 1024, requires_grad=True)  # 1 MiB, made outside
    with memory.track() as t:
        loss = (w.sin() * 3).cos().sum()
        t.mark("forward")
        loss.backward()
    assert t.current >= MiB  # w.grad
    assert t.peak >= t.marks["forward"] + MiB
    w.grad = None
    del loss
    assert t.current == 0


def test_tensor_made_in_post_accumulate_grad_hook_is_counted():
    model = mlp()
    made = []

    def hook(p):
        made.append(torch.empty(MiB // 4))

    handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]
    with memory.track() as t:
        model(torch.randn(4, 64)).sum().backward()
        n = len(made)
    for h in handles:
        h.remove()
    assert n == 4
    assert t.current == grad_bytes(model) + 4 * MiB
    made.clear()
    model.zero_grad(set_to_none=True)
    assert t.current == 0


def test_gradient_accumulation_in_place_adds_nothing():
    model = mlp()
    x = torch.randn(4, 64)
    model(x).sum().backward()  # .grad exists before the block
    with memory.track() as t:
        model(x).sum().backward()  # accumulates into the existing .grad
    assert t.current == 0
    assert t.peak > 0  # activations and the incoming gradients


# -- what is not counted, and add() ----------------------------------------------


def test_tensors_made_before_entering_are_not_counted():
    a = f32(MiB)
    with memory.track() as t:
        v = a.view(-1)[1:]
        a.mul_(2.0)
        del a, v
    assert t.peak == 0
    assert t.current == 0
    assert t.allocated == 0


def test_add_counts_an_outside_tensor_until_it_dies():
    a = f32(MiB)
    with memory.track() as t:
        assert t.add(a) == MiB
        assert t.add(a.view(-1)) == 0  # same storage, counted once
        assert t.current == MiB
    del a
    assert t.current == 0
    assert t.peak == MiB
    with pytest.raises(TypeError, match=r"Tracker.add\(tensor\): expected a torch.Tensor"):
        t.add([1.0])


def test_growth_of_an_outside_storage_counts_only_the_growth():
    a = torch.empty(0)
    with memory.track() as t:
        torch.add(f32(KiB), 1.0, out=a)  # out= resizes a from 0 to 1 KiB
        assert t.current == KiB
        a.resize_(512)  # 2 KiB
        assert t.current == 2 * KiB
    del a
    assert t.current == 0


def test_storage_resize_frees_and_regrows():
    with memory.track() as t:
        x = f32(MiB)
        x.untyped_storage().resize_(0)  # FSDP-style free, bypasses dispatch
        assert t.current == 0
        x.untyped_storage().resize_(MiB)
        assert t.current == MiB
    assert t.peak == MiB
    assert "resize_" not in torch.UntypedStorage.__dict__  # wrapper removed
    del x
    assert t.current == 0


# -- nesting and reuse ------------------------------------------------------------


def test_nested_trackers_both_count():
    with memory.track() as outer:
        a = f32(MiB)
        with memory.track() as inner:
            b = f32(2 * MiB)
            del a
            c = f32(MiB)
        d = f32(4 * MiB)
    assert inner.peak == 3 * MiB
    assert inner.current == 3 * MiB
    assert outer.peak == 7 * MiB  # b + c + d
    assert outer.current == 7 * MiB
    del b
    assert inner.current == MiB
    assert outer.current == 5 * MiB
    del c, d
    assert inner.current == 0
    assert outer.current == 0


def test_tracker_cannot_be_entered_twice():
    t = memory.track()
    with t:
        pass
    with pytest.raises(RuntimeError, match="already entered once"):
        with t:
            pass


def test_tracker_that_dies_first_leaves_no_trace(monkeypatch):
    # an exception in a weakref callback is not raised but handed to sys.unraisablehook: catch it there
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with memory.track() as t:
        x = f32(KiB)
    tracker = weakref.ref(t)
    del t
    gc.collect()
    assert tracker() is None  # the tracker really died before the storage it counted
    del x  # the weakref callback must not fail on a collected tracker
    gc.collect()
    assert not unraisable, [(u.exc_type, u.exc_value, u.object) for u in unraisable]


# -- collectives ------------------------------------------------------------------


def _collectives_worker(rank: int, world_size: int, init_file: str) -> None:
    import torch.distributed._functional_collectives as fcol

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        x = torch.full((256,), float(rank + 1))  # 1 KiB, made outside
        with memory.track() as t:
            y = x.clone()  # 1 KiB
            dist.all_reduce(y)  # in place into y: nothing new
            t.mark("after all_reduce")
            out = torch.empty(world_size * 256)  # 2 KiB
            dist.all_gather_into_tensor(out, x)
            z = fcol.wait_tensor(fcol.all_reduce(x, "sum", dist.group.WORLD))  # 1 KiB
        total = sum(range(1, world_size + 1))
        assert torch.equal(y, torch.full((256,), float(total)))
        assert torch.equal(z, y)
        assert torch.equal(out, torch.arange(1.0, world_size + 1).repeat_interleave(256))
        assert t.marks["after all_reduce"] == KiB
        assert t.current == 4 * KiB  # y + out + z; the functional output is counted
        del y, out, z
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown, in which gloo's threads may still let go of the last
    # collective's tensors and abort the process ("terminate called without an active exception"), one run
    # in three on this test's functional all-reduce. A failure above still raises to mp.spawn.
    os._exit(0)


def test_gloo_collectives_work_inside(tmp_path):
    mp.spawn(_collectives_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)
