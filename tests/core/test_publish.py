"""Publish off the critical path (stages 1 and 2): a step returns with its parameter all-gathers in
flight, as handles the state carries (``state.inflight``); the next forward waits for each bucket when it
first reads it, and every other read of the parameters waits for all of them first, so no reader ever
sees a bucket half gathered. The module the state adopted holds placeholders then (it would read buffers
in flight), and no module's ``_parameters`` stays replaced after a step."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from helpers import make_transformer, max_abs_diff, rank_slice, transformer_batch
from zerofn.transforms import shard_grads, shard_optimizer

import zerofn as zf
from zerofn.state import InFlight

BATCH = 8


def _step(stage, loss_fn, defer=True, **kw):
    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2, weight_decay=0.1), bucket_bytes=1024, **kw)
    step = (shard_optimizer if stage == 1 else shard_grads)(step)
    return step.replace(storage=step.storage.replace(defer_publish=defer))


def _batch(i):
    world, rank = dist.get_world_size(), dist.get_rank()
    return rank_slice(transformer_batch(i, BATCH), rank, world)


def _waits_in_forward_order():
    """The second step waits for buckets one by one as its forward reads them, the embedding's first."""
    _, apply, loss_fn = make_transformer()
    step = _step(1, loss_fn)
    state = step.init(apply.params)
    state, _ = step(state, _batch(0))
    left = state.inflight.buckets()  # reading state.params would wait for them
    order, real = [], InFlight.wait_bucket

    def spy(self, i):
        if i in self.params:
            order.append(i)
        real(self, i)

    InFlight.wait_bucket = spy
    try:
        state, _ = step(state, _batch(1))
    finally:
        InFlight.wait_bucket = real
    layout = state.spec.layout
    where = {s.name: i for i, b in enumerate(layout.buckets) for s in b.slots}
    return dict(left=left, buckets=len(layout.buckets), order=order, first=where["tok.weight"])


READERS = {  # each the first read after the step, so that it is the one that must wait
    "state.params": lambda model, step, state: [t.clone() for t in state.params],
    "full_params": lambda model, step, state: step.full_params(state),
    "apply": lambda model, step, state: step.apply(state, _batch(5)),
    "tree_map": lambda model, step, state: zf.tree.tree_map(torch.clone, state).arriving_params(),
    "pickle": lambda model, step, state: pickle.loads(pickle.dumps(state)).arriving_params(),
    "deepcopy": lambda model, step, state: copy.deepcopy(state).arriving_params(),
    "block_until_ready": lambda model, step, state: zf.block_until_ready(state).arriving_params(),
}


def _readers():
    """Each way of reading the parameters after a step sees them whole, equal to a step that waits."""
    out = {}
    for defer in (True, False):
        for name, read in READERS.items():
            model, apply, loss_fn = make_transformer()
            step = _step(1, loss_fn, defer)
            state = step.init(apply.params)
            for i in range(2):
                state, _ = step(state, _batch(i))
            out[defer, name] = (read(model, step, state), state.inflight.buckets())
    return out


def _module_after_a_deferred_publish():
    """The adopted module holds placeholders where the step publishes late (calling it raises, pointing
    to step.apply), and views of the state's buffers where it does not; no _parameters stays replaced."""
    from zerofn.functional import _ReadWaits

    out = {}
    for defer in (True, False):
        model, apply, loss_fn = make_transformer()
        step = _step(1, loss_fn, defer)
        state = step.init(apply.params)
        state, _ = step(state, _batch(0))
        out[defer] = dict(
            meta=model.blocks[1].fc.weight.is_meta,
            watched=any(isinstance(m._parameters, _ReadWaits) for m in model.modules()),
        )
        try:
            model(_batch(5))
            out[defer]["call"] = None
        except RuntimeError as e:
            out[defer]["call"] = str(e)
    return out


