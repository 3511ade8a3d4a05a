"""from_deepspeed refuses what would change the numbers if ignored: an enabled compression technique,
ZenFlow's stale updates, and keys of zero_optimization (or of its offload blocks) it does not know; keys that
change nothing stay one warning, and disabled blocks pass silently."""

from __future__ import annotations

import warnings

import pytest
import torch

import zerofn as zf
from zerofn.deepspeed import from_deepspeed
from zerofn.deepspeed._keys import COMPRESSION_TECHNIQUES, OFFLOAD_KNOWN, ZERO_ANYWAY, ZERO_IGNORED

BASE = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _loss_fn():
    apply = zf.functional(torch.nn.Linear(4, 1))
    return lambda p, b: apply(p, b).square().mean()


def _build(extra: dict) -> tuple[zf.Step, list[str]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        step, _ = from_deepspeed({**BASE, **extra}, _loss_fn())
    return step, [str(w.message) for w in record]


def _technique(enabled: bool, name: str = "weight_quantization") -> dict:
    if name == "layer_reduction":
        return {"enabled": enabled, "keep_number_layer": 5}
    return {"shared_parameters": {"enabled": enabled, "schedule_offset": 0}, "different_groups": {}}


@pytest.mark.parametrize("name", sorted(COMPRESSION_TECHNIQUES))
def test_an_enabled_compression_technique_is_an_error_naming_it(name):
    others = {n: _technique(False, n) for n in COMPRESSION_TECHNIQUES if n != name}  # disabled: asks for nothing
    config = {"compression_training": {**others, name: _technique(True, name)}}
    with pytest.raises(ValueError, match=f"compression_training enables {name}: {name} ") as e:
        _build(config)
    assert "which changes the numbers" in str(e.value) and '"shared_parameters": {"enabled": false}' in str(e.value)


def test_compression_with_every_technique_disabled_passes_silently():
    step, warned = _build({"compression_training": {n: _technique(False, n) for n in COMPRESSION_TECHNIQUES}})
    assert step.name == "train_step" and not warned
    with pytest.raises(ValueError, match="enables weight_quantization, activation_quantization: weight_quantization"):
        _build(
            {
                "compression_training": {
                    "weight_quantization": _technique(True),
                    "activation_quantization": _technique(True),
                }
            }
        )


def test_a_misspelled_or_malformed_technique_is_an_error():
    with pytest.raises(ValueError, match=r"compression_training.weight_quantisation: not a technique"):
        _build({"compression_training": {"weight_quantisation": {"bits": 8}}})
    with pytest.raises(ValueError, match=r"compression_training.row_pruning must be a JSON object"):
        _build({"compression_training": {"row_pruning": True}})


def test_zenflow_is_an_error_and_a_disabled_one_passes():
    zenflow = {"topk_ratio": 0.05, "select_strategy": "auto", "update_interval": 4, "overlap_step": True}
    with pytest.raises(ValueError, match=r"zero_optimization.zenflow is set: ZenFlow updates .* stale"):
        _build({"zero_optimization": {"stage": 2, "zenflow": zenflow}})
    step, warned = _build({"zero_optimization": {"stage": 2, "zenflow": {**zenflow, "enabled": False}}})
    assert step.name == "shard_grads(train_step)" and not warned
    assert _build({"zero_optimization": {"stage": 1, "zenflow": None}})[0].name == "shard_optimizer(train_step)"


def test_an_unknown_zero_optimization_key_is_an_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"zero_optimization.stage3_prefetch_bucket: not a zero_optimization key") as e:
        _build({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 1000}})
    assert "stage3_prefetch_bucket_size" in str(e.value) and "check its spelling" in str(e.value)


