"""``from_deepspeed``: DeepSpeed configs build the Step one would compose by hand, bit for bit on 2 ranks, whose
states are interchangeable with the hand-written step's; DeepSpeed's schedulers, batch-size rule, example configs from its docs, and the errors for bad configs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings

import pytest
import torch
from helpers import config_vs_hand, make_mlp, mlp_batch, train

import zerofn as zf
from zerofn import collectives as C
from zerofn.deepspeed import DeepSpeedConfig, DeepSpeedRun, batch_sizes, from_deepspeed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- DeepSpeed's schedulers, as its code computes them


class _DeepSpeedLR:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (deepspeed/runtime/lr_schedules.py), driven as its
    engine drives them: the constructor sets the lr of the first update (last_batch_iteration = -1), and
    ``step()`` runs after every update. ``lrs(n)`` is the lr each of the first n updates runs at."""

    def __init__(self, kind, lr=None, **p):
        self.kind, self.lr, self.p = kind, lr, p
        self.w = max(2, p.get("warmup_num_steps", 1000))
        self.type = p.get("warmup_type", "log")
        self.inverse_log = 1.0 / math.log(self.w)

    def _gamma(self, it):
        if self.type == "log":
            return self.inverse_log * math.log(it + 1)
        return it / self.w

    def get_lr(self, it):
        p = self.p
        if self.kind == "WarmupCosineLR":
            if it < 0:
                return 0.0
            if it < self.w:
                ratio = self._gamma(it)
                wmin = p.get("warmup_min_ratio", 0.0)
                ratio = wmin + ratio * (1.0 - wmin)
            else:
                total = p["total_num_steps"]
                cmin = p.get("cos_min_ratio", 0.0001)
                ratio = (1 + math.cos(math.pi * (it - self.w + 1) / (total - self.w))) / 2
                ratio = max(0.0, cmin + (1.0 - cmin) * ratio)
            return self.lr * ratio
        lo = p.get("warmup_min_lr", 0.0)
        hi = p.get("warmup_max_lr", self.lr if self.kind == "WarmupLR" else 0.001)
        if it < 0:
            return lo
        if it < self.w:
            gamma = self._gamma(it)
        elif self.kind == "WarmupLR":
            gamma = 1.0
        else:
            total = p["total_num_steps"]
            gamma = max(0.0, float(total - it) / float(max(1.0, total - self.w)))
        return lo + (hi - lo) * gamma

    def lrs(self, n):
        it, out = -1, []
        for _ in range(n):
            out.append(self.get_lr(it))  # this update's lr
            it += 1  # engine.step(): optimizer.step(), then lr_scheduler.step()
        return out


SCHEDULES = [
    ("WarmupLR", 0.01, {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-2, "warmup_num_steps": 7}),
    ("WarmupLR", 0.01, {"warmup_num_steps": 5, "warmup_type": "linear"}),  # warmup_max_lr: the optimizer's lr
    ("WarmupLR", 0.01, {"warmup_num_steps": 0}),  # DeepSpeed warms up over at least 2
    ("WarmupDecayLR", 0.5, {"total_num_steps": 30, "warmup_min_lr": 1e-3, "warmup_num_steps": 6}),  # max: 0.001
    (
        "WarmupDecayLR",
        0.5,
        {"total_num_steps": 20, "warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"},
    ),
    ("WarmupCosineLR", 0.3, {"total_num_steps": 25, "warmup_num_steps": 5}),
    (
        "WarmupCosineLR",
        0.3,
        {
            "total_num_steps": 25,
            "warmup_num_steps": 5,
            "warmup_min_ratio": 0.2,
            "cos_min_ratio": 0.1,
            "warmup_type": "linear",
        },
    ),
]


@pytest.mark.parametrize("kind,lr,params", SCHEDULES)
def test_schedules_equal_deepspeeds_lr_for_every_update(kind, lr, params):
    assert _lr_sequence(kind, lr, params, 40) == _DeepSpeedLR(kind, lr, **params).lrs(40)


