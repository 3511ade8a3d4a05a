"""expert_parallel: Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V3 (a shared expert) and GPT-OSS whose experts are
cut over ep ranks train as one process over the concatenated batch, under every ZeRO stage (the experts
sharded over the ranks that hold them, the rest over all), with amp, remat and the global load-balancing
loss, on routing so skewed that a rank receives no token; the all-to-alls' bytes are what the routing sent;
bad sizes and models are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import EXPERTS, HIDDEN, TOP_K, moe_model
from helpers import rank_slice, stats_bytes, tiny_llama
from zerofn.transforms import (
    amp,
    expert_parallel,
    offload,
    quantize,
    remat,
    shard_grads,
    shard_optimizer,
    shard_params,
    tensor_parallel,
)
from zerofn.transforms.quantize import dequantized

import zerofn as zf

pytest.importorskip("transformers")

STEPS, BATCH, SEQ = 4, 8, 8

COMPOSE = {
    "plain": lambda s: s,
    "shard_optimizer": shard_optimizer,
    "shard_grads": shard_grads,
    "shard_params": shard_params,
    "amp": lambda s: amp(shard_params(s), torch.bfloat16),
    "remat": lambda s: remat(shard_params(s)),
    "offload": lambda s: offload(shard_params(s), "cpu"),
    "tp": lambda s: tensor_parallel(shard_params(s), 2),  # attention split over tp, the experts over ep
    "qlora": lambda s: quantize(shard_params(s), "nf4"),  # the frozen base, experts included, held in NF4
}


def _batch(i: int) -> dict:
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + i))
    return {"input_ids": ids, "labels": ids}


def _model(kind: str, skew: bool, lora: bool = False):
    """``skew``: layer 0's router sends every token to experts 0 and 1 (rank 0's at ep 2 and ep 4); ``lora``:
    peft's LoRA on attention's q and v over the frozen model (its adapters' B drawn, so that all train)."""
    model = moe_model(kind)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        return model
    if not skew:
        return model
    layer = model.model.layers[0]
    with torch.no_grad():
        if kind == "deepseek_v3":  # its selection bias, which takes no gradient
            layer.mlp.gate.e_score_correction_bias[:2] += 10.0
        else:  # a coordinate of the residual stream held at +10 for every token, which the router reads
            model.model.embed_tokens.weight[:, 0] = 10.0
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:2, 0] = 5.0
            layer.mlp.gate.weight[2:, 0] = -5.0
    return model


def _loss_fn(apply, aux: bool):
    def model_loss(params, batch):
        return apply(params, **batch).loss

    def with_aux(params, batch):  # the load-balancing term over the global batch (zf.moe), beside a plain mean
        out = apply(params, input_ids=batch["input_ids"], output_router_logits=True)
        logits, labels = out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()
        aux_loss = zf.moe.load_balancing_loss(out.router_logits, num_experts=EXPERTS, top_k=TOP_K)
        return F.cross_entropy(logits.float(), labels) + 0.02 * aux_loss

    return with_aux if aux else model_loss


def _step(kind: str, ep: int, compose: str, variant: str = ""):
    apply = zf.functional(_model(kind, variant == "skew", compose == "qlora"))
    step = zf.train_step(_loss_fn(apply, variant == "aux"), zf.optim.adamw(1e-3, eps=1e-4, weight_decay=0.1))
    step = COMPOSE[compose](step)
    if ep:
        step = expert_parallel(step, ep)
    return apply, step


def _steps(step, state, steps: range) -> tuple:
    """``steps`` of the global batches, each rank on its data rank's share: the state, losses and metrics."""
    here, data = zf.collectives.data_rank(step), zf.collectives.world_size(step.group)
    losses, m = [], None
    for i in steps:
        state, m = step(state, rank_slice(_batch(i), here, data))
        losses.append(float(m["loss"]))
    return state, losses, m


