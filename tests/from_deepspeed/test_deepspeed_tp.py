"""from_deepspeed maps AutoTP training, ``"tensor_parallel": {"autotp_size": N}``, to ``tensor_parallel(step, N)``
on the built step: on 2 gloo ranks the step is named as the composition written by hand and trains bit for bit
like it; the batch sizes are DeepSpeed's over the data-parallel ranks; keys that would change the split are
refused, keys that change no number warned."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import tiny_llama
from torch import nn

import zerofn as zf
from zerofn.deepspeed import from_deepspeed

pytest.importorskip("transformers")

STEPS, MICRO, SEQ = 3, 2, 12


def _llama() -> nn.Module:
    return tiny_llama(max_position_embeddings=32)


def _loss_fn(apply):
    def loss_fn(params, batch):
        logits = apply(params, input_ids=batch[:, :-1]).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return loss_fn


CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": False},
}


def _train(by_hand: bool) -> dict:
    from zerofn.transforms import shard_grads, tensor_parallel

    apply = zf.functional(_llama())
    if by_hand:
        opt = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-3, weight_decay=0.1))
        step, batch = tensor_parallel(shard_grads(zf.train_step(_loss_fn(apply), opt)), 2), None
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about
            step, batch = from_deepspeed(CONFIG, _loss_fn(apply))
    state = step.init(apply.params)
    losses = []
    for i in range(STEPS):  # every rank of the tensor-parallel group feeds the same micro-batch
        data = torch.randint(0, 64, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(i))
        state, m = step(state, data)
        losses.append(float(m["loss"]))
    return {"name": step.name, "params": step.full_params(state), "losses": losses, "batch": batch}


def _both() -> tuple[dict, dict]:
    return _train(False), _train(True)


def test_autotp_size_is_tensor_parallel_on_the_built_step(ranks):
    for built, hand in ranks(2).run(_both):
        assert built["name"] == hand["name"] == "tensor_parallel(shard_grads(train_step))", built["name"]
        assert built["losses"] == hand["losses"]
        assert built["params"].keys() == hand["params"].keys()
        for k, v in built["params"].items():
            assert torch.equal(v, hand["params"][k]), k
        # DeepSpeed's train_batch_size counts the data-parallel ranks: 2 ranks at autotp_size 2 are one
        b = built["batch"]
        assert (b.world_size, b.micro_batch_size, b.train_batch_size) == (1, MICRO, MICRO)


def _refused(extra: dict) -> str:
    apply = zf.functional(_llama())
    config = {**CONFIG, "tensor_parallel": extra}
    with pytest.raises(ValueError) as e:
        from_deepspeed(config, _loss_fn(apply))
    return str(e.value)


def test_what_would_change_the_split_is_refused():
    # one process: a size that does not divide the world
    assert "autotp_size 2 does not divide the world size 1" in _refused({"autotp_size": 2})
    assert "tensor_parallel.partition_config is set: a custom split" in _refused(
        {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": [".*o_proj"], "partition_type": "row"}]}}
    )
    assert "tensor_parallel.injection_policy_tuple is set" in _refused(
        {"autotp_size": 2, "injection_policy_tuple": [1]}
    )
    assert "preset_model is 'bloom'" in _refused({"autotp_size": 2, "preset_model": "bloom"})
    assert "tp.tp_size is 4 but tensor_parallel.autotp_size is 2" in _refused({"autotp_size": 2, "tp": {"tp_size": 4}})
    assert "tensor_parallel.tp.mpu is set" in _refused({"autotp_size": 2, "tp": {"mpu": "mine"}})


def test_no_split_asks_nothing_and_what_changes_no_number_is_warned():
    apply = zf.functional(_llama())
    for extra in ({"autotp_size": 0}, {"autotp_size": 1, "preset_model": "llama", "tp": {"tp_size": 1}}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step, _ = from_deepspeed({**CONFIG, "tensor_parallel": extra}, _loss_fn(apply))
        assert step.name == "shard_grads(train_step)"
    with pytest.warns(UserWarning, match="tensor_parallel.tp_overlap_comm: the tensor-parallel all-reduces") as w:
        from_deepspeed(
            {**CONFIG, "tensor_parallel": {"autotp_size": 1, "tp_overlap_comm": True, "dtype": "bf16"}}, _loss_fn(apply)
        )
    assert "tensor_parallel.dtype: the parameters' dtype is the precision block's" in str(w[0].message)


ALST = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3},
    "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True},
    "sequence_parallel_size": 2,
}


def _train_alst(by_hand: bool) -> dict:
    from zerofn.transforms import context_parallel, remat, shard_params

    apply = zf.functional(_llama())

    def loss_fn(params, batch):
        return apply(params, **batch).loss

    if by_hand:
        opt = zf.optim.adamw(1e-3, weight_decay=0.1)
        step = context_parallel(remat(shard_params(zf.train_step(loss_fn, opt)), offload="cpu"), 2)
        batch = None
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about: cpu_checkpointing is remat's offload now
            step, batch = from_deepspeed(ALST, loss_fn)
    state = step.init(apply.params)
    losses = []
    for i in range(STEPS):  # the ranks of a sequence-parallel group feed the same micro-batch, cut by the step
        ids = torch.randint(0, 64, (MICRO, SEQ), generator=torch.Generator().manual_seed(i))
        state, m = step(state, {"input_ids": ids, "labels": ids})
        losses.append(float(m["loss"]))
    return {"name": step.name, "params": step.full_params(state), "losses": losses, "batch": batch}


def _both_alst() -> tuple[dict, dict]:
    return _train_alst(False), _train_alst(True)


def test_sequence_parallel_size_is_context_parallel_and_cpu_checkpointing_remat_offload(ranks):
    for built, hand in ranks(2).run(_both_alst):
        assert built["name"] == hand["name"] == "context_parallel(remat(shard_params(train_step)))", built["name"]
        assert built["losses"] == hand["losses"]
        for k, v in built["params"].items():
            assert torch.equal(v, hand["params"][k]), k
        b = built["batch"]  # DeepSpeed's batch sizes count the data-parallel ranks: 2 ranks at sp 2 are one
        assert (b.world_size, b.micro_batch_size, b.train_batch_size) == (1, MICRO, MICRO)
