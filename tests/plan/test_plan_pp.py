"""The planner's pipeline parallelism (``estimate(..., pp=, microbatches=)``, ``python -m zerofn plan --pp N
--microbatches M``), against counts and formulas worked here; no ranks, no model built.

- The cut: each stage's parameters against a small Llama config's parameters counted by name, as Hugging Face
  names and shapes them, cut as ``pipeline_parallel`` cuts a model (the first stages one block more, the
  embedding on the first stage, the final norm and an untied head on the last, a tied head with the embedding);
  under tensor parallelism the stages add up to one GPU's share of the model.
- pp 1 is no pipeline: every composition, and the command line's whole output (with ``--hardware`` too), as
  without ``--pp``.
- The bubble fractions' values, and the speed model's step: compute x (m + p - 1) / m under 1F1B.
- Activations: stage i's are linear in the micro-batches 1F1B keeps in flight on it, ``min(p - i, m)``; the first
  stage holds the whole model's one micro-batch (and its p - 1 more inputs); interleaved's first stage holds
  Narayanan et al.'s ``(1 + (p - 1) / (p v)) x p`` micro-batches of its blocks.
- Traffic: the stages' sends, across nodes when a stage spans a node; the ZeRO stages reduce the stage's own
  parameters only.
- Refusals, each saying what was wrong and what to do; the command line's.
"""

from __future__ import annotations

import json
import math

import pytest

from zerofn import plan
from zerofn.plan import (
    bubble_fraction,
    compositions,
    estimate,
    load_hardware,
    model_shape,
    pipeline_parallel_plan,
    speeds,
)
from zerofn.plan.activations import activation_bytes

# A small Llama: 6 blocks (cut 2, 2, 1, 1 over 4 stages), grouped-query attention, an untied head
LLAMA = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
LLAMA2_7B = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=11008,
    num_attention_heads=32,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def _llama_parameters(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter of transformers' LlamaForCausalLM for ``cfg``, by name, as it shapes them."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        block = {
            "self_attn.q_proj.weight": (h, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, h),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        out.update({f"model.layers.{i}.{k}": s for k, s in block.items()})
    out["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    return out


def _stage_of(name: str, bounds: list[int]) -> int:
    """The stage pipeline_parallel gives a parameter: the embedding the first, a block its stage's, the rest the
    last (a tied head is the embedding, held by the first)."""
    if name.startswith("model.embed_tokens"):
        return 0
    if name.startswith("model.layers."):
        i = int(name.split(".")[2])
        return next(s for s in range(len(bounds) - 1) if bounds[s] <= i < bounds[s + 1])
    return len(bounds) - 2


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [2, 4])
def test_stage_parameters_are_the_llama_s_cut(pp, tied):
    cfg = {**LLAMA, "tie_word_embeddings": tied}
    named = _llama_parameters(cfg)
    shape = model_shape(cfg)
    assert shape.params == sum(math.prod(s) for s in named.values())
    layers = cfg["num_hidden_layers"]
    base, more = divmod(layers, pp)  # the first stages one block more, as pipeline_parallel cuts them
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + base + (s < more))
    want = [0] * pp
    for name, s in named.items():
        want[_stage_of(name, bounds)] += math.prod(s)
    e = estimate(shape, gpus=pp, pp=pp, microbatches=pp)
    t = e.pipeline_parallel
    assert list(t.stage_params) == want
    assert list(t.stage_blocks) == [b - a for a, b in zip(bounds, bounds[1:])]
    assert sum(t.stage_params) == shape.params  # each parameter held once (a tied head too)
    assert (t.data, t.group) == (1, 1)
    # the largest stage is reported: with every state whole (DDP, one rank a stage), the most parameters
    assert e.params == 2 * max(want) and e.grads == 2 * max(want)
    assert e.pipeline_parallel.stage == want.index(max(want))
    for i in range(pp):
        assert estimate(shape, gpus=pp, pp=pp, microbatches=pp, pp_stage=i).params == 2 * want[i]


