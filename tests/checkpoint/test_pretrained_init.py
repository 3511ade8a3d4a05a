"""zf.checkpoint.pretrained_init: a Hugging Face checkpoint read tensor by tensor as shard_params' init_fn."""

from __future__ import annotations

import pytest
import torch

import zerofn as zf

pytest.importorskip("transformers")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg), cfg


def test_sharded_files_read_each_tensor_as_saved(tmp_path):
    model, _ = _llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    init = zf.checkpoint.pretrained_init(tmp_path)
    for name, p in model.named_parameters():
        got = init(name, torch.empty(p.shape, device="meta"))
        assert torch.equal(got, p.detach()), name
    # peft's names map onto the base model's; its LoRA adapters start as peft starts them
    q = "model.layers.0.self_attn.q_proj.weight"
    peft_name = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(init(peft_name, torch.empty(32, 32, device="meta")), model.get_parameter(q).detach())
    b = init(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight", torch.empty(32, 4, device="meta")
    )
    assert b.shape == (32, 4) and not b.any()


def test_bad_directories_and_names_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="expected a Hugging Face model directory with model.safetensors"):
        zf.checkpoint.pretrained_init(tmp_path)
    model, _ = _llama()
    model.save_pretrained(tmp_path)
    init = zf.checkpoint.pretrained_init(tmp_path)
    with pytest.raises(ValueError, match=r"'model.layers.9.mlp.up_proj.weight' \(looked up as"):
        init("model.layers.9.mlp.up_proj.weight", torch.empty(64, 32, device="meta"))
    with pytest.raises(ValueError, match=r"is stored with shape \[64, 32\]"):
        init("model.layers.0.mlp.up_proj.weight", torch.empty(32, 32, device="meta"))
