"""Checkpoints: round trips for every composition, resharding across compositions and world sizes,
background saves, crash safety, integrity errors, buffers, export to safetensors."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any, NamedTuple

import pytest
import torch
from helpers import TinyTransformer, rank_slice
from torch import nn

import zerofn as zf
from zerofn import collectives as C
from zerofn import keys
from zerofn.checkpoint import CheckpointError, IntegrityError
from zerofn.roles import Inner, Quantity

HERE = pathlib.Path(__file__).parent
TESTS = HERE.parent
ROOT = TESTS.parent


def _transform(name: str, nvme: str | None):
    from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

    def nv(s, params=False):
        os.makedirs(nvme, exist_ok=True)
        return offload(s, "nvme", path=nvme, sub_group_bytes=4096, params=params)

    table = {
        "plain": [],
        "shard_optimizer": [shard_optimizer],
        "shard_grads": [shard_grads],
        "shard_params": [shard_params],
        "amp": [amp],
        "shard_params+amp": [shard_params, amp],
        "offload": [lambda s: offload(s, "cpu")],
        "shard_params+offload_params": [shard_params, lambda s: offload(s, "cpu", params=True)],
        "nvme": [nv],
        "shard_optimizer+amp+nvme": [shard_optimizer, amp, nv],
        "shard_params+nvme": [shard_params, nv],
        "shard_params+nvme_params": [shard_params, lambda s: nv(s, "nvme")],
        "shard_params+amp+nvme_params": [shard_params, amp, lambda s: nv(s, "nvme")],
    }
    return table[name.removesuffix("-lite")]


def _plain_model(name: str) -> bool:
    """amp (bf16 layer norms on the CPU) and NVMe offload (one dtype) take the model without its
    float64 and frozen extras; so does any name ending in -lite."""
    return "amp" in name or "nvme" in name or name.endswith("-lite")


def _build(name: str, seed: int = 0, nvme: str | None = None, optimizer=None):
    torch.manual_seed(seed)
    model = TinyTransformer(extras=not _plain_model(name))
    apply = zf.functional(model)

    def loss_fn(params, batch):
        logits = apply(params, batch[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    step = zf.train_step(loss_fn, optimizer or zf.optim.adamw(1e-2, weight_decay=0.1))
    for t in _transform(name, nvme):
        step = t(step)
    return step, apply, model


def _batch(i: int) -> torch.Tensor:
    return torch.randint(0, 23, (12, 9), generator=torch.Generator().manual_seed(100 + i))  # 12: splits over 1..4


def _train(step, state, lo: int, hi: int):
    rank, world = C.rank(), C.world_size()
    for i in range(lo, hi):
        state, _ = step(state, rank_slice(_batch(i), rank, world))
    return state


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the same step, bit for bit


def _rank_round_trip(root: str, names: list) -> dict:
    out = {}
    for name in names:
        step, apply, _ = _build(name, nvme=f"{root}/nvme-{name}-a")
        state = _train(step, step.init(apply.params), 0, 5)
        at5 = step.state_dict(state, master="amp" in name)
        handle = zf.checkpoint.save(state, f"{root}/{name}/step5", blocking=False)
        state = _train(step, state, 5, 10)  # trains (and changes the state in place) while the save writes
        handle.wait()
        ref = step.state_dict(state)
        step2, _, _ = _build(name, seed=1, nvme=f"{root}/nvme-{name}-b")
        loaded = zf.checkpoint.load(f"{root}/{name}/step5", step2)
        snap = step2.state_dict(loaded, master="amp" in name)
        count = int(loaded.count)
        got = step2.state_dict(_train(step2, loaded, 5, 10))
        out[name] = (_equal(at5, snap), _equal(ref, got), count, handle.bytes_written, zf.memory.state_bytes(state))
    return out


# The compositions a checkpoint round trip covers (save, then load into a live and into a fresh state).
ROUND_TRIP = [
    "plain",
    "shard_optimizer",
    "shard_grads",
    "shard_params",
    "amp",
    "shard_params+amp",
    "offload",
    "shard_params+offload_params",
    "nvme",
    "shard_optimizer+amp+nvme",
    "shard_params+nvme_params",
    "shard_params+amp+nvme_params",
]


def test_round_trip_every_composition_bit_for_bit(ranks, tmp_path):
    names = ROUND_TRIP
    per_rank = ranks(2).run(_rank_round_trip, str(tmp_path), names)
    for name in names:
        snapshot_equal, resumed_equal, count, _, _ = per_rank[0][name]
        assert snapshot_equal, f"{name}: the checkpoint differs from the state at the moment of the save"
        assert resumed_equal, f"{name}: resuming differs from the uninterrupted run"
        assert count == 5
    # Every rank writes its part; together about the state's bytes held on one rank (sharded
    # compositions) or less (replicated parameters are written once, split over the ranks).
    for name in ["shard_params", "shard_optimizer"]:
        written = [r[name][3] for r in per_rank]
        held = per_rank[0][name][4]["total"]
        assert all(w > 0 for w in written)
        assert sum(written) <= 2 * held + 64 * 1024, (name, written, held)


# ---------------------------------------------------------------- a fresh state holds nothing the load does not write


def _held(state) -> tuple[dict, dict, list]:
    """Every bucket range a state holds (files read, padding included), its small tensors, and every
    tensor leaf of it (scratch included)."""
    from zerofn._io import FileTensor
    from zerofn.checkpoint.parts import layouts, state_parts

    held = state_parts(state, C.rank(), layouts(state))
    parts = {
        (p.key, p.bucket): p.value.read() if isinstance(p.value, FileTensor) else p.value.detach().reshape(-1).clone()
        for p in held.parts
    }
    small = {k: v.clone() for k, v in held.small.items()}
    tree = (state.params, state.frozen, state.buffers, state.opt_state, state.loss_scale, state.extra)
    leaves = [t.detach().clone() for t in zf.tree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return parts, small, leaves


def _poisoned(parts: dict) -> list:
    return sorted({key for (key, _), t in parts.items() if t.is_floating_point() and t.isnan().any()})


def _rank_fresh_load(root: str, names: list) -> dict:
    from zerofn import alloc

    out = {}
    for name in names:
        step, apply, _ = _build(name, nvme=f"{root}/nvme-{name}-saved")
        state = _train(step, step.init(apply.params), 0, 3)
        zf.checkpoint.save(state, f"{root}/{name}")
        saved = _held(state)
        # What step.init(structure_only=True) leaves unwritten, filled with NaN here.
        probe_step, probe_apply, _ = _build(name, seed=1, nvme=f"{root}/nvme-{name}-probe")
        with alloc.unfilled(poison=float("nan")):
            unwritten = _poisoned(_held(probe_step.init(probe_apply.params, structure_only=True))[0])
        fresh_step, _, _ = _build(name, seed=2, nvme=f"{root}/nvme-{name}-fresh")
        with alloc.unfilled(poison=float("nan")):
            fresh = _held(zf.checkpoint.load(f"{root}/{name}", fresh_step))
        live_step, live_apply, _ = _build(name, seed=3, nvme=f"{root}/nvme-{name}-live")
        live = _held(zf.checkpoint.load(f"{root}/{name}", live_step, state=live_step.init(live_apply.params)))
        out[name] = {
            "unwritten": unwritten,
            "nonfinite": _poisoned(fresh[0]) + [i for i, t in enumerate(fresh[2]) if not t.isfinite().all()],
            "parts_as_saved": [k for k in saved[0] if not torch.equal(fresh[0].get(k), saved[0][k])],
            # Small tensors (counts, the loss scale) are made filled, and some (shard_params' unit order) start
            # afresh on load: as in a state init filled.
            "small_as_live": [k for k in live[1] if not torch.equal(fresh[1].get(k), live[1][k])],
            "leaves_as_live": len(fresh[2]) == len(live[2]) and all(map(torch.equal, fresh[2], live[2])),
        }
    return out


def test_a_fresh_load_writes_every_value_init_left_unwritten(ranks, tmp_path):
    names = ROUND_TRIP
    for rank, got in enumerate(ranks(2).run(_rank_fresh_load, str(tmp_path), names)):
        for name in names:
            r = got[name]
            # The state built to be loaded into holds no values: the parameters and the optimizer's
            # parameter-shaped state (amp's masters, offload's host copies and files among them).
            assert "params" in r["unwritten"] and any(k.startswith("opt:") for k in r["unwritten"]), (name, r)
            assert r["nonfinite"] == [], f"{name} rank {rank}: the load left these unwritten: {r['nonfinite']}"
            assert r["parts_as_saved"] == [] and r["small_as_live"] == [], (name, rank, r)
            assert r["leaves_as_live"], f"{name} rank {rank}: differs from a load into a state init filled"


# ---------------------------------------------------------------- another composition, another world size


def _rank_save(root: str, name: str) -> dict:
    step, apply, _ = _build(name, nvme=f"{root}/nvme-save-{name}")
    state = _train(step, step.init(apply.params), 0, 5)
    zf.checkpoint.save(state, f"{root}/{name}@{C.world_size()}")
    return {"masters": step.full_params(state, master=True), "params": step.full_params(state, local=True)}


def _rank_resume(root: str, saved: str, name: str) -> dict:
    # Each rank a different fresh model (as unseeded ranks build): load overwrites every value.
    step, _, _ = _build(name, seed=3 + C.rank(), nvme=f"{root}/nvme-load-{name}-{C.world_size()}")
    state = zf.checkpoint.load(f"{root}/{saved}", step)
    loaded = {
        "params": step.full_params(state, local=True),  # as held (amp's bf16)
        "masters": step.full_params(state, master=True),
        "count": int(state.count),
    }
    final = step.state_dict(_train(step, state, 5, 10))
    return {"loaded": loaded, "final": final}


def _close(a: dict, b: dict, tol: float) -> float:
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= tol, worst
    return worst


def test_load_on_other_compositions_and_world_sizes(ranks, tmp_path):
    root = str(tmp_path)
    step, apply, _ = _build("plain")
    reference = step.state_dict(_train(step, step.init(apply.params), 0, 10))  # uninterrupted, one process
    ranks(4).run(_rank_save, root, "shard_params")
    targets = [(2, "shard_optimizer"), (3, "shard_grads"), (3, "shard_params"), (2, "offload")]
    for world, name in targets:
        result = ranks(world).run(_rank_resume, root, "shard_params@4", name)[0]
        assert result["loaded"]["count"] == 5
        _close(result["final"], reference, 1e-6)
    _close(_rank_resume(root, "shard_params@4", "plain")["final"], reference, 1e-6)


def test_nvme_state_reshards_both_ways(ranks, tmp_path):
    root = str(tmp_path)
    step, apply, _ = _build("plain-lite")  # the model without extras
    reference = step.state_dict(_train(step, step.init(apply.params), 0, 10))
    ranks(2).run(_rank_save, root, "shard_params+nvme")
    _close(ranks(3).run(_rank_resume, root, "shard_params+nvme@2", "shard_optimizer-lite")[0]["final"], reference, 1e-6)
    ranks(3).run(_rank_save, root, "shard_grads-lite")
    _close(ranks(2).run(_rank_resume, root, "shard_grads-lite@3", "shard_params+nvme")[0]["final"], reference, 1e-6)


def test_parameters_on_nvme_reshard_to_another_world_size_and_placement(ranks, tmp_path):
    """Parameter shards in files on 2 ranks load into 3 ranks with them in memory, and back: the same
    parameters as one process training without a break."""
    root = str(tmp_path)
    step, apply, _ = _build("plain-lite")
    reference = step.state_dict(_train(step, step.init(apply.params), 0, 10))
    ranks(2).run(_rank_save, root, "shard_params+nvme_params")
    moved = ranks(3).run(_rank_resume, root, "shard_params+nvme_params@2", "shard_optimizer-lite")
    _close(moved[0]["final"], reference, 1e-6)
    ranks(3).run(_rank_save, root, "shard_params-lite")
    _close(
        ranks(2).run(_rank_resume, root, "shard_params-lite@3", "shard_params+nvme_params")[0]["final"], reference, 1e-6
    )


def test_amp_masters_come_back_as_masters_or_as_fp32_parameters(ranks, tmp_path):
    root = str(tmp_path)
    saved = ranks(2).run(_rank_save, root, "shard_params+amp")[0]
    # Into a step without amp: the fp32 masters become the parameters, bit for bit.
    plain = _rank_resume(root, "shard_params+amp@2", "plain-lite")["loaded"]
    assert _equal(plain["params"], saved["masters"])
    # Into amp on another world size: masters as masters, the bf16 parameters as saved.
    other = ranks(3).run(_rank_resume, root, "shard_params+amp@2", "shard_optimizer+amp+nvme")[0]["loaded"]
    assert _equal(other["masters"], saved["masters"]) and _equal(other["params"], saved["params"])
    # And from fp32 into amp: the masters are the fp32 parameters, the parameters their bf16 rounding.
    fp32 = ranks(3).run(_rank_save, root, "shard_grads-lite")[0]
    into_amp = ranks(2).run(_rank_resume, root, "shard_grads-lite@3", "shard_params+amp")[0]["loaded"]
    names = into_amp["masters"].keys()
    assert all(torch.equal(into_amp["masters"][k], fp32["params"][k]) for k in names)
    assert all(torch.equal(into_amp["params"][k], fp32["params"][k].bfloat16()) for k in names)


# ---------------------------------------------------------------- buffers


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x):
        return self.body(x)


def _normed_step(name: str):
    from zerofn.transforms import shard_params

    torch.manual_seed(0)
    model = Normed()
    apply = zf.functional(model)
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-2))
    return (shard_params(step) if name == "shard_params" else step), apply, model


def _rank_normed(root: str):
    step, apply, model = _normed_step("shard_params")
    state = step.init(apply.params)
    rank, world = C.rank(), C.world_size()
    for i in range(3):
        state, _ = step(state, rank_slice(torch.randn(16, 6, generator=torch.Generator().manual_seed(i)), rank, world))
    zf.checkpoint.save(state, f"{root}/normed")
    model.eval()
    return step.apply(state, torch.ones(5, 6)), state.buffers


def test_buffers_saved_on_two_ranks_evaluate_the_same_on_one(ranks, tmp_path):
    (out0, buf0), (out1, buf1) = ranks(2).run(_rank_normed, str(tmp_path))
    assert _equal(buf0, buf1) and torch.equal(out0, out1)
    step, _, model = _normed_step("plain")
    state = zf.checkpoint.load(tmp_path / "normed", step)
    assert _equal(state.buffers, buf0)
    model.eval()
    torch.testing.assert_close(step.apply(state, torch.ones(5, 6)), out0, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- export


def _rank_export(root: str):
    step, apply, _ = _build("shard_params")
    state = _train(step, step.init(apply.params), 0, 3)
    zf.checkpoint.save(state, f"{root}/export")
    x = _batch(50)[:2, :-1]
    return step.apply(state, x), x


def test_consolidate_loads_into_the_module_strictly_and_equals_apply(ranks, tmp_path):
    from safetensors.torch import load_file

    out, x = ranks(2).run(_rank_export, str(tmp_path))[0]
    files = zf.checkpoint.consolidate(tmp_path / "export", tmp_path / "model.safetensors")
    assert files == [str(tmp_path / "model.safetensors")]
    fresh = TinyTransformer()
    fresh.load_state_dict(load_file(files[0]), strict=True)  # the tied head.weight is in the file
    assert fresh.head.weight is fresh.tok.weight
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), out, rtol=0, atol=0)
    # Shards of at most 2 KB with a Hugging Face index give the same tensors.
    shards = zf.checkpoint.consolidate(tmp_path / "export", tmp_path / "sharded", max_shard_bytes=2048)
    index = json.loads(pathlib.Path(shards[-1]).read_text())
    assert len(shards) > 3 and set(index["weight_map"]) == set(fresh.state_dict())
    whole = load_file(files[0])
    for name, f in index["weight_map"].items():
        assert torch.equal(load_file(str(tmp_path / "sharded" / f))[name], whole[name])
    # The command line, cast to bf16.
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerofn",
            "consolidate",
            str(tmp_path / "export"),
            str(tmp_path / "bf16.safetensors"),
            "--dtype",
            "bf16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert cli.returncode == 0, cli.stderr
    half = load_file(str(tmp_path / "bf16.safetensors"))
    assert all(torch.equal(half[k], v.bfloat16()) for k, v in whole.items() if v.is_floating_point())


# ---------------------------------------------------------------- integrity


def _saved_plain(root: pathlib.Path, name="plain", optimizer=None) -> tuple:
    step, apply, _ = _build(name, optimizer=optimizer)
    state = _train(step, step.init(apply.params), 0, 2)
    zf.checkpoint.save(state, root / "good")
    return step, root / "good"


def _fresh_step(name="plain", optimizer=None):
    return _build(name, seed=5, optimizer=optimizer)[0]


def test_corruption_and_other_models_are_errors_that_name_the_file(tmp_path):
    _, good = _saved_plain(tmp_path)
    data = good / "rank0.safetensors"
    original = data.read_bytes()
    zf.checkpoint.verify(good)

    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x10
    data.write_bytes(bytes(flipped))
    with pytest.raises(IntegrityError, match=r"rank0\.safetensors is corrupted: bytes \d+\.\.\d+ do not match"):
        zf.checkpoint.load(good, _fresh_step())
    with pytest.raises(IntegrityError, match="corrupted"):
        zf.checkpoint.verify(good)

    data.write_bytes(original[:-100])
    with pytest.raises(
        IntegrityError, match=r"rank0\.safetensors has \d+ bytes, the manifest recorded \d+ \(a truncated"
    ):
        zf.checkpoint.load(good, _fresh_step())

    data.unlink()
    with pytest.raises(IntegrityError, match=r"rank0\.safetensors is missing"):
        zf.checkpoint.load(good, _fresh_step())

    data.write_bytes(original)
    zf.checkpoint.load(good, _fresh_step())  # restored: loads again

    # Another model.
    other = nn.Sequential(nn.Linear(4, 3))
    apply = zf.functional(other)
    step = zf.train_step(lambda p, x: apply(p, x).sum(), zf.optim.adamw(1e-2))
    with pytest.raises(
        CheckpointError, match=r"of another model .*\n  parameters this model has and the checkpoint lacks: \['0\.bias'"
    ):
        zf.checkpoint.load(good, step)
    # The same model with a different shape.
    torch.manual_seed(0)
    wider = TinyTransformer(dim=12)
    apply = zf.functional(wider)
    step = zf.train_step(lambda p, x: apply(p, x).sum(), zf.optim.adamw(1e-2))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.fc\.bias: shape \[21\] saved, \[25\] here"):
        zf.checkpoint.load(good, step)
    # Another optimizer: its state does not map.
    with pytest.raises(
        CheckpointError,
        match=r"optimizer state does not map .* entries saved that this optimizer lacks: \['opt:0/0', 'opt:0/1/\*'",
    ):
        zf.checkpoint.load(good, _fresh_step(optimizer=zf.optim.sgd(0.1, momentum=0.9)))
    # No manifest: not a checkpoint (or an incomplete one); the error names the newest complete one.
    with pytest.raises(CheckpointError, match=r"no manifest\.json there.*newest complete checkpoint in it is .*good"):
        zf.checkpoint.load(tmp_path, _fresh_step())


def test_save_refuses_mid_accumulation_and_load_refuses_adopted_params(tmp_path):
    step, apply, _ = _build("shard_params")
    step = step.replace(accumulate_steps=2)
    state, _ = step(step.init(apply.params), _batch(0))
    with pytest.raises(CheckpointError, match=r"1 micro-step\(s\) into an update .* state\.micro == 0"):
        zf.checkpoint.save(state, tmp_path / "mid")
    assert not (tmp_path / "mid").exists() and not (tmp_path / "mid.partial").exists()
    state, _ = step(state, _batch(1))
    zf.checkpoint.save(state, tmp_path / "ok")
    with pytest.raises(CheckpointError, match=r"held by a state already .* load\(path, step, state=state\)"):
        zf.checkpoint.load(tmp_path / "ok", step)  # apply.params are the state's placeholders now
    again = zf.checkpoint.load(tmp_path / "ok", step, state=step.init(step.full_params(state, requires_grad=True)))
    assert int(again.count) == 1 and _equal(step.full_params(again), step.full_params(state))


def test_keep_and_latest(tmp_path):
    step, apply, _ = _build("plain")
    state = step.init(apply.params)
    for i in range(4):
        state = _train(step, state, i, i + 1)
        zf.checkpoint.save(state, tmp_path / f"step_{i + 1}", keep=2, blocking=i % 2 == 0)
    zf.checkpoint.save(state, tmp_path / "step_4", keep=2)  # the same path again: replaced when complete
    assert sorted(os.listdir(tmp_path)) == ["step_3", "step_4"]
    assert zf.checkpoint.latest(tmp_path) == str(tmp_path / "step_4")
    assert zf.checkpoint.latest(tmp_path / "nothing-here") is None


# ---------------------------------------------------------------- crash safety

_CRASH = """
import os, signal, shutil, sys, torch
sys.path[:0] = [{tests!r}, {here!r}]
import zerofn as zf
from zerofn import _safetensors as st
from zerofn.checkpoint import saving as ck
from test_checkpoint import _build, _train

