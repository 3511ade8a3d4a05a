"""quantize: a LoRA model whose frozen base is held as NF4 (or int8) trains as the same model whose frozen
weights were replaced by their dequantized values, under every composition, on 1 and 2 gloo ranks; the
base held per rank is the quantized bytes, sharded under shard_params."""

from __future__ import annotations

import tempfile

import pytest
import torch
from helpers import rank_slice, tiny_llama_config
from torch import nn
from zerofn.transforms import amp, offload, quantize, remat, shard_grads, shard_params
from zerofn.transforms.quantize import quantized_layers
from zerofn.transforms.quantize._codecs import codec

import zerofn as zf

pytest.importorskip("peft")

STEPS, GLOBAL_BATCH, SEQ = 4, 4, 12


def _config(layers: int = 2):
    return tiny_llama_config(num_hidden_layers=layers, max_position_embeddings=32)


def _lora_llama(
    dequantized: str | None = None, block_size: int = 64, *, held: torch.dtype = torch.float32, layers: int = 2
) -> nn.Module:
    """A small Llama (grouped-query attention) with LoRA adapters on its attention and MLP projections, the
    same values each call; ``dequantized``: its frozen Linear weights replaced by their ``kind`` round trip
    from the dtype they are ``held`` in (amp's: bf16)."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(layers)).float()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # LoRA starts B at zero; give it values so every adapter trains from step 1
            nn.init.normal_(p, std=0.02)
    if dequantized is not None:
        fmt = codec(dequantized, block_size)
        with torch.no_grad():
            for path, m in model.named_modules():
                if isinstance(m, nn.Linear) and not m.weight.requires_grad and not path.endswith("lm_head"):
                    w = m.weight.to(held)
                    m.weight.copy_(fmt.decode(fmt.encode(w), w.shape, w.dtype))
    return model


def _loss_fn(apply):
    def loss_fn(params, batch):
        out = apply(params, input_ids=batch[:, :-1])
        logits = out.logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return loss_fn


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10 + i))


COMPOSITIONS = {
    "plain": lambda s: s,
    "shard_grads": shard_grads,
    "shard_params": shard_params,
    "shard_params+offload_params": lambda s: offload(shard_params(s), "cpu", params="cpu"),
    "shard_params+remat": lambda s: remat(shard_params(s)),
    # the quantized shards in files, read per unit, the adapters' optimizer state beside them
    "shard_params+offload_params_nvme": lambda s: offload(
        shard_params(s), "nvme", path=tempfile.mkdtemp(prefix="zf-quant-nvme-"), params="nvme"
    ),
    "shard_params+amp": lambda s: amp(shard_params(s), torch.bfloat16),
}


def _adapters(step, state) -> dict:
    full = step.full_params(state)
    return {k: v for k, v in full.items() if "lora_" in k}


def _quantized_bytes(state) -> int:
    """Bytes of the quantized parts this rank holds."""
    layout = state.spec.layout
    return sum(
        shard.numel() * shard.dtype.itemsize
        for bucket, shard in zip(layout.frozen_buckets, state.frozen)
        if any("weight_" in s.name for s in bucket.slots)
    )


def _train(name: str, kind: str | None, dequantized: str | None):
    rank, world = zf.collectives.rank(), zf.collectives.world_size()
    # under amp the base is held (and quantized) in bf16: the reference dequantizes that, exact in fp32
    model = _lora_llama(dequantized, held=torch.bfloat16 if "amp" in name else torch.float32)
    apply = zf.functional(model)
    step = COMPOSITIONS[name](zf.train_step(_loss_fn(apply), zf.optim.adamw(1e-2, weight_decay=0.1)))
    if kind is not None:
        step = quantize(step, kind)
    state = step.init(apply.params)
    start = _adapters(step, state)
    comm = 0
    for i in range(STEPS):
        state, m = step(state, rank_slice(_batch(i), rank, world))
        comm += m["comm_bytes"]
    layers = quantized_layers(model)
    base = sum(q.shape.numel() for q in layers.values())
    held = _quantized_bytes(state) if kind is not None else 0
    # what a unit's gather fills: the full (unsharded, padded) frozen buckets that hold quantized parts
    gathered = sum(
        b.padded * b.dtype.itemsize
        for b in state.spec.layout.frozen_buckets
        if any("weight_" in s.name for s in b.slots)
    )
    info = {"base": base, "comm": comm, "layers": len(layers), "held": held, "gathered": gathered}
    return _adapters(step, state), start, info


def _rank_cases(names: list, kinds: list) -> dict:
    out = {}
    for name in names:
        for kind in kinds:
            got, start, info = _train(name, kind, None)
            ref, _, ref_info = _train(name, None, kind)  # the same LoRA model on the dequantized base, unquantized
            out[(name, kind)] = {
                "worst": max((got[k].double() - ref[k].double()).abs().max().item() for k in ref),
                "moved": min((got[k] - start[k]).abs().max().item() for k in got),
                "keys": got.keys() == ref.keys() and len(got) > 0,
                "info": info,
                "ref_comm": ref_info["comm"],
            }
    return out


NAMES = list(COMPOSITIONS)


@pytest.fixture(scope="module")
def two_ranks(ranks):
    return ranks(2).run(_rank_cases, NAMES, ["nf4"])


def test_nf4_lora_equals_the_dequantized_model_on_one_rank():
    for (name, kind), r in _rank_cases(["plain", "shard_params+remat"], ["nf4", "int8"]).items():
        assert r["keys"] and r["moved"] > 0, (name, kind, r)
        assert r["worst"] <= 1e-6, (name, kind, r)
        assert r["info"]["layers"] == 14  # the 7 projections of 2 blocks; not the embedding nor the head


def test_nf4_lora_equals_the_dequantized_model_on_two_ranks(two_ranks):
    for rank, out in enumerate(two_ranks):
        for (name, _), r in out.items():
            assert r["keys"] and r["moved"] > 0, (name, rank, r)
            assert r["worst"] <= 1e-6, (name, rank, r)


def test_the_base_held_per_rank_and_gathered_is_the_quantized_bytes(two_ranks):
    for out in two_ranks:
        r = out[("shard_params", "nf4")]
        # NF4 with its scales: at most 0.6 bytes per frozen parameter, over the world size
        assert r["info"]["held"] <= 0.6 * r["info"]["base"] / 2, r["info"]
        # and the buffers the units gather those into: the quantized sizes too, not the weights'
        assert 0 < r["info"]["gathered"] <= 0.6 * r["info"]["base"], r["info"]
        # the unit's gathers move the quantized parts: less traffic than the fp32 base by most of its bytes
        assert r["info"]["comm"] < r["ref_comm"] - 2 * 3.0 * r["info"]["base"], (r["info"]["comm"], r["ref_comm"])


def test_a_policy_that_picks_a_trainable_weight_is_refused():
    model = _lora_llama()
    apply = zf.functional(model)
    step = quantize(
        zf.train_step(_loss_fn(apply), zf.optim.adamw(1e-3)), "nf4", policy=lambda p, m: p.endswith("lora_A.default")
    )
    with pytest.raises(ValueError, match=r"whose weight is trainable \(requires_grad=True\)"):
        step.init(apply.params)


def _meta_cases(directory: str) -> dict:
    """A LoRA Llama built on the meta device and read from ``directory`` layer by layer
    (zf.checkpoint.pretrained_init) against the same model built whole: the same state, bit for bit, the
    same training, and an init whose peak holds one layer unquantized, not the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    rank, world = zf.collectives.rank(), zf.collectives.world_size()
    real = _lora_llama(layers=4)
    adapters = {n: p.detach().clone() for n, p in real.named_parameters() if "lora_" in n}
    base = zf.checkpoint.pretrained_init(directory)

    def init_fn(name, meta):
        return adapters[name] if name in adapters else base(name, meta)

    with torch.device("meta"):
        model = LlamaForCausalLM(_config(4))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    sizes = {  # before quantize holds them as parts: the blocks' frozen weights in fp32, and the largest
        "base_bytes": sum(p.numel() * 4 for n, p in real.named_parameters() if not p.requires_grad and "layers." in n),
        "layer_bytes": max(p.numel() * 4 for p in real.parameters()),
    }
    out = {}
    states = {}
    for name, m in (("whole", real), ("meta", model)):
        apply = zf.functional(m)
        fn = init_fn if name == "meta" else None
        step = quantize(shard_params(zf.train_step(_loss_fn(apply), zf.optim.adamw(1e-2)), init_fn=fn), "nf4")
        with zf.memory.track() as t:
            state = step.init(apply.params)
        start = step.full_params(state)
        for i in range(STEPS):
            state, _ = step(state, rank_slice(_batch(i), rank, world))
        states[name] = (start, _adapters(step, state))
        held = zf.memory.state_bytes(state)["total"]
        out[name] = {"peak": t.peak, "held": held}
    (s0, a0), (s1, a1) = states["whole"], states["meta"]
    out["same_start"] = s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    out["same_adapters"] = a0.keys() == a1.keys() and all(torch.equal(a0[k], a1[k]) for k in a0)
    out["parts"] = sum("weight_codes" in k for k in s1)
    out.update(sizes)
    return out


