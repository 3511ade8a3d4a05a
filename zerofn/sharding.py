"""Placements: how a parameter a rank holds is cut from the whole one, per axis of the step's mesh.

As DTensor writes them: one placement per mesh axis, in the mesh's order, each :class:`Replicate` (the
rank holds the tensor whole along that axis), :class:`Shard` (cut along a tensor dimension over the
axis's ranks) or :class:`Stage` (whole, held by the ranks at one coordinate of the axis only). The
state's spec records them for every parameter a model-parallel transform cuts (``state.spec.placements``,
beside ``state.spec.mesh``: each cutting axis's name, size and this rank's coordinate on it), and a
checkpoint's manifest records them for each part it saved; saving, loading onto another mesh,
``consolidate`` and ``full_params`` reassemble and re-cut any parameter from them alone, so a new
parallelism that cuts parameters declares placements and needs no code in persistence.

Two generalisations of DTensor's ``Shard(dim)`` that tensor parallelism needs, both as fields of
:class:`Shard`:

- ``parts``: the dimension is ``parts`` blocks side by side (a fused q/k/v projection), each cut alike
  and this rank's piece of each put side by side; DTensor's ``_StridedShard(dim, split_factor=parts)``.
- ``share``: ``share`` consecutive ranks of the axis hold the same piece (key/value heads fewer than the
  ranks: the axis's ``size`` ranks hold ``size // share`` pieces).

A pipeline's placement is not DTensor's: :class:`Stage` ``(index)`` says that the ranks at coordinate ``index``
of the axis hold the whole tensor and the axis's other ranks none of it (a pipeline's stages over ``pp``: each
parameter lives on the stage that runs it; with virtual stages, on the rank whose coordinate is its stage
modulo the pipeline's ranks). Written ``Stage(index)``. One piece makes the whole (:func:`pieces` names the
coordinate that holds it, :func:`join` takes it as it is), :func:`cut` gives the whole tensor at that
coordinate and refuses the others, and :func:`holds` says whether a rank holds any of a tensor. The claim
names every parameter of the model, held here or not, so the spec of every rank of a pipeline describes the
whole model; what moves a parameter to the ranks without it (``full_params``: sent from the holding stage;
a checkpoint: one part per coordinate, each written once by its own ranks, read back from the part that
holds it) reads that placement alone.

Data-parallel axes never appear here: ZeRO's shards are flat ranges of buckets (``state.spec.layout``),
resharded by the layout, not by placements.

Example:
    >>> import torch
    >>> from zerofn.sharding import Shard, cut, join, parse
    >>> w = torch.arange(12.0).view(6, 2)
    >>> qkv = Shard(0, parts=3)
    >>> [cut(w, (qkv,), (2,), (r,))[:, 0].tolist() for r in range(2)]
    [[0.0, 4.0, 8.0], [2.0, 6.0, 10.0]]
    >>> torch.equal(join({(r,): cut(w, (qkv,), (2,), (r,)) for r in range(2)}, (qkv,), (2,)), w)
    True
    >>> str(qkv), parse("S(0,share=2)"), str(parse("R"))
    ('S(0,parts=3)', Shard(dim=0, parts=1, share=2), 'R')
    >>> held = Stage(1)  # a pipeline's second stage holds it whole, the first none of it
    >>> pieces((held,), (2,)), holds((held,), (0,)), torch.equal(cut(w, (held,), (2,), (1,)), w), parse(str(held))
    ([(1,)], False, True, Stage(index=1))
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Claim",
    "Placement",
    "Replicate",
    "Shard",
    "Stage",
    "cut",
    "holds",
    "join",
    "parse",
    "piece",
    "pieces",
    "whole_shape",
]


@dataclass(frozen=True)
class Replicate:
    """Whole along this axis: every rank of it holds the same tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Cut along tensor dimension ``dim`` over the axis's ranks (see the module for ``parts`` and ``share``)."""

    dim: int
    parts: int = 1
    share: int = 1

    def __str__(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in (("parts", self.parts), ("share", self.share)) if v != 1)
        return f"S({self.dim}{extra})"


