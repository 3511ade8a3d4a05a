"""The planner's expert parallelism (``estimate(..., ep=)``, ``python -m zerofn plan --ep``).

- Shapes: ``model_shape`` of small Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and GPT-OSS configs against the
  parameters (all, and the routed experts' stacked weights) of the Hugging Face models they build.
- Bytes per GPU: a Mixtral-like and a DeepSeek-V3-like config (dense first block, shared expert, latent
  attention) under every ZeRO stage, against the formula written out here: each GPU holds ``experts / ep`` of
  the experts and the rest whole; the ZeRO stages shard the rest over ``world / tp`` GPUs and the experts over
  ``world / (tp x ep)``; exact at stage 0, within the buckets' padding above.
- Traffic: the routed tokens' all-to-alls, ``4 x moe_layers x (micro_batch x seq / cp) x top_k x hidden x``
  the activations' bytes per micro-batch (6 under remat), bf16 and fp32, with and without cp.
- Refusals: a dense model, a bare parameter count, an ep that does not divide the experts or the
  data-parallel ranks, ep 0, ep with inference; the command line naming ep.
"""

from __future__ import annotations

import json

import pytest

from zerofn import plan
from zerofn.plan import estimate, fmt_bytes, model_shape

BASE = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# Mixtral-like: 8 experts of width 96 a block, each token to 2 of them
MIXTRAL = dict(model_type="mixtral", **BASE, num_local_experts=8, num_experts_per_tok=2)
# DeepSeek-V3-like: 4 blocks, the first dense (width 96), then 8 routed experts of width 32 (top 2) beside one
# shared expert of the same width; multi-head latent attention
DEEPSEEK = dict(
    model_type="deepseek_v3",
    **{**BASE, "num_hidden_layers": 4},
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_group=2,
    topk_group=1,
)


def _experts(cfg: dict) -> tuple[int, int, int]:
    """(routed experts' parameters in all, mixture-of-experts blocks, an expert's width), written out from the
    config: SwiGLU experts of three matrices, every block but DeepSeek's first_k_dense_replace."""
    width = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    blocks = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    return blocks * experts * 3 * cfg["hidden_size"] * width, blocks, width


def test_model_shape_counts_the_experts_of_hugging_face_models():
    transformers = pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    configs = {
        "mixtral": MIXTRAL,
        "deepseek_v3": DEEPSEEK,
        "qwen2_moe": dict(
            model_type="qwen2_moe",
            **BASE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[1],
        ),
        "qwen3_moe": dict(
            model_type="qwen3_moe",
            **BASE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            decoder_sparse_step=2,
        ),
        "gpt_oss": dict(
            model_type="gpt_oss",
            **BASE,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            attention_bias=True,
            layer_types=["full_attention", "sliding_attention"],
        ),
    }
    for kind, cfg in configs.items():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        shape = model_shape(cfg)
        experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
        assert shape.params == sum(p.numel() for p in model.parameters()), kind
        assert shape.expert_params == experts, kind
    deepseek = model_shape(DEEPSEEK)
    assert (deepseek.experts, deepseek.top_k, deepseek.moe_layers, deepseek.shared_ffn) == (8, 2, 3, 32)
    assert deepseek.expert_params == _experts(DEEPSEEK)[0]


