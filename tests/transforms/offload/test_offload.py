"""offload to CPU RAM and NVMe files: the same parameters as without it, bounded RAM, failures that lose nothing."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import re
import sys

import pytest
import torch
from helpers import make_transformer, train, transformer_batch
from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params
from zerofn.transforms._param_files import read_buffers

import zerofn as zf
from zerofn import alloc, roles
from zerofn._io import FileTensor, IntegrityError

SHARDS = {"plain": lambda s: s, "zero1": shard_optimizer, "zero2": shard_grads, "zero3": shard_params}
STEPS, GLOBAL_BATCH = 4, 8


def _train(shard, where, use_amp, world, rank, root):
    _, apply, loss_fn = make_transformer(extras=False)
    step = SHARDS[shard](zf.train_step(loss_fn, zf.optim.adamw(3e-3, weight_decay=0.1), 2 if shard == "zero2" else 1))
    if use_amp:
        step = amp(step, torch.bfloat16)
    if where in ("cpu", "cpu-overlap"):  # the update before the step returns, or alongside the next forward
        step = offload(step, "cpu", params=shard == "zero3", overlap=where == "cpu-overlap")
    elif where and where.startswith("nvme"):  # the optimizer state in files; the parameter shards in RAM or files too
        path = os.path.join(root, f"{shard}-{use_amp}")
        os.makedirs(path, exist_ok=True)
        params = {"nvme": False, "nvme-cpu-params": "cpu", "nvme-params": "nvme", "nvme-params-remat": "nvme"}[where]
        step = offload(step, "nvme", path=path, sub_group_bytes=4096, params=params)
        if where.endswith("remat"):  # backward reads each unit's shard from its file again, for the recompute too
            step = remat(step)
    state = step.init(apply.params)
    state, _ = train(step, state, transformer_batch, STEPS, GLOBAL_BATCH, world, rank)
    zf.block_until_ready(state)
    return step.full_params(state), zf.memory.state_bytes(state)["by_placement"], step.name


def _rank_compare(root):
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    out = {}
    for shard in SHARDS:
        for use_amp in (False, True):
            ref = _train(shard, None, use_amp, world, rank, root)[0]
            for where in ("cpu", "cpu-overlap", "nvme") + (
                ("nvme-cpu-params", "nvme-params", "nvme-params-remat") if shard == "zero3" else ()
            ):
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
            assert name.startswith("remat(offload(" if where.endswith("remat") else "offload("), name
            if where.startswith("nvme"):
                assert placement.get("nvme", 0) > 0  # the moments (and amp's master) are in files


# ---------------------------------------------------------------- bounded RAM


def _big_state(path, sub_group_bytes, width=512, depth=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    apply = zf.functional(model)
    step = offload(
        zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3)),
        "nvme",
        path=path,
        sub_group_bytes=sub_group_bytes,
    )
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
    # reading, updating and writing sub-groups: the update's pool of four buffers (the one read ahead, the one
    # updated, two being written), each Adam's two moments and the parameter and gradient slices of a
    # sub-group (two sub-groups' bytes), and the step counts: a handful of sub-groups whatever the model size
    assert t.peak <= 8 * sub_group + 1024, (t.peak, sub_group, opt_bytes)
    assert new.files.generation == 1 - state.opt_state.files.generation


def _vm_bytes(field):
    """This process's own /proc/self/status figure ``field`` ("VmRSS", "VmHWM"), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def _reset_peak():
    """Reset this process's VmHWM to its current RSS (write 5 to /proc/self/clear_refs) and return it; None
    where Linux cannot (no clear_refs, or the peak did not go back to the RSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    base = _vm_bytes("VmHWM")
    if base is None or base > _vm_bytes("VmRSS") + (1 << 20):
        return None
    return base


def _without_allocator_settings(monkeypatch):
    """The environment a user runs in: no ``MALLOC_*`` variable reaches the fresh processes (none is set
    here; any the environment had is taken away), so glibc's allocator runs with its defaults."""
    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)