def _lr_sequence(kind, lr, params, n):
    """The lr of each of the first n updates of SGD (no momentum) under from_deepspeed's schedule."""
    step = from_deepspeed(
        {
            "train_batch_size": 1,
            "optimizer": {"type": "SGD", "params": {"lr": lr}},
            "scheduler": {"type": kind, "params": params},
        },
        lambda p, b: b,
    ).step
    opt = step.optimizer
    params_ = {"w": torch.zeros((), dtype=torch.float64)}
    state = opt.init(params_)
    out = []
    for _ in range(n):
        updates, state = opt.update({"w": torch.ones((), dtype=torch.float64)}, state, params_)
        out.append(-float(updates["w"]))  # sgd's update is -lr * grad
    return out


def test_schedule_functions_are_deepspeeds_by_update_count():
    ds = _DeepSpeedLR("WarmupLR", 1e-3, warmup_num_steps=10).lrs(30)
    assert [zf.optim.deepspeed_warmup_lr(1e-3, warmup_num_steps=10)(c) for c in range(30)] == ds
    assert ds[0] == ds[1] == 0.0 and ds[2] > 0  # the first two updates run at warmup_min_lr
    ds = _DeepSpeedLR("WarmupCosineLR", 2.0, total_num_steps=12, warmup_num_steps=3).lrs(12)
    assert [zf.optim.deepspeed_warmup_cosine_lr(2.0, 12, warmup_num_steps=3)(c) for c in range(12)] == ds
    assert ds[0] == 0.0  # as in DeepSpeed: lr 0 for the first update
    with pytest.raises(ValueError, match="warmup_type"):
        zf.optim.deepspeed_warmup_lr(1e-3, warmup_type="cosine")
    with pytest.raises(ValueError, match="total_num_steps"):
        zf.optim.deepspeed_warmup_cosine_lr(1e-3, 10, warmup_num_steps=10)


# ---------------------------------------------------------------- configs against the same composition by hand