@dataclass(frozen=True)
class Stage:
    """Whole on the ranks at coordinate ``index`` of this axis, absent on its other ranks (a pipeline's
    stage; see the module)."""

    index: int

    def __str__(self) -> str:
        return f"Stage({self.index})"


Placement = Replicate | Shard | Stage

_SHARD = re.compile(r"^S\((\d+)((?:,(?:parts|share)=\d+)*)\)$")
_STAGE = re.compile(r"^Stage\((\d+)\)$")


def parse(text: str) -> Placement:
    """The placement written as ``text`` (``"R"``, ``"S(0)"``, ``"S(1,parts=3,share=2)"``, ``"Stage(1)"``), as
    ``str`` writes it.

    Raises:
        ValueError: ``text`` is no placement.
    """
    if text == "R":
        return Replicate()
    stage = _STAGE.match(text)
    if stage is not None:
        return Stage(int(stage.group(1)))
    m = _SHARD.match(text)
    if m is None:
        raise ValueError(
            f"not a placement: {text!r} (expected one of 'R', 'S(dim)', 'S(dim,parts=k,share=s)', 'Stage(index)')"
        )
    fields = dict(kv.split("=") for kv in m.group(2).split(",")[1:])
    return Shard(int(m.group(1)), **{k: int(v) for k, v in fields.items()})


def piece(p: Placement, size: int, coord: int) -> tuple[int, int]:
    """(which piece, of how many) the rank at ``coord`` of an axis of ``size`` holds under ``p``. A
    :class:`Stage` is one piece, the whole, held at its index only (:func:`holds` says whether ``coord`` holds
    it)."""
    if isinstance(p, Replicate):
        return 0, 1
    if isinstance(p, Stage):
        _check_stage(p, size)
        return 0, 1
    if size % p.share:
        raise ValueError(f"{p}: share {p.share} does not divide the axis's {size} ranks")
    return coord // p.share, size // p.share


def _check_stage(p: Stage, size: int) -> None:
    if not 0 <= p.index < size:
        raise ValueError(f"{p}: no coordinate {p.index} on an axis of {size} ranks (a stage index from 0 to size - 1)")


def holds(placements: Sequence[Placement], coords: Sequence[int]) -> bool:
    """Whether the rank at ``coords`` (one per axis) holds a piece of a tensor so placed: False where a
    :class:`Stage` names another coordinate of its axis."""
    return all(not isinstance(p, Stage) or p.index == c for p, c in zip(placements, coords))


def _coords(p: Placement, size: int) -> list[int]:
    """The coordinate on the axis of one rank per distinct piece, in the pieces' order."""
    if isinstance(p, Stage):
        _check_stage(p, size)
        return [p.index]
    _, n = piece(p, size, 0)
    share = size // n
    return [i * share for i in range(n)]


def _cut1(t: torch.Tensor, p: Placement, size: int, coord: int) -> torch.Tensor:
    if isinstance(p, Stage):
        _check_stage(p, size)
        if coord != p.index:
            raise ValueError(
                f"{p}: the rank at coordinate {coord} of the axis holds none of the tensor, only the ranks at "
                f"{p.index} do (ask holds() first)"
            )
        return t
    i, n = piece(p, size, coord)
    if n == 1:
        return t
    if p.parts == 1:
        return t.chunk(n, p.dim)[i]
    return torch.cat([block.chunk(n, p.dim)[i] for block in t.chunk(p.parts, p.dim)], p.dim)


def _join1(by_piece: Sequence[torch.Tensor], p: Placement) -> torch.Tensor:
    if len(by_piece) == 1:
        return by_piece[0]
    if p.parts == 1:
        return torch.cat(list(by_piece), p.dim)
    blocks = [[t.chunk(p.parts, p.dim)[k] for t in by_piece] for k in range(p.parts)]
    return torch.cat([torch.cat(b, p.dim) for b in blocks], p.dim)