def _rank_peak_growth(path, where):
    """In a fresh rank: how far training (init and two steps) raises this process's peak RSS above its RSS
    just before ``step.init``, and the optimizer state's bytes (in RAM for "cpu", in files for "nvme").

    The peak is VmHWM, reset to the current RSS by writing 5 to /proc/self/clear_refs: ru_maxrss will not
    do, as Linux hands a process's high-water mark on across fork and exec, so even a fresh rank's
    ru_maxrss starts at whatever the pytest process had peaked at before (other tests), hiding the run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # 48 MiB of fp32
    apply = zf.functional(model)
    del model
    # 4 MiB buckets: the gradient buckets in flight (which both runs have) stay small beside the state
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3), bucket_bytes=1 << 22)
    step = offload(step, "nvme", path=path, sub_group_bytes=1 << 18) if where == "nvme" else offload(step, "cpu")
    x = torch.randn(2, 1024)
    base = _reset_peak()
    if base is None:
        return None
    state = step.init(apply.params)
    for _ in range(2):
        state, _ = step(state, x)
    grown = _vm_bytes("VmHWM") - base
    opt = zf.memory.state_bytes(state)["optimizer"] if where == "cpu" else state.opt_state.files.nbytes
    return grown, opt


def test_nvme_rss_grows_far_less_than_the_optimizer_state(tmp_path, monkeypatch):
    """Peak RSS of training the same model in a fresh process: optimizer state in RAM against on NVMe."""
    _without_allocator_settings(monkeypatch)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two fresh processes, each measuring only itself
        runs = [pool.submit(zf.spawn, _rank_peak_growth, 1, str(tmp_path), w, timeout=300) for w in ("cpu", "nvme")]
        in_ram, on_disk = (run.result()[0] for run in runs)
    if in_ram is None or on_disk is None:
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS (VmHWM)")
    (ram_peak, opt_ram), (nvme_peak, moments) = in_ram, on_disk
    # ram_peak - opt_ram: what training holds besides its optimizer state (parameters, gradients in flight,
    # temporaries). Both runs hand each bucket's reduced gradient over as backward lands it: the RAM run into
    # a host buffer, part of opt_ram; the NVMe run into a file. held: what the NVMe run's peak holds beyond
    # that, i.e. its optimizer state (and gradient) in RAM
    held = nvme_peak - (ram_peak - opt_ram)
    figures = "MiB: RAM run peak +{:.1f}, NVMe run peak +{:.1f}, optimizer in RAM {:.1f}, moments {:.1f}, held {:.1f}"
    figures = figures.format(*(b / 2**20 for b in (ram_peak, nvme_peak, opt_ram, moments, held)))
    assert moments >= 2 * 48 * 2**20, figures  # Adam's two moments: 96 MiB in files
    # in RAM the peak grows by at least the optimizer state (192 MiB: the moments and host copies of the
    # parameters and gradients): the measurement sees the memory a run holds
    assert ram_peak >= opt_ram, figures
    # on NVMe a few 256 KiB sub-groups of it are in RAM at a time: far under half of the moments (held
    # measures -20 to 15 MiB, the allocator's noise; with every moment kept in RAM it is about 200)
    assert held <= moments / 2, figures


def _rank_params_peak(path, depth, params):
    """In a fresh rank: how far ``step.init`` and two steps of ZeRO-3 with the optimizer state on NVMe raise
    this process's peak RSS (VmHWM, reset as in :func:`_rank_peak_growth`), for a model of ``depth`` 4 MiB
    layers built on the meta device, with the parameter shards in files (``params="nvme"``) or in RAM."""
    torch.manual_seed(0)
    with torch.device("meta"):  # never whole in this process: each shard is filled and written in turn
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(depth)])
    apply = zf.functional(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3))
    step = offload(shard_params(step), "nvme", path=path, params=params, sub_group_bytes=1 << 20)
    x = torch.randn(2, 1024)
    base = _reset_peak()
    if base is None:
        return None
    state = step.init(apply.params)
    for _ in range(2):
        state, _ = step(state, x)
    return _vm_bytes("VmHWM") - base, zf.memory.state_bytes(state)["by_placement"]


PARAMS_RSS_BOUND = 112 * 2**20
# The pool the shards are read into, with shard_params' default prefetch (1): one buffer per unit read ahead
# or being gathered, each one 4 MiB layer's shards (weight and bias).
READ_POOL_BYTES = read_buffers(1 + 2, 1 + 1) * alloc.slot_bytes([(torch.float32, 1024 * 1024), (torch.float32, 1024)])


def test_parameters_on_nvme_hold_ram_independent_of_the_model_size(tmp_path, monkeypatch):
    """ZeRO-Infinity's promise: with the parameters and the optimizer state in files, a rank's peak RSS is
    the buffers in flight (a few units' shards read ahead, gathered and their gradients, a few sub-groups
    of the update, from pools sized by the options), whatever the model's size. Measured for 6 and 24 layers
    of 4 MiB under the allocator's defaults: 94 and 97 MiB, under a bound of 112 MiB both times (the larger
    model's files are 4 x 96 MiB), and about the same; the larger model with its parameters in RAM shows the
    measurement sees them."""
    _without_allocator_settings(monkeypatch)
    cases = [(6, "nvme"), (24, "nvme"), (24, "cpu")]
    for d, p in cases:
        os.makedirs(tmp_path / f"{d}-{p}")
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        runs = [
            pool.submit(zf.spawn, _rank_params_peak, 1, str(tmp_path / f"{d}-{p}"), d, p, timeout=300) for d, p in cases
        ]
        got = [run.result()[0] for run in runs]
    if any(g is None for g in got):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS (VmHWM)")
    (small, small_at), (large, large_at), (in_ram, in_ram_at) = got
    figures = (
        f"MiB: peak +{small / 2**20:.1f} (6 layers), +{large / 2**20:.1f} (24), +{in_ram / 2**20:.1f} (24, in RAM)"
    )
    assert large_at["nvme"] >= 4 * 96 * 2**20 and large_at.get("cpu", 0) < 2**20, (large_at, figures)
    assert small < PARAMS_RSS_BOUND and large < PARAMS_RSS_BOUND, figures
    # measured 2-8 MiB apart: bookkeeping of kilobytes per unit and sub-group (hooks, placeholders, each
    # sub-group's bound optimizer), not bytes of the model
    assert abs(large - small) < 16 * 2**20, figures
    # the 96 MiB of shards in RAM show, less the pool the run from files reads them into (20 MiB), which the
    # run with them in RAM has no need of
    assert in_ram >= large + 96 * 2**20 - READ_POOL_BYTES - 8 * 2**20, (in_ram_at, figures)


def _rank_rss_after_steps(path, depth, steps):
    """In a fresh rank: ZeRO-Infinity (``offload(shard_params(step), "nvme", params="nvme")``, every option
    at its default) over ``depth`` 4 MiB layers built on the meta device. Returns this process's resident
    memory (VmRSS) after each of ``steps`` steps, and the pool the parameter shards are read into."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(depth)])
    apply = zf.functional(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3))
    step = offload(shard_params(step), "nvme", path=path, params="nvme")
    x = torch.randn(2, 1024)
    state = step.init(apply.params)
    rss = []
    for _ in range(steps):
        state, _ = step(state, x)
        rss.append(_vm_bytes("VmRSS"))
    pools = sys.modules["zerofn.transforms._param_files"]._POOLS
    (pool,) = next(iter(pools.values())).values()  # one size of unit (a layer's weight and bias): one pool
    return rss, (pool.count, pool.allocated, pool.peak, pool.overflows, pool.nbytes)