def _table(tmp: str) -> dict:
    """name -> (DeepSpeed config, the Step written by hand for loss_fn). Global batch 8 over 2 ranks."""
    from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

    from zerofn import optim as O

    def nvme(name):
        path = os.path.join(tmp, name)
        os.makedirs(path, exist_ok=True)
        return path

    def sched(kind, lr, **p):
        lrs = _DeepSpeedLR(kind, lr, **p).lrs(64)
        return lambda count: lrs[count]  # DeepSpeed's lr for each update, computed from its formulas

    adamw = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
    return {
        "stage0_sgd_nesterov": (
            {
                "train_batch_size": 8,
                "optimizer": {
                    "type": "SGD",
                    "params": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
                },
            },
            lambda f, _: zf.train_step(f, O.sgd(0.05, 0.9, True, 1e-3)),
        ),
        "stage1_adam_l2": (  # Adam with adam_w_mode false: L2 weight decay
            {
                "train_micro_batch_size_per_gpu": 4,
                "zero_optimization": {"stage": 1},
                "optimizer": {
                    "type": "Adam",
                    "params": {
                        "lr": 1e-2,
                        "betas": [0.8, 0.99],
                        "eps": 1e-6,
                        "weight_decay": 0.01,
                        "adam_w_mode": False,
                    },
                },
            },
            lambda f, _: shard_optimizer(zf.train_step(f, O.adam(1e-2, (0.8, 0.99), 1e-6, 0.01))),
        ),
        "stage2_accumulate_clip": (  # "Adam" is AdamW by default (adam_w_mode true)
            {
                "train_batch_size": 8,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 0.05,
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 100},
                "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            },
            lambda f, _: shard_grads(
                zf.train_step(
                    f, O.chain(O.clip_by_global_norm(0.05), O.adamw(1e-2, weight_decay=0.1)), 2, bucket_bytes=400
                )
            ),
        ),
        "stage3_warmup_lr_no_prefetch": (
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_num_steps": 4}},
                "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0},
            },
            lambda f, _: shard_params(
                zf.train_step(
                    f, O.adamw(sched("WarmupLR", 1e-2, warmup_min_lr=1e-3, warmup_num_steps=4), weight_decay=0.1)
                ),
                prefetch=0,
            ),
        ),
        "bf16_warmup_decay_reduce_fp32": (
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "bf16": {"enabled": True},
                "communication_data_type": "fp32",
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {
                        "total_num_steps": 6,
                        "warmup_max_lr": 2e-2,
                        "warmup_num_steps": 2,
                        "warmup_type": "linear",
                    },
                },
                "zero_optimization": {"stage": 1},
            },
            lambda f, _: amp(
                shard_optimizer(
                    zf.train_step(
                        f,
                        O.adamw(
                            sched(
                                "WarmupDecayLR",
                                1e-2,
                                total_num_steps=6,
                                warmup_max_lr=2e-2,
                                warmup_num_steps=2,
                                warmup_type="linear",
                            ),
                            weight_decay=0.1,
                        ),
                    )
                ),
                torch.bfloat16,
                reduce_dtype=torch.float32,
            ),
        ),
        "fp16_dynamic_warmup_cosine": (
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "fp16": {
                    "enabled": True,
                    "loss_scale": 0,
                    "initial_scale_power": 8,
                    "loss_scale_window": 2,
                    "hysteresis": 1,
                    "min_loss_scale": 2,
                },
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {
                        "total_num_steps": 8,
                        "warmup_num_steps": 2,
                        "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.2,
                    },
                },
                "zero_optimization": {"stage": 2},
            },
            lambda f, _: amp(
                shard_grads(
                    zf.train_step(
                        f,
                        O.adamw(
                            sched(
                                "WarmupCosineLR",
                                1e-2,
                                total_num_steps=8,
                                warmup_num_steps=2,
                                warmup_min_ratio=0.1,
                                cos_min_ratio=0.2,
                            ),
                            weight_decay=0.1,
                        ),
                    )
                ),
                torch.float16,
                loss_scale="dynamic",
                init_scale=256.0,
                growth_interval=2,
                hysteresis=1,
                min_scale=2.0,
            ),
        ),
        "fp16_static_stage0": (
            {"train_batch_size": 8, "optimizer": adamw, "fp16": {"enabled": True, "loss_scale": 128}},
            lambda f, _: amp(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1)), torch.float16, loss_scale=128.0),
        ),
        "offload_cpu_bf16": (
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            },
            lambda f, _: offload(
                amp(shard_grads(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1))), torch.bfloat16), "cpu"
            ),
        ),
        "offload_params": (
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "cpu"},
                },
            },
            lambda f, _: offload(shard_params(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1))), "cpu", params=True),
        ),
        "nvme_sub_groups": (  # sub_group_size elements x (2 Adam moments x 4 bytes)
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "zero_optimization": {
                    "stage": 1,
                    "sub_group_size": 600,
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme("ds-nvme")},
                },
            },
            lambda f, _: offload(
                shard_optimizer(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1))),
                "nvme",
                path=nvme("hand-nvme"),
                sub_group_bytes=600 * 8,
            ),
        ),
        "nvme_bf16_stage3": (  # ... plus amp's fp32 master: 12 bytes per element
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "bf16": {"enabled": True},
                "zero_optimization": {
                    "stage": 3,
                    "sub_group_size": 500,
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme("ds-nvme3")},
                },
            },
            lambda f, _: offload(
                amp(shard_params(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1))), torch.bfloat16),
                "nvme",
                path=nvme("hand-nvme3"),
                sub_group_bytes=500 * 12,
            ),
        ),
        "params_in_ram_optimizer_on_nvme": (  # ZeRO-Infinity's arrangement for a model larger than the GPU
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme("ds-inf")},
                    "offload_param": {"device": "cpu"},
                },
            },
            lambda f, _: offload(
                shard_params(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1))),
                "nvme",
                path=nvme("hand-inf"),
                params="cpu",
            ),
        ),
        "zero_infinity": (  # ZeRO-Infinity as DeepSpeed writes it: the parameter shards in files beside the state
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "nvme_path": nvme("ds-infinity")},
                    "offload_param": {"device": "nvme", "nvme_path": nvme("ds-infinity")},
                },
            },
            lambda f, _: offload(
                shard_params(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1))),
                "nvme",
                path=nvme("hand-infinity"),
                params="nvme",
            ),
        ),
        "zeropp": (  # ZeRO++'s qwZ and qgZ, and hpZ within nodes of one rank (two "nodes" of one)
            {
                "train_batch_size": 8,
                "optimizer": adamw,
                "zero_optimization": {
                    "stage": 3,
                    "zero_hpz_partition_size": 1,
                    "zero_quantized_weights": True,
                    "zero_quantized_nontrainable_weights": True,
                    "zero_quantized_gradients": True,
                },
            },
            lambda f, _: shard_params(
                zf.train_step(f, O.adamw(1e-2, weight_decay=0.1)), gather_dtype="int8", reduce_dtype="int8"
            ),
        ),
        "mics": (  # MiCS: sharded within groups of mics_shard_size ranks, replicated across (hybrid sharding)
            {"train_batch_size": 8, "optimizer": adamw, "zero_optimization": {"stage": 2, "mics_shard_size": 1}},
            lambda f, _: shard_grads(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1)), replicate=C.world_size()),
        ),
        "remat_small_buckets": (  # reduce_bucket_size counts elements: 50 fp32 elements are 200 bytes
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
                "optimizer": adamw,
                "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False},
                "zero_optimization": {"stage": 2, "reduce_bucket_size": 50},
            },
            lambda f, _: remat(shard_grads(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1), 2, bucket_bytes=200))),
        ),
    }