point, root = sys.argv[1], sys.argv[2]
step, apply, _ = _build("nvme", nvme=os.path.join(root, "nvme"))
state = _train(step, step.init(apply.params), 0, 2)
ck.save(state, os.path.join(root, "step_2"), keep=1)
state = _train(step, state, 2, 3)

def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "writing":  # halfway through this rank's data file
    real = st._Sink.write
    calls = []
    def write(self, data):
        calls.append(1)
        if len(calls) == 3:
            die()
        return real(self, data)
    st._Sink.write = write
elif point == "before-manifest":
    real_json = ck.write_json
    ck.write_json = lambda p, o: die() if p.endswith("manifest.json") else real_json(p, o)
elif point == "before-rename":
    real_rename = os.rename
    ck.os.rename = lambda a, b: die() if a.endswith(".partial") else real_rename(a, b)
elif point == "pruning":
    real_rmtree = shutil.rmtree
    ck.shutil.rmtree = lambda p, **k: die() if p.endswith(".deleting") else real_rmtree(p, **k)
ck.save(state, os.path.join(root, "step_3"), keep=1, blocking=False)
state = _train(step, state, 3, 4)  # the background thread dies with the process
ck.wait_saves()
"""


@pytest.mark.parametrize("point", ["writing", "before-manifest", "before-rename", "pruning"])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, point):
    script = tmp_path / "crash.py"
    script.write_text(_CRASH.format(tests=str(TESTS), here=str(HERE)))
    proc = subprocess.run(
        [sys.executable, str(script), point, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    found = zf.checkpoint.latest(tmp_path)
    expect = "step_3" if point == "pruning" else "step_2"  # pruning runs after the new one is complete
    assert found == str(tmp_path / expect)
    zf.checkpoint.verify(found)
    step = _build("nvme", seed=9, nvme=str(tmp_path / "nvme-load"))[0]
    assert int(zf.checkpoint.load(found, step).count) == int(expect[-1])
    if point != "pruning":
        assert not (tmp_path / "step_3").exists()


_CRASH_IN_UPDATE = """
import os, signal, sys, torch
sys.path[:0] = [{tests!r}, {here!r}]
import zerofn as zf
from zerofn.transforms.offload import _nvme_update
torch.set_num_threads(1)  # as the tests run (conftest.py): the same rounding as the reference
from test_checkpoint import _build, _train