def test_stages_under_tensor_parallelism_add_up_to_a_gpu_s_share():
    shape = model_shape(LLAMA)
    e = estimate(shape, gpus=8, tp=2, pp=2, microbatches=4, stage=1)
    t, tensor = e.pipeline_parallel, e.tensor_parallel
    assert sum(t.stage_params) == tensor.local and t.stage_blocks == (3, 3)
    # the embedding and the head split over the vocabulary: vocab x hidden / 2 on the first and on the last
    table = LLAMA["vocab_size"] * LLAMA["hidden_size"] // 2
    assert t.stage_params[0] == 3 * tensor.block + table
    assert t.stage_params[1] == 3 * tensor.block + table + LLAMA["hidden_size"]
    assert (t.data, t.group, tensor.data) == (2, 2, 2)  # 8 GPUs / (pp 2 x tp 2): the stage's ZeRO group


def test_pp_1_is_the_plan_without_pp(capsys):
    shape = model_shape(LLAMA2_7B)
    kw = dict(gpus=8, nodes=2, seq=4096, micro_batch=1, tp=2, cp=2)
    assert compositions(shape, **kw) == compositions(shape, **kw, pp=1, microbatches=8)
    assert estimate(shape, **kw, stage=3, pp=1).pipeline_parallel is None


