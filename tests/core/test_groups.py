"""Explicit process groups: two steps on two disjoint 2-rank subgroups of a 4-rank gloo world train at the same
time, each equal to one process (torch) over its own ranks' concatenated batches; the collectives under
zf.collectives.group_scope run on the group, a group this rank is not in is refused by name, and asking the rank
joins nothing."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
import torch.distributed as dist
from helpers import MLP, max_abs_diff, mlp_batch, rank_slice
from zerofn.transforms import shard_optimizer, shard_params

import zerofn as zf
from zerofn import collectives as C

STEPS, BATCH = 4, 8  # BATCH: one group's global batch, split over its 2 ranks
# Each half of the world trains its own model with its own optimizer and data (a gradient that crossed
# over from the other half would show): (model seed, data seed).
HALVES = {
    "adamw": (0, 1),  # ranks 0 and 1: shard_optimizer, zf.optim.adamw
    "sgd": (1, 2),  # ranks 2 and 3: shard_params, zf.optim.sgd with momentum
}

_GROUPS: dict = {}  # in each rank process: the subgroups, made once (every rank makes them, in the same order)


def _groups():
    if not _GROUPS:
        _GROUPS["low"] = dist.new_group([0, 1])
        _GROUPS["high"] = dist.new_group([2, 3])
        _GROUPS["ours"] = C.new_group([0, 1])
    me = dist.get_rank()
    return (_GROUPS["low"] if me < 2 else _GROUPS["high"]), ("adamw" if me < 2 else "sgd")


def _model(half):
    torch.manual_seed(HALVES[half][0])
    return MLP().double()


def _batch(half, i):
    b = mlp_batch(i, BATCH, seed=HALVES[half][1])
    return {k: v.double() for k, v in b.items()}


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _step(half, group):
    apply = zf.functional(_model(half))

    def loss_fn(params, batch):
        return _mse(apply(params, batch["x"]), batch["y"])

    if half == "adamw":
        return apply, shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(3e-3, weight_decay=0.1), group=group))
    return apply, shard_params(zf.train_step(loss_fn, zf.optim.sgd(0.05, momentum=0.9), group=group))


def _rank_train(root):
    group, half = _groups()
    apply, step = _step(half, group)
    me = C.rank(group=group)
    losses, default_bytes = [], None
    with C.counting() as on_default:  # the default group's traffic: none, all of it went on the subgroup
        state = step.init(apply.params)
        for i in range(STEPS):
            state, metrics = step(state, rank_slice(_batch(half, i), me, 2))
            losses.append(float(metrics["loss"]))
        default_bytes = on_default.bytes
    params = step.full_params(state)
    # A checkpoint of the group: its 2 ranks write it and its rank 0 commits it, beside the other group's.
    path = f"{root}/{half}"
    if half == "adamw":
        zf.checkpoint.save(state, path, group=group)
    else:
        with C.group_scope(group):
            zf.checkpoint.save(state, path)
    fresh = _step(half, group)[1]
    again = zf.checkpoint.load(path, fresh)  # in fresh.group
    return {
        "half": half,
        "params": params,
        "losses": losses,
        "world": state.spec.world_size,
        "comm_bytes": int(metrics["comm_bytes"]),
        "default_bytes": default_bytes,
        "loaded": fresh.full_params(again),
        "count": int(again.count),
    }


def _reference(half):
    """torch driving the module itself over the group's whole batch (the concatenation of its ranks' slices)."""
    model = _model(half)
    if half == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for i in range(STEPS):
        b = _batch(half, i)
        loss = _mse(model(b["x"]), b["y"])
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}, losses


def _rank_scope():
    """The collectives inside a scope run on the group; outside it, on the world."""
    group, _ = _groups()
    me = dist.get_rank()
    out = {}
    with C.group_scope(group) as current:
        out["current"] = current is group and C.current_group() is group
        out["rank"], out["size"] = C.rank(), C.world_size()
        x = torch.tensor([float(me + 1)])
        C.all_reduce(x)
        out["sum"] = x.item()
        full = torch.empty(4)
        C.all_gather(full, torch.full((2,), float(me)))
        out["all_gather"] = full.tolist()
        shard = torch.empty(2)
        C.reduce_scatter(shard, torch.arange(4.0) * (me + 1))
        out["reduce_scatter"] = shard.tolist()
        hi, lo = C.max_min(torch.tensor([float(me)]))
        out["max_min"] = (hi.item(), lo.item())
        out["any_of"] = C.any_of(torch.tensor([me == 0, me == 3, False], dtype=torch.uint8)).tolist()
        out["gather_objects"] = C.gather_objects(me)
        out["broadcast"] = C.broadcast_object(me, src=1)  # the group's rank 1
        C.barrier()
        with C.counting() as c:
            C.all_reduce(torch.ones(3))
            C.all_reduce(torch.ones(2), control=True)
        out["bytes"] = c.bytes
        with C.group_scope(dist.group.WORLD):
            out["nested_world"] = C.world_size()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            out["thread_carried"] = pool.submit(C.with_current_group(C.rank)).result()
            try:
                pool.submit(C.world_size).result()
            except RuntimeError as err:
                out["thread_plain"] = str(err)
    out["outside"] = (C.rank(), C.world_size())
    out["explicit"] = (C.rank(group=group), C.world_size(group=group))
    return out


def _rank_not_a_member():
    """Every rank made the groups; ranks 2 and 3 are not in either group of ranks [0, 1]."""
    _groups()
    out = {"size": C.world_size(group=_GROUPS["ours"]) if dist.get_rank() < 2 else None}
    if dist.get_rank() >= 2:
        for name in ("ours", "low"):
            try:
                C.all_reduce(torch.ones(1), group=_GROUPS[name])
            except ValueError as err:
                out[name] = str(err)
        apply = zf.functional(_model("adamw"))
        step = zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.sgd(0.1), group=_GROUPS["ours"])
        try:
            step.init(apply.params)
        except ValueError as err:
            out["step"] = str(err)
    return out


def _rank_uneven_histories() -> tuple | None:
    """A group from zf.collectives.new_group checks on its control group, on ranks that hold unequal numbers
    of groups: torch names a group made by its ranks only from the number each holds."""
    rank = dist.get_rank()
    if rank < 2:  # ranks 0 and 1 make a group of their own: from here rank 1 holds one group more than rank 3
        dist.new_group([0, 1], use_local_synchronization=True)
    group = C.new_group([1, 3], timeout_s=30)
    out = None
    if rank in (1, 3):  # a check on the group's control group (made with the group, by every rank together)
        hi, lo = C.max_min(torch.tensor([float(rank)]), group=group)
        out = (float(hi), float(lo))
    return out


@pytest.fixture(scope="module")
def world(ranks):
    return ranks(4)


def test_two_subgroups_train_at_once_each_equal_to_one_process_over_its_ranks(world, tmp_path):
    results = world.run(_rank_train, str(tmp_path))
    refs = {half: _reference(half) for half in HALVES}
    init = {half: dict(zf.functional(_model(half)).params) for half in HALVES}
    for rank, out in enumerate(results):
        half = "adamw" if rank < 2 else "sgd"
        ref_params, ref_losses = refs[half]
        assert out["half"] == half and out["world"] == 2
        diff = max_abs_diff(out["params"], ref_params)
        assert diff <= 1e-6, f"rank {rank} ({half}): max abs param diff {diff:.3g}"
        assert max_abs_diff(ref_params, init[half]) > 1e-3  # it trained
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-9)
        assert out["comm_bytes"] > 0 and out["default_bytes"] == 0
        # the group's checkpoint loads back into its step, in its group
        assert out["count"] == STEPS and max_abs_diff(out["loaded"], out["params"]) == 0
    assert results[0]["comm_bytes"] == results[1]["comm_bytes"]
    assert results[2]["comm_bytes"] == results[3]["comm_bytes"]


def test_collectives_under_a_scope_run_on_its_group(world):
    results = world.run(_rank_scope)
    for me, out in enumerate(results):
        first = 0 if me < 2 else 2  # the global rank of the group's rank 0
        assert out["current"] and (out["rank"], out["size"]) == (me - first, 2)
        assert out["sum"] == (first + 1) + (first + 2)
        assert out["all_gather"] == [float(first)] * 2 + [float(first + 1)] * 2
        local = me - first
        assert out["reduce_scatter"] == [float(v) * ((first + 1) + (first + 2)) for v in (2 * local, 2 * local + 1)]
        assert out["max_min"] == (first + 1, first)
        assert out["any_of"] == ([1, 0, 0] if me < 2 else [0, 1, 0])
        assert out["gather_objects"] == [first, first + 1]
        assert out["broadcast"] == first + 1
        assert out["bytes"] == 2 * 3 * 4 + 2 * 2 * 4  # counted on the group, the control group's too
        assert out["nested_world"] == 4
        assert out["thread_carried"] == me - first
        msg = out["thread_plain"]
        assert "is the current group of thread 'MainThread'" in msg and f"ranks [{first}, {first + 1}]" in msg
        assert "with_current_group" in msg
        assert out["outside"] == (me, 4) and out["explicit"] == (me - first, 2)


def test_a_group_this_rank_is_not_in_is_refused_by_name(world):
    results = world.run(_rank_not_a_member)
    assert [r["size"] for r in results] == [2, 2, None, None]
    for me in (2, 3):
        out = results[me]
        assert f"all_reduce: rank {me} is not in the group of ranks [0, 1]" in out["ours"]
        assert f"rank {me} is not in GroupMember.NON_GROUP_MEMBER" in out["low"]
        assert f"group_scope: rank {me} is not in the group of ranks [0, 1]" in out["step"]
        assert "only on the ranks in the group" in out["ours"]


def test_asking_the_rank_joins_no_process_group(monkeypatch):
    if dist.is_initialized():
        pytest.skip("this process joined a process group already")
    assert (C.rank(), C.world_size(), C.current_group()) == (0, 1, None)
    assert C.init() is False and not dist.is_initialized()
    # A torchrun rank before anything joined: the environment answers, and nothing joins (no store to reach
    # here, so a join would fail within the second).
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("ZEROFN_TIMEOUT_S", "1")
    assert (C.rank(), C.world_size()) == (2, 4)
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup"):
        C.world_size(group="world")


def test_a_groups_control_group_needs_no_equal_histories():
    # made on its first use by its ranks only, the control group of ranks [1, 3] waited forever: rank 1 named it
    # after the groups it held, one more than rank 3's. On ranks of their own: the uneven histories stay there.
    with zf.RankPool(4) as pool:
        assert pool.run(_rank_uneven_histories, timeout=120) == [None, (3.0, 1.0), None, (3.0, 1.0)]
