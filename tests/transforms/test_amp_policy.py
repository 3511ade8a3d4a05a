"""amp(compute="param"): the forward in the parameter dtype with norms (and losses) in fp32, as FSDP2's
MixedPrecisionPolicy; against a hand-written bf16 model, against autocast, and its checks."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import make_transformer, train, transformer_batch
from torch import nn
from zerofn.transforms import amp, remat, shard_grads, shard_params
from zerofn.transforms.amp import FP32_MODULES

import zerofn as zf

BF16 = torch.bfloat16
LR, WD = 3e-3, 0.1


def _param_step(loss_fn, shard=lambda s: s, **kw):
    return amp(shard(zf.train_step(loss_fn, zf.optim.adamw(LR, weight_decay=WD))), BF16, compute="param", **kw)


# ---------------------------------------------------------------- (1) a hand-written reference


def _reference(steps: int, n: int) -> dict:
    """The same model as a plain bf16 nn.Module: LayerNorms kept fp32 with their input cast up and output cast
    down, logits cast to fp32 for the loss, and torch.optim.AdamW on fp32 master copies cast back after each step."""
    model, _, _ = make_transformer(extras=False)
    model.to(BF16)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.float()
            m.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
            m.register_forward_hook(lambda m, args, out: out.to(BF16))
    assert model.head.weight is model.tok.weight  # the tie survives the conversion
    params = dict(model.named_parameters())
    masters = {k: p.detach().float().clone().requires_grad_() for k, p in params.items()}
    opt = torch.optim.AdamW(masters.values(), lr=LR, weight_decay=WD, fused=True)
    for i in range(steps):
        batch = transformer_batch(i, n)
        logits = model(batch[:, :-1]).float()
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
        for k, p in params.items():
            masters[k].grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(masters[k])
    return {k: p.detach() for k, p in params.items()}


def test_param_compute_equals_a_bf16_model_with_fp32_layernorms():
    steps, n = 6, 8
    ref = _reference(steps, n)
    _, apply, loss_fn = make_transformer(extras=False)
    step = _param_step(loss_fn)
    state = step.init(apply.params)
    for i in range(steps):
        state, _ = step(state, transformer_batch(i, n))
    got = step.full_params(state, local=True)  # as the step holds them (the model's own dtypes: test_readme)
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype == (torch.float32 if ".ln." in k else BF16), k
        assert torch.equal(got[k], ref[k]), (k, (got[k].double() - ref[k].double()).abs().max().item())


# ---------------------------------------------------------------- (2), (3) what runs in which dtype


def test_no_autocast_bf16_matmuls_fp32_layernorms():
    model, apply, loss_fn = make_transformer(extras=False)
    seen: dict[str, list] = {"autocast": [], "linear": [], "ln_in": [], "ln_w": [], "ln_out": [], "logits": []}

    def linear(m, args, out):
        seen["linear"].append(out.dtype)

    def layer_norm(forward):
        def run(x):  # what LayerNorm's forward itself gets and returns (amp's hooks cast around it)
            out = forward(x)
            seen["ln_in"].append(x.dtype)
            seen["ln_w"].append(forward.__self__.weight.dtype)
            seen["ln_out"].append(out.dtype)
            return out

        return run

    hooks = [m.register_forward_hook(linear) for m in model.modules() if isinstance(m, nn.Linear)]
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.forward = layer_norm(m.forward)

    def spy(params, batch):
        seen["autocast"].append(torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled())
        logits = apply(params, batch[:, :-1])
        seen["logits"].append(logits.dtype)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    step = _param_step(spy)
    state = step.init(apply.params)
    state, m = step(state, transformer_batch(0, 4))
    for h in hooks:
        h.remove()
    assert seen["autocast"] == [False]
    assert set(seen["linear"]) == {BF16} and len(seen["linear"]) == 9  # 4 per block and the head: in bf16
    assert seen["ln_in"] == seen["ln_w"] == seen["ln_out"] == [torch.float32] * 2  # LayerNorm computes in fp32
    assert seen["logits"] == [torch.float32]  # the model's output comes back in fp32: the loss is fp32
    held = step.full_params(state, local=True)
    assert {k for k, v in held.items() if v.dtype == torch.float32} == {
        f"blocks.{i}.ln.{w}" for i in range(2) for w in ("weight", "bias")
    }
    # the hooks are gone after the step (they live for its forward and backward only)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks
    # step.apply runs the same way, and removes them at once
    out = step.apply(state, transformer_batch(1, 2)[:, :-1])
    assert out.dtype == torch.float32 and not torch.nn.modules.module._global_forward_hooks


class _Net(nn.Module):
    """A float input, an RMSNorm-like custom norm, BatchNorm and a loss module inside the model."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.norm = nn.LayerNorm(8)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        h = self.norm(torch.tanh(self.bn(self.fc1(x))))
        assert h.dtype == BF16 and x.dtype == BF16  # the input was cast where it entered; the norm's output back
        out = self.fc2(h)
        return self.loss(out, y)  # a loss's output stays fp32


