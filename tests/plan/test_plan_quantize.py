"""The planner's LoRA and QLoRA (``estimate(..., lora_rank=, quantize=)``, ``python -m zerofn plan --lora-rank R
--quantize nf4``) against real runs, the 70B verdict, and the combinations it refuses.

- State: ``estimate(...).state`` against ``zf.memory.state_bytes(state)`` of a small Hugging Face Llama with peft's
  LoRA on its seven projections, ``quantize(step, kind)`` around ``zf.train_step(...)``, on 1 and 2 gloo ranks:
  DDP and ZeRO-3 (``shard_params``), bf16 (``amp``) and fp32, NF4, int8 and an unquantized base, the base's shards
  in CPU RAM too (``offload(..., params="cpu")``). Exact, byte for byte, under ZeRO-3, but for the model's buffers
  (the rotary embedding's ``inv_freq``), which the planner does not count; unsharded, NF4's scalers keep up to 255
  bytes of padding per weight that the codec's parts do not count (1.2 % of this tiny model's state).
- The dequantization transient against ``zf.memory.track()``'s peak of decoding a projection's weight.
- Llama-2-70B with LoRA rank 16 on an NF4 base over 2 x 24 GB GPUs and 128 GB of RAM, 2 x 2048 tokens per GPU:
  what fits, and the figures docs/planning.md shows.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import zerofn as zf
from zerofn import plan
from zerofn.plan import compositions, dequant_bytes, estimate, fmt_bytes, model_shape

pytest.importorskip("peft")
pytest.importorskip("transformers")

RANK = 4
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# A small Llama: grouped-query attention (2 key/value heads of 4), a gated MLP, an untied head. Its projections'
# sizes are whole NF4 blocks but not whole scaler blocks, and the per-unit buffers' lengths are odd where the world
# size 2 pads them.
LLAMA = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    tie_word_embeddings=False,
)

# (stage, mixed precision, quantize, the parameters' shards in CPU RAM)
COMBOS = [
    (0, True, "nf4", False),
    (3, True, "nf4", False),
    (3, False, "nf4", False),
    (3, True, "int8", False),
    (3, True, None, False),
    (3, True, "nf4", True),
    (0, True, "int8", False),
]


def _lora_llama():
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).float()
    return get_peft_model(model, LoraConfig(r=RANK, lora_alpha=8, target_modules=PROJECTIONS, lora_dropout=0.0))


def _loss_fn(apply):
    def loss_fn(params, batch):
        logits = apply(params, input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    return loss_fn


def _rank_measure() -> list[dict]:
    """Every composition on this world size: what the state holds after init, and after one step."""
    from zerofn.transforms import amp, offload, quantize, shard_params

    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    batch = torch.randint(0, LLAMA["vocab_size"], (2 * world, 9), generator=torch.Generator().manual_seed(0))
    out = []
    for stage, mp, kind, params_on_host in COMBOS:
        apply = zf.functional(_lora_llama())
        step = zf.train_step(_loss_fn(apply), zf.optim.adamw(1e-3))
        step = shard_params(step) if stage == 3 else step
        step = amp(step, torch.bfloat16) if mp else step
        step = offload(step, "cpu", params="cpu") if params_on_host else step
        step = quantize(step, kind) if kind else step
        state = step.init(apply.params)
        held = zf.memory.state_bytes(state)
        state, _ = step(state, batch[2 * rank : 2 * rank + 2])
        after = zf.memory.state_bytes(state)
        out.append(dict(combo=(stage, mp, kind, params_on_host), held=held, after=after))
        del state, step, apply
    return out


def _estimate_for(n: int, stage: int, mp: bool, kind, params_on_host: bool):
    return estimate(
        model_shape(LLAMA | {"model_type": "llama"}),
        gpus=n,
        stage=stage,
        mixed_precision=mp,
        optimizer_offload="cpu" if params_on_host else None,
        param_offload="cpu" if params_on_host else None,
        lora_rank=RANK,
        quantize=kind,
        device="cpu",
    )


def test_the_shape_is_the_models():
    """The planner's count of the small Llama is the model's, and its adapters peft's."""
    model = _lora_llama()
    shape = model_shape(LLAMA | {"model_type": "llama"})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    lora = estimate(shape, lora_rank=RANK).lora
    assert (lora.trainable, lora.frozen) == (trainable, frozen) == (13440, shape.params)


