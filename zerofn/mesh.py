"""The ranks as a named N-D mesh, over torch's ``DeviceMesh``.

Each kind of parallelism lays the ranks out along an axis of its own; the
world is the product of the axes. The axes zerofn knows, outermost first
(torchtitan's order, with the experts' axis beside context parallelism):

    pp  dp_replicate  dp_shard  cp  ep  tp

Ranks are numbered row-major over the axes, so the innermost axis holds
consecutive ranks: with ``dp_shard=2, tp=4`` on 8 ranks, global rank ``r``
sits at ``tp`` coordinate ``r % 4`` and ``dp_shard`` coordinate ``r // 4``,
its ``tp`` group is ``[4 (r // 4), ..., 4 (r // 4) + 3]`` and its
``dp_shard`` group ``[r % 4, r % 4 + 4]``.

:func:`make` builds a :class:`Mesh` from the sizes of the axes it is given;
``dp_shard``, unless given, takes what the others leave (``world_size //
their product``). It validates once, before any group is made, and names
both numbers when they disagree (``dp_shard x tp = 2 x 4 = 8 != world_size
4``). Which axes a mesh has: every axis given to :func:`make`, whatever its
size (an axis given as 1 is kept: its groups are each rank alone), and
``dp_shard`` always; an axis not given is absent, and reading it gives size
1 and coordinate 0 (its group is refused: a missing group must not fall
back to the current group). So ``make(tp=1)`` on 4 ranks is ``dp_shard=4,
tp=1``, and ``make(tp=4)`` is ``dp_shard=1, tp=4``: the data-parallel axis
is a group of one, which a step can run on.

The data-parallel axes are ``dp_replicate`` and ``dp_shard``: a rank's
data-parallel rank (:attr:`Mesh.data_rank`, which micro-batch it feeds) is
its place in their product, and :attr:`Mesh.data_group` the group over it.

The groups are zerofn's own, made with :func:`zerofn.collectives.new_group`
(so zerofn's timeouts bound them and its errors name them), every rank
making every group in the same order: each axis in turn, outermost first,
its lines in row-major order, then the data-parallel product when more than
one data-parallel axis is above 1. :attr:`Mesh.device_mesh` wraps them as a
``DeviceMesh`` with named dims through ``DeviceMesh.from_group`` (a list of
groups plus the mesh tensor, the N-D form of torch 2.4+), which makes no
group of its own: ``mesh.device_mesh["tp"].get_group()`` is the very group
``mesh.group("tp")`` is (:meth:`Mesh.device_submesh` keeps each axis's slice,
made once). ``init_device_mesh`` is not used because it would
create groups zerofn did not make, outside zerofn's timeouts and error
translation.

One process with no process group works: every axis has size 1, there are
no groups (``group(axis)`` is None) and no ``device_mesh`` (None); so does a
world of one.

Group creation is collective, so meshes are made once per process: the
cache below holds each shape's groups, keyed by the axes' sizes and the
world group's identity (the entry holds that group, so its id is not
reused), with a ``Mesh`` per device type and the sub-splits of an axis
(:meth:`Mesh.subgroup`) made for it. A group is made once per set of ranks
and shared by every mesh that has such a line: when a second parallelism
joins a step's mesh (:meth:`Mesh.with_axes`) outside the axes it has, those
axes keep their very groups, so what the first parallelism holds stays the
step's. No other module keeps groups of its own.

Example:
    >>> from zerofn import mesh
    >>> m = mesh.make(tp=1)  # one process
    >>> m
    Mesh(dp_shard=1, tp=1)
    >>> m.size("tp"), m.coordinate("tp"), m.data_rank, m.data_size, m.group("tp") is None
    (1, 0, 0, 1, True)
    >>> m.size("cp")  # an axis it does not have
    1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerofn import collectives as C

__all__ = ["AXES", "DATA_AXES", "Mesh", "for_step", "make", "world_size"]

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "ep", "tp")  # outermost first
DATA_AXES = ("dp_replicate", "dp_shard")  # their product: which micro-batch a rank feeds


def world_size() -> int:
    """The ranks of the default group, joining it under torchrun first (as ``step.init`` does); 1 when
    there is none."""
    C.init()
    return C.world_size(group=dist.group.WORLD) if dist.is_initialized() else 1


@dataclass(eq=False)
class _Made:
    """One shape's groups in this process (see the module's cache)."""

    world: Any  # the default group they were made in (held: its id keys the cache)
    rank: int
    groups: dict[str, Any]  # axis -> this rank's group along it (none in a world of one)
    data: Any  # this rank's group over the data-parallel axes' product
    splits: dict[tuple[str, int], Any] = field(default_factory=dict)  # (axis, n) -> this rank's sub-split
    products: dict[tuple[str, ...], Any] = field(default_factory=dict)  # axes -> this rank's group over them
    apart: dict[tuple[str, str], Any] = field(default_factory=dict)  # (axis, use) -> a group of its own
    meshes: dict[str, Mesh] = field(default_factory=dict)  # device type -> its Mesh


_MADE: dict[tuple, _Made] = {}  # ((axis, size), ...), id(world group) -> its groups: made once per process
_LINES: dict[tuple, tuple] = {}  # id(world group), ranks -> (world group, the group over those ranks)


def _line(world: Any, ranks: list[int]) -> Any:
    """The group over ``ranks`` (global, in order), made the first time any mesh asks for it and shared by
    every mesh after: an axis keeps its very groups when another joins beside it. Collective the first time
    (every rank asks for every line in the same order, so every rank makes the same groups)."""
    key = (id(world), tuple(ranks))
    if key not in _LINES:
        _LINES[key] = (world, C.new_group(list(ranks)))
    return _LINES[key][1]


@dataclass(frozen=True, eq=False)
class Mesh:
    """The world as named axes, outermost first, and this rank's place and groups on them.

    Made by :func:`make`; compared by identity (one per shape and device type per process).

    Attributes:
        axes: the axes' names, outermost first (a subsequence of :data:`AXES`).
        shape: their sizes; their product is the world size.
        coordinates: this rank's coordinate on each axis.
        device_type: the device type of :attr:`device_mesh` (``"cuda"``, ``"cpu"``).
        device_mesh: torch's ``DeviceMesh`` over the same groups, its dims named as :attr:`axes`; None in a
            world of one.
    """

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    coordinates: tuple[int, ...]
    device_type: str
    device_mesh: Any = field(repr=False)
    _made: _Made = field(repr=False)
    _submeshes: dict[str, Any] = field(repr=False)  # axis -> device_mesh[axis], sliced once

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{a}={n}' for a, n in zip(self.axes, self.shape))})"

    @property
    def sizes(self) -> dict[str, int]:
        """``{axis: size}``, outermost first (what :func:`make` takes back)."""
        return dict(zip(self.axes, self.shape))

    def _index(self, axis: str) -> int | None:
        if axis not in AXES:
            raise ValueError(f"zerofn.mesh: unknown axis {axis!r}; the axes are {', '.join(AXES)} (outermost first)")
        return self.axes.index(axis) if axis in self.axes else None

    def size(self, axis: str) -> int:
        """Ranks along ``axis`` (1 for an axis this mesh does not have)."""
        i = self._index(axis)
        return 1 if i is None else self.shape[i]

    def coordinate(self, axis: str) -> int:
        """This rank's coordinate on ``axis``: its rank in :meth:`group` (0 for an axis this mesh does not have)."""
        i = self._index(axis)
        return 0 if i is None else self.coordinates[i]

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``, in coordinate order."""
        i = self._index(axis)
        if i is None:
            return [self._made.rank]
        stride = math.prod(self.shape[i + 1 :])
        first = self._made.rank - self.coordinates[i] * stride
        return [first + k * stride for k in range(self.shape[i])]

    def group(self, axis: str) -> Any:
        """This rank's process group along ``axis`` (None in a world of one).

        Raises:
            ValueError: the mesh has no such axis (its group would be no group: pass the axis to :func:`make`).
        """
        if self._index(axis) is None:
            raise ValueError(
                f"zerofn.mesh: {self!r} has no axis {axis!r}, so no group along it; make the mesh with "
                f"zerofn.mesh.make({axis}=...)"
            )
        return self._made.groups.get(axis)

    @property
    def data_size(self) -> int:
        """Data-parallel ranks: the product of the data-parallel axes."""
        return math.prod(self.size(a) for a in DATA_AXES)

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel rank (which micro-batch it feeds): its place in the data-parallel axes'
        product, row-major, which is its rank in :attr:`data_group`."""
        return self.coordinate("dp_replicate") * self.size("dp_shard") + self.coordinate("dp_shard")

    @property
    def data_group(self) -> Any:
        """This rank's group over the data-parallel axes' product (None in a world of one)."""
        return self._made.data

    def group_over(self, *axes: str) -> Any:
        """This rank's group over the product of ``axes`` (row-major, in the mesh's order): the data-parallel
        axes with context parallelism's ``cp``, over which a step whose ranks split each micro-batch's
        sequence reduces its gradients. One axis gives that axis's group, the data-parallel axes
        :attr:`data_group`. Collective the first time per set of axes (every rank makes every such group, in
        the same order); kept with the mesh's groups after. None in a world of one.

        Raises:
            ValueError: an axis the mesh does not have.
        """
        for a in axes:
            self.group(a)  # an axis the mesh has
        mine = tuple(a for a in self.axes if a in axes)
        if len(mine) == 1:
            return self.group(mine[0])
        if set(mine) == {a for a in DATA_AXES if a in self.axes}:
            return self.data_group
        made = self._made
        if mine not in made.products:
            found = None
            if made.world is not None:
                for line in _lines(self.shape, tuple(self.axes.index(a) for a in mine)):
                    g = _line(made.world, line)
                    if made.rank in line:
                        found = g
            made.products[mine] = found
        return made.products[mine]

    def subgroup(self, axis: str, n: int) -> Any:
        """This rank's group of ``n`` consecutive coordinates along ``axis`` (``n`` divides its size): the
        axis cut into ``size // n`` parts. Collective the first time per ``(axis, n)``: every rank makes every
        such group, in the same order; kept with the mesh's groups after. None in a world of one.

        Raises:
            ValueError: ``n`` does not divide the axis's size, or the mesh has no such axis.
        """
        size = self.size(axis)
        self.group(axis)  # an axis the mesh has
        if not isinstance(n, int) or n < 1 or size % n:
            raise ValueError(f"zerofn.mesh: subgroup({axis!r}, {n!r}): n must divide the axis's size {size}")
        made = self._made
        if (axis, n) not in made.splits:
            mine = None
            if made.world is not None:
                for line in _lines(self.shape, (self.axes.index(axis),)):
                    for start in range(0, size, n):
                        ranks = line[start : start + n]
                        g = _line(made.world, ranks)
                        if made.rank in ranks:
                            mine = g
            made.splits[(axis, n)] = mine
        return made.splits[(axis, n)]

    def own_group(self, axis: str, use: str) -> Any:
        """A group over this rank's ranks along ``axis`` that no other mesh or group shares, for ``use``: the
        collectives of a parallelism whose order on those ranks is not tied to the step's gradient
        reductions (expert parallelism's token exchanges, issued in the model's order, while buckets are
        reduced as backward completes them, which may differ between ranks where one rank's experts got no
        token) go there, so that each group sees one order on every rank. Collective the first time per
        ``(axis, use)``: every rank makes every such group, in the same order. None in a world of one.

        Raises:
            ValueError: the mesh has no such axis.
        """
        self.group(axis)  # an axis the mesh has
        made = self._made
        if (axis, use) not in made.apart:
            mine = None
            if made.world is not None:
                for line in _lines(self.shape, (self.axes.index(axis),)):
                    g = C.new_group(list(line))
                    if made.rank in line:
                        mine = g
            made.apart[(axis, use)] = mine
        return made.apart[(axis, use)]

    def axes_of(self, group: Any) -> str | None:
        """The mesh axes ``group`` spans, as ``metrics["comm_bytes_by_axis"]`` names them: an axis
        (``"dp_shard"``), or several joined by ``" x "`` in the mesh's order (``"dp_replicate x dp_shard"``:
        the data-parallel group over both); None for a group this mesh did not make. An axis's own group
        (:meth:`own_group`) and a part of one (:meth:`subgroup`) count as the axis."""
        made = self._made
        for axis, g in made.groups.items():
            if g is group:
                return axis
        if made.data is group:
            return " x ".join(a for a in DATA_AXES if self.size(a) > 1) or "dp_shard"
        for axes, g in made.products.items():
            if g is group:
                return " x ".join(axes)
        for (axis, _), g in (*made.apart.items(), *made.splits.items()):
            if g is group:
                return axis
        return None

    def device_submesh(self, axis: str) -> Any:
        """``device_mesh[axis]``: the 1-D ``DeviceMesh`` over ``axis`` (a ``DTensor`` placed on one axis
        lives on it), sliced once when the mesh is made (slicing makes a new one, reading its ranks on the
        host, each time). None in a world of one.

        Raises:
            ValueError: the mesh has no such axis.
        """
        self.group(axis)  # an axis the mesh has
        return self._submeshes.get(axis)

    def with_axes(self, **sizes: int) -> Mesh:
        """The mesh with these axes added (or resized) beside this one's other axes, ``dp_shard`` filled
        again from what is left (:func:`make`): how a second parallelism joins a step's mesh, e.g.
        ``step.mesh.with_axes(cp=2)`` on a ``tp`` mesh. The axes inside the new one keep their groups (the
        same objects); those outside it are laid over other ranks."""
        kept = {a: n for a, n in self.sizes.items() if a != "dp_shard"}
        return make(device_type=self.device_type, **{**kept, **sizes})

    def on(self, device_type: str) -> Mesh:
        """This mesh with its :attr:`device_mesh` on ``device_type``: the same groups (no collective)."""
        return make(device_type=device_type, **self.sizes)


