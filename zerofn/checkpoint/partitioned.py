"""A checkpoint of a model split over groups of ranks (tensor parallelism, any parallelism that cuts
parameters), read as the part a loading state holds: each cut parameter reassembled whole from the saved
parts, one at a time, and cut as the loading state cuts it.

``save`` writes such a state as one checkpoint per part (``path/part{i}``, each of its group of ranks) and
``partitions.json``: the mesh axes that cut parameters (names and sizes) and, for each part, its
coordinates on them and each cut parameter's placements (``state.spec.mesh``, ``state.spec.placements``;
:mod:`zerofn.sharding`). A checkpoint written before placements were recorded lists each part's slices
instead (name, dim, parts, count, index, over one tensor-parallel axis); :func:`partitions` reads both as
placements. :func:`view` gives the loader what it reads from a checkpoint
(:class:`~zerofn.checkpoint.manifest.Saved`'s interface): the saved part itself when the loading state is
cut as it was, else a :class:`PartView` whose every parameter is one bucket of its own, read by
reassembling it from the saved parts (each part's piece of it read as that part saved it) and cutting the
loading state's piece: one whole parameter of one quantity in memory at a time.

A pipeline's parts hold different parameters (:class:`zerofn.sharding.Stage`: whole on the ranks at one
coordinate of ``pp``, absent on the others): each part's checkpoint lists its own, and a view lists every
part's, each read from the part at its stage's coordinate, leaving out those the loading part holds none of
(another stage's). The update count of each parameter (``param_steps``, saved by each part in its own order)
is carried over by name.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import torch

from zerofn import sharding
from zerofn.checkpoint._format import FORMAT, CheckpointError
from zerofn.checkpoint.manifest import IndexEntry, Piece, Saved, Scalar, Source
from zerofn.checkpoint.parts import BUFFERS, PARAM_STEPS, PARAMS

__all__ = ["PARTITIONS", "Cuts", "PartView", "into_part", "of_spec", "partitions", "record", "view", "whole"]

PARTITIONS = "partitions.json"
_VIRTUAL = "<reassembled>"


class Cuts(NamedTuple):
    """How one part's parameters are cut: the mesh axes that cut parameters, their sizes, the part's
    coordinates on them, and name -> placements (one per axis) for each parameter not whole."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    coords: tuple[int, ...]
    placements: dict[str, tuple[sharding.Placement, ...]]


def record(cuts: Cuts) -> dict:
    """One part's entry of ``partitions.json``."""
    return {"coords": list(cuts.coords), "placements": {n: [str(p) for p in ps] for n, ps in cuts.placements.items()}}


def partitions(path: str) -> dict[int, Cuts] | None:
    """A split model's checkpoint's parts (part index -> its cuts; None: an ordinary checkpoint)."""
    name = os.path.join(os.fspath(path), PARTITIONS)
    if not os.path.exists(name):
        return None
    with open(name) as f:
        info = json.load(f)
    if info.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {info.get('format')!r}, this zerofn reads {FORMAT!r}")
    if "mesh" not in info:  # written before placements: slices over one tensor-parallel axis
        count = int(info["count"])
        return {int(i): _from_slices(count, int(i), sl) for i, sl in info["parts"].items()}
    axes, sizes = tuple(info["mesh"]["axes"]), tuple(int(n) for n in info["mesh"]["sizes"])
    return {
        int(i): Cuts(
            axes,
            sizes,
            tuple(int(c) for c in part["coords"]),
            {n: tuple(sharding.parse(p) for p in ps) for n, ps in part["placements"].items()},
        )
        for i, part in info["parts"].items()
    }


