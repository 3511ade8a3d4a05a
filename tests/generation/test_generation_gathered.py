"""zf.generate(..., gather_once=True) and shard_params' gathered(step, state): on 2 gloo ranks under shard_params
(alone, with quantize and LoRA, with the shards offloaded to host memory) the tokens equal those of the per-call
path, which gathers every unit for every token, while the whole generation moves one gather of the model; a
max_bytes budget the model exceeds is refused with its bytes, and without shard_params nothing changes."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from torch import nn
from zerofn.transforms import offload, quantize, shard_params
from zerofn.transforms.shard_params import gathered

import zerofn as zf

pytest.importorskip("transformers")
pytest.importorskip("peft")

NEW = 8
PROMPTS = torch.tensor([[0, 0, 5, 17, 33, 2], [7, 41, 9, 60, 12, 3]])  # left-padded (pad 0, masked out)
MASK = (PROMPTS != 0).long()


def _llama(lora: bool = False, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(seed, num_hidden_layers=3, max_position_embeddings=64)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero; values make the adapters count
                nn.init.normal_(p, std=0.02)
    return model.eval()


COMPOSITIONS = {
    "shard_params": lambda s: shard_params(s),
    "quantize_lora": lambda s: quantize(shard_params(s), "nf4"),
    "offload_params": lambda s: offload(shard_params(s), params=True),
}


def _step(model, compose):
    apply = zf.functional(model)

    def loss_fn(params, ids):
        return apply(params, input_ids=ids, labels=ids).loss

    step = compose(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    return step, step.init(apply.params)


def _model_bytes(state) -> int:
    """What gathering every unit takes on a rank: each unit's flat buffers, padded, as the state holds them."""
    layout = state.spec.layout
    return sum(b.nbytes for b in (*layout.buckets, *layout.frozen_buckets))


def _generate(step, state, gather_once: bool) -> tuple[torch.Tensor, zf.collectives.Counter]:
    with zf.collectives.counting() as c:
        out = zf.generate(
            step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, pad_token_id=0, gather_once=gather_once
        )
    return out, c


def _compare(name: str) -> dict:
    step, state = _step(_llama(lora=name == "quantize_lora"), COMPOSITIONS[name])
    per_call, c_call = _generate(step, state, gather_once=False)
    once, c_once = _generate(step, state, gather_once=True)
    return {
        "per_call": per_call,
        "once": once,
        "call_bytes": c_call.bytes,
        "call_gathers": c_call.calls.get("all_gather", 0),
        "once_bytes": c_once.bytes,
        "once_calls": dict(c_once.calls),
        "model": _model_bytes(state),
        "buckets": len(state.spec.layout.buckets) + len(state.spec.layout.frozen_buckets),
        "reference": _hf() if name == "shard_params" else None,
    }


def _hf() -> torch.Tensor:
    with torch.no_grad():
        return _llama().generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def test_gather_once_generates_the_same_tokens_moving_one_gather_of_the_model(ranks):
    for name in COMPOSITIONS:
        out = ranks(2).run(_compare, name)
        for rank, r in enumerate(out):
            assert torch.equal(r["once"], r["per_call"]), (name, rank, r["once"], r["per_call"])
            if r["reference"] is not None:
                assert torch.equal(r["once"], r["reference"]), (name, rank)
            # one all-gather of each unit's buffers, exactly the model's bytes, and nothing else
            assert r["once_calls"] == {"all_gather": r["buckets"]}, (name, r["once_calls"])
            assert r["once_bytes"] == r["model"], (name, r["once_bytes"], r["model"])
            # the per-call path gathers the whole model for every one of the NEW calls (and agrees on each unit)
            assert r["call_gathers"] == NEW * r["buckets"], (name, r["call_gathers"])
            assert r["call_bytes"] > NEW * r["model"], (name, r["call_bytes"], r["model"])
        assert torch.equal(out[0]["once"], out[1]["once"])


def _block() -> dict:
    step, state = _step(_llama(), COMPOSITIONS["shard_params"])
    other = _step(_llama(seed=1), COMPOSITIONS["shard_params"])[1]  # another state of the same step
    need = _model_bytes(state)
    out: dict = {"need": need}
    try:
        with gathered(step, state, max_bytes=need - 1):
            pass
    except ValueError as e:
        out["refused"] = str(e)
    ids = PROMPTS[:, 2:]
    alone = step.apply(state, input_ids=ids).logits
    other_alone = step.apply(other, input_ids=ids).logits
    block = gathered(step, state, max_bytes=need)
    with zf.collectives.counting() as inside:
        block.__enter__()
        with gathered(step, state):  # nested on the same state: gathered already, nothing more
            first = step.apply(state, input_ids=ids).logits
        second = step.apply(state, input_ids=ids).logits
    with zf.collectives.counting() as c_other:  # still in the block
        other_inside = step.apply(other, input_ids=ids).logits  # another state: gathered per call
    block.__exit__(None, None, None)
    out["first"], out["second"] = torch.equal(first, alone), torch.equal(second, alone)
    out["other"] = torch.equal(other_inside, other_alone) and not torch.equal(other_alone, alone)
    out["other_gathers"] = c_other.calls.get("all_gather", 0)
    out["inside"] = inside.bytes
    with zf.collectives.counting() as after:  # released on leaving: the next call gathers again
        step.apply(state, input_ids=ids)
    out["after_gathers"] = after.calls.get("all_gather", 0)
    out["buckets"] = len(state.spec.layout.buckets) + len(state.spec.layout.frozen_buckets)
    return out


def test_the_block_is_for_its_state_refuses_a_budget_and_releases_on_leaving(ranks):
    for r in ranks(2).run(_block):
        need = r["need"]
        assert "refused" in r, r
        assert f"takes {need:,} bytes" in r["refused"] and f"max_bytes={need - 1:,}" in r["refused"], r["refused"]
        assert r["first"] and r["second"] and r["other"], r
        assert r["inside"] == need  # one gather, for both calls and the nested block
        assert r["other_gathers"] == r["buckets"] and r["after_gathers"] == r["buckets"], r


def test_without_shard_params_it_does_nothing():
    step, state = _step(_llama(), lambda s: s)
    with zf.collectives.counting() as c:
        once = zf.generate(step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, gather_once=True)
        with gathered(step, state, max_bytes=0):  # nothing is gathered, so nothing exceeds the budget
            pass
    assert c.bytes == 0
    assert torch.equal(once, zf.generate(step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW))
    with pytest.raises(TypeError, match="gather_once must be True or False"):
        zf.generate(step, state, PROMPTS, max_new_tokens=1, gather_once="yes")
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0 or None"):
        with gathered(step, state, max_bytes=-1):
            pass
