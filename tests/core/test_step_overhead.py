"""A step's own host work, counted rather than timed: the Python function calls (cProfile's count) and the aten
operations (a dispatch mode's count) a step makes beyond torch's own step on the same model (its forward,
backward, fused AdamW and ``zero_grad``), on the benchmark's GPT at 2, 4 and 8 blocks, world size 1.

Both counts are deterministic for a torch version, so they bound what the step does, not how fast the machine
is: a per-parameter Python loop in the step shows as calls that grow with the blocks, an op per parameter as
ops that do. The bounds hold the counts of 2026-12-06 (docs/benchmarks.md, "One hook call per bucket") with
about 15 % to spare."""

from __future__ import annotations

import cProfile
import functools
import pstats

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from zerofn.transforms import shard_grads, shard_optimizer, shard_params

import zerofn as zf
from zerofn.bench.gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for

COMPOSITIONS = {
    "train_step": lambda s: s,
    "shard_optimizer": shard_optimizer,
    "shard_grads": shard_grads,
    "shard_params": shard_params,
}
# Beyond torch's step at 4 blocks (49 tensors): (Python calls, aten ops) per step; counted then: 340 / 90 for
# train_step, 386 / 90 for the other two stages, 2900 / 111 for shard_params.
BOUNDS = {
    "train_step": (400, 105),
    "shard_optimizer": (450, 105),
    "shard_grads": (450, 105),
    "shard_params": (3300, 130),
}
# shard_params' calls per block added (a unit of 12 tensors and 7 module calls): about 495 beyond torch's
PER_UNIT = 570
STEPS = 5


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _count(run, batch: torch.Tensor) -> tuple[float, int]:
    """(Python calls per step, aten ops per step) of ``run`` after 3 steps that learn what a step repeats."""
    for _ in range(3):
        run(batch)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(STEPS):
        run(batch)
    profile.disable()
    ops = _Ops()
    with ops:
        run(batch)
    return pstats.Stats(profile).total_calls / STEPS, ops.n


def _config(blocks: int) -> GPTConfig:
    return GPTConfig(vocab=64, dim=32, layers=blocks, seq_len=16)


def _torch(blocks: int):
    torch.manual_seed(0)
    model = GPT(_config(blocks))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def run(batch):
        logits = model(batch[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def _zerofn(name: str, blocks: int):
    torch.manual_seed(0)
    apply = zf.functional(GPT(_config(blocks)))
    step = COMPOSITIONS[name](zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-3)))
    box = [step.init(apply.params)]

    def run(batch):
        box[0], _ = step(box[0], batch)

    return run


@functools.cache
def _beyond_torch(name: str, blocks: int) -> tuple[float, int]:
    batch = MarkovCorpus(vocab=64).sample(2, 17, seed=1)
    calls, ops = _count(_zerofn(name, blocks), batch)
    torch_calls, torch_ops = _count(_torch(blocks), batch)
    return calls - torch_calls, ops - torch_ops


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_a_steps_own_work_is_bounded(name):
    calls, ops = _beyond_torch(name, 4)
    most_calls, most_ops = BOUNDS[name]
    assert 0 < calls <= most_calls and 0 < ops <= most_ops, (name, calls, ops)


@pytest.mark.parametrize("name", ["train_step", "shard_optimizer", "shard_grads"])
def test_stages_0_to_2_do_no_python_per_parameter(name):
    """Four times the blocks (25 -> 97 tensors, one bucket): the step's Python calls beyond torch's do not grow
    (torch's own AdamW loops over the parameters in Python; the step's fused one does not, and its gradients
    reach their bucket one hook call per bucket); its aten ops beyond torch's grow by at most two per tensor
    (the bucket's views)."""
    (calls_2, ops_2), (calls_8, ops_8) = _beyond_torch(name, 2), _beyond_torch(name, 8)
    assert calls_8 <= calls_2, (name, calls_2, calls_8)
    assert ops_8 - ops_2 <= 2 * (97 - 25), (name, ops_2, ops_8)


def test_shard_params_works_per_unit_not_per_parameter():
    """shard_params' calls beyond torch's grow with the units (each block one), by its module calls' hooks and
    the unit's gather and release, not by its 12 tensors one by one."""
    (calls_4, _), (calls_8, _) = _beyond_torch("shard_params", 4), _beyond_torch("shard_params", 8)
    assert 0 < (calls_8 - calls_4) / 4 <= PER_UNIT, (calls_4, calls_8)
