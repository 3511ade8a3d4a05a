"""zerofn.mesh: the ranks as a named N-D mesh. Its refusals name both numbers and the fix; one process has
every axis of size 1 and no groups; on real gloo ranks (world 2 and 4) each axis's group holds the ranks
torchtitan's layout gives (row-major over pp, dp_replicate, dp_shard, cp, ep, tp: tp innermost, so
consecutive ranks), ``mesh.device_mesh[axis]`` wraps the very group zerofn made, and a collective over either
agrees."""

from __future__ import annotations

import pytest
import torch

import zerofn as zf
from zerofn import mesh

# world size -> [(make's sizes, {axis: the groups of ranks along it, rank 0's group first}, data group per rank)]
LAYOUTS = {
    2: [
        ({}, {"dp_shard": [[0, 1]]}, [[0, 1], [0, 1]]),
        ({"tp": 2}, {"dp_shard": [[0], [1]], "tp": [[0, 1]]}, [[0], [1]]),
        ({"cp": 2}, {"dp_shard": [[0], [1]], "cp": [[0, 1]]}, [[0], [1]]),
        ({"tp": 1}, {"dp_shard": [[0, 1]], "tp": [[0], [1]]}, [[0, 1], [0, 1]]),
    ],
    4: [
        ({"tp": 2}, {"dp_shard": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}, [[0, 2], [1, 3], [0, 2], [1, 3]]),
        ({"tp": 4}, {"dp_shard": [[0], [1], [2], [3]], "tp": [[0, 1, 2, 3]]}, [[0], [1], [2], [3]]),
        (
            {"pp": 2, "tp": 2},
            {"pp": [[0, 2], [1, 3]], "dp_shard": [[0], [1], [2], [3]], "tp": [[0, 1], [2, 3]]},
            [[0], [1], [2], [3]],
        ),
        (
            {"dp_replicate": 2, "dp_shard": 2},
            {"dp_replicate": [[0, 2], [1, 3]], "dp_shard": [[0, 1], [2, 3]]},
            [[0, 1, 2, 3]] * 4,
        ),
        (
            {"dp_shard": 2, "cp": 2},
            {"dp_shard": [[0, 2], [1, 3]], "cp": [[0, 1], [2, 3]]},
            [[0, 2], [1, 3], [0, 2], [1, 3]],
        ),
        (
            {"ep": 2, "tp": 2},
            {"dp_shard": [[0], [1], [2], [3]], "ep": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]},
            [[0], [1], [2], [3]],
        ),
    ],
}


def _refused(**sizes) -> str:
    with pytest.raises(ValueError) as e:
        mesh.make(**sizes)
    return str(e.value)


def test_sizes_that_do_not_fill_the_world_are_refused_with_both_numbers_and_the_fix():
    said = _refused(dp_shard=2, tp=4)
    assert "dp_shard x tp = 2 x 4 = 8 != world_size 1" in said, said
    assert "Give sizes whose product is 1, or leave dp_shard out" in said, said
    said = _refused(tp=2)
    assert "tp = 2 does not divide world_size 1: dp_shard takes what the other axes leave" in said, said
    assert "Run on a multiple of 2 ranks" in said, said
    assert "pp x tp = 2 x 3 = 6 does not divide world_size 1" in _refused(pp=2, tp=3)
    assert "unknown axis 'dp'; the axes are pp, dp_replicate, dp_shard, cp, ep, tp" in _refused(dp=2)
    for bad in (0, -1, True, 2.0, "2"):
        assert f"tp must be an int >= 1 (ranks along that axis), got {bad!r}" in _refused(tp=bad)