@pytest.fixture(scope="module")
def meta_two_ranks(ranks, tmp_path_factory):
    from transformers import LlamaForCausalLM

    directory = str(tmp_path_factory.mktemp("llama"))
    torch.manual_seed(0)  # the base weights _lora_llama builds
    LlamaForCausalLM(_config(4)).float().save_pretrained(directory)
    return ranks(2).run(_meta_cases, directory)


def test_a_model_built_on_meta_is_quantized_layer_by_layer_from_its_files(meta_two_ranks):
    for rank, out in enumerate(meta_two_ranks):
        assert out["parts"] == 28, out  # the 7 projections of 4 blocks
        assert out["same_start"], rank  # the same codes and scales as quantizing the whole model
        assert out["same_adapters"], rank  # and the same training
        # init's peak from meta: at most that of init from the model already in memory (which the tracker does
        # not count: it was built before) plus two layers' weights, unquantized; below the fp32 base alone
        bound = out["whole"]["peak"] + 2 * out["layer_bytes"]
        assert out["meta"]["peak"] <= bound, (rank, out)
        assert bound < out["base_bytes"], out
        assert out["whole"]["held"] == out["meta"]["held"], out


def _quantized_step(model, sharded: bool = True):
    apply = zf.functional(model)
    step = zf.train_step(_loss_fn(apply), zf.optim.adamw(1e-2, weight_decay=0.1))
    return quantize(shard_params(step) if sharded else step, "nf4"), apply