@pytest.mark.parametrize("n", [1, 2])
def test_state_matches_state_bytes(ranks, n):
    """Per rank, the state the planner counts (adapters, their optimizer state, the frozen base as it is held:
    quantized parts and the rest in the parameters' dtype, whole or this rank's padded shard of each unit's
    buffers) is what ``state_bytes`` reports, byte for byte under ZeRO-3, in all and per placement, before and
    after a step (unsharded, up to the NF4 scalers' padding, below);
    the state also holds the rotary embedding's buffers, which the planner does not count (its ``inv_freq`` and a
    copy of it: 64 bytes, under 0.1 %)."""
    worst: dict[int, float] = {}
    for rows in ranks(n).run(_rank_measure):
        for r in rows:
            stage, _, kind, _ = r["combo"]
            e = _estimate_for(n, *r["combo"])
            held, what = r["held"], (r["combo"], n)
            assert held == r["after"], what  # a step changes no byte of what the state holds
            # Unsharded (DDP), each NF4 weight's int8 scalers are a view of the encoder's buffer padded to whole
            # scaler blocks of 256, which the state keeps: up to 255 bytes per weight (21 here) more than the
            # codec's parts; ZeRO-3 copies the parts into its flat buffers, exactly.
            slack = 255 * 7 * LLAMA["num_hidden_layers"] if (stage < 3 and kind == "nf4") else 0
            extra = held["params"] + held["optimizer"] - e.state
            assert 0 <= extra <= slack, (what, held, e.state)
            assert 0 < held["buffers"] <= 1e-3 * held["total"], what
            placement = dict(held["by_placement"])
            placement["cpu"] -= held["buffers"] + extra  # the ranks compute on the CPU: one placement for both
            assert placement == e.by_placement("cpu"), (what, placement, e.by_placement("cpu"))
            worst[stage] = max(worst.get(stage, 0), extra / e.state)
    print(f"\n{n} rank(s): ZeRO-3 exact; DDP within {100 * worst[0]:.2f} % (the NF4 scalers' padded views)")


def test_dequant_is_decodings_peak():
    """``Estimate.dequant``: the peak of decoding the largest projection's weight, as ``track()`` measures it (NF4:
    its code-book values beside the scaled weight, the per-block scales and its tables; int8 through fp32), byte for
    byte."""
    from zerofn.transforms.quantize import codec

    for kind in ("nf4", "int8"):
        for dtype in (torch.bfloat16, torch.float32):
            for shape in ((160, 64), (512, 1536), (96, 100)):
                w = torch.randn(*shape, dtype=dtype)
                parts = codec(kind).encode(w)
                with zf.memory.track() as t:
                    codec(kind).decode(parts, w.shape, dtype)
                want = dequant_bytes(kind, w.numel(), dtype)
                assert t.peak == want, (kind, dtype, shape, t.peak, want)
    e = estimate(model_shape(LLAMA | {"model_type": "llama"}), lora_rank=RANK, quantize="nf4")
    assert e.dequant == dequant_bytes("nf4", 64 * 160, torch.bfloat16)  # the MLP's, the largest


# ---------------------------------------------------------------- Llama-2-70B over 2 x 24 GB

# Llama-2-70B's config.json (hidden 8192, MLP 28672, 80 layers, 64 heads, 8 key/value heads, vocabulary 32000)
LLAMA2_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
QLORA_70B = dict(gpus=2, seq=2048, micro_batch=2, lora_rank=16, quantize="nf4")
LIMITS = dict(gpu_memory=24e9, cpu_memory=128e9)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerofn", "plan", *args], capture_output=True, text=True, timeout=120)


