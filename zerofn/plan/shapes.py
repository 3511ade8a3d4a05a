"""Hugging Face ``config.json`` to a model's size and shapes: :class:`ModelShape`, :func:`model_shape`; the same
from the shapes alone: :func:`shape_from_dims`."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "model_shape", "shape_from_dims"]


@dataclass(frozen=True)
class ModelShape:
    """A transformer's size and shapes, as :func:`estimate` takes them.

    ``params`` counts each tensor once (a tied head adds nothing). Block
    shapes follow GPT: ``layers`` blocks of attention (``heads`` query
    heads, ``kv_heads`` key/value heads) and an MLP of width ``ffn``
    (``gated``: SwiGLU's three matrices, Llama-style); ``head_dim`` where
    the config gives one (else hidden / heads), ``experts`` the MLPs of a
    mixture-of-experts block (1: dense).

    A mixture-of-experts model (``experts`` > 1): ``moe_layers`` of its blocks route each token to
    ``top_k`` of their ``experts`` routed experts, each an MLP of width ``expert_ffn``, beside shared
    experts (one MLP of width ``shared_ffn`` in all, 0 for none); its other blocks (DeepSeek's dense first
    layers, Qwen's ``mlp_only_layers``) have a dense MLP of width ``ffn``. ``expert_params`` counts the
    routed experts' parameters (their stacked weights and biases) over every block: what expert parallelism
    cuts, the rest (attention, routers, shared experts, embeddings, norms) being whole on every GPU.
    ``layer_params`` is then the blocks' mean.
    """

    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    positions: int | None = None
    gated: bool = False
    tied: bool = True
    layer_params: int | None = None  # one block's parameters (a ZeRO-3 unit)
    name: str = ""
    head_dim: int | None = None
    experts: int = 1
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    top_k: int = 1
    expert_ffn: int | None = None
    shared_ffn: int = 0
    moe_layers: int = 0
    expert_params: int = 0

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks (embeddings, head, final norm): ZeRO-3's root unit."""
        return self.params - self.layers * (self.layer_params or 0)

    def given(self, layers, hidden, heads, kv_heads, ffn, vocab, gated) -> tuple:
        """The block shapes a caller was given, each None taken from this shape, in the order given."""
        mine = (self.layers, self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab, self.gated)
        return tuple(m if g is None else g for g, m in zip((layers, hidden, heads, kv_heads, ffn, vocab, gated), mine))


_GATED_TYPES = frozenset(
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi3 olmo olmo2 cohere "
    "internlm2 granite deepseek_v2 deepseek_v3 starcoder2_gated smollm3 exaone gpt_oss".split()
)
_ABSOLUTE_POSITIONS = frozenset("gpt2 gpt_bigcode opt gpt_neo bloom_absolute".split())


def _first(cfg: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def model_shape(config: dict | str | os.PathLike) -> ModelShape:
    """A model's parameter count and shapes from a Hugging Face config.

    Reads ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
    ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``, ``tie_word_embeddings``, ``attention_bias``/``mlp_bias``
    (Llama, Mistral, Qwen, Gemma-style: gated MLP, RMSNorm, rotary
    positions), or GPT-2's ``n_embd``, ``n_layer``, ``n_head``, ``n_inner``,
    ``n_positions`` (biases, LayerNorm, learned positions).

    Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS): the routed experts
    per block (``num_local_experts``, ``num_experts`` or ``n_routed_experts``), the experts a token goes
    to (``num_experts_per_tok``), an expert's width (``moe_intermediate_size``, else
    ``intermediate_size``), the shared experts (DeepSeek's ``n_shared_experts`` of the experts' width,
    Qwen2-MoE's ``shared_expert_intermediate_size`` and its gate), the dense blocks (DeepSeek's first
    ``first_k_dense_replace``, Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``, whose MLP is
    ``intermediate_size`` wide), DeepSeek's multi-head latent attention (``q_lora_rank``,
    ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), GPT-OSS's biased
    experts and router and its attention sinks. Qwen3's q/k norms count too.

    Args:
        config: a dict, a ``config.json`` path, or a directory holding one.

    Returns:
        A :class:`ModelShape`.

    Raises:
        ValueError: a config without a hidden size, layer count, head count
            or vocabulary size.

    Example:
        >>> from zerofn.plan import model_shape
        >>> gpt2 = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
        ...         "n_positions": 1024}
        >>> model_shape(gpt2).params                                   # GPT-2 small: 124 M
        124439808
        >>> llama2_70b = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "num_hidden_layers": 80,
        ...               "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
        ...               "tie_word_embeddings": False}
        >>> model_shape(llama2_70b).params
        68976648192
    """
    name = ""
    if not isinstance(config, dict):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            config = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    cfg = dict(config)
    if "text_config" in cfg and _first(cfg, "hidden_size", "n_embd", "d_model") is None:
        cfg = {**cfg, **cfg["text_config"]}  # a multimodal config: plan for its language model
    kind = str(cfg.get("model_type", ""))
    gpt2_names = "n_embd" in cfg
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head")
    vocab = _first(cfg, "vocab_size")
    named = (("hidden size", hidden), ("layers", layers), ("heads", heads), ("vocab_size", vocab))
    missing = [n for n, v in named if v is None]
    if missing:
        raise ValueError(
            f"model_shape: the config lacks {', '.join(missing)}; expected Hugging Face names (hidden_size, "
            "num_hidden_layers, num_attention_heads, vocab_size) or GPT-2's (n_embd, n_layer, n_head)"
        )
    hidden, layers, heads, vocab = int(hidden), int(layers), int(heads), int(vocab)
    kv_heads = int(_first(cfg, "num_key_value_heads", default=1 if cfg.get("multi_query") else heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
    ffn = int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden))
    act = str(_first(cfg, "hidden_act", "activation_function", default=""))
    gated = (kind in _GATED_TYPES or act in ("silu", "swiglu")) and not gpt2_names
    positions = _first(cfg, "max_position_embeddings", "n_positions", "n_ctx")
    learned_positions = gpt2_names or kind in _ABSOLUTE_POSITIONS
    tied = bool(cfg.get("tie_word_embeddings", True))
    layer_norm = not gated  # GPT-2 style LayerNorm (weight + bias) or RMSNorm (weight)
    norm = 2 * hidden if layer_norm else hidden
    q, kv = heads * head_dim, kv_heads * head_dim
    if gated:  # Llama-style: no biases unless the config says (Qwen2 has q, k, v biases)
        biased = cfg.get("attention_bias", kind == "gpt_oss")  # GPT-OSS's default: biases
        qkv_bias = bool(biased) or kind.startswith("qwen2")
        out_bias = bool(biased)
        mlp_bias = bool(cfg.get("mlp_bias", False))
    else:  # GPT-2 style: biases everywhere
        qkv_bias = out_bias = mlp_bias = True
    if cfg.get("kv_lora_rank"):  # DeepSeek's multi-head latent attention
        attn = _latent_attention(cfg, hidden, heads)
    else:
        attn = hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if qkv_bias else 0) + (hidden if out_bias else 0)
    if kind in ("qwen3", "qwen3_moe"):
        attn += 2 * head_dim  # q_norm and k_norm, over the head dimension
    if kind == "gpt_oss":
        attn += heads  # the attention sinks, one a head
    dense = _mlp(hidden, ffn, gated, mlp_bias)
    experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=1) or 1)
    moe = dict(top_k=1, expert_ffn=None, shared_ffn=0, moe_layers=0, expert_params=0)
    blocks = layers * (attn + dense + 2 * norm)
    if experts > 1:
        expert_ffn = int(_first(cfg, "moe_intermediate_size", default=ffn))
        biased = kind == "gpt_oss"  # GPT-OSS: biased experts and router
        expert = _mlp(hidden, expert_ffn, gated, biased or mlp_bias)
        shared_ffn = int(cfg.get("shared_expert_intermediate_size") or 0)
        shared_gate = hidden if shared_ffn else 0  # Qwen2-MoE's sigmoid gate of the shared expert
        shared_ffn = shared_ffn or int(cfg.get("n_shared_experts") or 0) * expert_ffn
        router = experts * hidden + (experts if biased else 0)
        routed = experts * expert
        mlp = routed + router + (_mlp(hidden, shared_ffn, gated, mlp_bias) + shared_gate if shared_ffn else 0)
        sparse = sum(_is_moe(cfg, kind, i) for i in range(layers))
        blocks = layers * (attn + 2 * norm) + sparse * mlp + (layers - sparse) * dense
        moe = dict(
            top_k=int(_first(cfg, "num_experts_per_tok", "experts_per_token", default=1)),
            expert_ffn=expert_ffn,
            shared_ffn=shared_ffn,
            moe_layers=sparse,
            expert_params=sparse * routed,
        )
    layer = blocks // layers  # the blocks' mean where they differ (dense blocks beside mixture-of-experts ones)
    params = vocab * hidden * (1 if tied else 2) + blocks + norm
    if learned_positions and positions:
        params += int(positions) * hidden
    return ModelShape(
        params=params,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        vocab=vocab,
        positions=int(positions) if positions else None,
        gated=gated,
        tied=tied,
        layer_params=layer,
        name=name or kind,
        head_dim=head_dim,
        experts=experts,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        **moe,
    )


