"""A transform written outside zerofn, as a user would: one module, one Extension, no core edits."""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

import pytest
import torch
from helpers import make_transformer, max_abs_diff, train, transformer_batch
from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

import zerofn as zf
from zerofn.extension import Extension
from zerofn.step import Step, transform


class CountState(NamedTuple):
    updates: torch.Tensor
    inner: object


def counting(inner: zf.optim.GradientTransformation) -> zf.optim.GradientTransformation:
    """An optimizer wrapper that counts updates in its own state and changes no number."""

    def init(params):
        return CountState(torch.zeros((), dtype=torch.int64), inner.init(params))

    def update_in_place(grads, state, params, **extra):
        return CountState(state.updates + 1, zf.optim.update_params(inner, grads, state.inner, params, **extra))

    return zf.optim.in_place(init, update_in_place, "counting")


@transform
def watch(step: Step, /, *, log: list) -> Step:
    """Logs every forward and backward and counts updates."""

    @contextlib.contextmanager
    def around(model, state):
        log.append(("enter", int(state.count), type(model()).__name__))
        model().module.active = True
        try:
            yield
        finally:
            model().module.active = False
            log.append(("exit",))

    def check(s: Step) -> None:
        if s.accumulate_steps > 4:
            raise ValueError("watch: at most 4 micro-steps")

    return step.extend(Extension("watch", id(log), counting, around, check=check))


def _backward_sees_context(model, seen):
    """A backward hook on a layer of the model records whether the around context is active."""
    return model.blocks[0].ln.register_full_backward_hook(lambda m, gi, go: seen.append(model.active))


@pytest.mark.parametrize("order", ["inside", "outside"])
def test_an_outside_transform_composes_and_changes_no_number(order):
    model, apply, loss_fn = make_transformer(extras=False)
    model.active = False
    seen: list = []
    hook = _backward_sees_context(model, seen)
    log: list = []
    base = amp(shard_grads(zf.train_step(loss_fn, zf.optim.adamw(1e-2), accumulate_steps=2)))
    step = (
        watch(base, log=log)
        if order == "outside"
        else amp(shard_grads(watch(zf.train_step(loss_fn, zf.optim.adamw(1e-2), accumulate_steps=2), log=log)))
    )
    assert step.name == "watch(amp(shard_grads(train_step)))"

    state = step.init(apply.params, keep_module=True)  # the reference below starts from the same module
    state, _ = train(step, state, transformer_batch, 3, 8, 1, 0)
    hook.remove()
    ref, _ = train(base, base.init(apply.params), transformer_batch, 3, 8, 1, 0)

    assert max_abs_diff(step.full_params(state), base.full_params(ref)) == 0
    # the wrapper sits outside amp's master weights: it counted every update
    assert int(state.opt_state.updates) == 3 and int(state.count) == 3
    assert type(state.opt_state.inner).__name__ == "MasterState"
    # around every forward and backward (6 micro-steps), the count as the state had it
    assert [e[1] for e in log if e[0] == "enter"] == [0, 0, 1, 1, 2, 2]
    assert {e[2] for e in log if e[0] == "enter"} == {"Functional"}
    assert len([e for e in log if e[0] == "exit"]) == 6
    assert seen == [True] * 6  # backward ran inside the context


def test_an_outside_transform_checks_at_init_and_reapplies_like_the_five():
    _, apply, loss_fn = make_transformer(extras=False)
    log: list = []
    step = watch(zf.train_step(loss_fn, zf.optim.sgd(0.1), accumulate_steps=5), log=log)
    with pytest.raises(ValueError, match="at most 4 micro-steps"):
        step.init(apply.params)
    assert step.extension("watch").options == id(log)


def _rank_watch(world):
    from helpers import make_transformer, train, transformer_batch
    from zerofn.transforms import shard_params

    import zerofn as zf

    model, apply, loss_fn = make_transformer(extras=False)
    model.active = False
    log: list = []
    base = shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
    step = watch(base, log=log)
    state, _ = train(
        step, step.init(apply.params, keep_module=True), transformer_batch, 2, 8, world, zf.collectives.rank()
    )
    ref, _ = train(base, base.init(apply.params), transformer_batch, 2, 8, world, zf.collectives.rank())
    return step.full_params(state), base.full_params(ref), len(log), sorted(state.extra)


def test_an_outside_transform_on_two_ranks_under_shard_params(ranks):
    for got, ref, n_log, keys in ranks(2).run(_rank_watch, 2):
        assert max_abs_diff(got, ref) == 0
        assert n_log == 4  # two steps: enter and exit each
        assert keys == ["shard_params.order"]


def test_reapplying_any_of_the_five_transforms(tmp_path):
    _, _, loss_fn = make_transformer(extras=False)
    base = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
    same = {
        "shard_optimizer": lambda s: shard_optimizer(s),
        "shard_grads": lambda s: shard_grads(s),
        "shard_params": lambda s: shard_params(s, prefetch=2),
        "amp": lambda s: amp(s, torch.float16),
        "offload": lambda s: offload(s, "nvme", path=tmp_path),
    }
    other = {
        "shard_grads": (lambda s: shard_grads(s, bucket_bytes=1 << 20), "shards gradients"),
        "shard_params": (lambda s: shard_params(s, prefetch=0), "shards parameters"),
        "amp": (lambda s: amp(s, torch.bfloat16), "runs in mixed precision"),
        "offload": (lambda s: offload(s, "cpu"), "offloads"),
    }
    for name, t in same.items():
        once = t(base)
        assert t(once) is once, name  # the same options: unchanged
        if name in other:
            change, what = other[name]
            pattern = re.escape(f"{name}: {once.name} already {what}") + f".*Apply {name} once"
            with pytest.raises(ValueError, match=pattern):
                change(once)
    # implied transforms are the same effect
    assert shard_optimizer(shard_grads(base)) == shard_grads(base)
    assert shard_grads(shard_params(base)).name == "shard_params(train_step)"


def test_the_design_page_lists_the_hooks_the_code_has():
    """docs/design.md's Extension block names every field of Extension, and no other; at most 9 hooks (the
    ninth, ``runs``, is a pipeline's: it owns the forward and backward, which no other hook can express)."""
    import dataclasses
    import pathlib
    import re

    root = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "docs" / "design.md").exists())
    page = (root / "docs" / "design.md").read_text()
    block = page[page.index("class Extension:") :].split("\n\n", 1)[0]
    listed = re.findall(r"^    (\w+):", block, re.M) + re.findall(r"^    name: str; (\w+):", block, re.M)
    listed = [n for n in listed if n != "name"] + ["name"]
    fields = [f.name for f in dataclasses.fields(Extension)]
    assert sorted(listed) == sorted(fields), (listed, fields)
    assert len(set(fields) - {"name", "options"}) <= 9
