"""zf.generate: greedy tokens equal Hugging Face's own generate on the same weights (left-padded prompts,
eos and padding included), a quantized LoRA model's equal those of the model on its dequantized base, on
one process and on 2 gloo ranks under shard_params; sampling draws from the generator it is given."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from torch import nn
from zerofn.transforms import quantize, shard_params
from zerofn.transforms.quantize import dequantized

import zerofn as zf

pytest.importorskip("transformers")
pytest.importorskip("peft")

NEW = 10
# two prompts of different lengths, left-padded (pad 0, masked out)
PROMPTS = torch.tensor([[0, 0, 5, 17, 33, 2], [7, 41, 9, 60, 12, 3]])
MASK = (PROMPTS != 0).long()


def _llama(lora: bool):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama(max_position_embeddings=64)
    if lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero; values make the adapters count
                nn.init.normal_(p, std=0.02)
    return model.eval()


def _step(model, wrap=lambda s: s, kind: str | None = None):
    apply = zf.functional(model)

    def loss_fn(params, ids):
        return apply(params, input_ids=ids, labels=ids).loss

    step = wrap(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    if kind is not None:
        step = quantize(step, kind)
    return step, step.init(apply.params)


def _hf(model, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, **kw)


def _dequantized_reference(model, step, state):
    """A fresh LoRA model holding the quantized model's weights, its frozen ones dequantized."""
    fresh = _llama(lora=True)
    fresh.load_state_dict(dequantized(step.full_params(state), model), strict=True)
    return fresh


def test_greedy_tokens_equal_hugging_faces_generate():
    model = _llama(lora=False)
    step, state = _step(model)
    got = zf.generate(step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, pad_token_id=0)
    want = _hf(_llama(lora=False), pad_token_id=0)
    assert got.dtype == torch.long and got.shape == (2, 6 + NEW)
    assert torch.equal(got, want), (got, want)
    assert len(set(got[:, 6:].flatten().tolist())) > 2  # the model says something, not one token

    # eos: the first row's third new token ends that row, which gets pad after it, as Hugging Face's does
    eos = int(got[0, 8])
    got_eos = zf.generate(
        step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=1
    )
    want_eos = _hf(_llama(lora=False), eos_token_id=eos, pad_token_id=1)
    assert torch.equal(got_eos, want_eos), (got_eos, want_eos)
    assert (got_eos[0, 9:] == 1).all()
    # a single row that emits eos stops the loop there
    one = zf.generate(step, state, PROMPTS[:1, 2:], max_new_tokens=NEW, eos_token_id=eos)
    assert one.shape == (1, 7) and int(one[0, -1]) == eos


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantized_lora_model_generates_as_the_model_on_its_dequantized_base(kind):
    model = _llama(lora=True)
    step, state = _step(model, kind=kind)
    got = zf.generate(step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, pad_token_id=0)
    want = _hf(_dequantized_reference(model, step, state), pad_token_id=0)
    assert torch.equal(got, want), (got, want)


def test_sampling_draws_from_the_generator():
    step, state = _step(_llama(lora=False))

    def sample(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return zf.generate(
            step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=True, generator=g, **kw
        )

    a, b = sample(0, temperature=2.0), sample(0, temperature=2.0)
    assert torch.equal(a, b)  # the same generator state, the same tokens
    assert not torch.equal(a, sample(1, temperature=2.0))
    assert 0 <= int(a.min()) and int(a.max()) < 64
    greedy = zf.generate(step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW)
    assert torch.equal(sample(2, top_k=1), greedy)  # the one most likely token: greedy's


def test_bad_arguments_are_refused():
    step, state = _step(_llama(lora=False))
    with pytest.raises(TypeError, match=r"input_ids must be a 2-D integer tensor \(batch, tokens\), got a 1-D"):
        zf.generate(step, state, PROMPTS[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        zf.generate(step, state, PROMPTS, max_new_tokens=-1)
    with pytest.raises(ValueError, match="attention_mask must be a tensor shaped like input_ids"):
        zf.generate(step, state, PROMPTS, max_new_tokens=2, attention_mask=MASK[:, 1:])
    with pytest.raises(ValueError, match="temperature must be a number > 0"):
        zf.generate(step, state, PROMPTS, max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        zf.generate(step, state, PROMPTS, max_new_tokens=2, do_sample=True, top_k=0)
    assert torch.equal(zf.generate(step, state, PROMPTS, max_new_tokens=0), PROMPTS)


def _on_ranks(kind: str) -> dict:
    """Greedy and sampled tokens of a quantized LoRA model under shard_params, and the reference's greedy tokens
    (Hugging Face's generate on the dequantized base), on this rank."""
    model = _llama(lora=True)
    step, state = _step(model, shard_params, kind)
    greedy = zf.generate(step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, pad_token_id=0)
    g = torch.Generator().manual_seed(7)  # seeded alike on every rank
    sampled = zf.generate(step, state, PROMPTS, max_new_tokens=NEW, do_sample=True, top_k=8, generator=g)
    reference = _hf(_dequantized_reference(model, step, state), pad_token_id=0)  # full_params: collective
    held = sum(t.numel() for t in state.frozen)  # this rank's shard of the frozen parts
    return {"greedy": greedy, "sampled": sampled, "reference": reference, "held": held}


def test_under_shard_params_and_quantize_on_two_ranks(ranks):
    out = ranks(2).run(_on_ranks, "nf4")
    for rank, r in enumerate(out):
        assert torch.equal(r["greedy"], r["reference"]), (rank, r)
    assert torch.equal(out[0]["greedy"], out[1]["greedy"])
    assert torch.equal(out[0]["sampled"], out[1]["sampled"])  # the same logits, the same draws
    assert out[0]["held"] > 0 and out[1]["held"] > 0  # each rank holds a shard of the base