root = sys.argv[1]
step, apply, _ = _build("shard_params+nvme_params", nvme=os.path.join(root, "nvme"))
state = _train(step, step.init(apply.params), 0, 2)
zf.checkpoint.save(state, os.path.join(root, "step_2"))
state = _train(step, state, 2, 3)
real, calls = _nvme_update._write_group, []

def write_group(*a):  # the next update dies with some of its new files written and others not
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a)

_nvme_update._write_group = write_group
_train(step, state, 3, 4)
"""


def test_sigkill_during_an_update_with_parameters_on_nvme_resumes_bit_for_bit(tmp_path):
    """Parameters and optimizer state in files: a process killed halfway through an update leaves the last
    checkpoint whole (its hard links keep the bytes it saw, though the update rewrites both generations'
    names), and a run restarted in the same directory resumes from it bit for bit."""
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_IN_UPDATE.format(tests=str(TESTS), here=str(HERE)))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    zf.checkpoint.verify(tmp_path / "step_2")
    name = "shard_params+nvme_params"
    step, _, _ = _build(name, seed=9, nvme=str(tmp_path / "nvme"))  # the killed run's directory, as a restart
    resumed = _train(step, zf.checkpoint.load(tmp_path / "step_2", step), 2, 6)
    ref_step, ref_apply, _ = _build(name, nvme=str(tmp_path / "nvme-ref"))
    ref = _train(ref_step, ref_step.init(ref_apply.params), 0, 6)
    assert _equal(step.state_dict(resumed), ref_step.state_dict(ref))


# ---------------------------------------------------------------- a save some ranks never join


def _rank_save_on_rank_0_only(root: str):
    step, apply, _ = _build("shard_optimizer")
    state = step.init(apply.params)
    if C.rank() == 0:
        zf.checkpoint.save(state, f"{root}/alone")
    else:
        time.sleep(60)


def test_a_save_on_one_rank_fails_within_the_timeout(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROFN_TIMEOUT_S", "2")
    start = time.monotonic()
    with pytest.raises(zf.RankError) as info:
        zf.spawn(_rank_save_on_rank_0_only, 2, str(tmp_path))
    assert time.monotonic() - start < 30
    assert info.value.rank == 0
    assert "CollectiveTimeoutError: broadcast_object" in str(info.value) and "ZEROFN_TIMEOUT_S=2" in str(info.value)
    assert zf.checkpoint.latest(tmp_path) is None


def test_a_hugging_face_model_round_trips_through_consolidate(tmp_path):
    """GPT-2 with its tied lm_head, saved under shard_params and amp: the export loads strictly."""
    import transformers
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel
    from zerofn.transforms import amp, shard_params

    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    fresh = copy.deepcopy(model)
    apply = zf.functional(model)
    step = amp(shard_params(zf.train_step(lambda p, b: apply(p, input_ids=b, labels=b).loss, zf.optim.adamw(1e-2))))
    state = step.init(apply.params)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        state, _ = step(state, torch.randint(64, (2, 16), generator=g))
    zf.checkpoint.save(state, tmp_path / "gpt2")
    out = zf.checkpoint.consolidate(tmp_path / "gpt2", tmp_path / "gpt2.safetensors")[0]
    sd = load_file(out)
    assert sd.keys() == fresh.state_dict().keys()  # lm_head.weight too
    fresh.load_state_dict(sd, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    masters = step.state_dict(state, master=True)  # the export holds the fp32 masters
    assert all(torch.equal(sd[k], masters[k]) for k in sd)


def test_rng_states_come_back_on_the_same_world_size(tmp_path):
    step, apply, _ = _build("plain")
    state = _train(step, step.init(apply.params), 0, 1)
    torch.manual_seed(1234)
    zf.checkpoint.save(state, tmp_path / "rng")
    expected = torch.rand(5)  # what the run draws next
    torch.manual_seed(99)
    zf.checkpoint.load(tmp_path / "rng", _fresh_step())
    assert torch.equal(torch.rand(5), expected)
    torch.manual_seed(99)
    zf.checkpoint.load(tmp_path / "rng", _fresh_step(), rng=False)
    assert not torch.equal(torch.rand(5), expected)


# ---------------------------------------------------------------- roles, not names


class _Copy(NamedTuple):
    """A wrapper state of no transform: an fp32 copy of the parameters under a name of its own."""

    copy: Any
    inner: Any

    def state_parts(self) -> tuple:
        return (Quantity("fp32_copy", self.copy, precise=True), Inner(self.inner))


def _keep_fp32(inner):
    def init(params):
        copy = zf.tree.tree_map(lambda p: p.detach().to(torch.float32, copy=True), params)
        return _Copy(copy, inner.init(copy))

    @torch.no_grad()
    def update_in_place(grads, state, params, **extra):
        grads = zf.tree.tree_map(lambda g: g.float(), grads)
        new_inner = zf.optim.update_params(inner, grads, state.inner, state.copy, **extra)
        torch._foreach_copy_(zf.tree.tree_leaves(params), zf.tree.tree_leaves(state.copy))
        return _Copy(state.copy, new_inner)

    return zf.optim.in_place(init, update_in_place, "keep_fp32")


def _copy_step(dtype, wrap: bool):
    torch.manual_seed(0)
    apply = zf.functional(nn.Linear(8, 4).to(dtype))
    opt = zf.optim.adamw(1e-2)
    step = zf.train_step(lambda p, x: apply(p, x.to(dtype)).float().square().mean(), _keep_fp32(opt) if wrap else opt)
    return step, apply


def test_a_declared_quantity_is_loaded_by_its_role_not_its_name(tmp_path):
    step, apply = _copy_step(torch.bfloat16, wrap=True)
    state = step.init(apply.params)
    for i in range(3):
        state, _ = step(state, _batch(i)[:, :8])
    zf.checkpoint.save(state, tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["quantities"] == {"fp32_copy": {"precise": True, "newer": False}}
    copies = state.spec.layout.views(tuple(state.opt_state.copy[keys.bucket(i)] for i in range(len(state.params))))
    assert all(t.dtype == torch.float32 for t in copies.values())
    # An fp32 step without the wrapper takes the precise copy as its parameters, not their bf16 rounding.
    plain, plain_apply = _copy_step(torch.float32, wrap=False)
    loaded = zf.checkpoint.load(tmp_path / "ck", plain, params=plain_apply.params)
    got = plain.full_params(loaded)
    assert all(torch.equal(got[n], copies[n].view(got[n].shape)) for n in got)
    assert any(not torch.equal(got[n], step.full_params(state)[n].float()) for n in got)
    # The wrapper's step loads its copy from a checkpoint without one: the saved parameters.
    zf.checkpoint.save(loaded, tmp_path / "plain")
    again, again_apply = _copy_step(torch.bfloat16, wrap=True)
    back = zf.checkpoint.load(tmp_path / "plain", again, params=again_apply.params)
    back_copies = back.spec.layout.views(tuple(back.opt_state.copy[keys.bucket(i)] for i in range(len(back.params))))
    assert all(torch.equal(back_copies[n].view(got[n].shape), got[n]) for n in got)
