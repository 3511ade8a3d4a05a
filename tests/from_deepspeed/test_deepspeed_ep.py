"""from_deepspeed maps AutoEP, ``"expert_parallel": {"enabled": true, "autoep_size": N}``, to
``expert_parallel(step, N)`` on the built step (outside ``tensor_parallel``, inside ``context_parallel``): the
reader's size and refusals on their own (no transform needed), the batch sizes over every rank of an
expert-parallel group (each feeds its own micro-batch), and on 2 gloo ranks the step named as the composition
written by hand, training bit for bit like it. The arguments of DeepSpeed's own MoE layer that a config may
carry (capacity factors, token dropping, noisy gates, ...) are refused with what zerofn does instead:
dropless routing, no capacity factor."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import zerofn as zf
from zerofn.deepspeed import from_deepspeed
from zerofn.deepspeed._expert import read_expert_parallel

STEPS, MICRO, SEQ = 3, 2, 12
BASE = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _read(block: dict | None = None, world: int = 8, group=None, **top) -> tuple[int, dict]:
    ignored: dict = {}
    raw = dict(top) if block is None else {**top, "expert_parallel": block}
    return read_expert_parallel(raw, world, group, ignored), ignored


def _refused(block: dict | None = None, world: int = 8, **top) -> str:
    with pytest.raises(ValueError) as e:
        _read(block, world, **top)
    return str(e.value)


def test_autoep_size_is_the_expert_parallel_size():
    assert _read({"enabled": True, "autoep_size": 4}) == (4, {})
    assert (
        _read({"enabled": True, "autoep_size": 8, "preset_model": "mixtral", "expert_tensor_parallel_size": 1})[0] == 8
    )
    # DeepSpeed's defaults ask for nothing: the model's own routing, kernels chosen for it
    defaults = {
        "enabled": True,
        "autoep_size": 2,
        "preset_model": "deepseek_v3",
        "use_grouped_mm": True,
        "score_func": "auto",
        "score_apply": "auto",
        "route_norm": None,
        "route_scale": 1.0,
        "top_k": "auto",
        "routed_scaling_factor": "auto",
        "num_expert_groups": None,
        "load_balance_coeff": None,
        "combine_impl": "auto",
    }
    assert _read(defaults) == (2, {})
    # no block, a disabled one, or size 1 (every rank holds every expert): nothing to apply
    assert _read() == (1, {})
    assert _read({"enabled": False, "autoep_size": 4, "capacity_factor": 2.0}) == (1, {})  # DeepSpeed reads none
    assert _read({"enabled": True}) == (1, {})
    assert _read({"enabled": True, "autoep_size": 1}, world=1) == (1, {})
    # without "enabled": true DeepSpeed ignores the block, and so does zerofn, saying so
    size, ignored = _read({"autoep_size": 4})
    assert size == 1 and 'DeepSpeed reads none of its keys without "enabled": true' in ignored["expert_parallel"]


def test_what_changes_no_number_is_warned():
    size, ignored = _read(
        {"enabled": True, "autoep_size": 2, "use_grouped_mm": False, "combine_impl": "legacy_bmm", "x": 1},
        use_tutel=True,
    )
    assert size == 2
    assert ignored["expert_parallel.use_grouped_mm"].startswith("the model's own experts implementation")
    assert ignored["expert_parallel.combine_impl"].startswith("the routed outputs are combined")
    assert ignored["expert_parallel.x"] == "unknown key"
    assert ignored["use_tutel"].startswith("no Tutel kernels")
    # drop_tokens false is zerofn's dropless routing: the capacity keys then ask for nothing
    dropless = {"enabled": True, "autoep_size": 2, "drop_tokens": False, "capacity_factor": 1.25, "use_rts": True}
    assert _read(dropless) == (2, {})


def test_what_would_change_the_numbers_or_the_layout_is_refused():
    ep = {"enabled": True, "autoep_size": 4}
    message = _refused({**ep, "capacity_factor": 1.25})
    assert "expert_parallel.capacity_factor is 1.25" in message and "zerofn's expert_parallel is dropless" in message
    assert "no capacity factor" in message and '"drop_tokens": false' in message
    assert "drop_tokens is True: tokens past an expert's capacity are dropped" in _refused(drop_tokens=True)
    assert "moe.min_capacity is 4" in _refused(moe={"min_capacity": 4})
    assert "eval_capacity_factor is 2" in _refused(moe={"eval_capacity_factor": 2})
    assert "noisy_gate_policy is 'RSample': noise in the gate" in _refused(noisy_gate_policy="RSample")
    assert "use_residual is True: Residual MoE" in _refused({**ep, "use_residual": True})
    assert "top2_2nd_expert_sampling is True" in _refused(moe={"top2_2nd_expert_sampling": True})
    assert "enable_expert_tensor_parallelism is True" in _refused(enable_expert_tensor_parallelism=True)
    assert "moe.num_experts is 8: the model's config says" in _refused(moe={"num_experts": 8})
    message = _refused(moe={"ep_size": 4})
    assert "moe.ep_size is 4" in message and '"expert_parallel": {"enabled": true, "autoep_size": N}' in message
    assert "expert_parallel_size is 4: not a DeepSpeed config key" in _refused(expert_parallel_size=4)
    assert "expert_parallel.top_k is 4: it overrides the model's routing" in _refused({**ep, "top_k": 4})
    assert "expert_parallel.score_func is 'sigmoid'" in _refused({**ep, "score_func": "sigmoid"})
    assert "load_balance_coeff is 0.001: auxiliary-loss-free" in _refused({**ep, "load_balance_coeff": 0.001})
    message = _refused({**ep, "moe_layer_pattern": "model\\.layers\\.\\d+\\.moe"})
    assert "moe_layer_pattern is" in message and "finds the experts of Hugging Face Mixtral" in message
    assert "preset_model is 'qwen3_5_moe': zerofn's expert_parallel needs no preset" in _refused(
        {**ep, "preset_model": "qwen3_5_moe"}
    )
    assert "expert_tensor_parallel_size is 2: zerofn holds each expert whole" in _refused(
        {**ep, "expert_tensor_parallel_size": 2}
    )
    message = _refused({**ep, "autoep_size": 3}, world=8)
    assert "autoep_size 3 does not divide the 8 data-parallel ranks" in message
    assert "autoep_size must be >= 1" in _refused({**ep, "autoep_size": 0})
    with pytest.raises(ValueError, match="group= and expert_parallel.autoep_size together"):
        _read(ep, group=object())


def _loss_fn():
    apply = zf.functional(nn.Linear(4, 1))
    return lambda p, b: apply(p, b).square().mean()


def test_from_deepspeed_refuses_before_building_and_resolves_the_batch_over_every_rank():
    # one process: an autoep_size above 1 divides no data-parallel rank
    with pytest.raises(ValueError, match="autoep_size 2 does not divide the 1 data-parallel ranks"):
        from_deepspeed({**BASE, "expert_parallel": {"enabled": True, "autoep_size": 2}}, _loss_fn())
    with pytest.raises(ValueError, match="capacity_factor is 1.0: a capacity per expert"):
        from_deepspeed({**BASE, "moe": {"capacity_factor": 1.0}}, _loss_fn())
    # size 1 applies nothing; what changes no number is one warning
    config = {
        **BASE,
        "expert_parallel": {"enabled": True, "autoep_size": 1, "use_grouped_mm": False},
        "use_data_before_expert_parallelism": True,
    }
    with pytest.warns(UserWarning, match="expert_parallel.use_grouped_mm: the model's own experts") as w:
        step, batch = from_deepspeed(config, _loss_fn())
    assert "use_data_before_expert_parallelism: zerofn lays out its own mesh" in str(w[0].message)
    assert step.name == "train_step" and (batch.world_size, batch.train_batch_size) == (1, MICRO)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DeepSpeed's default layout, a disabled block: nothing to say
        off = {**BASE, "expert_parallel": {"enabled": False}, "use_data_before_expert_parallelism": False}
        assert from_deepspeed(off, _loss_fn()).step.name == "train_step"


CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 2},
    "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"},
}


def _mixtral() -> nn.Module:
    import transformers
    from transformers import MixtralConfig, MixtralForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return MixtralForCausalLM(cfg).float()


def _train(by_hand: bool) -> dict:
    from zerofn.transforms import expert_parallel, shard_grads

    apply = zf.functional(_mixtral())

    def loss_fn(params, batch):
        logits = apply(params, input_ids=batch[:, :-1]).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    if by_hand:
        opt = zf.optim.adamw(1e-3, weight_decay=0.1)
        step, batch = expert_parallel(shard_grads(zf.train_step(loss_fn, opt)), 2), None
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about
            step, batch = from_deepspeed(CONFIG, loss_fn)
    state = step.init(apply.params)
    rank = zf.collectives.data_rank(step)
    losses = []
    for i in range(STEPS):  # every rank of the expert-parallel group feeds its own micro-batch
        gen = torch.Generator().manual_seed(100 * i + rank)
        state, m = step(state, torch.randint(0, 64, (MICRO, SEQ + 1), generator=gen))
        losses.append(float(m["loss"]))
    return {"name": step.name, "params": step.full_params(state), "losses": losses, "batch": batch, "rank": rank}


def _both() -> tuple[dict, dict]:
    return _train(False), _train(True)


def test_autoep_size_is_expert_parallel_on_the_built_step(ranks):
    import zerofn.transforms

    pytest.importorskip("transformers")
    if not hasattr(zerofn.transforms, "expert_parallel"):
        pytest.skip("zerofn.transforms has no expert_parallel")
    runs = ranks(2).run(_both)
    assert sorted(built["rank"] for built, _ in runs) == [0, 1]  # two data-parallel ranks
    for built, hand in runs:
        assert built["name"] == hand["name"] == "expert_parallel(shard_grads(train_step))", built["name"]
        assert built["losses"] == hand["losses"]
        assert built["params"].keys() == hand["params"].keys()
        for k, v in built["params"].items():
            assert torch.equal(v, hand["params"][k]), k
        # DeepSpeed's train_batch_size counts every rank of an expert-parallel group: each feeds its own
        b = built["batch"]
        assert (b.world_size, b.micro_batch_size, b.train_batch_size) == (2, MICRO, 2 * MICRO)