def test_one_process_has_every_axis_of_size_one_and_no_groups():
    m = mesh.make(tp=1)
    assert m is mesh.make(tp=1) is mesh.make(dp_shard=1, tp=1)  # made once per shape
    assert repr(m) == "Mesh(dp_shard=1, tp=1)" and m.axes == ("dp_shard", "tp") and m.shape == (1, 1)
    assert m.sizes == {"dp_shard": 1, "tp": 1} and m.coordinates == (0, 0)
    assert (m.group("tp"), m.group("dp_shard"), m.data_group, m.device_mesh) == (None, None, None, None)
    assert m.device_submesh("tp") is None
    assert (m.data_rank, m.data_size, m.ranks("tp"), m.subgroup("tp", 1)) == (0, 1, [0], None)
    assert (m.size("cp"), m.coordinate("cp"), m.ranks("cp")) == (1, 0, [0])  # an axis it does not have
    with pytest.raises(ValueError, match="has no axis 'cp', so no group along it; make the mesh with"):
        m.group("cp")
    with pytest.raises(ValueError, match="unknown axis 'dp'"):
        m.size("dp")
    with pytest.raises(ValueError, match=r"subgroup\('tp', 2\): n must divide the axis's size 1"):
        m.subgroup("tp", 2)
    assert mesh.make().axes == ("dp_shard",)  # dp_shard always; an axis not given is absent
    other = m.on("meta")
    assert other is not m and other.device_type == "meta" and other.sizes == m.sizes and other.on("meta") is other