def _rank_table(tmp: str) -> dict:
    rank, world = C.rank(), C.world_size()
    out = {}
    for name, (config, by_hand) in _table(tmp).items():
        r = config_vs_hand(config, lambda f, by_hand=by_hand: by_hand(f, tmp), 5)  # maps without a warning
        step, hand, total = r.step, r.hand, r.total
        assert hand.accumulate_steps == step.accumulate_steps and total == 8
        # Interchangeable: the hand-written step updates the from_deepspeed state once more, and vice versa.
        state, _ = train(hand, r.state, mlp_batch, 1, total, world, rank)
        state2, _ = train(step, r.hand_state, mlp_batch, 1, total, world, rank)
        ours, theirs = hand.full_params(state), step.full_params(state2)
        swapped = all(torch.equal(ours[k], theirs[k]) for k in ours)
        same = _parts(step) == _parts(hand)
        out[name] = (r.equal, r.moved, same, swapped, step.name, hand.name, float(r.metrics["loss"]))
    return out


def _parts(step) -> tuple:
    """What a step is made of, but the optimizer (functions); paths left out."""

    def options(o):
        if dataclasses.is_dataclass(o):  # an options record: its type and its fields
            return type(o).__name__, options(tuple(getattr(o, f.name) for f in dataclasses.fields(o)))
        return (
            tuple("<dir>" if isinstance(x, str) and os.path.isdir(x) else x for x in o) if isinstance(o, tuple) else o
        )

    exts = [(e.name, options(e.options)) for e in step.extensions]
    return step.accumulate_steps, step.bucket_bytes, step.reduction, options(step.storage), step.precision, exts


def test_each_config_is_the_composition_written_by_hand(ranks, tmp_path):
    results = ranks(2).run(_rank_table, str(tmp_path))[0]
    for name, (equal, moved, same_parts, swapped, ours, theirs, loss) in results.items():
        assert equal, f"{name}: {ours} differs from {theirs} written by hand after 5 steps"
        assert same_parts, f"{name}: {ours} has other settings (buckets, prefetch, loss scale, offload) than by hand"
        assert moved and math.isfinite(loss), name
        assert ours == theirs, (name, ours, theirs)  # no extension of its own: the same name, so the same states
        assert swapped, f"{name}: each step stepping the other's state differs from stepping its own"


