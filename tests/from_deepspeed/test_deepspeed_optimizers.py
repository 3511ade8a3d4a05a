"""DeepSpeed's optimizer names and precision options in ``from_deepspeed``: ``Lamb`` (FusedLamb), Adam's
``bias_correction: false`` (FusedAdam) and ``bf16.bf16_master_weights_and_grads``; each against a plain
reference of DeepSpeed's formulas, and each config trained on 2 ranks against the composition written by
hand, bit for bit. The 1-bit and 0/1 optimizers are refused."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import config_vs_hand, make_mlp, mlp_batch

import zerofn as zf
from zerofn import optim as O
from zerofn.deepspeed import from_deepspeed

# ---------------------------------------------------------------- plain references of DeepSpeed's kernels


def _deepspeed_adam(params, grads_seq, lr, b1, b2, eps, wd, decoupled):
    """DeepSpeed's FusedAdam with bias_correction=False (csrc/adam/multi_tensor_adam.cu), element by element
    in torch's order of operations: no 1 - b**t anywhere, step size lr, denominator sqrt(v) + eps."""
    p = {k: v.clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v2 = {k: torch.zeros_like(v) for k, v in p.items()}
    for grads in grads_seq:
        for k in p:
            g = grads[k] if decoupled or not wd else grads[k].add(p[k], alpha=wd)  # L2: g + wd * p
            m[k].lerp_(g, 1 - b1)  # b1 * m + (1 - b1) * g
            v2[k].mul_(b2).addcmul_(g, g, value=1 - b2)  # b2 * v + (1 - b2) * g * g
            update = m[k] / (v2[k].sqrt() + eps)
            if decoupled and wd:
                update = update + wd * p[k]
            p[k] = p[k] + update * -lr
    return p


def _deepspeed_lamb(params, grads_seq, lr, b1, b2, eps, wd, bias_correction, min_coeff, max_coeff):
    """DeepSpeed's FusedLamb (csrc/lamb/fused_lamb_cuda_kernel.cu), per parameter in float64: uncorrected
    moments, u = m / (sqrt(v) + eps) + wd * w, ratio ||w|| / ||u|| clamped to [min_coeff, max_coeff] (1 when
    either norm is 0), w -= step_size * ratio * u with step_size = lr * sqrt(1 - b2**t) / (1 - b1**t)."""
    p = {k: v.double().clone() for k, v in params.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v2 = {k: torch.zeros_like(v) for k, v in p.items()}
    for t, grads in enumerate(grads_seq, 1):
        step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
        for k in p:
            g = grads[k].double()
            m[k] = b1 * m[k] + (1 - b1) * g
            v2[k] = b2 * v2[k] + (1 - b2) * g * g
            u = m[k] / (v2[k].sqrt() + eps) + wd * p[k]
            wn, un = p[k].norm().item(), u.norm().item()
            ratio = 1.0 if wn == 0 or un == 0 else min(max(wn / un, min_coeff), max_coeff)
            p[k] = p[k] - step_size * ratio * u
    return p


def _params_and_grads(steps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {
        "big": torch.randn(6, 5, generator=g) * 30,  # ||w|| / ||u|| far above 10: clamped to max_coeff
        "tiny": torch.randn(7, generator=g) * 1e-4,  # far below 0.01: clamped to min_coeff
        "mid": torch.randn(3, 4, generator=g) * 0.3,
        "zero": torch.zeros(2),  # ||w|| = 0: ratio 1
    }
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in params.items()} for _ in range(steps)]
    return params, grads


def _run(opt, params, grads_seq):
    p = {k: v.clone() for k, v in params.items()}
    state = opt.init(p)
    for grads in grads_seq:
        state = O.update_params(opt, {k: v.clone() for k, v in grads.items()}, state, p)
    return p


# ---------------------------------------------------------------- Adam and AdamW, bias_correction=False


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_without_bias_correction_is_deepspeeds_fused_adam(decoupled, wd):
    params, grads = _params_and_grads()
    make = O.adamw if decoupled else O.adam
    ours = _run(make(1e-2, (0.8, 0.99), 1e-6, wd, bias_correction=False), params, grads)
    ref = _deepspeed_adam(params, grads, 1e-2, 0.8, 0.99, 1e-6, wd, decoupled)
    corrected = _run(make(1e-2, (0.8, 0.99), 1e-6, wd), params, grads)
    for k in params:
        if decoupled and wd:  # zerofn decays as torch.optim.AdamW rounds it, DeepSpeed inside the update
            torch.testing.assert_close(ours[k], ref[k], rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(ours[k], ref[k]), k
        assert not torch.equal(ours[k], corrected[k]) or k == "zero", k  # the option changes the update


def test_bias_correction_keeps_torch_adam_bit_for_bit():
    params, grads = _params_and_grads()
    ours = _run(O.adamw(1e-2, weight_decay=0.1, bias_correction=True), params, grads)
    tp = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.AdamW(tp.values(), lr=1e-2, weight_decay=0.1, fused=True)
    for g in grads:
        for k, t in tp.items():
            t.grad = g[k].clone()
        opt.step()
    for k in params:
        assert torch.equal(ours[k], tp[k].detach()), k


def test_bias_correction_must_be_a_bool():
    with pytest.raises(TypeError, match="bias_correction must be a bool"):
        O.scale_by_adam(bias_correction="no")


# ---------------------------------------------------------------- LAMB as DeepSpeed's FusedLamb


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_step_size_correction_is_deepspeeds_fused_lamb(bias_correction):
    params, grads = _params_and_grads()
    kw = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, min_coeff=0.01, max_coeff=10.0)
    opt = O.lamb(
        kw["lr"],
        (kw["b1"], kw["b2"]),
        kw["eps"],
        kw["wd"],
        bias_correction="step_size" if bias_correction else False,
        min_trust_ratio=kw["min_coeff"],
        max_trust_ratio=kw["max_coeff"],
    )
    ours = _run(opt, params, grads)
    ref = _deepspeed_lamb(params, grads, bias_correction=bias_correction, **kw)
    for k in params:
        torch.testing.assert_close(ours[k].double(), ref[k], rtol=2e-6, atol=1e-7)
    # optax's correction (the default) differs where eps or the clamp matter: not the same optimizer
    optax = _run(O.lamb(1e-2, eps=1e-8, weight_decay=0.01, min_trust_ratio=0.01, max_trust_ratio=10.0), params, grads)
    ds = _deepspeed_lamb(params, grads, bias_correction=True, **kw)
    assert not all(torch.allclose(optax[k].double(), ds[k], rtol=1e-4) for k in params)


def test_lamb_config_maps_deepspeeds_names_and_defaults():
    _, _, loss_fn = make_mlp()
    step, _ = from_deepspeed({"train_batch_size": 2, "optimizer": {"type": "Lamb", "params": {}}}, loss_fn)
    params, grads = _params_and_grads()
    ours = _run(step.optimizer, params, grads)
    # FusedLamb's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, no decay, bias correction, coeffs [0.01, 10]
    ref = _deepspeed_lamb(params, grads, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 0.01, 10.0)
    for k in params:
        torch.testing.assert_close(ours[k].double(), ref[k], rtol=2e-6, atol=1e-7)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("kind", ["OneBitAdam", "OnebitAdam", "ZeroOneAdam", "OneBitLamb", "OnebitLamb", "onebitadam"])
def test_the_compressing_optimizers_are_refused(kind):
    _, _, loss_fn = make_mlp()
    with pytest.raises(ValueError, match="compresses communication") as e:
        from_deepspeed({"train_batch_size": 2, "optimizer": {"type": kind, "params": {"lr": 1e-3}}}, loss_fn)
    assert ('"type": "Lamb"' if "lamb" in kind.lower() else '"type": "Adam"') in str(e.value)
    assert "bf16" in str(e.value)


@pytest.mark.parametrize(
    "optimizer, precision, match",
    [
        ({"type": "Lamb", "params": {"eps_inside_sqrt": True}}, {}, "eps_inside_sqrt true"),
        ({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, {}, "gradient_clipping"),
        ({"type": "Lamb", "params": {"amsgrad": True}}, {}, "amsgrad"),
        ({"type": "Lamb", "params": {"min_coeff": 20.0}}, {}, "min_coeff <= max_coeff"),
        ({"type": "Lamb", "params": {"trust_clip": True}}, {}, "not a parameter of DeepSpeed's Lamb"),
        (
            {"type": "AdamW", "params": {}},
            {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
            "needs bf16_master_weights_and_grads",
        ),
        (
            {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "momentum in fp32",
        ),
    ],
)
def test_keys_that_would_change_the_numbers_are_refused(optimizer, precision, match):
    _, _, loss_fn = make_mlp()
    with pytest.raises(ValueError, match=match):
        from_deepspeed({"train_batch_size": 2, "optimizer": optimizer, **precision}, loss_fn)


# ---------------------------------------------------------------- bf16 master weights


def test_bf16_masters_hold_no_fp32_copy_and_the_planner_counts_it():
    from zerofn.transforms import amp

    sizes = {}
    for name, master, mu in (("fp32 copy", torch.float32, None), ("bf16", torch.bfloat16, None)):
        model, apply, loss_fn = make_mlp()
        step = amp(zf.train_step(loss_fn, O.adamw(1e-2, mu_dtype=mu, nu_dtype=mu)), master_dtype=master)
        state = step.init(apply.params)
        state, _ = step(state, mlp_batch(0, 4))
        assert all(p.dtype == torch.bfloat16 for p in state.params)
        sizes[name] = zf.memory.state_bytes(state)["optimizer"]
    psi = sum(p.numel() for p in make_mlp()[1].params.values())
    assert sizes["fp32 copy"] - sizes["bf16"] >= 4 * psi + 4 * psi  # the master and fp32 -> bf16 moments
    e = zf.memory.estimate(7e9, gpus=8, stage=2)
    e_bf16 = zf.memory.estimate(7e9, gpus=8, stage=2, master_weights=False)
    e_states = zf.memory.estimate(7e9, gpus=8, stage=2, master_weights=False, optimizer=O.adamw(1e-3))
    assert (e.optimizer_per_param, e_bf16.optimizer_per_param, e_states.optimizer_per_param) == (12, 8, 4)
    assert math.isclose(e.state - e_bf16.state, 4 * 7e9 / 8, rel_tol=1e-6)  # no 4 Psi master (over 8 ranks)
    assert e_bf16.update < e.update  # no fp32 copy of the gradient partition
    with pytest.raises(ValueError, match="master_dtype must be torch.float32"):
        amp(zf.train_step(make_mlp()[2], O.adamw(1e-2)), torch.bfloat16, master_dtype=torch.float16)


def test_bf16_masters_train_as_torch_adamw_on_bf16_parameters():
    """bf16 parameters and moments, no fp32 copy: torch.optim.AdamW(fused=True) on a bf16 model, step for step."""
    from zerofn.transforms import amp

    model, apply, loss_fn = make_mlp()
    ref = make_mlp()[0].to(torch.bfloat16)
    step = amp(zf.train_step(loss_fn, O.adamw(1e-2, weight_decay=0.1)), torch.bfloat16, master_dtype=torch.bfloat16)
    state = step.init(apply.params)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for i in range(4):
        b = mlp_batch(i, 8)
        state, _ = step(state, b)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ((ref(b["x"]) - b["y"]) ** 2).mean()
        loss.float().backward()
        opt.step()
        opt.zero_grad()
    ours = step.full_params(state, local=True)  # as held: bf16, the optimizer's own (no master copy)
    for k, v in ref.named_parameters():
        assert ours[k].dtype == torch.bfloat16
        assert torch.equal(ours[k], v.detach()), k


# ---------------------------------------------------------------- configs against the composition by hand, 2 ranks


def _table() -> dict:
    """name -> (DeepSpeed config, the Step written by hand for loss_fn). Global batch 8 over 2 ranks."""
    from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

    bert = {  # BERT pre-training's LAMB (DeepSpeed's bing_bert config): no bias correction, max_coeff 0.3
        "type": "Lamb",
        "params": {"lr": 4e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3, "min_coeff": 0.01},
    }
    return {
        "bert_lamb_fp16_warmup_clip": (
            {
                "train_batch_size": 8,
                "gradient_clipping": 1.0,
                "optimizer": bert,
                "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 4e-3, "warmup_num_steps": 3}},
                "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8},
                "zero_optimization": {"stage": 2},
            },
            lambda f: amp(
                shard_grads(
                    zf.train_step(
                        f,
                        O.chain(
                            O.clip_by_global_norm(1.0),
                            O.lamb(
                                O.deepspeed_warmup_lr(4e-3, 0.0, warmup_num_steps=3, warmup_type="log"),
                                (0.9, 0.999),
                                1e-8,
                                0.01,
                                bias_correction=False,
                                min_trust_ratio=0.01,
                                max_trust_ratio=0.3,
                            ),
                        ),
                    )
                ),
                torch.float16,
                init_scale=2.0**8,
            ),
        ),
        "lamb_defaults_stage1": (
            {
                "train_batch_size": 8,
                "optimizer": {"type": "Lamb", "params": {"lr": 1e-2, "weight_decay": 0.01}},
                "zero_optimization": {"stage": 1},
            },
            lambda f: shard_optimizer(
                zf.train_step(
                    f,
                    O.lamb(
                        1e-2,
                        eps=1e-8,
                        weight_decay=0.01,
                        bias_correction="step_size",
                        min_trust_ratio=0.01,
                        max_trust_ratio=10.0,
                    ),
                )
            ),
        ),
        "bf16_masters_fp32_states_stage2": (
            {
                "train_batch_size": 8,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                "zero_optimization": {"stage": 2},
            },
            lambda f: amp(
                shard_grads(
                    zf.train_step(f, O.adamw(1e-2, weight_decay=0.1, mu_dtype=torch.float32, nu_dtype=torch.float32))
                ),
                torch.bfloat16,
                master_dtype=torch.bfloat16,
            ),
        ),
        "bf16_masters_fp32_states_offload": (  # DeepSpeed's own pairing: fp32 moments on the host
            {
                "train_batch_size": 8,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
            },
            lambda f: offload(
                amp(
                    shard_optimizer(
                        zf.train_step(
                            f, O.adamw(1e-2, weight_decay=0.1, mu_dtype=torch.float32, nu_dtype=torch.float32)
                        )
                    ),
                    torch.bfloat16,
                    master_dtype=torch.bfloat16,
                ),
                "cpu",
            ),
        ),
        "bf16_masters_bf16_states_stage3": (
            {
                "train_batch_size": 8,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                "zero_optimization": {"stage": 3},
            },
            lambda f: amp(
                shard_params(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1))),
                torch.bfloat16,
                master_dtype=torch.bfloat16,
            ),
        ),
        "adam_no_bias_correction_stage1": (
            {
                "train_batch_size": 8,
                "optimizer": {
                    "type": "Adam",
                    "params": {"lr": 1e-2, "weight_decay": 0.01, "bias_correction": False, "adam_w_mode": False},
                },
                "zero_optimization": {"stage": 1},
            },
            lambda f: shard_optimizer(zf.train_step(f, O.adam(1e-2, weight_decay=0.01, bias_correction=False))),
        ),
        "adamw_no_bias_correction_bf16": (
            {
                "train_batch_size": 8,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1, "bias_correction": False}},
                "bf16": {"enabled": True},
            },
            lambda f: amp(zf.train_step(f, O.adamw(1e-2, weight_decay=0.1, bias_correction=False)), torch.bfloat16),
        ),
    }


def _rank_table() -> dict:
    out = {}
    for name, (config, by_hand) in _table().items():
        r = config_vs_hand(config, by_hand, 5)  # every config maps without a warning
        dtypes = sorted({str(t.dtype) for t in zf.tree.tree_leaves(r.state.opt_state) if isinstance(t, torch.Tensor)})
        same = r.step.precision == r.hand.precision
        out[name] = (r.equal, r.moved, r.step.name, r.hand.name, same, float(r.metrics["loss"]), dtypes)
    return out


def test_each_config_trains_as_the_composition_written_by_hand(ranks):
    results = ranks(2).run(_rank_table)[0]
    assert set(results) == set(_table())
    for name, (equal, moved, ours, theirs, same_precision, loss, _) in results.items():
        assert equal, f"{name}: {ours} differs from {theirs} written by hand after 5 steps"
        assert ours == theirs and same_precision, (name, ours, theirs)
        assert moved and math.isfinite(loss), name
    # bf16 masters: no fp32 master copy; fp32 moments unless bf16_optimizer_states
    assert "torch.float32" in results["bf16_masters_fp32_states_stage2"][6]
    assert "torch.float32" not in results["bf16_masters_bf16_states_stage3"][6]