def _train(case: tuple) -> dict:
    """``case``: (model, ep, composition, variant); ep 0: one process over the whole batch. ``routed``: how
    many of this rank's (token, expert) pairs went to each expert of each layer on the last step."""
    kind, ep, compose, variant = case
    apply, step = _step(kind, ep, compose, variant)
    state, losses, m = _steps(step, step.init(apply.params), range(STEPS - 1))
    routed = []
    hooks = [
        experts.register_forward_pre_hook(lambda mod, args: routed.append(torch.bincount(args[1].flatten(), None, 8)))
        for name, experts in apply.module.named_modules()
        if name.endswith("mlp.experts")
    ]
    state, more, m = _steps(step, state, range(STEPS - 1, STEPS))
    for h in hooks:
        h.remove()
    out = {"params": step.full_params(state), "losses": losses + more, "comm": int(m["comm_bytes"])}
    out |= {"name": step.name, "routed": routed[: len(hooks)]}  # the forward's calls (remat's recompute after)
    out["frozen"] = sorted(state.spec.layout.frozen)
    if compose == "qlora":  # exported: the experts' parts decoded into the stacked weights the model holds
        whole = dequantized(step.full_params(state), apply.module)
        _model(kind, False, True).load_state_dict(whole, strict=True)  # a fresh peft model loads them
        out["dequantized"] = {k: v for k, v in whole.items() if ".experts." in k}
    return out | {"data_rank": zf.collectives.data_rank(step), "grad_norm": float(m["grad_norm"])}


def _cases(cases: list) -> dict:
    return {c: _train(c) for c in cases}


REFS: dict = {}