def test_float_inputs_cast_losses_stay_fp32_and_custom_types():
    torch.manual_seed(0)
    apply = zf.functional(_Net())
    loss_fn = lambda p, b: apply(p, *b)  # noqa: E731
    step = _param_step(loss_fn)
    state = step.init(apply.params)
    batch = (torch.randn(5, 6), torch.randn(5, 3))
    state, m = step(state, batch)
    assert math.isfinite(float(m["loss"]))
    held = step.full_params(state, local=True)
    assert held["bn.weight"].dtype == held["norm.weight"].dtype == torch.float32 and held["fc1.weight"].dtype == BF16
    # fp32_modules=(): LayerNorm runs in bf16 with bf16 parameters (BatchNorm keeps fp32 parameters, as under autocast)
    apply2 = zf.functional(_Net())
    step2 = _param_step(lambda p, b: apply2(p, *b), fp32_modules=())
    held2 = step2.full_params(step2.init(apply2.params), local=True)
    assert held2["norm.weight"].dtype == BF16 and held2["bn.weight"].dtype == torch.float32


# ---------------------------------------------------------------- composes: remat's recompute, shard_params


def _gpt():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    import gpt

    torch.manual_seed(0)
    apply = zf.functional(gpt.GPT(gpt.GPTConfig(vocab=32, seq_len=12, dim=16, heads=2, layers=2)))
    return apply, gpt.loss_fn_for(apply), lambda i: gpt.MarkovCorpus(32).sample(8, 12, seed=i)


def test_composes_with_remat_and_shard_params_exactly():
    """remat recomputes each block in backward: the casts must be there then too (the GPT calls its blocks)."""
    apply, loss_fn, batch = _gpt()
    plain = _param_step(loss_fn)
    s0 = plain.init(apply.params)
    for i in range(3):
        s0, _ = plain(s0, batch(i))
    want = plain.full_params(s0)
    for wrap in (remat, shard_params, lambda s: remat(shard_params(s))):
        apply, loss_fn, batch = _gpt()
        step = wrap(_param_step(loss_fn))
        state = step.init(apply.params)
        for i in range(3):
            state, _ = step(state, batch(i))
        got = step.full_params(state)
        assert all(torch.equal(got[k], want[k]) for k in want), step.name


def _rank_param(world, rank):
    _, apply, loss_fn = make_transformer(extras=False)
    step = _param_step(loss_fn, shard_grads)
    state = step.init(apply.params)
    state, m = train(step, state, transformer_batch, 4, 16, world, rank)
    return step.full_params(state), float(m["loss"])


def _rank_main():
    return _rank_param(dist.get_world_size(), dist.get_rank())