def _mlp(hidden: int, width: int, gated: bool, bias: bool) -> int:
    """One MLP's parameters: SwiGLU's gate, up and down (``gated``) or GPT's two matrices, with their biases."""
    if gated:
        return 3 * hidden * width + (2 * width + hidden if bias else 0)
    return 2 * hidden * width + (width + hidden if bias else 0)


def _latent_attention(cfg: dict, hidden: int, heads: int) -> int:
    """DeepSeek's multi-head latent attention: q through a rank ``q_lora_rank`` bottleneck (with its norm) or
    one projection, k and v from a ``kv_lora_rank`` latent (with its norm) beside the shared rotary key, and
    the output projection."""
    nope, rope = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("qk_rope_head_dim") or 0)
    v_dim = int(cfg.get("v_head_dim") or nope)
    q_rank, kv_rank = int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"])
    bias = bool(cfg.get("attention_bias", False))
    qk = heads * (nope + rope)
    q = hidden * q_rank + (q_rank if bias else 0) + q_rank + q_rank * qk if q_rank else hidden * qk
    kv = hidden * (kv_rank + rope) + ((kv_rank + rope) if bias else 0) + kv_rank + kv_rank * heads * (nope + v_dim)
    return q + kv + heads * v_dim * hidden + (hidden if bias else 0)