def make(*, device_type: str | None = None, **sizes: int) -> Mesh:
    """The mesh of the given axes' sizes over the world, made once per process and shape (see the module).

    Args:
        device_type: the device type of its ``device_mesh``; default ``"cuda"`` when CUDA is available, else
            ``"cpu"``.
        **sizes: ranks along each axis, by name (:data:`AXES`); ``dp_shard``, unless given, takes what the
            others leave.

    Returns:
        The :class:`Mesh`. Collective the first time for a shape (every rank makes every group).

    Raises:
        ValueError: an unknown axis, a size that is not an int >= 1, or sizes that do not fill the world
            (both numbers named), before any group is made.
    """
    unknown = [a for a in sizes if a not in AXES]
    if unknown:
        raise ValueError(f"zerofn.mesh.make: unknown axis {unknown[0]!r}; the axes are {', '.join(AXES)}")
    for a, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"zerofn.mesh.make: {a} must be an int >= 1 (ranks along that axis), got {n!r}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = world_size()
    sizes = _fill(dict(sizes), world)
    axes = tuple(a for a in AXES if a in sizes)
    shape = tuple(sizes[a] for a in axes)
    group = dist.group.WORLD if dist.is_initialized() else None
    key = (tuple(zip(axes, shape)), None if group is None else id(group))
    made = _MADE.get(key)
    if made is None:
        made = _MADE[key] = _make_groups(axes, shape, world, group)
    if device_type not in made.meshes:
        rank, coordinates = made.rank, []
        for n in reversed(shape):
            coordinates.append(rank % n)
            rank //= n
        whole = _device_mesh(axes, shape, made, device_type)
        submeshes = {} if whole is None else {a: whole[a] for a in axes}
        made.meshes[device_type] = Mesh(axes, shape, tuple(reversed(coordinates)), device_type, whole, made, submeshes)
    return made.meshes[device_type]