def test_cli_pp_1_prints_what_it_prints_without(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    args = ["--model", str(tmp_path), "--nodes", "2", "--hardware", "h100", "--seq", "4096", "--micro-batch", "1"]
    assert plan.main(args) == 0
    without = capsys.readouterr().out
    assert plan.main(args + ["--pp", "1"]) == 0
    assert capsys.readouterr().out == without


def test_bubble_fractions():
    assert bubble_fraction("1f1b", 4, 8) == 3 / 11  # (p - 1) / (m + p - 1)
    assert bubble_fraction("1f1b", 8, 32) == 7 / 39
    assert bubble_fraction("interleaved", 4, 8, 2) == 3 / 19  # (p - 1) / (v m + p - 1)
    assert bubble_fraction("zero_bubble", 4, 8) == 3 / 27  # (p - 1) / (3 v m + p - 1)
    assert bubble_fraction("zero_bubble", 4, 8, 2) == 3 / 51
    assert bubble_fraction("1f1b", 1, 8) == 0
    # zero bubble's idle time is a third of 1F1B's: (p - 1) / 3 micro-batches' time against p - 1
    one, zb = bubble_fraction("1f1b", 4, 8), bubble_fraction("zero_bubble", 4, 8)
    assert math.isclose(zb / (1 - zb), one / (1 - one) / 3)


def test_the_step_is_m_plus_p_minus_1_micro_batches():
    shape = model_shape(LLAMA2_7B)
    kw = dict(hardware=load_hardware("h100"), nodes=4, seq=4096, micro_batch=1)
    rows = speeds(shape, **kw, pp=4, microbatches=8)
    assert rows and all(r.bubble_s > 0 for r in rows)
    for r in rows:
        assert math.isclose(r.compute_s + r.bubble_s, r.compute_s * (8 + 4 - 1) / 8)
        assert math.isclose(r.step_s, r.compute_s + r.bubble_s + r.exposed_s + r.update_s + r.codec_s)
    assert rows[0].tokens == 32 // 4 * 8 * 4096  # 8 pipelines side by side, 8 micro-batches of one sequence
    inter = speeds(shape, **kw, pp=4, microbatches=8, schedule="interleaved", virtual_stages=2)
    assert inter[0].bubble_s < rows[0].bubble_s


def test_activations_follow_the_micro_batches_in_flight():
    shape = model_shape(LLAMA2_7B)
    kw = dict(gpus=8, stage=1, seq=4096, micro_batch=1, pp=4, microbatches=8)
    acts = [estimate(shape, **kw, pp_stage=i).activations for i in range(4)]
    held = estimate(shape, **kw).pipeline_parallel.in_flight
    assert held == (4, 3, 2, 1)  # min(p - i, m)
    # stages 0-2 (no logits): linear in the micro-batches in flight, each of the stage's 8 blocks
    per = acts[1] - acts[2]
    assert acts[0] - acts[1] == per and per > 0
    one = activation_bytes(layers=8, hidden=4096, seq=4096, micro_batch=1, heads=32, ffn=11008, gated=True)
    head = activation_bytes(layers=0, hidden=4096, seq=4096, micro_batch=1, heads=32, ffn=11008, gated=True)
    assert per == one - head + 4096 * 4096 * 2  # a micro-batch's 8 blocks and its input, bf16
    # the first stage holds the whole model's one micro-batch (no logits) and the inputs of 3 more
    whole = activation_bytes(layers=32, hidden=4096, seq=4096, micro_batch=1, heads=32, ffn=11008, gated=True)
    assert acts[0] == whole + 3 * 4096 * 4096 * 2
    # the last stage holds one micro-batch of its blocks and the logits
    assert acts[3] == activation_bytes(
        layers=8, hidden=4096, seq=4096, micro_batch=1, heads=32, ffn=11008, gated=True, vocab=32000
    )
    # more micro-batches do not add to what 1F1B keeps in flight; fewer stages keep more blocks
    assert estimate(shape, **{**kw, "microbatches": 32}).activations == acts[0]
    # interleaved: (1 + (p - 1) / (p v)) x p micro-batches of a stage's blocks on the first, v m at most
    p, v = 4, 2
    t = estimate(shape, **kw | dict(schedule="interleaved", virtual_stages=v), pp_stage=0).pipeline_parallel
    assert t.in_flight[0] == (1 + (p - 1) / (p * v)) * p * v == 11
    assert t.chunks == (4,) * 8 and t.stage_blocks == (8,) * 4
    # zero bubble with one chunk a GPU: 1F1B's, and the weight gradients' inputs of i micro-batches on stage i
    t = estimate(shape, **kw | dict(schedule="zero_bubble")).pipeline_parallel
    assert t.in_flight == (4, 3, 2, 1) and t.waiting == (0, 1, 2, 3)


def test_remat_keeps_each_micro_batch_s_inputs():
    shape = model_shape(LLAMA2_7B)
    kw = dict(gpus=8, stage=3, remat=True, seq=4096, micro_batch=1, pp=4, microbatches=8, pp_stage=0)
    e = estimate(shape, **kw)
    x = 4096 * 4096 * 2  # one hidden state a sequence, bf16
    # 4 micro-batches in flight x 8 blocks' kept inputs, one block recomputed
    assert e.activations >= 4 * 8 * x
    off = estimate(shape, **kw, remat_offload=True)
    assert off.remat_host == 4 * 8 * x and off.activations < e.activations


def test_traffic_between_stages_and_over_the_stage_s_ranks():
    shape = model_shape(LLAMA2_7B)
    hw = load_hardware("h100")
    # 4 nodes, pp 4: a stage a node, neighbours across nodes; stage 1 sends 2 a micro-batch
    rows = speeds(shape, hardware=hw, nodes=4, seq=4096, micro_batch=1, pp=4, microbatches=8)
    send = 1 * 4096 * 4096 * 2
    for r in rows:
        (pipe,) = [c for c in r.comms if c.kind == "send_recv"]
        assert (pipe.inter_bytes, pipe.intra_bytes, pipe.count) == (2 * 8 * send, 0, 16)
    # the ZeRO stages reduce the stage's own parameters (a quarter of the blocks), over its 8 GPUs
    z1 = next(r for r in rows if r.label == "ZeRO-1")
    e = estimate(shape, gpus=8, nodes=4, stage=1, seq=4096, micro_batch=1, pp=4, microbatches=8)
    local = e.pipeline_parallel.stage_params[e.pipeline_parallel.stage]
    reduced = sum(c.full_bytes for c in z1.comms if c.kind == "reduce_scatter")
    assert reduced == 2 * local and local < shape.params / 3
    assert all(c.ranks == 8 for c in z1.comms if c.kind != "send_recv")
    # one node: the stages' neighbours on NVLink
    (pipe,) = [
        c
        for c in speeds(shape, hardware=hw, seq=4096, micro_batch=1, pp=4, microbatches=8)[0].comms
        if c.kind == "send_recv"
    ]
    assert pipe.inter_bytes == 0 and pipe.intra_bytes > 0


def test_a_tied_head_is_lent_to_the_last_stage():
    cfg = {**LLAMA, "tie_word_embeddings": True}
    shape = model_shape(cfg)
    table = 2 * LLAMA["vocab_size"] * LLAMA["hidden_size"]  # bf16
    first = estimate(shape, gpus=2, pp=2, microbatches=2, seq=8, micro_batch=1, pp_stage=0)
    last = estimate(shape, gpus=2, pp=2, microbatches=2, seq=8, micro_batch=1, pp_stage=1)
    assert last.gathered == 2 * table and first.gathered == 0  # the weight and its gradient, for the step
    send = 8 * 64 * 2
    assert first.pp_traffic == 2 * send + table and last.pp_traffic == 2 * send + table


def _message(**kw) -> str:
    with pytest.raises(ValueError) as e:
        estimate(kw.pop("source", model_shape(LLAMA2_7B)), **kw)
    return str(e.value)


def test_refusals_say_what_was_wrong_and_what_to_do():
    m = _message(gpus=8, pp=3, microbatches=8)
    assert "pp=3 does not divide world / (tp x cp) = 8" in m and "Pick pp from [1, 2, 4, 8]" in m
    m = _message(gpus=8, tp=2, pp=8, microbatches=8)
    assert "pp=8 does not divide world / (tp x cp) = 4" in m and "plan a multiple of 16 GPUs" in m
    m = _message(gpus=8, pp=4, microbatches=2)
    assert "microbatches=2 is fewer than the pp=4 stages" in m and "microbatches >= 4" in m
    assert "microbatches=" in _message(gpus=8, pp=4) and "at least 4 for 1F1B" in _message(gpus=8, pp=4)
    assert "schedule='interleaved'" in _message(gpus=8, pp=4, microbatches=8, virtual_stages=2)
    assert "virtual_stages >= 2" in _message(gpus=8, pp=4, microbatches=8, schedule="interleaved")
    m = _message(gpus=8, pp=4, microbatches=9, schedule="interleaved", virtual_stages=2)
    assert "not a multiple of 2" in m and "such as 8 or 12" in m
    m = _message(gpus=8, pp=8, microbatches=8, schedule="interleaved", virtual_stages=8)
    assert "64 model chunks for 32 blocks" in m and "at most 4" in m
    assert "schedule must be one of ['1f1b', 'interleaved', 'zero_bubble']" in _message(
        gpus=8, pp=2, microbatches=2, schedule="gpipe"
    )
    assert "pp must be an int >= 1" in _message(gpus=8, pp=0, microbatches=2)
    assert "pp=2 with inference=True is not modelled" in _message(gpus=8, pp=2, microbatches=2, inference=True)
    assert "pp=2 with lora_rank=8 is not modelled" in _message(gpus=8, pp=2, microbatches=2, lora_rank=8)
    assert "whose count it needs" in _message(source=7e9, gpus=8, pp=2, microbatches=2)
    assert "pp_stage must be a rank of the pipeline, an int from 0 to 1" in _message(
        gpus=8, pp=2, microbatches=2, pp_stage=2
    )
    # the plan itself: torch's rounds allow fewer micro-batches than stages under the interleaved schedules
    t = pipeline_parallel_plan(
        size=4, microbatches=2, world=4, layers=8, block=1, first=0, last=0, schedule="zero_bubble"
    )
    assert t.in_flight == (2, 2, 2, 1)


def test_cli_prints_the_pipeline_and_refuses_what_it_cannot_plan(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    base = ["--model", str(tmp_path), "--gpus", "8", "--gpu-memory", "80GB", "--seq", "4096", "--micro-batch", "1"]
    assert plan.main(base + ["--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "data parallel 2 x pipeline parallel 4" in out
    assert "pipeline parallelism over 4 stages (1F1B, 8 micro-batches a step) x 2 data-parallel rank(s)" in out
    assert "bubble: (p - 1) / (m + p - 1) = 3 / (8 + 3) = 3 / 11 = 27.3% of a step idle" in out
    assert "min(p - i, m) micro-batches of 1 sequence(s) (a step takes 8 a data-parallel rank)" in out
    assert "stage 0: 4, stage 1: 3, stage 2: 2, stage 3: 1" in out
    assert "composition                                         stage" in out
    for args, message in (
        (["--microbatches", "8"], "--microbatches 8: how --pp N pipelines a step"),
        (["--pp", "4"], "--pp 4 pipelines each step in micro-batches: pass --microbatches M"),
        (["--pp", "0"], "--pp 0: the pipeline stages must be at least 1"),
        (["--pp", "2", "--microbatches", "2", "--schedule", "gpipe"], "invalid choice: 'gpipe'"),
    ):
        with pytest.raises(SystemExit):
            plan.main(base + args)
        assert message in capsys.readouterr().err, args
    assert plan.main(base + ["--pp", "3", "--microbatches", "8"]) == 2
    assert "error: estimate: pp=3 does not divide world / (tp x cp) = 8" in capsys.readouterr().err
    assert plan.main(base + ["--pp", "2", "--microbatches", "8", "--virtual-stages", "2"]) == 2
    assert "schedule='1f1b' runs one model chunk a GPU" in capsys.readouterr().err