def test_a_state_of_the_config_and_one_of_the_hand_written_step_are_interchangeable():
    """On one process (the 2-rank table above checks every config): the same name, so each step takes the other's
    state, and stepping the other's state gives what stepping its own does."""
    from zerofn.transforms import amp, shard_grads

    from zerofn import optim as O

    config = {
        "train_batch_size": 4,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
    }
    step, batch = from_deepspeed(config, make_mlp()[2])
    optimizer = O.chain(O.clip_by_global_norm(1.0), O.adamw(1e-2, weight_decay=0.1))
    hand = amp(shard_grads(zf.train_step(make_mlp()[2], optimizer)), torch.bfloat16)
    assert step.name == hand.name == "amp(shard_grads(train_step))"

    def params():
        return make_mlp()[1].params  # the same numbers each time, in a module of their own (init takes them over)

    hand.check_state(step.init(params()))
    step.check_state(hand.init(params()))
    ours, _ = train(hand, step.init(params()), mlp_batch, 3, batch.train_batch_size, 1, 0)
    theirs, _ = train(step, hand.init(params()), mlp_batch, 3, batch.train_batch_size, 1, 0)
    alone, _ = train(step, step.init(params()), mlp_batch, 3, batch.train_batch_size, 1, 0)
    ours, theirs, alone = hand.full_params(ours), step.full_params(theirs), step.full_params(alone)
    assert all(torch.equal(ours[k], theirs[k]) and torch.equal(ours[k], alone[k]) for k in ours)
    assert not all(torch.equal(ours[k], v) for k, v in params().items())


# ---------------------------------------------------------------- batch sizes