def test_resident_memory_of_zero_infinity_does_not_grow_with_the_model(tmp_path, monkeypatch):
    """Resident memory after each of 5 steps, under the allocator's defaults, in a fresh process per model:
    16 and 64 layers of 4 MiB (the larger one 192 MiB more of fp32 parameters, 5 x 192 MiB more in files).
    The host buffers come from pools sized by the options, and what the step itself frees (on the CPU its
    gathered units and gradients) goes back to the system: the two RSS are the same within a few MiB, and
    neither rises from step to step. Before, glibc's heap kept every freed buffer resident, fragmented: the
    64-layer run held hundreds of MiB more, still rising at the fifth step."""
    _without_allocator_settings(monkeypatch)
    cases = (16, 64)
    for d in cases:
        os.makedirs(tmp_path / str(d))
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        runs = [
            pool.submit(zf.spawn, _rank_rss_after_steps, 1, str(tmp_path / str(d)), d, 5, timeout=600) for d in cases
        ]
        (small, small_pool), (large, large_pool) = (run.result()[0] for run in runs)
    mib = [[round(b / 2**20) for b in rss] for rss in (small, large)]
    figures = f"RSS MiB per step: 16 layers {mib[0]}, 64 layers {mib[1]}"
    # measured 2-5 MiB apart (75 MiB of growth from before init in both); 300-700 MiB apart before the pools
    assert abs(large[-1] - small[-1]) < 32 * 2**20, figures
    for rss in (small, large):  # no step holds more than the one before it (a few MiB of noise)
        assert max(rss[2:]) - rss[1] < 16 * 2**20, figures
    for count, allocated, peak, overflows, nbytes in (small_pool, large_pool):
        # the shards' buffers: at most the pool's count made, each one unit's shards, none outside it
        assert allocated <= count and peak <= count and overflows == 0, (small_pool, large_pool)
        assert nbytes == alloc.slot_bytes([(torch.float32, 1024 * 1024), (torch.float32, 1024)])
    assert small_pool == large_pool  # the same pool whatever the number of layers