def _check(results: list, case: tuple, tol: float = 1e-5) -> None:
    kind, ep, compose, variant = case
    key = (kind, 0, compose if compose in ("amp", "qlora") else "plain", variant)
    if key not in REFS:
        REFS[key] = _train(key)
    ref = REFS[key]
    tp = 2 if compose == "tp" else 1  # a tensor-parallel pair feeds one micro-batch; every ep rank its own
    assert sorted(r[case]["data_rank"] for r in results) == [i // tp for i in range(len(results))]
    for r in results:
        got = r[case]
        assert got["name"].startswith("expert_parallel("), got["name"]
        assert got["params"].keys() == ref["params"].keys()
        worst = max(float((got["params"][k] - ref["params"][k]).abs().max()) for k in ref["params"])
        assert worst <= tol, (case, worst)
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= tol, (
            case,
            got["losses"],
            ref["losses"],
        )
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= tol * max(1.0, ref["grad_norm"]), (case, got, ref)
        if compose == "qlora":  # the frozen experts: the very numbers one process decodes
            assert all(torch.equal(got["dequantized"][k], v) for k, v in ref["dequantized"].items())


def test_the_skewed_router_sends_every_token_to_rank_0s_experts():
    """The premise of the "skew" cases: in layer 0 every token's two experts are 0 and 1 (rank 0's at ep 2
    and ep 4), so that rank 1 receives no token there and rank 0 every one."""
    model = _model("mixtral", skew=True)
    out = model(input_ids=_batch(0)["input_ids"], output_router_logits=True)
    chosen = torch.topk(out.router_logits[0], TOP_K, dim=-1).indices
    assert set(chosen.flatten().tolist()) == {0, 1}
    model = _model("deepseek_v3", skew=True)
    gate = model.model.layers[0].mlp.gate
    seen = []
    gate.register_forward_hook(lambda m, args, out: seen.append(out[2]))  # (logits, weights, indices)
    model(input_ids=_batch(0)["input_ids"])
    assert set(seen[0].flatten().tolist()) == {0, 1}


def test_ep2_trains_as_one_process_over_the_concatenated_batch(ranks):
    cases = [
        ("mixtral", 2, "plain", ""),  # first: its traffic is checked below
        ("mixtral", 2, "shard_optimizer", ""),
        ("mixtral", 2, "shard_grads", "skew"),
        ("mixtral", 2, "shard_params", "skew"),
        ("mixtral", 2, "shard_params", "aux"),
        ("mixtral", 2, "remat", ""),
        ("mixtral", 2, "amp", ""),
        ("qwen3_moe", 2, "shard_params", ""),
        ("qwen2_moe", 2, "shard_grads", ""),
        ("deepseek_v3", 2, "plain", ""),
        ("deepseek_v3", 2, "shard_params", ""),
        ("gpt_oss", 2, "shard_params", ""),
        ("qwen3_moe", 2, "qlora", ""),
    ]
    results = ranks(2).run(_cases, cases)
    for case in cases:
        _check(results, case, 2e-2 if case[2] == "amp" else 1e-5)
    # QLoRA: the frozen experts held as NF4 parts stacked along the experts (cut with them), not as weights
    frozen = results[0][("qwen3_moe", 2, "qlora", "")]["frozen"]
    assert "base_model.model.model.layers.0.mlp.experts.gate_up_proj_codes" in frozen, frozen
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in frozen), frozen
    # Traffic. The non-expert gradients are all-reduced over both ranks (2 x their bytes), the experts' over
    # the ranks that hold them (each rank alone here: nothing), plus the statistics and the rotary
    # frequencies' average. Each MoE layer's exchanges: the routing counts (8 int64) once, and in forward the
    # rank's T k pairs out and the R rows it received back (its experts' pairs from both ranks, as routed),
    # in backward as many the other way: 2 (T k + R) rows of HIDDEN fp32.
    plain = cases[0]
    params = results[0][plain]["params"]
    experts = sum(p.numel() for k, p in params.items() if ".experts." in k)
    dense = sum(p.numel() for p in params.values()) - experts
    buffers = sum(b.nbytes for b in moe_model("mixtral").buffers() if b.is_floating_point())
    each = 2 * dense * 4 + stats_bytes(len(params), 2) + 2 * buffers
    layers, pairs, local = 2, (BATCH // 2) * SEQ * TOP_K, EXPERTS // 2
    for me, r in enumerate(results):
        received = sum(
            int(o[plain]["routed"][layer][me * local : (me + 1) * local].sum()) for o in results for layer in range(2)
        )
        rows = 2 * (layers * pairs + received)
        assert r[plain]["comm"] == each + layers * EXPERTS * 8 + rows * HIDDEN * 4, (me, r[plain]["comm"], received)


def test_ep4_and_ep2_by_dp2_train_as_one_process(ranks):
    cases = [
        ("mixtral", 4, "shard_params", "skew"),  # one expert per rank... two: ranks 1-3 receive none in layer 0
        ("qwen3_moe", 4, "plain", ""),
        ("deepseek_v3", 4, "shard_grads", ""),
        ("mixtral", 2, "shard_params", ""),  # ep 2 x dp 2: the experts sharded over the 2 ranks that hold them
        ("deepseek_v3", 2, "shard_params", "skew"),
        ("qwen3_moe", 2, "shard_optimizer", ""),
        ("mixtral", 2, "amp", ""),
        ("qwen3_moe", 2, "offload", "skew"),  # the experts' shards in host memory, updated there
        ("mixtral", 2, "tp", ""),  # tp 2 x ep 2
        ("mixtral", 2, "qlora", ""),  # the experts' NF4 parts sharded over the 2 ranks that hold them
    ]
    results = ranks(4).run(_cases, cases)
    for case in cases:
        _check(results, case, 2e-2 if case[2] == "amp" else 1e-5)


def _refusals(_):
    out = {}
    apply = zf.functional(tiny_llama())
    step = expert_parallel(zf.train_step(lambda p, b: apply(p, **b).loss, zf.optim.sgd(0.1)), 2)
    with pytest.raises(ValueError, match="found no experts module") as e:
        step.init(apply.params)
    out["dense"] = str(e.value)
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=3,
    )
    apply = zf.functional(transformers.MixtralForCausalLM(config))
    step = expert_parallel(zf.train_step(lambda p, b: apply(p, **b).loss, zf.optim.sgd(0.1)), 2)
    with pytest.raises(ValueError, match="cannot split 'model.layers.0.mlp.experts'.s 3 experts over 2") as e:
        step.init(apply.params)
    return out