def cut(whole: torch.Tensor, placements: Sequence[Placement], sizes: Sequence[int], coords: Sequence[int]):
    """The piece of ``whole`` the rank at ``coords`` (one per axis, the axes of ``sizes``) holds.

    Raises:
        ValueError: a :class:`Stage` of another coordinate: the rank holds none of it (:func:`holds`).
    """
    t = whole
    for p, size, coord in zip(placements, sizes, coords):
        t = _cut1(t, p, size, coord)
    return t


def pieces(placements: Sequence[Placement], sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """One coordinate tuple per distinct piece: the ranks whose pieces make the whole tensor."""
    out: list[tuple[int, ...]] = [()]
    for p, size in zip(placements, sizes):
        out = [c + (k,) for c in out for k in _coords(p, size)]
    return out


def join(
    held: Mapping[tuple[int, ...], torch.Tensor], placements: Sequence[Placement], sizes: Sequence[int]
) -> torch.Tensor:
    """The whole tensor from the pieces ``held`` by coordinates (at least those :func:`pieces` names), the
    inverse of :func:`cut`."""
    return _rebuild(held, tuple(placements), tuple(sizes), ())


def _rebuild(held: Mapping, placements: tuple, sizes: tuple, prefix: tuple[int, ...]) -> torch.Tensor:
    """The tensor after the cuts of the axes before ``len(prefix)`` only, at ``prefix``: the innermost axes
    were cut last, so they are joined first. A function of the module, not a closure calling itself: such a
    closure is a reference cycle, which would keep every piece alive until the garbage collector ran."""
    k = len(prefix)
    if k == len(sizes):
        return held[prefix]
    p, size = placements[k], sizes[k]
    return _join1([_rebuild(held, placements, sizes, prefix + (c,)) for c in _coords(p, size)], p)


def whole_shape(local: Sequence[int], placements: Sequence[Placement], sizes: Sequence[int]) -> tuple[int, ...]:
    """The whole tensor's shape from a piece's."""
    shape = list(local)
    for p, size in zip(placements, sizes):
        _, n = piece(p, size, 0)
        if isinstance(p, Shard):
            shape[p.dim] *= n
    return tuple(shape)


@dataclass(frozen=True)
class Claim:
    """A parallelism's part of the step: the axis of the step's mesh it works on, and what it cuts there.

    A transform claims its axis with :meth:`zerofn.step.Step.claim`; the step refuses a second claim of an
    axis by another transform. The core reads, after ``init`` prepared the model:

    Attributes:
        axis: the mesh axis (``"tp"``, ``"dp_shard"``, ...).
        by: the claiming transform's name.
        placements: ``() -> {parameter name: Placement}``: the parameters it cuts along its axis (absent:
            replicated along it), as the model ``init`` prepared last holds them; None: it cuts none. A claim
            that places whole parameters on some coordinates of its axis (:class:`Stage`) names every
            parameter of the model, those this rank holds and those it does not.
        whole: ``() -> None``, raising with what to do instead where its pieces cannot be joined into the
            whole parameter (``full_params``); None: they always can.
        groups: ``() -> (group, ...)``: groups beside the mesh's axes that its collectives use (counted in
            ``metrics["comm_bytes"]``); None: none.
        reduces: the axis's ranks hold the same parameters and each computes a part of every micro-batch's
            loss (context parallelism's slices of the sequence): the step runs on the group over the
            data-parallel axes and this one, reducing gradients (and sharding ZeRO's buckets) over it. Its
            ranks feed one micro-batch all the same (``zf.collectives.data_rank`` reads the data-parallel
            axes only).
        feeds: the axis's ranks each feed a micro-batch of their own, as data-parallel ranks do, while they
            hold different pieces of the parameters it cuts (expert parallelism's experts): the step runs on
            the group over the data-parallel axes and this one (``zf.collectives.data_rank`` counts it), and
            the parameters it cuts are reduced and sharded over that group's ranks that hold the same pieces
            (``zerofn.collectives.without(axis)``), the others over all of it.
    """

    axis: str
    by: str
    placements: Callable[[], Mapping[str, Placement]] | None = None
    whole: Callable[[], None] | None = None
    groups: Callable[[], tuple[Any, ...]] | None = None
    reduces: bool = False
    feeds: bool = False