# ---------------------------------------------------------------- bad input


def test_bad_paths_are_refused_before_anything_runs(tmp_path):
    _, _, loss_fn = make_transformer(extras=False)
    base = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        offload(base, "nvme", path=str(tmp_path / "missing"))
    (tmp_path / "a_file.py").write_text("")
    with pytest.raises(ValueError, match=r"a_file\.py' is a file; pass a directory"):
        offload(base, "nvme", path=str(tmp_path / "a_file.py"))
    with pytest.raises(ValueError, match="not writable"):
        offload(base, "nvme", path="/proc")
    with pytest.raises(ValueError, match="needs path="):
        offload(base, "nvme")
    with pytest.raises(ValueError, match='device must be "cpu" or "nvme"'):
        offload(base, "gpu")
    with pytest.raises(ValueError, match="needs shard_params"):
        offload(base, params=True).init(make_transformer(extras=False)[1].params)
    with pytest.raises(ValueError, match=r'params="nvme" streams the parameter shards from files beside an optim'):
        offload(base, "cpu", params="nvme")
    with pytest.raises(ValueError, match=r"offload\(params='nvme'\) keeps parameter shards off the device"):
        offload(base, "nvme", path=str(tmp_path), params=True).init(make_transformer(extras=False)[1].params)
    with pytest.raises(ValueError, match=r'params must be False, True, "cpu" or "nvme", got \'gpu\''):
        offload(base, params="gpu")


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
    step = offload(
        shard_grads(zf.train_step(loss_fn, zf.optim.adamw(3e-3))), "nvme", path=str(tmp_path), sub_group_bytes=4096
    )
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

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match="Nothing was changed: the state from before this step is intact"):
        step(state, transformer_batch(1, 8))
    monkeypatch.setattr(os, "pwrite", real)
    after = step.full_params(state)  # the state is not donated: the failed step raised before that
    assert all(torch.equal(before[k], after[k]) for k in before)
    state, _ = step(state, transformer_batch(1, 8))  # and it trains on, as if nothing had happened
    ref_state, _ = ref(ref_state, transformer_batch(1, 8))
    new, want = step.full_params(state), ref.full_params(ref_state)
    assert all(torch.equal(new[k], want[k]) for k in new)