def test_models_and_sizes_it_cannot_split_are_refused(ranks):
    for r in ranks(2).run(_refusals, None):
        assert "use_experts_implementation" in r["dense"]
    apply = zf.functional(moe_model("mixtral"))
    step = zf.train_step(lambda p, b: apply(p, **b).loss, zf.optim.sgd(0.1))
    with pytest.raises(ValueError, match="size 2 does not divide the world size 1"):
        expert_parallel(step, 2)
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        expert_parallel(step, 0)


def _save(args: tuple) -> dict:
    """Half the steps at ep 2 under ``compose`` (shard_params: the experts sharded over the ranks that hold
    them at 4 ranks), saved."""
    path, kind, compose = (*args, "shard_params")[:3]
    apply, step = _step(kind, 2, compose)
    state, _, _ = _steps(step, step.init(apply.params), range(STEPS // 2))
    zf.checkpoint.save(state, path)
    return step.full_params(state)


def _resume(args: tuple) -> dict:
    """The checkpoint loaded into ``(ep, composition)`` (ep 0: no expert parallelism), and the other half."""
    path, kind, ep, compose = args
    apply, step = _step(kind, ep, compose)
    state = zf.checkpoint.load(path, step)
    loaded = step.full_params(state)
    state, losses, _ = _steps(step, state, range(STEPS // 2, STEPS))
    return {"loaded": loaded, "params": step.full_params(state), "losses": losses}


def test_a_checkpoint_at_ep2_resumes_at_ep4_ep1_and_without_expert_parallel(ranks, tmp_path):
    """Saved at ep 2 on 4 ranks (experts over 2 ranks each, the rest over 4), it loads at ep 4, at ep 1 on 2
    ranks, under plain shard_params and on one process, and trains on as one process over all the steps;
    consolidate writes the experts stacked, as the model holds them. Saved at tp 2 x ep 2, it loads there and
    on one process."""
    path = str(tmp_path / "ep2")
    saved = ranks(4).run(_save, (path, "mixtral"))[0]
    reference = _train(("mixtral", 0, "plain", ""))
    runs = {
        "ep 4": ranks(4).run(_resume, (path, "mixtral", 4, "shard_grads"))[0],
        "ep 1": ranks(2).run(_resume, (path, "mixtral", 1, "shard_params"))[0],
        "shard_params": ranks(2).run(_resume, (path, "mixtral", 0, "shard_params"))[0],
        "one process": _resume((path, "mixtral", 0, "plain")),
    }
    for name, run in runs.items():
        assert all(torch.equal(run["loaded"][k], saved[k]) for k in saved), name
        worst = max(float((run["params"][k] - reference["params"][k]).abs().max()) for k in saved)
        assert worst <= 1e-5, (name, worst)
        assert max(abs(a - b) for a, b in zip(run["losses"], reference["losses"][STEPS // 2 :])) <= 1e-5, name
    # tp 2 x ep 2: one part per tensor-parallel rank, each saved by its step's group (dp x ep), its experts whole
    split = str(tmp_path / "tp2_ep2")
    saved_split = ranks(4).run(_save, (split, "mixtral", "tp"))[0]
    runs = {"tp 2 x ep 2": ranks(4).run(_resume, (split, "mixtral", 2, "tp"))[0]}
    runs["one process"] = _resume((split, "mixtral", 0, "plain"))
    for name, run in runs.items():
        assert all(torch.equal(run["loaded"][k], saved_split[k]) for k in saved_split), name
        worst = max(float((run["params"][k] - reference["params"][k]).abs().max()) for k in saved_split)
        assert worst <= 1e-5, (name, worst)
    out = str(tmp_path / "whole.safetensors")
    zf.checkpoint.consolidate(path, out)
    from safetensors.torch import load_file

    whole = load_file(out)
    stacked = "model.layers.0.mlp.experts.gate_up_proj"
    assert whole[stacked].shape == (EXPERTS, 2 * 48, HIDDEN)
    assert torch.equal(whole[stacked], saved[stacked])