def test_batch_sizes_follow_deepspeeds_rule():
    assert batch_sizes({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4) == (32, 4, 2)
    assert batch_sizes({"train_batch_size": 32}, 4).micro_batch_size == 8  # a record: the sizes by name
    assert batch_sizes({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4) == (32, 4, 2)
    assert batch_sizes({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4) == (32, 4, 2)
    assert batch_sizes({"train_batch_size": 32}, 4) == (32, 8, 1)
    assert batch_sizes({"train_micro_batch_size_per_gpu": 4}, 4) == (16, 4, 1)
    assert batch_sizes({"train_batch_size": 3.2e1, "train_micro_batch_size_per_gpu": 4}, 4) == (32, 4, 2)
    # one "auto" among two numbers: derived, as the Trainer would have
    assert batch_sizes(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4
    ) == (32, 4, 2)
    with pytest.raises(
        ValueError,
        match=r"train_batch_size 30 must equal train_micro_batch_size_per_gpu 4 x "
        r"gradient_accumulation_steps 2 x world size 4 \(= 32\)",
    ):
        batch_sizes({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4)
    with pytest.raises(
        ValueError,
        match=r"train_batch_size 6 .* not a multiple of train_micro_batch_size_per_gpu 4 x "
        r"world size 4 \(= 16\): no whole gradient_accumulation_steps",
    ):
        batch_sizes({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}, 4)
    with pytest.raises(ValueError, match=r"not a multiple of gradient_accumulation_steps 1 x world size 4 \(= 4\)"):
        batch_sizes({"train_batch_size": 6}, 4)
    with pytest.raises(ValueError, match="give train_batch_size or train_micro_batch_size_per_gpu"):
        batch_sizes({"gradient_accumulation_steps": 2}, 1)
    with pytest.raises(ValueError, match='train_micro_batch_size_per_gpu is "auto".*per_device_train_batch_size'):
        batch_sizes(
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}, 1
        )
    with pytest.raises(ValueError, match="whole number"):
        batch_sizes({"train_batch_size": 8.5}, 1)


def test_the_micro_batch_size_and_the_resolved_config_are_beside_the_step():
    run = from_deepspeed(
        {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4, "optimizer": {"type": "AdamW"}},
        lambda p, b: b,
    )
    step, batch = run
    assert isinstance(run, DeepSpeedRun) and run.step is step and run.batch is batch
    assert batch.micro_batch_size == 3 and step.accumulate_steps == 4
    assert batch == DeepSpeedConfig(12, 3, 4, 1, ())
    assert step.extensions == () and step.name == "train_step"  # nothing of its own on the step


# ---------------------------------------------------------------- the optimizer mapping


def _first_update(opt) -> float:
    """The first update of ``opt`` for a parameter 1 with gradient 1 (float64)."""
    p = {"w": torch.ones(1, dtype=torch.float64)}
    updates, _ = opt.update({"w": torch.ones(1, dtype=torch.float64)}, opt.init(p), p)
    return float(updates["w"])


def _config_update(config_optimizer: dict) -> float:
    return _first_update(
        from_deepspeed({"train_batch_size": 1, "optimizer": config_optimizer}, lambda p, b: b).step.optimizer
    )


def test_adam_is_adamw_unless_adam_w_mode_is_false():
    lr, wd = 0.1, 0.5
    adamw = _first_update(zf.optim.adamw(lr, weight_decay=wd))
    assert adamw == pytest.approx(-lr - lr * wd)  # decoupled: the decay is lr * wd * p
    assert _config_update({"type": "Adam", "params": {"lr": lr, "weight_decay": wd}}) == adamw
    assert _config_update({"type": "AdamW", "params": {"lr": lr, "weight_decay": wd, "adam_w_mode": False}}) == adamw
    adam = _config_update({"type": "Adam", "params": {"lr": lr, "weight_decay": wd, "adam_w_mode": False}})
    assert adam == _first_update(zf.optim.adam(lr, weight_decay=wd)) == pytest.approx(-lr)  # L2, normalised away
    # no decay by default (FusedAdam's), torch.optim.AdamW's 0.01 with torch_adam
    assert _config_update({"type": "AdamW", "params": {"lr": lr}}) == pytest.approx(-lr)
    assert _config_update({"type": "AdamW", "params": {"lr": lr, "torch_adam": True}}) == pytest.approx(-lr - lr * 0.01)


# ---------------------------------------------------------------- DeepSpeed's own example configs


def _build(config):
    _, _, loss_fn = make_mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = from_deepspeed(config, loss_fn).step
    return step, [str(w.message) for w in caught]


def test_deepspeed_example_configs_load(tmp_path):
    # Getting started (deepspeed.ai/getting-started): the boolean zero_optimization is stage 1.
    step, warned = _build(
        {
            "train_batch_size": 8,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
            "fp16": {"enabled": True},
            "zero_optimization": True,
        }
    )
    assert step.name == "amp(shard_optimizer(train_step))" and not warned
    # config-json: the Adam, WarmupLR and fp16 examples, with the ZeRO tutorial's stage-2 block.
    config = {
        "train_batch_size": 16,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 32,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "zero_optimization": {
            "stage": 2,
            "contiguous_gradients": True,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e8,
            "allgather_bucket_size": 5e8,
        },
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    step, warned = _build(str(path))
    assert step.name == "amp(shard_grads(train_step))"
    assert step.bucket_bytes == 5 * 10**8 * 2  # elements of fp16 parameters
    assert float(step.precision.new_loss_scale().scale) == 2.0**32
    assert (
        len(warned) == 1 and "steps_per_print" in warned[0] and "zero_optimization.allgather_bucket_size" in warned[0]
    )
    assert "wall_clock_breakdown" not in warned[0] and "overlap_comm" not in warned[0]  # false / done anyway
    # ZeRO-3 (deepspeed.readthedocs.io, zero3.html): AdamW and fp16, the optimizer and the parameters on the CPU.
    step, warned = _build(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            },
            "fp16": {"enabled": True},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7},
            },
        }
    )
    assert step.name == "offload(amp(shard_params(train_step)))" and not warned
    assert step.storage.param_placement == "cpu"  # parameter shards in CPU RAM
    # A Hugging Face style ZeRO-3 config: "auto" sizes that only tune performance take zerofn's defaults.
    step, warned = _build(
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
            "gradient_clipping": 1.0,
            "zero_optimization": {
                "stage": 3,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "sub_group_size": 1e9,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 1e9,
                "stage3_max_reuse_distance": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True,
            },
        }
    )
    assert step.name == "amp(shard_params(train_step))" and step.storage.prefetch == 1
    assert step.bucket_bytes == zf.step.DEFAULT_BUCKET_BYTES
    for key in (
        "sub_group_size",
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save",
    ):
        assert f"zero_optimization.{key}" in warned[0], key
    # ZeRO-Infinity (zero3.html): the optimizer state and the parameter shards on NVMe, with DeepSpeed's buffer
    # settings (warned: zerofn streams sub-groups of sub_group_size) and the path spelled once with a trailing "/".
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True, "buffer_count": 4}
    step, warned = _build(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
            "fp16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": nvme,
                "offload_param": {**nvme, "nvme_path": str(tmp_path) + "/", "buffer_size": 1e8, "max_in_cpu": 1e9},
            },
        }
    )
    assert step.name == "offload(amp(shard_params(train_step)))"
    assert step.storage.param_placement == "nvme" and os.path.samefile(step.storage.param_path, tmp_path)
    assert len(warned) == 1 and all(
        f"zero_optimization.{key}" in warned[0]
        for key in (
            "offload_optimizer.buffer_count",
            "offload_param.buffer_count",
            "offload_param.buffer_size",
            "offload_param.max_in_cpu",
        )
    )
    assert "nvme_path" not in warned[0] and "pin_memory" not in warned[0]


