"""In-step memory no worse than torch's: the GPT example at world size 1, measured from building the model.

Plain torch (torch.optim.AdamW) for fp32, torch AMP (autocast, fused AdamW on
fp32 parameters) for amp; zf.memory.track() around each whole program."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from zerofn.transforms import amp, remat

import zerofn as zf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for  # noqa: E402

CFG, BATCH = GPTConfig(vocab=512, seq_len=128, dim=256, heads=4, layers=4), 8  # the bench's GPT, 8 x 128 tokens
# Under amp, the bench's GPT halved in every dimension but the depth and the sequence: width, vocabulary, heads
# (64 per head, as there) and batch. Every term of the peak (parameters, Adam's moments, gradients, activations,
# logits) is a quarter of the bench's, so the peaks' ratios are the bench's (zerofn / torch 0.940 against 0.938,
# remat / zerofn 0.763 against 0.759), at an eighth of the matmul work: on a CPU without AVX-512 BF16 torch's
# bf16 matmuls run 10 - 30 x slower than fp32's, and the bench's shape took 75 s on one core.
HALF_CFG, HALF_BATCH = GPTConfig(vocab=256, seq_len=128, dim=128, heads=2, layers=4), 4
STEPS = 3


def _data(cfg: GPTConfig, batch: int):
    return MarkovCorpus(cfg.vocab).sample(batch, cfg.seq_len + 1, seed=0)


def _torch_program(use_amp: bool, cfg: GPTConfig = CFG, batch: int = BATCH) -> tuple[int, int]:
    data = _data(cfg, batch)
    with zf.memory.track() as t:
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        setup = t.current
        for _ in range(STEPS):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_amp):
                logits = model(data[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return setup, t.peak


def _zf_program(transform, cfg: GPTConfig = CFG, batch: int = BATCH) -> tuple[int, int]:
    data = _data(cfg, batch)
    with zf.memory.track() as t:
        torch.manual_seed(0)
        model = GPT(cfg)
        apply = zf.functional(model)
        step = transform(zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-3)))
        state = step.init(apply.params)
        setup = t.current
        for _ in range(STEPS):
            state, _ = step(state, data)
    return setup, t.peak


@pytest.mark.parametrize("precision", ["fp32", "amp"])
def test_peak_is_at_most_torchs(precision):
    use_amp = precision == "amp"
    shape = (HALF_CFG, HALF_BATCH) if use_amp else (CFG, BATCH)
    _, torch_peak = _torch_program(use_amp, *shape)
    _, zf_peak = _zf_program(amp if use_amp else (lambda s: s), *shape)
    assert zf_peak <= torch_peak, (zf_peak / 2**20, torch_peak / 2**20)
    # remat cuts activations below both
    _, remat_peak = _zf_program(lambda s: remat(amp(s)) if use_amp else remat(s), *shape)
    assert remat_peak < zf_peak


def test_at_world_size_one_the_shard_transforms_cost_nothing():
    """One rank has nothing to shard: no gradient copy for a scatter, no unit buffers to gather into,
    so every stage's program peaks where the plain step's does (shard_params keeps its unit order, a few
    bytes, beside it)."""
    from zerofn.transforms import shard_grads, shard_optimizer, shard_params

    _, plain = _zf_program(lambda s: s)
    for transform in (shard_optimizer, shard_grads, shard_params):
        _, peak = _zf_program(transform)
        assert plain <= peak <= plain + 1024, (transform.__name__, peak, plain)