def _ckpt_cases(root: str) -> dict:
    """Checkpoints of a quantized LoRA state on 2 ranks: the base written every time, once (later saves link
    the first one's file), or not at all (rebuilt from the source model on load); each resumes bit for bit."""
    import os

    rank, world = zf.collectives.rank(), zf.collectives.world_size()
    step, apply = _quantized_step(_lora_llama())
    state = step.init(apply.params)
    out: dict = {"bytes": {}}
    for i in range(2):
        state, _ = step(state, rank_slice(_batch(i), rank, world))
    for mode, path in ((True, "every/step_2"), ("once", "once/step_2"), (False, "none/step_2")):
        out["bytes"][(mode, 2)] = zf.checkpoint.save(state, f"{root}/{path}", frozen=mode).bytes_written
    saved_full = step.full_params(state)
    out["base_bytes"] = _quantized_bytes(state)
    later = state
    for i in range(2, 4):
        later, _ = step(later, rank_slice(_batch(i), rank, world))
    out["bytes"][("once", 4)] = zf.checkpoint.save(later, f"{root}/once/step_4", frozen="once").bytes_written
    frozen = f"rank{rank}.frozen.safetensors"
    out["linked"] = os.stat(f"{root}/once/step_2/{frozen}").st_ino == os.stat(f"{root}/once/step_4/{frozen}").st_ino
    want = _adapters(step, later)
    out["resumed"] = {}
    for path in ("every/step_2", "once/step_2", "none/step_2"):
        fresh, fresh_apply = _quantized_step(_lora_llama())  # the source model, for the base saved without
        loaded = zf.checkpoint.load(f"{root}/{path}", fresh, params=fresh_apply.params)
        full = fresh.full_params(loaded)
        same_state = full.keys() == saved_full.keys() and all(torch.equal(full[k], saved_full[k]) for k in full)
        for i in range(2, 4):
            loaded, _ = fresh(loaded, rank_slice(_batch(i), rank, world))
        got = _adapters(fresh, loaded)
        out["resumed"][path] = same_state and all(torch.equal(got[k], want[k]) for k in want)
    # a base rebuilt from another source than the one saved without it is refused, not trained on
    other = _lora_llama()
    with torch.no_grad():
        other.get_parameter("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight").mul_(2)
    wrong, wrong_apply = _quantized_step(other)
    try:
        zf.checkpoint.load(f"{root}/none/step_2", wrong, params=wrong_apply.params)
        out["refused"] = None
    except zf.checkpoint.CheckpointError as e:
        out["refused"] = str(e)
    out["want"] = saved_full
    return out


@pytest.fixture(scope="module")
def ckpt_two_ranks(ranks, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qckpt"))
    return root, ranks(2).run(_ckpt_cases, root)


def test_checkpoints_save_the_base_every_time_once_or_never_and_resume_bit_for_bit(ckpt_two_ranks):
    _, outs = ckpt_two_ranks
    for rank, out in enumerate(outs):
        assert all(out["resumed"].values()), (rank, out["resumed"])
        assert out["linked"], rank  # the second "once" save links the first one's base file
        b = out["bytes"]
        # "once" writes the base the first time only, "never" not at all: each saves this rank's base bytes less
        assert b[("once", 2)] - b[("once", 4)] >= out["base_bytes"], (rank, b, out["base_bytes"])
        assert b[(True, 2)] - b[(False, 2)] >= out["base_bytes"], (rank, b, out["base_bytes"])
        assert out["refused"] and "differ from the ones it was trained with" in out["refused"], out["refused"]


def test_a_quantized_checkpoint_of_two_ranks_loads_on_one_without_shard_params(ckpt_two_ranks):
    root, outs = ckpt_two_ranks
    want = outs[0]["want"]
    for path in ("every/step_2", "once/step_2"):
        step, apply = _quantized_step(_lora_llama(), sharded=False)
        full = step.full_params(zf.checkpoint.load(f"{root}/{path}", step, params=apply.params))
        assert full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in want), path
    with pytest.raises(zf.checkpoint.CheckpointError, match="saved without its frozen parameters"):
        zf.checkpoint.consolidate(f"{root}/none/step_2", f"{root}/model.safetensors")
