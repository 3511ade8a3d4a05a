"""The state owns the parameters: no hidden copies beside it, and the module says what to use instead.

Also: a model's own activation checkpointing recomputes with the step's
parameters, and a loss_fn that ignores its params is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import compositions
from torch import nn
from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

import zerofn as zf

COMPOSITIONS = {
    **compositions(),
    "amp_shard_optimizer": lambda s: amp(shard_optimizer(s)),
    "amp_shard_grads": lambda s: amp(shard_grads(s)),
    "amp_shard_params": lambda s: amp(shard_params(s)),
    "amp_offload_shard_params": lambda s: amp(offload(shard_params(s), "cpu", params=True)),
}


class Blocks(nn.Module):
    def __init__(self, width=48, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _build(name, donate):
    torch.manual_seed(0)
    model = Blocks()
    apply = zf.functional(model)

    def loss_fn(params, x):
        return apply(params, x).square().mean()

    step = COMPOSITIONS[name](zf.train_step(loss_fn, zf.optim.adamw(1e-3), donate=donate))
    return model, step, step.init(apply.params)


def _rank_held_after_init(names, donate):
    """Per composition: bytes alive after building the model and the state, against the state's."""
    out = {}
    for name in names:
        with zf.memory.track() as t:
            model, step, state = _build(name, donate)
        largest = max(p.numel() * 4 for p in Blocks().parameters())
        after_init = t.current
        del model  # the user lets go of the model: nothing else should go with it
        out[name] = (after_init, t.current, zf.memory.state_bytes(state)["total"], largest)
        del step, state
    return out


@pytest.mark.parametrize("donate", [True, False])
def test_live_bytes_after_init_are_the_state_for_every_composition(ranks, donate):
    for per_rank in ranks(2).run(_rank_held_after_init, list(COMPOSITIONS), donate):
        for name, (after_init, after_del, state, largest) in per_rank.items():
            # the state and a few scalars (count, micro, loss scale): no copy of the parameters beside it
            assert state <= after_init <= state + largest, (name, after_init, state, largest)
            assert after_del == after_init, name  # the model held nothing else


def test_the_module_reads_the_state_or_says_what_to_use():
    torch.manual_seed(0)
    model = Blocks()
    apply = zf.functional(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-2))
    state = step.init(apply.params)
    x = torch.randn(5, 48)
    for _ in range(3):
        state, _ = step(state, x)
    # a donating full-precision step: the module's parameters are views of the state's buffers
    torch.testing.assert_close(model(x), step.apply(state, x), rtol=0, atol=0)
    torch.testing.assert_close(model.state_dict()["head.weight"], step.full_params(state)["head.weight"])

    for make in (lambda s: amp(s), lambda s: shard_params(s), lambda s: s.replace(donate=False)):
        torch.manual_seed(0)
        model = Blocks()
        apply = zf.functional(model)
        step = make(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-2)))  # noqa: B023 (used in this iteration; the closure is how the step finds apply)
        state = step.init(apply.params)
        state, _ = step(state, x)
        with pytest.raises(RuntimeError, match=r"(?s)held by a zerofn TrainState.*step.apply\(state"):
            model(x)
        with pytest.raises(RuntimeError, match="keep_module=True"):
            model.state_dict()
        assert step.apply(state, x).shape == (5, 1)


def test_a_second_init_from_taken_parameters_is_refused():
    torch.manual_seed(0)
    model = Blocks()
    apply = zf.functional(model)
    step = amp(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-2)))
    state = step.init(apply.params)
    for other in (step, shard_params(step)):  # shard_params would otherwise re-initialise the placeholders
        with pytest.raises(
            ValueError, match=r"(?s)init\(apply.params\): the module's parameters are held.*full_params"
        ):
            other.init(apply.params)
    again = shard_params(step).init(step.full_params(state, requires_grad=True))  # the way to build another state
    assert again.spec.layout.trainable_numel == state.spec.layout.trainable_numel > 0  # trains the same ones
    zf.testing.assert_trees_all_close(shard_params(step).full_params(again), step.full_params(state))


def test_keep_module_leaves_the_module_alone():
    torch.manual_seed(0)
    model = Blocks()
    before = copy.deepcopy(model.state_dict())
    apply = zf.functional(model)
    step = shard_params(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-2)))
    state = step.init(apply.params, keep_module=True)
    state, _ = step(state, torch.randn(5, 48))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # a second state from the same module, which still holds its parameters
    assert torch.equal(step.full_params(step.init(apply.params))["head.bias"], before["head.bias"])


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_a_loss_that_ignores_its_params_is_refused(name):
    torch.manual_seed(0)
    model = Blocks()
    apply = zf.functional(model)

    def loss_fn(params, x):  # closes over the module's parameters instead of using its argument
        return apply(apply.params, x).square().mean()

    step = COMPOSITIONS[name](zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
    state = step.init(apply.params)
    before = step.full_params(state)
    with pytest.raises((ValueError, RuntimeError), match="the step passe"):
        step(state, torch.randn(5, 48))
    after = step.full_params(state)  # the state was not donated: still readable, and unchanged
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------- checkpointing inside the model


def _llama(reentrant: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model.train()


def _rank_checkpointed_llama(reentrant: bool, sharded: bool, steps: int = 3):
    import warnings

    warnings.filterwarnings("ignore")  # torch's reentrant-checkpoint advice
    model = _llama(reentrant)
    reference = copy.deepcopy(model)
    apply = zf.functional(model)

    def loss_fn(params, ids):
        return apply(params, input_ids=ids, labels=ids).loss

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2, weight_decay=0.1))
    step = shard_params(step) if sharded else step
    state = step.init(apply.params)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(64, (2 * world, 16), generator=g)
        state, _ = step(state, ids[2 * rank : 2 * rank + 2])
        opt.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()  # equal-sized slices: the mean of the means
        opt.step()
    full = step.full_params(state)
    return max((full[k] - v).abs().max().item() for k, v in reference.named_parameters() if k in full)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_models_own_checkpointing_trains_like_torch(reentrant):
    assert _rank_checkpointed_llama(reentrant, sharded=False) < 1e-5


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_models_own_checkpointing_under_shard_params_on_two_ranks(ranks, reentrant):
    assert max(ranks(2).run(_rank_checkpointed_llama, reentrant, True)) < 1e-5