def _direct_reads(stage):
    """loss_fn reading the params dict itself (a penalty), and a nested params tree, as with a waiting step."""
    out = {}
    for defer in (True, False):
        _, apply, loss_fn = make_transformer()

        def penalised(params, batch):
            return loss_fn(params, batch) + 1e-2 * sum(p.float().square().sum() for p in params.values())  # noqa: B023

        step = _step(stage, penalised, defer)
        state = step.init(apply.params)
        for i in range(3):
            state, _ = step(state, _batch(i))
        torch.manual_seed(0)
        w = {"enc": {"a": torch.randn(40, 8), "b": torch.randn(8)}}
        w["enc"]["a"].requires_grad_(True)
        w["enc"]["b"].requires_grad_(True)
        nested = _step(stage, lambda p, x: ((x @ p["enc"]["a"] + p["enc"]["b"]) ** 2).mean(), defer)
        nested_state = nested.init(w)
        for i in range(3):
            nested_state, _ = nested(nested_state, torch.randn(4, 40, generator=torch.Generator().manual_seed(i)))
        out[defer] = (step.full_params(state), nested.full_params(nested_state))
    return out


def _not_donated():
    """A step that copies its input state first waits for the input's gathers before copying it."""
    _, apply, loss_fn = make_transformer()
    step = _step(1, loss_fn, donate=False)
    s1, _ = step(step.init(apply.params), _batch(0))
    s2, _ = step(s1, _batch(1))
    again, _ = step(s1, _batch(1))  # s1 is intact: the same update twice
    return max_abs_diff(step.full_params(s2), step.full_params(again))


def _cases():
    return dict(
        order=_waits_in_forward_order(),
        readers=_readers(),
        direct={s: _direct_reads(s) for s in (1, 2)},
        not_donated=_not_donated(),
        module=_module_after_a_deferred_publish(),
    )


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(_cases)


def test_a_step_returns_with_its_gathers_in_flight_and_the_next_forward_waits_bucket_by_bucket(results):
    for r in results:
        o = r["order"]
        assert o["buckets"] > 3 and len(o["left"]) == o["buckets"], o  # every bucket was still in flight
        assert o["order"][0] == o["first"], o  # the embedding, which the forward reads first, is waited for first
        assert len(set(o["order"])) >= 3, o  # one bucket at a time, not all at once


@pytest.mark.parametrize("reader", list(READERS))
def test_every_read_outside_the_step_sees_whole_parameters(results, reader):
    for r in results:
        (lazy, left), (waited, _) = r["readers"][True, reader], r["readers"][False, reader]
        assert left == []  # the read waited for every gather
        if isinstance(lazy, dict):
            assert max_abs_diff(lazy, waited) == 0.0, reader
        else:
            lazy, waited = (lazy, waited) if isinstance(lazy, (list, tuple)) else ([lazy], [waited])
            assert all(torch.equal(a, b) for a, b in zip(lazy, waited, strict=True)), reader


@pytest.mark.parametrize("stage", [1, 2])
def test_reads_of_the_params_tree_in_loss_fn_wait(results, stage):
    for r in results:
        (params, nested), (params_w, nested_w) = r["direct"][stage][True], r["direct"][stage][False]
        assert max_abs_diff(params, params_w) == 0.0
        assert max_abs_diff(nested["enc"], nested_w["enc"]) == 0.0


def test_a_copying_step_waits_before_it_copies(results):
    assert all(r["not_donated"] == 0.0 for r in results)


def test_the_module_holds_placeholders_where_the_step_publishes_late(results):
    for r in results:
        late, now = r["module"][True], r["module"][False]
        assert late["meta"] and "step.apply" in late["call"], late
        assert not now["meta"] and now["call"] is None, now  # the module reads the state's own buffers
        assert not late["watched"] and not now["watched"]


def test_nothing_is_in_flight_where_nothing_is_published():
    """World size 1 publishes nothing: the state has no handles, the module shares the state's buffers."""
    model, apply, loss_fn = make_transformer()
    step = _step(1, loss_fn)
    state = step.init(apply.params)
    state, _ = step(state, transformer_batch(0, BATCH))
    assert state.inflight.buckets() == [] and not state.inflight
    assert not model.blocks[1].fc.weight.is_meta
