"""A state_dict-shaped export that a fresh module loads with strict=True, and amp's fp32 masters."""

from __future__ import annotations

import copy

import torch
from helpers import compositions
from zerofn.transforms import amp

import zerofn as zf


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()  # no dropout: outputs compare exactly


def _rank_export(names):
    import transformers

    transformers.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(zf.collectives.rank())
    x = torch.randint(64, (1, 8), generator=torch.Generator().manual_seed(7))
    out = {}
    for name in names:
        model = _gpt2()
        fresh = copy.deepcopy(model)
        apply = zf.functional(model)
        loss_fn = lambda p, b: apply(p, input_ids=b, labels=b).loss  # noqa: B023, E731 - used in this iteration
        step = compositions()[name](zf.train_step(loss_fn, zf.optim.adamw(1e-2)))
        state = step.init(apply.params)
        for _ in range(2):
            state, _ = step(state, torch.randint(64, (2, 16), generator=g))
        sd = step.state_dict(state)
        assert sd.keys() == fresh.state_dict().keys()  # tied lm_head.weight included
        fresh.load_state_dict(sd, strict=True)
        assert fresh.lm_head.weight is fresh.transformer.wte.weight  # loading kept the tie
        out[name] = (fresh(x).logits - step.apply(state, x).logits).abs().max().item()
        # amp: the fp32 masters round to the bf16 parameters the state holds
        model = _gpt2()
        apply = zf.functional(model)
        loss_fn = lambda p, b: apply(p, input_ids=b, labels=b).loss  # noqa: B023, E731 - used in this iteration
        amp_step = amp(compositions()[name](zf.train_step(loss_fn, zf.optim.adamw(1e-2))))
        state = amp_step.init(apply.params)
        for _ in range(2):
            state, _ = amp_step(state, torch.randint(64, (2, 16), generator=g))
        masters, params = amp_step.full_params(state, master=True), amp_step.full_params(state, local=True)
        full = amp_step.full_params(state)  # the model's fp32: the masters themselves
        assert all(full[k].dtype == torch.float32 and torch.equal(full[k], masters[k]) for k in masters)
        assert all(m.dtype == torch.float32 for m in masters.values())
        assert all(torch.equal(masters[k].to(params[k].dtype), params[k]) for k in params)
        assert any(not torch.equal(masters[k], params[k].float()) for k in params)  # more bits than bf16
        fresh.load_state_dict(amp_step.state_dict(state, master=True), strict=True)
    return out


def test_state_dict_loads_strictly_and_equals_apply(ranks):
    names = ["plain", "shard_optimizer", "shard_params", "offload"]
    for per_rank in ranks(2).run(_rank_export, names):
        assert per_rank == {n: 0.0 for n in names}, per_rank


def test_state_dict_carries_the_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh = copy.deepcopy(model)
    apply = zf.functional(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(0.1))
    state, _ = step(step.init(apply.params), torch.randn(8, 3))
    fresh.load_state_dict(step.state_dict(state), strict=True)
    assert torch.equal(fresh[1].running_mean, state.buffers["1.running_mean"])
    assert int(fresh[1].num_batches_tracked) == 1