def test_verdict_70b_qlora_on_2x24gb_with_the_base_in_ram(tmp_path):
    """Llama-2-70B, LoRA rank 16 on its 560 projections, the base in NF4, 2 x 24 GB GPUs, 128 GB of RAM, 2 sequences
    of 2048 tokens per GPU: the NF4 base is 36.4 GB (0.5157 bytes per projection parameter with its scales, the
    embeddings and head in bf16), so its ZeRO-3 shard alone is 18.2 GB per GPU, and with the gathered units,
    activations (remat) and the dequantized weight no composition that keeps it on the GPU fits. With the base's
    shards in CPU RAM (and the adapters' optimizer state there) and remat it fits: 10.7 GB per GPU, 40.1 GB of RAM."""
    shape = model_shape(LLAMA2_70B)
    rows = compositions(shape, **QLORA_70B)
    fit = [e for e in rows if e.fits(**LIMITS)]
    assert fit and all(e.remat and e.stage == 3 and e.param_offload for e in fit), [e.label for e in fit]
    assert not [e for e in rows if not e.param_offload and e.fits(LIMITS["gpu_memory"])]
    best = fit[0]
    assert best.label == "ZeRO-3 + params on CPU, optimizer on CPU + remat"
    lora = best.lora
    assert lora.trainable == 80 * 16 * (2 * 8192 + 2 * (8192 + 1024) + 2 * 8192 + 3 * (8192 + 28672)) == 207_093_760
    # The base as the codec holds it: every projection's parts, each its own NF4 blocks and scaler blocks.
    from zerofn.transforms.quantize import codec

    nf4 = codec("nf4")
    projections = [(8192, 8192), (8192, 1024), (8192, 1024), (8192, 8192), (8192, 28672), (8192, 28672), (28672, 8192)]
    quantized = 80 * sum(nf4.nbytes(i * o, torch.bfloat16) for i, o in projections)
    rest = 2 * (shape.params - 80 * sum(i * o for i, o in projections))  # embeddings, head, norms in bf16
    assert lora.base_bytes() == quantized + rest
    assert round(lora.bytes_per_quantized(), 4) == 0.5157
    on_gpu = next(e for e in rows if e.stage == 3 and e.remat and not e.optimizer_offload)
    assert on_gpu.frozen == lora.base_bytes(2) and fmt_bytes(on_gpu.frozen) == "18.2 GB"
    assert on_gpu.short(**LIMITS) == ["GPU"]
    # On the GPU with the base in RAM: the gathered units (the root's embeddings and head, three blocks' NF4 parts
    # and adapters with their gradients), activations, the MLP's weight dequantized, a few gradient buckets.
    assert best.params == best.frozen == 0 and best.update == 0
    assert best.dequant == dequant_bytes("nf4", 8192 * 28672, torch.bfloat16)
    assert best.total == best.grads + best.activations + best.gathered + best.dequant
    assert (fmt_bytes(best.total), fmt_bytes(best.cpu_per_node)) == ("10.7 GB", "40.1 GB")
    assert round(best.total / 2**30, 2) == 9.96  # answer.ai measured 14.92 GiB: docs/planning.md on the gap
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA2_70B))
    r = _cli(
        *("--model", str(config), "--lora-rank", "16", "--quantize", "nf4", "--gpus", "2"),
        *("--gpu-memory", "24GB", "--cpu-memory", "128GB", "--seq", "2048", "--micro-batch", "2"),
    )
    assert r.returncode == 0, r.stderr
    want = (
        "recommendation: ZeRO-3 + params on CPU, optimizer on CPU + remat (10.7 GB per GPU, 40.1 GB CPU RAM per node)"
    )
    assert want in r.stdout, r.stdout
    assert "LoRA rank 16 (207M trainable), the base frozen in NF4" in r.stdout
    assert "the projections' 68.5B in NF4 at 0.5157 bytes per parameter" in r.stdout
    # NVMe when RAM is short: 32 GB of RAM does not hold the base's shards (36.4 GB per node); the shards in files
    # beside the optimizer state do.
    r = _cli(
        *("--model", str(config), "--lora-rank", "16", "--quantize", "nf4", "--gpus", "2", "--gpu-memory", "24GB"),
        *("--cpu-memory", "32GB", "--nvme", "1TB", "--seq", "2048", "--micro-batch", "2"),
    )
    assert "recommendation: ZeRO-3 + params on NVMe, optimizer on NVMe + remat (10.7 GB per GPU" in r.stdout, r.stdout