def test_a_short_state_file_is_an_integrity_error_naming_it(tmp_path):
    _, apply, loss_fn = make_transformer(extras=False)
    step = offload(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), "nvme", path=str(tmp_path), sub_group_bytes=4096)
    state = step.init(apply.params)
    entry = state.opt_state.files.entries[0]
    name = state.opt_state.files.file(entry.stem)
    os.truncate(name, entry.nbytes // 2)  # cut outside zerofn
    with pytest.raises(IntegrityError, match=re.escape(name) + r": \d+ bytes where \d+ were expected"):
        step(state, transformer_batch(0, 8))
    assert issubclass(IntegrityError, ValueError)


# ---------------------------------------------------------------- what the states declare


def test_each_state_declares_its_parts_and_placement(tmp_path):
    def parts(transform):
        _, apply, loss_fn = make_transformer(extras=False)
        step = transform(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
        state = step.init(apply.params)
        return state, roles.parts_of(state.opt_state), roles.placement_of(state.opt_state)

    state, declared, where = parts(lambda s: offload(s, "cpu"))
    assert where == "cpu" and [type(p) for p in declared] == [roles.Inner, roles.Quantity]
    inner, host = declared
    assert inner.tree is state.opt_state.inner
    assert host.tree is state.opt_state.params and host.mirror and not (host.newer or host.precise)

    state, declared, where = parts(lambda s: offload(s, "cpu", delay=1))
    assert where == "cpu" and [type(p) for p in declared] == [roles.Inner, roles.Quantity]
    pending = declared[1]
    assert pending.name == "pending" and pending.newer and not pending.mirror
    assert pending.tree is state.opt_state.params

    state, declared, where = parts(lambda s: offload(shard_params(s), "cpu", params=True))
    assert where == "cpu" and [type(p) for p in declared] == [roles.Inner]  # the parameters are on the host

    (tmp_path / "z3").mkdir()
    state, declared, where = parts(lambda s: offload(shard_params(s), "nvme", path=str(tmp_path / "z3"), params="cpu"))
    assert where == "nvme" and [type(p) for p in declared] == [roles.Inner]
    assert all(t.device.type == "cpu" for t in state.params)  # the shards rest in RAM (the placement's own)
    assert zf.memory.state_bytes(state)["by_placement"]["nvme"] > 0

    state, declared, where = parts(lambda s: offload(s, "nvme", path=str(tmp_path)))
    assert where == "nvme" and [type(p) for p in declared] == [roles.Inner]
    files = state.opt_state.files
    on_disk = [t for t in zf.tree.tree_leaves(declared[0].tree) if isinstance(t, FileTensor)]
    assert len(on_disk) == len(files.entries) == 2 * len(state.params)  # Adam's two moments per bucket
    assert {t.path for t in on_disk} == {files.file(e.stem) for e in files.entries}
    assert all(os.path.getsize(t.path) == t.numel() * t.itemsize for t in on_disk)
    assert sum(isinstance(r, type(files.entries[0])) for r in files.roles) == len(on_disk)  # the rest in memory
    assert all(r.stem in {e.stem for e in files.entries} for r in files.roles if hasattr(r, "stem"))


def test_the_options_are_a_record_compared_by_value(tmp_path):
    base = zf.train_step(lambda p, b: p["w"].sum(), zf.optim.adamw(1e-3))
    cpu = offload(base, "cpu", delay=1)
    assert offload(cpu, "cpu", delay=1) is cpu  # equal settings, built anew: the same step
    with pytest.raises(ValueError, match=r"already offloads \(device and settings\): HostOptions\(.*delay=1"):
        offload(cpu, "cpu")
    nvme = offload(base, "nvme", path=str(tmp_path))
    assert offload(nvme, "nvme", path=str(tmp_path)) is nvme
    with pytest.raises(ValueError, match=r"NvmeOptions\(.*sub_group_bytes=8192"):
        offload(nvme, "nvme", path=str(tmp_path), sub_group_bytes=8192)