@pytest.mark.parametrize("cfg", [MIXTRAL, DEEPSEEK], ids=["mixtral", "deepseek_v3"])
@pytest.mark.parametrize("world, ep", [(8, 2), (8, 8), (16, 4)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_gpu_match_the_formula(cfg, world, ep, stage):
    shape = model_shape(cfg)
    experts, _, _ = _experts(cfg)
    rest = shape.params - experts  # attention, routers, shared experts, dense blocks, embeddings, norms
    local = rest + experts // ep
    n, n_x = world, world // ep  # the ZeRO groups: every GPU for the rest, those holding the same experts
    part = rest / n + experts / ep / n_x  # the shard one GPU updates
    e = estimate(shape, gpus=world, stage=stage, ep=ep)
    x = e.expert_parallel
    assert (x.local, x.local_experts, x.group, x.expert_group) == (local, 8 // ep, n, n_x)
    params = 2 * (part if stage == 3 else local)
    optimizer = 12 * (part if stage >= 1 else local) + 8  # fp32 master and Adam's moments, and the step count
    # each bucket is padded to its group (at most N - 1 elements): a few buckets per part at these sizes
    slack = 2 * 12 * (shape.layers + 2) * n
    for got, want in ((e.params, params), (e.optimizer, optimizer), (e.state, params + optimizer)):
        if stage == 0:
            assert got == want
        else:
            assert 0 <= got - want <= slack, (got, want)
    if stage <= 1:
        assert e.grads == 2 * local
    elif stage == 3:
        assert 0 <= e.grads - 2 * part <= slack
    # the ZeRO paper's elements moved per rank, each part over its group (a group of one moves nothing)
    assert e.traffic == (3 if stage == 3 else 2) * (rest + (experts // ep if n_x > 1 else 0))
    assert e.ep_traffic == 0  # no tokens given


@pytest.mark.parametrize("cfg", [MIXTRAL, DEEPSEEK], ids=["mixtral", "deepseek_v3"])
def test_all_to_all_bytes_match_the_formula(cfg):
    _, blocks, _ = _experts(cfg)
    h, k = cfg["hidden_size"], cfg["num_experts_per_tok"]
    shape = model_shape(cfg)
    seq, micro = 128, 3
    for kw, tokens in ((dict(), micro * seq), (dict(cp=2), micro * seq // 2)):
        for mixed, size in ((True, 2), (False, 4)):
            one = tokens * k * h * size  # one all-to-all: this GPU's routed rows, its own included
            e = estimate(shape, gpus=8, ep=4, seq=seq, micro_batch=micro, mixed_precision=mixed, **kw)
            assert e.expert_parallel.exchange == one
            assert e.ep_traffic == 4 * blocks * one  # dispatch and combine, forward and backward
            r = estimate(shape, gpus=8, ep=4, seq=seq, micro_batch=micro, mixed_precision=mixed, remat=True, **kw)
            assert r.ep_traffic == 6 * blocks * one  # and the recomputed forward's two
    # every GPU feeds its own micro-batch: ep divides nothing of the data-parallel ranks
    x = estimate(shape, gpus=8, ep=4, cp=2, seq=seq, micro_batch=micro).expert_parallel
    assert (x.data, x.group, x.expert_group) == (4, 8, 2)


def _message(**kw) -> str:
    with pytest.raises(ValueError) as e:
        estimate(kw.pop("source", model_shape(MIXTRAL)), **kw)
    return str(e.value)


def test_refusals_say_what_was_wrong_and_what_to_do():
    dense = model_shape({**BASE, "model_type": "llama"})
    assert "this model is dense" in _message(source=dense, gpus=8, ep=2)
    assert "leave --ep out" in _message(source=dense, gpus=8, ep=2)
    assert "a parameter count does not say" in _message(source=7e9, gpus=8, ep=2)
    message = _message(gpus=12, ep=3)
    assert "ep=3 does not divide the model's 8 experts per block" in message and "Pick ep from [1, 2, 4]" in message
    message = _message(gpus=8, ep=8, cp=2)
    assert "ep=8 does not divide the 4 data-parallel ranks (world 8 / (tp 1 x cp 2))" in message
    assert "Pick ep from [1, 2, 4], or plan a multiple of 16 GPUs" in message
    assert "ep must be an int >= 1" in _message(gpus=8, ep=0)
    assert "ep=2 with inference=True is not modelled" in _message(gpus=8, ep=2, inference=True)


def test_cli_names_ep_its_groups_and_its_traffic(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    args = ["--model", str(tmp_path), "--gpus", "8", "--ep", "4", "--gpu-memory", "1GB"]
    assert plan.main(args + ["--seq", "128", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    e = estimate(model_shape(MIXTRAL), gpus=8, ep=4, seq=128, micro_batch=2)
    assert "expert parallel 4 x data parallel 2" in out  # the mesh: dp 2 x ep 4, 8 micro-batches in flight
    assert "expert parallelism over 4 GPUs: each holds 2 of the 8 routed experts" in out
    assert "shard the experts over the 2 GPU(s) holding the same ones and the rest over the 8 GPU(s)" in out
    x = e.expert_parallel
    assert f"= {fmt_bytes(x.exchange)} each" in out and f": {fmt_bytes(e.ep_traffic)} over 2 blocks" in out
    assert plan.main(args) == 0
    assert "expert-parallel traffic not counted" in capsys.readouterr().out
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "llama"}))
    assert plan.main(args) == 2
    assert "error: estimate: ep=4 cuts a mixture-of-experts model's experts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--params", "7e9", "--gpu-memory", "80GB", "--ep", "0"])
    assert "--ep 0: the GPUs per expert-parallel group must be at least 1" in capsys.readouterr().err
