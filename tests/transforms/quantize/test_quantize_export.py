"""dequantized: the full parameters of a quantized model become those of the unquantized one, each frozen
weight its codec's round trip, under the names a freshly built model loads (peft's included), from plain,
amp (masters too) and shard_params states, a model built on meta and read from its files among them."""

from __future__ import annotations

import pytest
import torch
from test_quantize import _config, _lora_llama, _loss_fn
from torch import nn
from zerofn.transforms import amp, shard_params
from zerofn.transforms.quantize import dequantized, quantize, quantized_layers

import zerofn as zf

pytest.importorskip("peft")

PROMPT = torch.tensor([[3, 14, 15, 9, 2, 6], [5, 35, 8, 9, 7, 9]])


def _quantized(kind: str, wrap=lambda s: s, model: nn.Module | None = None, **init):
    model = _lora_llama() if model is None else model
    apply = zf.functional(model)
    step = quantize(wrap(zf.train_step(_loss_fn(apply), zf.optim.adamw(1e-3))), kind)
    return model, step, step.init(apply.params, **init)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_dequantized_params_are_the_round_trip_and_load_into_a_fresh_model(kind):
    model, step, state = _quantized(kind)
    full = step.full_params(state)
    got = dequantized(full, model)
    ref = _lora_llama(kind).state_dict()  # the same model, its frozen weights replaced by their round trip
    assert got.keys() == ref.keys()  # the unquantized model's names
    assert list(got).index("base_model.model.model.layers.0.mlp.down_proj.base_layer.weight") == list(full).index(
        "base_model.model.model.layers.0.mlp.down_proj.base_layer.weight_codes"
    )  # where its parts were
    for name, t in got.items():
        assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name
    untouched = [k for k in full if "weight_" not in k]
    assert all(got[k] is full[k] for k in untouched)  # the rest as given, not copied
    assert len(quantized_layers(model)) == 14

    fresh = _lora_llama()
    fresh.load_state_dict(got, strict=True)
    with torch.no_grad():
        want = fresh(input_ids=PROMPT).logits
    assert torch.equal(step.apply(state, input_ids=PROMPT).logits, want)  # the numbers the layers compute with

    # step.state_dict gives the same names here (no tied weights, no persistent buffers): the same result
    assert dequantized(step.state_dict(state), model).keys() == got.keys()


def test_under_amp_the_weights_are_the_bf16_round_trip_in_the_dtype_asked_for():
    model, step, state = _quantized("nf4", lambda s: amp(s, torch.bfloat16))
    ref = _lora_llama("nf4", held=torch.bfloat16).state_dict()
    held = dequantized(step.full_params(state), model)  # the dtype quantized from: amp's bf16
    # master=True gives the float parts in fp32: read back in bf16, exactly as held
    master = dequantized(step.full_params(state, master=True), model, torch.float32)
    for path in quantized_layers(model):
        name = f"{path}.weight"
        assert held[name].dtype == torch.bfloat16 and master[name].dtype == torch.float32, name
        assert torch.equal(held[name].float(), ref[name]) and torch.equal(master[name], ref[name]), name
    assert master["base_model.model.lm_head.weight"].dtype == torch.float32  # the rest: as step.full_params gives


def test_a_model_built_on_meta_and_read_from_its_files_dequantizes_to_their_round_trip(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)  # the base weights _lora_llama builds
    LlamaForCausalLM(_config()).float().save_pretrained(tmp_path)
    with torch.device("meta"):
        model = LlamaForCausalLM(_config())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    init_fn = zf.checkpoint.pretrained_init(str(tmp_path))
    apply = zf.functional(model)
    step = quantize(shard_params(zf.train_step(_loss_fn(apply), zf.optim.adamw(1e-3)), init_fn=init_fn), "nf4")
    state = step.init(apply.params)
    got = dequantized(step.full_params(state), model)
    ref = _lora_llama("nf4").state_dict()
    frozen = [k for k in ref if "lora_" not in k]  # the adapters start as peft starts them, not as _lora_llama's
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in frozen)


def test_missing_parts_and_a_model_not_quantized_are_refused():
    model, step, state = _quantized("nf4")
    full = step.full_params(state)
    part = "base_model.model.model.layers.1.mlp.up_proj.base_layer.weight_scalers"
    with pytest.raises(ValueError, match=r"params lack \['.*up_proj.base_layer.weight_scalers'\] of '.*layers.1"):
        dequantized({k: v for k, v in full.items() if k != part}, model)
    adapters = {k: v for k, v in full.items() if "lora_" in k}
    with pytest.raises(ValueError, match="params lack"):
        dequantized(adapters, model)
    with pytest.raises(ValueError, match="no layer of model is held quantized"):
        dequantized(full, _lora_llama())
    both = dict(full, **{part.replace("_scalers", ""): torch.zeros(64, 128)})
    with pytest.raises(ValueError, match="params hold both"):
        dequantized(both, model)
    with pytest.raises(ValueError, match="part 'scalers' should hold"):
        dequantized(dict(full, **{part: full[part][:-1]}), model)
    with pytest.raises(TypeError, match="params must be a dict"):
        dequantized(list(full.values()), model)