def test_every_key_deepspeed_documents_for_zero_optimization_is_read_warned_or_silent():
    # Each key of the reader's tables, at DeepSpeed's default or a changed value: never the unknown-key error.
    for key, anyway in ZERO_ANYWAY.items():
        step, warned = _build({"zero_optimization": {"stage": 2, key: anyway.value}})
        assert not warned, key
        step, warned = _build({"zero_optimization": {"stage": 2, key: not anyway.value}})
        assert f"zero_optimization.{key}" in warned[0], key
    for key in ZERO_IGNORED:
        step, warned = _build({"zero_optimization": {"stage": 3, key: 7}})
        assert step.name == "shard_params(train_step)" and f"zero_optimization.{key}" in warned[0], key


def test_offload_blocks_warn_buffer_keys_and_refuse_unknown_ones(tmp_path):
    for key in sorted(OFFLOAD_KNOWN):
        block = {"device": "cpu", key: 4}
        step, warned = _build({"zero_optimization": {"stage": 3, "offload_optimizer": block, "offload_param": block}})
        assert step.name == "offload(shard_params(train_step))", key
        assert f"offload_optimizer.{key}" in warned[0] and f"offload_param.{key}" in warned[0], key
    for key in sorted(OFFLOAD_KNOWN - {"nvme_path"}):  # ZeRO-Infinity's blocks: the same warnings
        block = {"device": "nvme", "nvme_path": str(tmp_path), key: 4}
        step, warned = _build({"zero_optimization": {"stage": 3, "offload_optimizer": block, "offload_param": block}})
        assert step.name == "offload(shard_params(train_step))" and step.storage.param_placement == "nvme", key
        assert f"offload_optimizer.{key}" in warned[0] and f"offload_param.{key}" in warned[0], key
        assert "nvme_path" not in warned[0], key
    with pytest.raises(ValueError, match=r"zero_optimization.offload_optimizer.bufer_count: not an offload key"):
        _build({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "bufer_count": 4}}})
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4, "my_knob": 1}
    with pytest.raises(ValueError, match=r"offload_optimizer.my_knob: not an offload key .* Known: buffer_count"):
        _build({"zero_optimization": {"stage": 2, "offload_optimizer": nvme}})


def test_an_unknown_top_level_key_stays_a_warning():
    step, warned = _build({"my_typo": 1, "zero_optimization": {"stage": 1}})
    assert step.name == "shard_optimizer(train_step)" and "my_typo: unknown key" in warned[0]


def test_a_missing_feature_is_named_before_anything_else_is_read():
    # DeepSpeed's MoQ example: no batch sizes (its script passes them), "auto" nowhere: the error names what
    # zerofn lacks, not the batch sizes it would ask for next.
    moq = {"fp16": {"enabled": True}, "quantize_training": {"enabled": True, "quantize_groups": 8}}
    with pytest.raises(ValueError, match="quantize_training is enabled"):
        from_deepspeed(moq, _loss_fn())
    auto = {"train_micro_batch_size_per_gpu": "auto", "compression_training": {"head_pruning": _technique(True)}}
    with pytest.raises(ValueError, match="compression_training enables head_pruning"):
        from_deepspeed(auto, _loss_fn())


def test_precision_blocks_warn_known_keys_and_refuse_unknown_ones():
    step, warned = _build({"bf16": {"enabled": True, "immediate_grad_update": True, "check_grad_overflow": True}})
    assert step.name == "amp(train_step)"
    assert "bf16.immediate_grad_update" in warned[0] and "bf16.check_grad_overflow" in warned[0]
    with pytest.raises(
        ValueError, match=r"fp16.loss_scale_windw: not a key of DeepSpeed's fp16 block .*loss_scale_window"
    ):
        _build({"fp16": {"enabled": True, "loss_scale_windw": 100}})
    with pytest.raises(ValueError, match=r"bf16.my_knob: not a key of DeepSpeed's bf16 block"):
        _build({"bf16": {"enabled": True, "my_knob": 1}})
    step, warned = _build({"bf16": {"enabled": False, "my_knob": 1}})  # disabled: asks for nothing
    assert step.name == "train_step" and not warned