def test_two_ranks_agree_with_one_process(ranks):
    ref, ref_loss = _rank_param(1, 0)
    for params, loss in ranks(2).run(_rank_main):
        for k in ref:  # each rank rounds its own gradient to bf16: 2 ulp plus one Adam step (as test_amp)
            tol = 2 * torch.finfo(BF16).eps * torch.maximum(params[k].double().abs(), ref[k].double().abs()) + LR
            assert ((params[k].double() - ref[k].double()).abs() <= tol).all(), k
        assert loss == pytest.approx(ref_loss, abs=2e-3)


# ---------------------------------------------------------------- (4) numerics against autocast and fp32


def _pattern_batch(step, n, seed=0):
    """Learnable sequences: start + stride * position (mod 23), the stride one of three."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    start = torch.randint(23, (n, 1), generator=g)
    stride = torch.tensor([1, 2, 5])[torch.randint(3, (n, 1), generator=g)]
    return (start + stride * torch.arange(9)) % 23


STEPS, BATCH = 150, 16
# Measured (this CPU, seed 0): the mean loss of the last 10 steps, from 9.56 at the start: fp32 0.4149,
# autocast 0.4165, param 0.4178; param and autocast differ by at most 0.011 at any step. The bound leaves
# room for other kernels' last bits.
BOUND = 0.05


def _curve(**amp_kw):
    _, apply, loss_fn = make_transformer(extras=False)
    step = zf.train_step(loss_fn, zf.optim.adamw(LR * 3, weight_decay=WD))
    if amp_kw:
        step = amp(step, BF16, **amp_kw)
    state = step.init(apply.params)
    losses = []
    for i in range(STEPS):
        state, m = step(state, _pattern_batch(i, BATCH))
        losses.append(float(m["loss"]))
    return losses


def test_param_compute_trains_as_well_as_autocast():
    fp32, auto, param = _curve(), _curve(compute="autocast"), _curve(compute="param")
    final = {name: sum(c[-10:]) / 10 for name, c in (("fp32", fp32), ("autocast", auto), ("param", param))}
    print({k: round(v, 4) for k, v in final.items()}, "start", round(fp32[0], 4))
    for name, c in (("autocast", auto), ("param", param)):
        assert final[name] < 0.5 * c[0], (name, c[0], final[name])  # it learns
        assert abs(final[name] - final["fp32"]) <= BOUND, (name, final)
    assert param != auto  # two different arithmetics


# ---------------------------------------------------------------- (5) the options are checked


def test_options_are_checked():
    _, _, loss_fn = make_transformer(extras=False)
    base = zf.train_step(loss_fn, zf.optim.adamw(LR))
    with pytest.raises(ValueError, match='compute must be "autocast" or "param"'):
        amp(base, compute="foo")
    with pytest.raises(ValueError, match="fp32_modules must be nn.Module subclasses"):
        amp(base, compute="param", fp32_modules=(nn.LayerNorm, "RMSNorm"))
    with pytest.raises(ValueError, match="fp32_modules must be nn.Module subclasses"):
        amp(base, compute="param", fp32_modules=nn.LayerNorm(3))  # an instance, not a type
    with pytest.raises(ValueError, match='fp32_modules applies with compute="param"'):
        amp(base, fp32_modules=(nn.LayerNorm,))
    # reapplying: the same options are a no-op, others raise
    assert amp(amp(base, compute="param"), compute="param") == amp(base, compute="param")
    with pytest.raises(ValueError, match="already runs in mixed precision"):
        amp(amp(base), compute="param")
    with pytest.raises(ValueError, match="already runs in mixed precision"):
        amp(amp(base, compute="param"), compute="param", fp32_modules=nn.LayerNorm)
    assert amp(base, compute="param", fp32_modules=nn.LayerNorm).precision.fp32_modules == (nn.LayerNorm,)
    assert amp(base).precision.fp32_modules == () and amp(base, compute="param").precision.fp32_modules == FP32_MODULES