def _layouts(world: int) -> list:
    """On each rank: per layout, each axis's group's ranks, sizes and coordinates, the DeviceMesh's view of it,
    and a sum of the ranks over the DeviceMesh's group and over zerofn's."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from zerofn import collectives as C

    rank, out = dist.get_rank(), []
    for sizes, _, _ in LAYOUTS[world]:
        m = mesh.make(**sizes)
        assert m is mesh.make(**sizes)
        dm = m.device_mesh
        got = {
            "mesh_dim_names": dm.mesh_dim_names,
            "coordinates": m.coordinates,
            "dm_coordinates": tuple(dm.get_coordinate()),
        }
        for axis in m.axes:
            g = m.group(axis)
            theirs = dm[axis].get_group()
            via_torch = torch.tensor([float(rank)])
            dist.all_reduce(via_torch, group=theirs)
            via_zerofn = C.all_reduce(torch.tensor([float(rank)]), group=g)
            sub = m.device_submesh(axis)  # dm[axis], sliced once
            assert sub is m.device_submesh(axis) and sub.mesh_dim_names == (axis,) and sub == dm[axis]
            whole = DTensor.from_local(torch.tensor([float(rank)]), sub, [Shard(0)]).full_tensor()
            got[axis] = {
                "ranks": dist.get_process_group_ranks(g),
                "said": m.ranks(axis),
                "same_group": theirs is g and sub.get_group() is g,
                "size": m.size(axis),
                "coordinate": m.coordinate(axis),
                "sums": (via_torch.item(), via_zerofn.item()),
                "whole": whole.tolist(),
            }
        got["data"] = (dist.get_process_group_ranks(m.data_group), m.data_rank, m.data_size)
        out.append(got)
    if world == 4:
        m = mesh.make(tp=4)
        halves = m.subgroup("tp", 2)
        assert halves is m.subgroup("tp", 2)  # made once
        out.append({"halves": dist.get_process_group_ranks(halves)})
        for sizes in ({"dp_shard": 2, "tp": 4}, {"tp": 3}):
            try:
                mesh.make(**sizes)
            except ValueError as e:
                out.append({"refused": str(e)})
        out.append(_joins())
    return out


def _joins() -> dict:
    """On 4 ranks: an axis joining outside tp keeps tp's very groups, on a mesh and on a step; one joining
    inside an axis a transform holds is refused, naming the order that works."""
    import torch.distributed as dist
    from zerofn.transforms import tensor_parallel

    from zerofn.sharding import Claim

    m = mesh.make(tp=2)
    j = m.with_axes(cp=2)
    step = zf.train_step(lambda p, b: p["w"].sum(), zf.optim.sgd(0.1))
    tp_first = tensor_parallel(step, 2)
    both = tp_first.claim(Claim("cp", "context"), tp_first.mesh.with_axes(cp=2))
    cp_first = step.claim(Claim("cp", "context"), mesh.make(cp=2))
    try:
        tensor_parallel(cp_first, 2)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {
        "joined": (j.sizes, j.group("tp") is m.group("tp"), dist.get_process_group_ranks(j.group("cp"))),
        "step": (both.mesh is j, both.group is j.data_group, [c.axis for c in both.claims]),
        "refused": refused,
    }


@pytest.mark.parametrize("world", [2, 4])
def test_each_axis_holds_torchtitans_ranks_and_its_device_mesh_is_the_same_group(world):
    # ranks of their own: the groups of ten layouts stay in these processes, not in the shared pool's, where
    # later tests' locally made groups over the same ranks would be named alike
    with zf.RankPool(world) as pool:
        results = pool.run(_layouts, world)
    for rank, got in enumerate(results):
        for (sizes, groups, data), seen in zip(LAYOUTS[world], got):
            axes = tuple(groups)
            assert seen["mesh_dim_names"] == axes, (sizes, seen)
            assert seen["dm_coordinates"] == seen["coordinates"], (sizes, seen)
            for axis, lines in groups.items():
                mine = next(line for line in lines if rank in line)
                s = seen[axis]
                assert s["ranks"] == s["said"] == mine, (sizes, axis, rank, s)
                assert s["same_group"], (sizes, axis)  # DeviceMesh.from_group wraps zerofn's group itself
                assert (s["size"], s["coordinate"]) == (len(mine), mine.index(rank)), (sizes, axis, s)
                assert s["sums"] == (float(sum(mine)), float(sum(mine))), (sizes, axis, s)
                assert s["whole"] == [float(r) for r in mine], (sizes, axis, s)
            assert seen["data"] == (data[rank], data[rank].index(rank), len(data[rank])), (sizes, seen["data"])
        if world == 4:
            extra = got[len(LAYOUTS[world]) :]
            assert extra[0]["halves"] == [[0, 1], [2, 3]][rank // 2]
            assert "dp_shard x tp = 2 x 4 = 8 != world_size 4" in extra[1]["refused"], extra
            assert "tp = 3 does not divide world_size 4" in extra[2]["refused"], extra
            joins = extra[3]
            assert joins["joined"] == ({"dp_shard": 1, "cp": 2, "tp": 2}, True, [[0, 2], [1, 3]][rank % 2]), joins
            assert joins["step"] == (True, True, ["tp", "cp"]), joins
            assert "lays context's axis 'cp' over other ranks" in joins["refused"], joins
            assert "Apply tensor_parallel before context: axes join from the innermost out" in joins["refused"]


def test_a_second_axis_joins_a_mesh_beside_the_first():
    m = mesh.make(tp=1)
    both = m.with_axes(cp=1)
    assert both.sizes == {"dp_shard": 1, "cp": 1, "tp": 1}
    assert both.with_axes(cp=1) is both  # made once per shape


def test_the_transforms_claim_their_axes_and_an_axis_is_one_parallelisms():
    from zerofn.transforms import shard_grads, shard_params, tensor_parallel

    import zerofn as zf
    from zerofn.sharding import Claim

    step = zf.train_step(lambda p, b: p["w"].sum(), zf.optim.sgd(0.1))
    zero = shard_params(shard_grads(step))
    assert [(c.axis, c.by) for c in zero.claims] == [("dp_shard", "zero")] and zero.mesh is None
    both = tensor_parallel(zero, 1)
    assert [(c.axis, c.by) for c in both.claims] == [("dp_shard", "zero"), ("tp", "tensor_parallel")]
    assert both.mesh.sizes == {"dp_shard": 1, "tp": 1} and both.group is both.mesh.data_group
    with pytest.raises(ValueError, match="'tp' is tensor_parallel's already"):
        both.claim(Claim("tp", "another"), both.mesh)