def _is_moe(cfg: dict, kind: str, i: int) -> bool:
    """Whether block ``i`` of a mixture-of-experts model routes to experts: DeepSeek's after its
    ``first_k_dense_replace`` dense ones, Qwen's every ``decoder_sparse_step``-th not in ``mlp_only_layers``,
    every other model's all."""
    if kind.startswith("deepseek"):
        return i >= int(cfg.get("first_k_dense_replace") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    return i not in (cfg.get("mlp_only_layers") or ()) and (i + 1) % step == 0


def shape_from_dims(
    *,
    layers: int,
    hidden: int,
    vocab: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    gated: bool = False,
    tied: bool = True,
) -> ModelShape:
    """A model's parameter count and shapes from its dimensions, counted as :func:`model_shape` counts a config.

    GPT-style blocks by default (LayerNorm, biases everywhere, an MLP of two matrices); ``gated``: Llama-style
    (RMSNorm, no biases, SwiGLU's three matrices). ``heads`` defaults to ``hidden / 64``, ``kv_heads`` to
    ``heads``, ``ffn`` to ``4 x hidden``; the embedding and head are one tensor unless ``tied`` is False.
    Positions are rotary (no parameters).

    Example:
        >>> from zerofn.plan import shape_from_dims
        >>> llama2_70b = shape_from_dims(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000,
        ...                              gated=True, tied=False)
        >>> llama2_70b.params                                          # as model_shape counts its config
        68976648192
        >>> shape_from_dims(layers=80, hidden=8192, heads=64, ffn=28672, vocab=32000).params  # GPT-style blocks
        59326152704
    """
    heads = heads or max(1, hidden // 64)
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or heads,
        "intermediate_size": ffn or 4 * hidden,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "hidden_act": "silu" if gated else "gelu",
    }
    return dataclasses.replace(model_shape(config), name="")
