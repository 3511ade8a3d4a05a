"""A checkpoint of a model split over groups of ranks (tensor parallelism), read as the part a loading
state holds: each split parameter reassembled whole from the saved parts, one at a time, and cut as the
loading state cuts it.

``save`` writes such a state as one checkpoint per part (``path/part{i}``, each of its group of ranks)
and ``partitions.json``: how each part's parameters are cut from whole ones (``state.spec.slices``:
name, dim, parts, count, index). :func:`view` gives the loader what it reads from a checkpoint
(:class:`~zerofn.checkpoint.manifest.Saved`'s interface): the saved part itself when the loading state is
cut as it was, else a :class:`PartView` whose every parameter is one bucket of its own, read by
reassembling it from the saved parts (each part's piece of it read as that part saved it) and cutting
the loading state's slice: one whole parameter of one quantity in memory at a time.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from zerofn.checkpoint._format import FORMAT, CheckpointError
from zerofn.checkpoint.manifest import IndexEntry, Piece, Saved, Source
from zerofn.checkpoint.parts import BUFFERS
from zerofn.state import cut_slice, join_slices

__all__ = ["PARTITIONS", "PartView", "partitions", "rules", "view", "whole"]

PARTITIONS = "partitions.json"
_VIRTUAL = "<reassembled>"


def partitions(path: str) -> dict | None:
    """A split model's checkpoint's ``partitions.json`` (None: an ordinary checkpoint)."""
    name = os.path.join(os.fspath(path), PARTITIONS)
    if not os.path.exists(name):
        return None
    with open(name) as f:
        info = json.load(f)
    if info.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: format {info.get('format')!r}, this zerofn reads {FORMAT!r}")
    return info


def rules(slices: Any) -> dict[str, tuple[int, int, int, int]]:
    return {name: (int(d), int(p), int(n), int(i)) for name, d, p, n, i in slices}


def view(path: str, info: dict, first: Saved, index: int, count: int, slices: Any) -> Any:
    """What the loader reads for a state holding part ``index`` of ``count`` cut as ``slices``:
    the saved part itself when it was cut alike, else a :class:`PartView`. ``first``: part 0, open."""
    saved_count = int(info["count"])
    wanted = rules(slices)
    if count == saved_count and rules(info["parts"][str(index)]) == wanted:
        if index == 0:
            return first
        first.close()
        return Saved(os.path.join(path, f"part{index}"))
    return _parts_view(path, info, first, wanted)


def whole(path: str, info: dict) -> PartView:
    """A split model's checkpoint read as the whole model (``consolidate``)."""
    return _parts_view(path, info, Saved(os.path.join(path, "part0")), {})


def _parts_view(path: str, info: dict, first: Saved, wanted: dict) -> PartView:
    """Every saved part (``first``: part 0, open), read as cut by ``wanted`` (name -> rule; {}: whole)."""
    parts = [first] + [Saved(os.path.join(path, f"part{i}")) for i in range(1, int(info["count"]))]
    return PartView(path, parts, {int(k): rules(v) for k, v in info["parts"].items()}, wanted)


class PartView:
    """A split model's checkpoint as the loading state's part would have been saved (see the module)."""

    def __init__(self, path: str, parts: list[Saved], saved: dict[int, dict], wanted: dict):
        self.path, self.parts, self.saved, self.wanted = path, parts, saved, wanted
        base = parts[0]
        self.what = f"checkpoint {os.path.abspath(path)}"
        self.m = dict(base.m, world_size=-1)  # no RNG states: the ranks differ
        self.layouts, self.small, self.keys = base.layouts, base.small, base.keys
        self.quantities, self.precise, self.newer = base.quantities, base.precise, base.newer
        self.index: dict[str, IndexEntry] = {}
        self.pieces: dict[Source, list[Piece]] = {}
        self._names: dict[int, str] = {}
        by_bucket: dict[tuple[str, int], list[str]] = {}
        for src in base.pieces:
            by_bucket.setdefault((src.kind, src.bucket), []).append(src.key)
        self.pieces.update((src, ps) for src, ps in base.pieces.items() if src.kind == BUFFERS)  # read from part 0
        for name, e in base.index.items():
            if e.kind == BUFFERS:
                self.index[name] = e
                continue
            whole = self._whole_shape(name, e.shape)
            shape = tuple(cut_slice(torch.empty(whole, device="meta"), wanted[name]).shape) if name in wanted else whole
            numel = int(torch.Size(shape).numel())
            vid = len(self._names)  # one bucket of its own per parameter
            self._names[vid] = name
            self.index[name] = IndexEntry(e.kind, vid, 0, numel, shape, e.dtype)
            for key in sorted(set(by_bucket.get((e.kind, e.bucket), []))):
                self.pieces[Source(key, e.kind, vid)] = [
                    Piece(0, numel, _VIRTUAL, 0, base.dtype(Source(key, e.kind, e.bucket)))
                ]
        self._cache: tuple | None = None

    def _whole_shape(self, name: str, local: tuple) -> tuple:
        rule = self.saved[0].get(name)
        if rule is None:
            return tuple(local)
        dim, _, n, _ = rule
        shape = list(local)
        shape[dim] *= n
        return tuple(shape)

    def _value(self, source: Source) -> torch.Tensor:
        """The loading state's slice of a parameter in one quantity, flat."""
        if self._cache is not None and self._cache[0] == source:
            return self._cache[1]
        name = self._names[source.bucket]
        pieces: dict[int, torch.Tensor] = {}
        rule = self.saved[0].get(name)
        holders = range(len(self.parts)) if rule is not None else [0]
        for p in holders:
            i = self.saved[p][name][3] if rule is not None else 0
            if i in pieces:  # several parts hold the same slice (shared key/value heads)
                continue
            part = self.parts[p]
            e = part.index[name]
            flat = part.read(Source(source.key, e.kind, e.bucket), e.offset, e.offset + e.numel)
            pieces[i] = flat.view(e.shape)
        whole = pieces[0] if rule is None else join_slices(pieces, rule[0], rule[1], rule[2])
        value = (cut_slice(whole, self.wanted[name]) if name in self.wanted else whole).contiguous().view(-1)
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
        return self.parts[0].small_for(key)

    def read_small(self, key: str) -> torch.Tensor:
        return self.parts[0].read_small(key)

    def reader(self, fname: str) -> Any:
        raise CheckpointError(
            f"{self.what}: a split model's checkpoint loads into file-held state (state in NVMe files) only on the "
            "split it was saved with"
        )

    def close(self) -> None:
        for p in self.parts:
            p.close()