def _from_slices(count: int, index: int, slices: Any) -> Cuts:
    """A part's cuts from the slices a checkpoint recorded before placements: (name, dim, parts, pieces,
    piece), cut over ``count`` ranks of which ``count // pieces`` consecutive ones hold the same piece."""
    placements = {name: (sharding.Shard(int(d), int(p), count // int(n)),) for name, d, p, n, _ in slices}
    return Cuts(("tp",), (count,), (index,), placements)


def of_spec(spec: Any) -> tuple[int, Cuts] | None:
    """(part index, cuts) of the parameters a state holds, from its spec (None: the whole model). The parts
    are numbered row-major over the axes that cut some parameter."""
    # an axis of the step's group that cuts parameters (expert parallelism's ep) is no part: its pieces are
    # described whole in the ordinary layout (zerofn.checkpoint.parts.layouts)
    lay = spec.layout
    apart = {b.apart for b in (*lay.buckets, *lay.frozen_buckets) if b.apart}
    cutting = [
        k
        for k in range(len(spec.mesh))
        if spec.mesh[k][0] not in apart and any(_cuts(ps[k], spec.mesh[k][1]) for _, ps in spec.placements)
    ]
    if not cutting:
        return None
    axes = tuple(spec.mesh[k][0] for k in cutting)
    sizes = tuple(spec.mesh[k][1] for k in cutting)
    coords = tuple(spec.mesh[k][2] for k in cutting)
    index = 0
    for size, c in zip(sizes, coords):
        index = index * size + c
    placements = {name: tuple(ps[k] for k in cutting) for name, ps in spec.placements}
    return index, Cuts(axes, sizes, coords, placements)


def _cuts(p: sharding.Placement, size: int) -> bool:
    """Whether ``p`` on an axis of ``size`` ranks leaves some of them without the whole tensor (a stage of an
    axis of one rank is everywhere)."""
    return not isinstance(p, sharding.Replicate) and not (isinstance(p, sharding.Stage) and size == 1)


def view(path: str, parts: dict[int, Cuts], first: Saved, mine: tuple[int, Cuts] | None) -> Any:
    """What the loader reads for a state holding part ``mine = (index, cuts)`` (None: the whole model): the
    saved part itself when it was cut alike, else a :class:`PartView`. ``first``: part 0, open."""
    if mine is None:
        return _parts_view(path, parts, first, None)
    index, wanted = mine
    if index in parts and parts[index] == wanted:
        if index == 0:
            return first
        first.close()
        return Saved(os.path.join(path, f"part{index}"))
    return _parts_view(path, parts, first, wanted)


def whole(path: str, parts: dict[int, Cuts]) -> PartView:
    """A split model's checkpoint read as the whole model (``consolidate``)."""
    return _parts_view(path, parts, Saved(os.path.join(path, "part0")), None)


def _parts_view(path: str, parts: dict[int, Cuts], first: Saved, wanted: Cuts | None) -> PartView:
    """Every saved part (``first``: part 0, open), read as cut by ``wanted`` (None: whole)."""
    opened = [first] + [Saved(os.path.join(path, f"part{i}")) for i in range(1, len(parts))]
    return PartView(path, opened, [parts[i] for i in range(len(parts))], wanted)


def into_part(path: str, saved: Saved, wanted: Cuts) -> PartView:
    """An ordinary checkpoint (the whole model) read as the part ``wanted`` holds."""
    return PartView(path, [saved], [Cuts((), (), (), {})], wanted)


class PartView:
    """A split model's checkpoint as the loading state's part would have been saved (see the module)."""

    def __init__(self, path: str, parts: list[Saved], saved: list[Cuts], wanted: Cuts | None):
        self.path, self.parts, self.saved, self.wanted = path, parts, saved, wanted
        base = parts[0]
        self.what = f"checkpoint {os.path.abspath(path)}"
        self.m = dict(base.m, world_size=-1)  # no RNG states: the ranks differ
        self.layouts = base.layouts
        self.quantities, self.precise, self.newer = base.quantities, base.precise, base.newer
        self.index: dict[str, IndexEntry] = {}
        self.pieces: dict[Source, list[Piece]] = {}
        self._names: dict[int, str] = {}
        self._holder: dict[str, int] = {}  # name -> the first part that holds (a piece of) it
        self.pieces.update((src, ps) for src, ps in base.pieces.items() if src.kind == BUFFERS)  # read from part 0
        # every part's parameters (a pipeline's parts hold different ones), each once; those the loading part
        # holds none of (another stage's) left out
        for p, part in enumerate(parts):
            by_bucket: dict[tuple[str, int], set] = {}
            for src in part.pieces:
                by_bucket.setdefault((src.kind, src.bucket), set()).add(src.key)
            for name, e in part.index.items():
                if name in self.index or (e.kind == BUFFERS and p > 0):
                    continue
                if e.kind == BUFFERS:
                    self.index[name] = e
                    continue
                if wanted is not None and not sharding.holds(wanted.placements.get(name, ()), wanted.coords):
                    continue
                self._holder[name] = p
                whole = self._whole_shape(name, e.shape)
                shape = tuple(self._cut(name, torch.empty(whole, device="meta")).shape)
                numel = int(torch.Size(shape).numel())
                vid = len(self._names)  # one bucket of its own per parameter
                self._names[vid] = name
                self.index[name] = IndexEntry(e.kind, vid, 0, numel, shape, e.dtype)
                for key in sorted(by_bucket.get((e.kind, e.bucket), ())):
                    dtype = part.dtype(Source(key, e.kind, e.bucket))
                    self.pieces[Source(key, e.kind, vid)] = [Piece(0, numel, _VIRTUAL, 0, dtype)]
        self.small: dict = {}
        self._small_part: dict[str, int] = {}
        for p, part in enumerate(parts):  # the same in every part (counts, the loss scale), but a group's counts
            for key, scalar in part.small.items():  # that some parts only have
                if key not in self.small:
                    self.small[key], self._small_part[key] = scalar, p
        self._steps = self._param_steps()
        self.small.pop(PARAM_STEPS, None)
        if self._steps is not None:
            self.small[PARAM_STEPS] = Scalar("", 0, self._steps.dtype, tuple(self._steps.shape))
        self.keys = {src.key for src in self.pieces} | set(self.small)
        self._cache: tuple | None = None

    def _param_steps(self) -> torch.Tensor | None:
        """Each trainable parameter's update count, in the loading part's order, gathered by name from the
        parts that saved them (each saved its own, in its params tree's order: the sorted names of a dict);
        None where a part saved none, or not one per trainable parameter (the loader then gives every
        parameter the step's count)."""
        counts: dict[str, int] = {}
        dtype = None
        for part in self.parts:
            if PARAM_STEPS not in part.small:
                return None
            names = sorted(n for n, e in part.index.items() if e.kind == PARAMS)
            steps = part.read_small(PARAM_STEPS)
            if steps.numel() != len(names):
                return None
            dtype = steps.dtype
            for n, c in zip(names, steps.view(-1).tolist()):
                counts.setdefault(n, c)
        wanted = sorted(n for n, e in self.index.items() if e.kind == PARAMS)
        if dtype is None or any(n not in counts for n in wanted):
            return None
        return torch.tensor([counts[n] for n in wanted], dtype=dtype)

    def _placed(self, name: str) -> tuple | None:
        """``name``'s placements as saved (None: whole in every part that holds it)."""
        return next((cuts.placements[name] for cuts in self.saved if name in cuts.placements), None)

    def _whole_shape(self, name: str, local: tuple) -> tuple:
        placements = self._placed(name)
        if placements is None:
            return tuple(local)
        return sharding.whole_shape(local, placements, self.saved[0].sizes)

    def _cut(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """The loading state's piece of the whole parameter ``name`` (itself when the state holds it whole)."""
        w = self.wanted
        if w is None or name not in w.placements:
            return whole
        return sharding.cut(whole, w.placements[name], w.sizes, w.coords)

    def _value(self, source: Source) -> torch.Tensor:
        """The loading state's piece of a parameter in one quantity, flat."""
        if self._cache is not None and self._cache[0] == source:
            return self._cache[1]
        name = self._names[source.bucket]
        placements = self._placed(name)
        if placements is None:  # whole in every part that holds it: the first's
            holders = {(): self._holder[name]}
        else:  # one part per distinct piece (parts sharing a piece, as key/value heads fewer than ranks, read once;
            # a stage's parameter, from the part at its coordinate)
            by_coords = {cuts.coords: p for p, cuts in enumerate(self.saved)}
            holders = {c: by_coords[c] for c in sharding.pieces(placements, self.saved[0].sizes)}
        held = {}
        for c, p in holders.items():
            part = self.parts[p]
            e = part.index[name]
            held[c] = part.read(Source(source.key, e.kind, e.bucket), e.offset, e.offset + e.numel).view(e.shape)
        whole = held[()] if placements is None else sharding.join(held, placements, self.saved[0].sizes)
        value = self._cut(name, whole).contiguous().view(-1)
        self._cache = (source, value)
        return value

    def dtype(self, source: Source) -> torch.dtype:
        if source.kind == BUFFERS:
            return self.parts[0].dtype(source)
        return self.pieces[source][0].dtype

    def read(self, source: Source, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if source.kind == BUFFERS:  # buffers are the same in every part
            return self.parts[0].read(source, lo, hi, out)
        got = self._value(source)[lo:hi]
        if out is None:
            return got.clone()
        out.copy_(got)
        return out

    def has(self, key: str) -> bool:
        return key in self.keys

    def entries(self) -> list[tuple[str, str, str]]:
        return self.parts[0].entries()

    def small_for(self, key: str) -> str | None:
        if key == PARAM_STEPS:
            return key if self._steps is not None else None
        for p, part in enumerate(self.parts):
            found = part.small_for(key)
            if found is not None:
                self._small_part[found] = p
                return found
        return None

    def read_small(self, key: str) -> torch.Tensor:
        if key == PARAM_STEPS and self._steps is not None:
            return self._steps.clone()
        return self.parts[self._small_part.get(key, 0)].read_small(key)

    def reader(self, fname: str) -> Any:
        raise CheckpointError(
            f"{self.what}: a split model's checkpoint loads into file-held state (state in NVMe files) only on the "
            "split it was saved with"
        )

    def close(self) -> None:
        for p in self.parts:
            p.close()
