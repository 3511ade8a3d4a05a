"""Tiny mixtures of experts from small configs (nothing downloaded), the same values each call."""

from __future__ import annotations

import torch
from torch import nn

EXPERTS, TOP_K, HIDDEN, VOCAB = 8, 2, 32, 64
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=TOP_K,
)


def moe_model(kind: str) -> nn.Module:
    """A float32 ``kind`` (mixtral, qwen3_moe, qwen2_moe, deepseek_v3, gpt_oss) of 8 experts, top-2, in
    every layer (DeepSeek-V3: one shared expert; Qwen2-MoE: a gated shared expert)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=EXPERTS)
        return transformers.MixtralForCausalLM(config).float()
    if kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **COMMON, head_dim=8, num_experts=EXPERTS, moe_intermediate_size=24, norm_topk_prob=True
        )
        return transformers.Qwen3MoeForCausalLM(config).float()
    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **COMMON, num_experts=EXPERTS, moe_intermediate_size=24, shared_expert_intermediate_size=24
        )
        return transformers.Qwen2MoeForCausalLM(config).float()
    if kind == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4},
            n_routed_experts=EXPERTS,
            n_shared_experts=1,
            moe_intermediate_size=24,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
        model = transformers.DeepseekV3ForCausalLM(config).float()
        for name, b in model.named_buffers():  # its routers' selection bias: drawn, so that it matters
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(7)) * 0.1)
        return model
    if kind == "gpt_oss":
        config = transformers.GptOssConfig(
            **{**COMMON, "intermediate_size": 24}, head_dim=8, num_local_experts=EXPERTS, sliding_window=16
        )
        model = transformers.GptOssForCausalLM(config).float()
        torch.manual_seed(1)
        for name, p in model.named_parameters():  # biases and sinks start at zero: drawn, so that they matter
            if name.endswith(("_bias", "sinks")) or "router.bias" in name:
                nn.init.normal_(p, std=0.02)
        return model
    raise ValueError(kind)
