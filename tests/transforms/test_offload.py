"""offload to CPU RAM and NVMe files: the same parameters as without it, bounded RAM, failures that lose nothing."""

from __future__ import annotations

import errno
import os
import resource
import sys

import pytest
import torch

import zerofn as zf
from helpers import make_transformer, train, transformer_batch
from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

SHARDS = {"plain": lambda s: s, "zero1": shard_optimizer, "zero2": shard_grads, "zero3": shard_params}
STEPS, GLOBAL_BATCH = 4, 8
OFFLOAD = sys.modules["zerofn.transforms.offload"]


def _train(shard, where, use_amp, world, rank, root):
    _, apply, loss_fn = make_transformer(extras=False)
    step = SHARDS[shard](zf.train_step(loss_fn, zf.optim.adamw(3e-3, weight_decay=0.1), 2 if shard == "zero2" else 1))
    if use_amp:
        step = amp(step, torch.bfloat16)
    if where == "cpu":
        step = offload(step, "cpu", params=shard == "zero3")
    elif where == "nvme":
        path = os.path.join(root, f"{shard}-{use_amp}")
        os.makedirs(path, exist_ok=True)
        step = offload(step, "nvme", path=path, sub_group_bytes=4096)
    state = step.init(apply.params)
    state, _ = train(step, state, transformer_batch, STEPS, GLOBAL_BATCH, world, rank)
    return step.full_params(state), zf.memory.state_bytes(state)["by_placement"], step.name


def _rank_compare(root):
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    out = {}
    for shard in SHARDS:
        for use_amp in (False, True):
            ref = _train(shard, None, use_amp, world, rank, root)[0]
            for where in ("cpu", "nvme"):
                params, placement, name = _train(shard, where, use_amp, world, rank, os.path.join(root, where))
                same = all(torch.equal(params[n], ref[n]) for n in ref)
                out[(shard, use_amp, where)] = (same, placement, name)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_offload_changes_no_number(ranks, world, tmp_path):
    """offload(T(step)) for cpu and nvme, with and without amp, every shard composition: bit for bit."""
    results = ranks(world).run(_rank_compare, str(tmp_path)) if world > 1 else [_rank_compare(str(tmp_path))]
    for rank, out in enumerate(results):
        for (shard, use_amp, where), (same, placement, name) in out.items():
            assert same, f"{where} {shard} amp={use_amp} world={world} rank={rank}"
            assert name.startswith("offload(")
            if where == "nvme":
                assert placement.get("nvme", 0) > 0  # the moments (and amp's master) are in files


# ---------------------------------------------------------------- bounded RAM


def _big_state(path, sub_group_bytes, width=512, depth=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    apply = zf.functional(model)
    step = offload(
        zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3)),
        "nvme", path=path, sub_group_bytes=sub_group_bytes,
    )  # fmt: skip
    return step, step.init(apply.params), torch.randn(2, width)


def test_nvme_update_holds_a_few_sub_groups(tmp_path):
    sub_group = 64 * 1024
    step, state, x = _big_state(str(tmp_path), sub_group)
    state, _ = step(state, x)
    opt_bytes = state.opt_state.files.nbytes
    assert opt_bytes > 40 * sub_group  # the optimizer state is many times a sub-group
    params = step._opt_params(state.params, state.spec.layout, 0)
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    with zf.memory.track() as t:
        new = zf.optim.update_params(step.effective_optimizer, grads, state.opt_state, params)
    # reading, updating and writing sub-groups (each: Adam's two moments, and its parameter and gradient
    # slices): a handful of sub-groups whatever the model size
    assert t.peak <= 8 * sub_group, (t.peak, sub_group, opt_bytes)
    assert new.files.generation == 1 - state.opt_state.files.generation


def _rank_rss(path, where):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    apply = zf.functional(model)
    del model
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3))
    step = offload(step, "nvme", path=path, sub_group_bytes=1 << 20) if where == "nvme" else offload(step, "cpu")
    state = step.init(apply.params)
    for _ in range(2):
        state, _ = step(state, torch.randn(2, 1024))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    opt = zf.memory.state_bytes(state)["optimizer"] if where == "cpu" else state.opt_state.files.nbytes
    return after - before, opt


def test_nvme_rss_grows_far_less_than_the_optimizer_state(tmp_path):
    """Peak RSS of a fresh process training the same model: optimizer state in RAM against on NVMe."""
    in_ram, opt_ram = zf.spawn(_rank_rss, 1, str(tmp_path), "cpu", timeout=300)[0]
    on_disk, opt_disk = zf.spawn(_rank_rss, 1, str(tmp_path), "nvme", timeout=300)[0]
    assert opt_disk >= 2 * 48 * 2**20  # Adam's moments: 96 MiB in files
    # the NVMe run's peak stays below the in-RAM run's by nearly the whole optimizer state
    assert in_ram - on_disk > 0.75 * opt_disk, (in_ram / 2**20, on_disk / 2**20, opt_disk / 2**20)


# ---------------------------------------------------------------- bad input


def test_bad_paths_are_refused_before_anything_runs(tmp_path):
    _, _, loss_fn = make_transformer(extras=False)
    base = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        offload(base, "nvme", path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not writable"):
        offload(base, "nvme", path="/proc")
    with pytest.raises(ValueError, match="needs path="):
        offload(base, "nvme")
    with pytest.raises(ValueError, match='device must be "cpu" or "nvme"'):
        offload(base, "gpu")
    with pytest.raises(ValueError, match="needs shard_params"):
        offload(base, params=True).init(make_transformer(extras=False)[1].params)


def test_files_of_another_model_are_refused(tmp_path):
    _, apply, loss_fn = make_transformer(extras=False)
    offload(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), "nvme", path=str(tmp_path)).init(apply.params)
    other = torch.nn.Linear(3, 3)
    apply2 = zf.functional(other)
    step2 = offload(zf.train_step(lambda p, x: apply2(p, x).sum(), zf.optim.adamw(1e-3)), "nvme", path=str(tmp_path))
    with pytest.raises(ValueError, match="holds optimizer state files of another model"):
        step2.init(apply2.params)


def test_a_full_disk_during_the_update_loses_nothing(tmp_path, monkeypatch):
    _, apply, loss_fn = make_transformer(extras=False)
    step = offload(shard_grads(zf.train_step(loss_fn, zf.optim.adamw(3e-3))), "nvme", path=str(tmp_path),
                   sub_group_bytes=4096)  # fmt: skip
    ref = shard_grads(zf.train_step(loss_fn, zf.optim.adamw(3e-3)))
    state, ref_state = step.init(apply.params), ref.init(apply.params)
    state, _ = step(state, transformer_batch(0, 8))
    ref_state, _ = ref(ref_state, transformer_batch(0, 8))
    before = step.full_params(state)

    real, calls = os.pwrite, [0]

    def full_disk(fd, data, offset):
        calls[0] += 1
        if calls[0] > 5:  # a few sub-groups in, the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(OFFLOAD.os, "pwrite", full_disk)
    with pytest.raises(OSError, match="Nothing was changed: the state from before this step is intact"):
        step(state, transformer_batch(1, 8))
    monkeypatch.setattr(OFFLOAD.os, "pwrite", real)
    after = step.full_params(state)  # the state is not donated: the failed step raised before that
    assert all(torch.equal(before[k], after[k]) for k in before)
    state, _ = step(state, transformer_batch(1, 8))  # and it trains on, as if nothing had happened
    ref_state, _ = ref(ref_state, transformer_batch(1, 8))
    new, want = step.full_params(state), ref.full_params(ref_state)
    assert all(torch.equal(new[k], want[k]) for k in new)
