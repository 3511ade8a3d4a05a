"""zf.functional: a pure apply over any nn.Module."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_transformer

import zerofn as zf


def test_params_are_the_modules_own_keyed_like_named_parameters():
    model, apply, _ = make_transformer()
    assert list(apply.params) == [n for n, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        assert apply.params[name] is p  # no copy: a second copy would double the parameter bytes
    assert apply.tied == {"head.weight": "tok.weight"}


def test_adopt_shares_or_replaces_every_place_of_a_parameter():
    model, apply, _ = make_transformer()
    idx = torch.randint(23, (3, 8))
    expected = model(idx)
    state = {k: v.detach().clone() for k, v in apply.params.items()}
    apply.adopt({"tok.weight": state["tok.weight"], "pos": state["pos"]})
    # shared: the module reads the given storage, in both places of the tied weight
    assert model.tok.weight.data_ptr() == model.head.weight.data_ptr() == state["tok.weight"].data_ptr()
    assert model.pos.data_ptr() == state["pos"].data_ptr()
    # the rest: meta placeholders, in apply.params too, so nothing keeps the old storage alive
    assert model.blocks[0].qkv.weight.device.type == "meta" and apply.params["blocks.0.qkv.weight"].is_meta
    with pytest.raises(RuntimeError, match="calling the module: the module's parameters are held"):
        model(idx)
    with pytest.raises(RuntimeError, match="state_dict"):
        model.state_dict()
    # a call with real params still works: the placeholders are swapped out for it
    torch.testing.assert_close(apply(state, idx), expected, rtol=0, atol=0)


def test_apply_equals_module_forward_and_uses_given_params():
    model, apply, _ = make_transformer()
    idx = torch.randint(23, (3, 8))
    torch.testing.assert_close(apply(apply.params, idx), model(idx), rtol=0, atol=0)
    doubled = {k: v * 2 for k, v in apply.params.items()}
    assert not torch.allclose(apply(doubled, idx), model(idx))
    # the tied head follows the embedding it shares: doubled has no head.weight, so apply must use the
    # doubled tok.weight for it. The reference is a copy of the module with every parameter doubled (the copy
    # keeps the tie); the module apply wraps keeps its own values, so reading its head would not pass.
    reference = copy.deepcopy(model)
    assert reference.head.weight is reference.tok.weight
    with torch.no_grad():
        for p in reference.parameters():  # each distinct parameter once: the tied one is doubled once
            p.mul_(2)
    torch.testing.assert_close(apply(doubled, idx), reference(idx))
    torch.testing.assert_close(apply(apply.params, idx), model(idx), rtol=0, atol=0)  # the module is untouched


def test_buffers_come_from_the_module():
    model = torch.nn.BatchNorm1d(3)
    apply = zf.functional(model.eval())
    model.running_mean.fill_(1.0)
    x = torch.ones(2, 3)
    torch.testing.assert_close(apply(apply.params, x), torch.zeros(2, 3) * 1.0, atol=1e-3, rtol=0)


def test_not_a_module():
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got function"):
        zf.functional(lambda x: x)


def test_a_module_used_twice_keeps_its_own_parameters():
    """torch.func.functional_call loses them (it saves the swapped tensor the second time)."""
    lin = torch.nn.Linear(2, 2)
    model = torch.nn.Sequential(lin, torch.nn.Tanh(), lin)
    apply = zf.functional(model)
    assert list(apply.params) == ["0.weight", "0.bias"]
    original = lin.weight
    zeros = {k: torch.zeros_like(v) for k, v in apply.params.items()}
    torch.testing.assert_close(apply(zeros, torch.ones(1, 2)), torch.zeros(1, 2))
    assert lin.weight is original
    torch.testing.assert_close(apply(apply.params, torch.ones(1, 2)), model(torch.ones(1, 2)))
    with pytest.raises(KeyError, match="params lacks"):
        apply({}, torch.ones(1, 2))