def test_lora_without_quantize_and_int8_count_their_bases():
    """LoRA on a bf16 base holds 2 bytes per frozen parameter, int8 1.0625 (codes and an fp32 scale per 64), NF4
    0.5157; the adapters and their state are the same."""
    shape = model_shape(LLAMA2_70B)
    per = {q: estimate(shape, gpus=2, stage=3, lora_rank=16, quantize=q).lora for q in (None, "int8", "nf4")}
    assert per[None].base_bytes() == 2 * shape.params
    assert per["int8"].bytes_per_quantized() == 1.0625
    assert per[None].trainable == per["int8"].trainable == per["nf4"].trainable
    assert per["nf4"].base_bytes() < per["int8"].base_bytes() < per[None].base_bytes()


# ---------------------------------------------------------------- combinations refused


def test_bad_combinations_are_refused(capsys):
    shape = model_shape(LLAMA2_70B)
    with pytest.raises(ValueError, match=r"quantize='nf4' without lora_rank: .* Pass lora_rank="):
        estimate(shape, stage=3, quantize="nf4")
    with pytest.raises(ValueError, match="inference=True counts 2-byte weights only"):
        estimate(shape, inference=True, lora_rank=16)
    with pytest.raises(ValueError, match="pass a ModelShape .* or layers= and hidden="):
        estimate(70e9, lora_rank=16, quantize="nf4")
    with pytest.raises(ValueError, match="lora_rank must be an int >= 1"):
        estimate(shape, lora_rank=0)
    with pytest.raises(ValueError, match=r"quantize must be one of \['nf4', 'int8'\]"):
        estimate(shape, lora_rank=16, quantize="fp8")
    moe = model_shape({**LLAMA2_70B, "model_type": "mixtral", "num_local_experts": 8})
    with pytest.raises(ValueError, match="mixture-of-experts model .8 experts per block. is not modelled"):
        estimate(moe, lora_rank=16)
    # As a count with layers and hidden it plans, if the projections fit in it; compositions passes both through
    dense = dict(layers=80, hidden=8192, ffn=28672, gated=True, lora_rank=16, quantize="nf4")
    with pytest.raises(ValueError, match="one block's projections hold 973078528 parameters, more than the block's"):
        estimate(70e9, **dense)  # 64 key/value heads (the default, as many as the query heads): 77.8e9 in all
    rows = compositions(70e9, gpus=2, heads=64, kv_heads=8, **dense)
    assert all(e.lora and e.lora.quantize == "nf4" for e in rows)
    base = ["--params", "70e9", "--gpus", "2", "--gpu-memory", "24GB"]
    for args, message in (
        (["--quantize", "nf4"], "--quantize nf4 holds the model's frozen Linear weights quantized"),
        (["--quantize", "nf4"], "Pass --lora-rank R"),
        (["--lora-rank", "16"], "pass --model config.json, or --layers and --hidden"),
        (["--lora-rank", "0", "--layers", "80", "--hidden", "8192"], "must be at least 1"),
        (["--lora-rank", "16", "--layers", "80", "--hidden", "8192", "--inference"], "--inference counts weights only"),
        (["--lora-rank", "16", "--quantize", "fp8"], "invalid choice: 'fp8'"),
    ):
        with pytest.raises(SystemExit) as e:
            plan.main(base + args)
        assert e.value.code == 2 and message in capsys.readouterr().err, (args, message)