# ---------------------------------------------------------------- bad configs


BAD = [
    (
        {"optimizer": {"type": "Adagrad", "params": {"lr": 1e-3}}},
        r"optimizer.type 'Adagrad' is not supported; zerofn maps Adam, AdamW, SGD, Lamb",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
        r'optimizer.params.lr is "auto".* write the learning rate',
    ),
    ({"gradient_clipping": "auto"}, r'gradient_clipping is "auto".*max_grad_norm'),
    ({"fp16": {"enabled": "auto"}}, r'fp16.enabled is "auto".*true or false'),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"fp16.enabled and bf16.enabled are both true"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True}}, r"fp16.consecutive_hysteresis"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, r"optimizer.params.amsgrad true"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, r'write "gradient_clipping": 1.0'),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}},
        r"optimizer.params.momentum: not a parameter of DeepSpeed's AdamW",
    ),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "dampening": 0.1}}}, r"dampening"),
    ({"optimizer": None}, r'no "optimizer": add one'),
    (
        {"scheduler": {"type": "OneCycle", "params": {}}},
        r"scheduler.type 'OneCycle' is not supported; zerofn maps WarmupLR, WarmupDecayLR, WarmupCosineLR",
    ),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, r"WarmupDecayLR needs params.total_num_steps"),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
        r'scheduler.params.warmup_max_lr is "auto".*peak learning rate',
    ),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}, r"scheduler WarmupLR: .*warmup_type"),
    (
        {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 10}}},
        r"total_num_steps \(10\) must be greater",
    ),
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage must be 0, 1, 2 or 3"),
    (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        r"offload_param needs stage 3, got stage 2",
    ),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, r'"nvme" needs "nvme_path"'),
    (  # ZeRO-Infinity's parameters on NVMe: stage 3, the optimizer state on NVMe too, in the same directory
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
        r"offload_param needs stage 3, got stage 2 \(DeepSpeed refuses it too\)",
    ),
    (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                "offload_param": {"device": "nvme"},
            }
        },
        r'offload_param.device "nvme" needs "nvme_path": a directory on the NVMe disk',
    ),
    (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
            }
        },
        r'offload_param.device "nvme" with the optimizer state in CPU RAM \(offload_optimizer "device": "cpu"\): '
        r'.*set offload_optimizer \{"device": "nvme", .*or write offload_param "device": "cpu"',
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
        r'offload_param.device "nvme" with the optimizer state where the step computes \(no offload_optimizer, '
        r'or "device": "none"\): .*set offload_optimizer',
    ),
    (
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme/optimizer"},
                "offload_param": {"device": "nvme", "nvme_path": "/nvme/params"},
            }
        },
        r"offload_param.nvme_path '/nvme/params' and zero_optimization.offload_optimizer.nvme_path "
        r"'/nvme/optimizer' differ: .*one directory tree.*give both blocks the same \"nvme_path\"",
    ),
    (
        {"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
        r"zero_quantized_gradients needs sharded gradients \(stage 2 or 3\), got stage 1",
    ),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, r"zero_quantized_weights is ZeRO-3's"),
    (
        {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
        r"zero_quantized_nontrainable_weights without zero_quantized_weights",
    ),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 3}}, r"mics_shard_size 3 does not divide the 1 ranks"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, r'amp is enabled: apex AMP.*"bf16": \{"enabled": true\}'),
    ({"curriculum_learning": {"enabled": True}}, r"curriculum_learning is enabled: it changes the data"),
]


