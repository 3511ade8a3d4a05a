"""A corpus of DeepSpeed configs written as users write them, each turned into a step by from_deepspeed and
trained on 2 gloo ranks against the composition written by hand: bit for bit.

The styles: a Hugging Face Trainer config with "auto" everywhere (for each ZeRO stage, resolved from the
Trainer's arguments), BERT pre-training with LAMB (DeepSpeed's bing_bert configs: fp16, no bias correction,
the trust ratio clamped), Adam without bias correction (BERT fine-tuning), fp16 with every loss-scale key,
and CPU offload of the optimizer state (bf16 master weights: tests/from_deepspeed/test_deepspeed_optimizers.py trains that config).
"""

from __future__ import annotations

import math

import torch
from helpers import config_vs_hand
from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

import zerofn as zf
from zerofn import optim as O

HIDDEN = 8  # the hidden size the "auto" sizes derive from (the MLP has no Hugging Face config)
ARGS = dict(  # a Trainer's arguments, as a dict of TrainingArguments' fields
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    adam_beta1=0.85,
    adam_beta2=0.98,
    adam_epsilon=1e-7,
    weight_decay=0.05,
    max_grad_norm=0.5,
    warmup_steps=3,
    max_steps=20,
)

HF_AUTO = {  # the Trainer's documented ZeRO config: every number "auto"
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def _hf_stage(stage: int) -> dict:
    zero: dict = {"stage": stage}
    if stage >= 1:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size="auto")
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
            stage3_max_live_parameters=1e9,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    return {**HF_AUTO, "zero_optimization": zero}


def _hf_by_hand(stage: int):
    shard = {0: lambda s: s, 1: shard_optimizer, 2: shard_grads, 3: shard_params}[stage]

    def build(loss_fn):
        lr = O.deepspeed_warmup_lr(3e-3, 0.0, warmup_num_steps=3)
        opt = O.chain(O.clip_by_global_norm(0.5), O.adamw(lr, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.05))
        bucket = HIDDEN * HIDDEN * 4 if stage >= 1 else None  # reduce_bucket_size h*h elements of fp32
        kw = {"bucket_bytes": bucket} if bucket else {}
        return shard(zf.train_step(loss_fn, opt, 2, **kw))

    return build


def _table() -> dict:
    """name -> (config, from_deepspeed keywords, the step written by hand from a loss_fn)."""
    hf = {"training_args": ARGS, "hidden_size": HIDDEN}
    out = {f"hf_auto_stage{s}": (_hf_stage(s), hf, _hf_by_hand(s)) for s in range(4)}
    out["bert_lamb_fp16"] = (  # bing_bert's deepspeed_bsz64k_lamb_config, at this test's batch
        {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 1000,
            "prescale_gradients": False,
            "optimizer": {
                "type": "Lamb",
                "params": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3},
            },
            "gradient_clipping": 1.0,
            "wall_clock_breakdown": False,
            "fp16": {"enabled": True, "loss_scale": 0},
        },
        {},
        lambda f: amp(
            zf.train_step(
                f,
                O.chain(
                    O.clip_by_global_norm(1.0),
                    O.lamb(  # DeepSpeed's FusedLamb defaults: eps 1e-8 (zf.optim.lamb's, optax's: 1e-6)
                        11e-3,
                        eps=1e-8,
                        weight_decay=0.01,
                        bias_correction=False,
                        min_trust_ratio=0.01,
                        max_trust_ratio=0.3,
                    ),
                ),
            ),
            torch.float16,
            loss_scale="dynamic",
        ),
    )
    out["bert_adam_no_bias_correction_offload"] = (  # BingBertSquad's config, with the optimizer state on the host
        {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 3e-3, "weight_decay": 0.0, "bias_correction": False}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        },
        {},
        lambda f: offload(
            shard_optimizer(
                zf.train_step(
                    f, O.chain(O.clip_by_global_norm(1.0), O.adamw(3e-3, weight_decay=0.0, bias_correction=False)), 2
                )
            ),
            "cpu",
        ),
    )
    out["fp16_loss_scale_keys"] = (
        {
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 3,
                "hysteresis": 1,
                "min_loss_scale": 0.5,
            },
            "zero_optimization": {"stage": 2},
        },
        {},
        lambda f: amp(
            shard_grads(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1))),
            torch.float16,
            loss_scale="dynamic",
            init_scale=2.0**12,
            growth_interval=3,
            hysteresis=1,
            min_scale=0.5,
        ),
    )
    return out


def _rank_corpus() -> dict:
    out = {}
    for name, (config, kw, by_hand) in _table().items():
        # steps_per_print and friends: one warning, checked elsewhere
        r = config_vs_hand(config, by_hand, 4, warn="ignore", **kw)
        s, h = r.step, r.hand
        out[name] = (r.equal, r.moved, s.name, h.name, s.accumulate_steps, h.accumulate_steps, r.total)
        out[name] += (float(r.metrics["loss"]),)
    return out


def test_each_corpus_config_trains_as_the_composition_written_by_hand(ranks):
    results = ranks(2).run(_rank_corpus)[0]
    assert set(results) == set(_table())
    for name, (equal, moved, ours, theirs, k, k_hand, _total, loss) in results.items():
        assert ours == theirs and k == k_hand, (name, ours, theirs, k, k_hand)
        assert equal, f"{name}: {ours} from the config differs from the one written by hand after 4 updates"
        assert moved and math.isfinite(loss), name
    assert results["hf_auto_stage0"][-2] == 2 * 2 * 2  # world x per_device_train_batch_size x accumulation