def for_step(mesh: Mesh | None, by: str, axis: str, size: int) -> Mesh:
    """The mesh a parallelism ``by`` runs a step on with ``size`` ranks along ``axis``: the step's ``mesh``
    with the axis joined (:meth:`Mesh.with_axes`), or, on a step without one, ``axis`` over the world with
    ``dp_shard`` the rest (:func:`make`).

    Raises:
        ValueError: on a step without a mesh, a ``size`` that does not divide the world size (named by ``by``).
    """
    if mesh is not None:
        return mesh.with_axes(**{axis: size})
    world = world_size()
    if world % size:
        raise ValueError(
            f"{by}: size {size} does not divide the world size {world}: the mesh is size x (world // size) ranks. "
            f"Run on a multiple of {size} ranks, or pick a size that divides {world}."
        )
    return make(**{axis: size})


def _fill(sizes: dict[str, int], world: int) -> dict[str, int]:
    """The sizes with ``dp_shard`` filled in, checked against the world size."""
    given = [a for a in AXES if a in sizes]
    product = math.prod(sizes[a] for a in given)
    names, values = " x ".join(given), " x ".join(str(sizes[a]) for a in given)
    said = f"{names} = {values}" + (f" = {product}" if len(given) > 1 else "")
    if "dp_shard" in sizes:
        if product != world:
            raise ValueError(
                f"zerofn.mesh.make: {said} != world_size {world}: the axes' sizes multiply to the world size. "
                f"Give sizes whose product is {world}, or leave dp_shard out and it takes what the other axes "
                f"leave (world_size // their product)."
            )
        return sizes
    if world % product:
        raise ValueError(
            f"zerofn.mesh.make: {said} does not divide world_size {world}: dp_shard takes what the other axes "
            f"leave (world_size // their product). Run on a multiple of {product} ranks, or pick sizes whose "
            f"product divides {world}."
        )
    return {**sizes, "dp_shard": world // product}


def _lines(shape: tuple[int, ...], dims: tuple[int, ...]) -> list[list[int]]:
    """The global ranks of every sub-mesh spanning ``dims`` (the other coordinates fixed), row-major."""
    grid = torch.arange(math.prod(shape)).reshape(shape)
    inner = tuple(range(len(shape) - len(dims), len(shape)))
    return grid.movedim(dims, inner).reshape(-1, math.prod(shape[d] for d in dims)).tolist()


def _make_groups(axes: tuple[str, ...], shape: tuple[int, ...], world: int, group: Any) -> _Made:
    """Every group of the mesh, made by every rank in the same order; this rank's kept."""
    rank = dist.get_rank() if group is not None else 0
    if world == 1:
        return _Made(group, rank, {}, None)
    mine: dict[str, Any] = {}
    for i, axis in enumerate(axes):
        for line in _lines(shape, (i,)):
            g = _line(group, line)
            if rank in line:
                mine[axis] = g
    data = [a for a in DATA_AXES if a in axes]
    above = [a for a in data if shape[axes.index(a)] > 1]
    mine_data = None
    if len(above) > 1:  # a product of axes: a group of its own
        for line in _lines(shape, tuple(axes.index(a) for a in data)):
            g = _line(group, line)
            if rank in line:
                mine_data = g
    else:  # the one data-parallel axis above 1, or dp_shard's group of one
        mine_data = mine[above[0] if above else "dp_shard"]
    return _Made(group, rank, mine, mine_data)


def _device_mesh(axes: tuple[str, ...], shape: tuple[int, ...], made: _Made, device_type: str) -> Any:
    """torch's DeviceMesh over the mesh's own groups (None in a world of one)."""
    if not made.groups:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.arange(math.prod(shape), dtype=torch.int).reshape(shape)
    return DeviceMesh.from_group([made.groups[a] for a in axes], device_type, grid, mesh_dim_names=axes)