@pytest.mark.parametrize("change,match", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_configs_raise_naming_the_key(change, match):
    config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        from_deepspeed(config, lambda p, b: b)


def test_config_files_and_optimizer_argument(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match="'train_batch_size' appears twice"):
        from_deepspeed(str(path), lambda p, b: b)
    with pytest.raises(FileNotFoundError, match="no config file"):
        from_deepspeed(str(tmp_path / "missing.json"), lambda p, b: b)
    with pytest.raises(TypeError, match="a dict or the path"):
        from_deepspeed(42, lambda p, b: b)
    # No optimizer in the config: pass one, as deepspeed.initialize(optimizer=...); both is refused.
    step, _ = from_deepspeed({"train_batch_size": 8}, lambda p, b: b, optimizer=zf.optim.sgd(0.1))
    assert step.name == "train_step"
    with pytest.raises(ValueError, match="optimizer= was passed too"):
        from_deepspeed(
            {"train_batch_size": 8, "optimizer": {"type": "SGD"}}, lambda p, b: b, optimizer=zf.optim.sgd(0.1)
        )
    with pytest.raises(ValueError, match='a "scheduler" needs the config\'s "optimizer"'):
        from_deepspeed(
            {"train_batch_size": 8, "scheduler": {"type": "WarmupLR"}}, lambda p, b: b, optimizer=zf.optim.sgd(0.1)
        )


def test_unsupported_keys_are_one_warning():
    with pytest.warns(UserWarning) as record:
        from_deepspeed(
            {
                "train_batch_size": 8,
                "optimizer": {"type": "AdamW"},
                "steps_per_print": 5,
                "wall_clock_breakdown": True,
                "zero_allow_untested_optimizer": True,
                "my_typo": 1,
                "communication_data_type": "bf16",
                "flops_profiler": {"enabled": False},
                "zero_optimization": {"stage": 1, "overlap_comm": False},
            },
            lambda p, b: b,
        )
    assert len(record) == 1
    text = str(record[0].message)
    for key in (
        "steps_per_print",
        "wall_clock_breakdown",
        "zero_allow_untested_optimizer",
        "my_typo: unknown key",
        "communication_data_type",
        "zero_optimization.overlap_comm",
    ):
        assert key in text, key
    assert "flops_profiler" not in text  # disabled: asks for nothing


def test_zf_from_deepspeed_is_the_lazy_export():
    import zerofn.transforms

    import zerofn.deepspeed as ds

    assert zf.from_deepspeed is ds.from_deepspeed and "from_deepspeed" in zf.__all__
    assert not hasattr(zerofn.transforms, "from_deepspeed")  # a front-end above the transforms, not one of them
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        zf.nope  # noqa: B018


# ---------------------------------------------------------------- the GPT example with --deepspeed


def _rank_example(steps: int) -> float:
    import sys

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt

    return train_gpt.main(
        ["--deepspeed", os.path.join(ROOT, "examples", "ds_config.json"), "--steps", str(steps), "--quiet"]
    )


def test_train_gpt_with_the_example_ds_config_learns(ranks):
    losses = ranks(2).run(_rank_example, 40)
    assert losses[0] == losses[1]
    assert losses[0] < 2.0, losses  # the corpus's unigram entropy is about 3.3 nats, its floor about 1.1
