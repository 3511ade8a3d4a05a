"""A checkpoint on disk: its manifest read into records, its files checked, byte-range reads of its
pieces; and the complete checkpoints of a directory (:func:`latest`)."""

from __future__ import annotations

import json
import os
import zlib
from typing import NamedTuple

import torch

from zerofn import keys
from zerofn._io import IntegrityError
from zerofn._safetensors import Reader, dtype_from_name
from zerofn.checkpoint._format import FORMAT, MANIFEST, PARTIAL, CheckpointError, Role, layouts_from_json
from zerofn.checkpoint.parts import BUFFERS

__all__ = ["Complete", "IndexEntry", "Piece", "Saved", "Scalar", "Source", "complete", "latest"]


class IndexEntry(NamedTuple):
    """Where a saved parameter (or buffer) lies: its layout's kind, bucket, offset and numel there."""

    kind: str
    bucket: int
    offset: int
    numel: int
    shape: tuple
    dtype: torch.dtype


class Source(NamedTuple):
    """A saved bucket of a quantity: what a range of the state is read from."""

    key: str
    kind: str
    bucket: int


class Piece(NamedTuple):
    """Elements ``[lo, hi)`` of a saved bucket, at byte ``offset`` of ``file``, in ``dtype``."""

    lo: int
    hi: int
    file: str
    offset: int
    dtype: torch.dtype


class Scalar(NamedTuple):
    """A small tensor saved whole, at byte ``offset`` of ``file``."""

    file: str
    offset: int
    dtype: torch.dtype
    shape: tuple


class Complete(NamedTuple):
    """A complete checkpoint of a directory (ordered by update count, then time)."""

    count: int
    time: float
    path: str


class Saved:
    """A checkpoint on disk: its manifest, checked files, and byte-range reads of its pieces.

    Attributes:
        index: parameter (or buffer) name -> :class:`IndexEntry`.
        quantities: saved declared quantity -> its :class:`Role`.
        precise: the saved quantity holding the parameters at full precision (None: none saved).
        newer: the saved quantity one update ahead of the parameters (None: none saved).
        keys: every saved quantity and small tensor key.
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(os.fspath(path))
        self.what = f"checkpoint {self.path}"
        name = os.path.join(self.path, MANIFEST)
        if not os.path.exists(name):
            hint = latest(self.path)
            raise CheckpointError(
                f"{self.what}: no {MANIFEST} there: not a checkpoint, or one whose save did not complete"
                + (f"; the newest complete checkpoint in it is {hint}" if hint else "")
            )
        try:
            with open(name) as f:
                m = json.load(f)
        except ValueError as e:
            raise IntegrityError(f"{self.what}: {MANIFEST} is not valid JSON ({e}); the file is corrupted") from None
        if m.get("format") != FORMAT:
            raise CheckpointError(f"{self.what}: format {m.get('format')!r}, this zerofn reads {FORMAT!r}")
        self.m = m
        self.layouts = layouts_from_json(m["layouts"])
        self.index: dict[str, IndexEntry] = {}
        for kind, buckets in self.layouts.items():
            for i, b in enumerate(buckets):
                for s in b.slots:
                    self.index[s.name] = IndexEntry(kind, i, s.offset, s.numel, s.shape, b.dtype)
        self.quantities = {k: Role.from_json(v) for k, v in m.get("quantities", {}).items()}
        self.precise = next((k for k, r in sorted(self.quantities.items()) if r.precise), None)
        self.newer = next((k for k, r in sorted(self.quantities.items()) if r.newer), None)
        self.pieces: dict[Source, list[Piece]] = {}
        self.small: dict[str, Scalar] = {}
        for r in m["records"]:
            dtype = dtype_from_name(r["dtype"])
            if "bucket" in r:
                piece = Piece(r["lo"], r["hi"], r["file"], r["offset"], dtype)
                self.pieces.setdefault(Source(r["key"], r["kind"], r["bucket"]), []).append(piece)
            else:
                self.small[r["key"]] = Scalar(r["file"], r["offset"], dtype, tuple(r["shape"]))
        for v in self.pieces.values():
            v.sort(key=lambda p: p.lo)
        self.keys = {s.key for s in self.pieces} | set(self.small)
        self._readers: dict[str, Reader] = {}
        self._fds: dict[str, int] = {}  # a second descriptor per file, for whole blocks read in place
        for fname, rec in m["files"].items():  # every file there and of its size, before any is read
            full = os.path.join(self.path, fname)
            if not os.path.exists(full):
                raise IntegrityError(f"{self.what}: file {fname} is missing (a deleted shard)")
            if os.path.getsize(full) != rec["size"]:
                raise IntegrityError(
                    f"{self.what}: file {fname} has {os.path.getsize(full)} bytes, the manifest recorded "
                    f"{rec['size']} (a truncated file)"
                )

    def reader(self, fname: str) -> Reader:
        if fname not in self._readers:
            self._readers[fname] = Reader(os.path.join(self.path, fname), self.m["files"][fname], self.what)
        return self._readers[fname]

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _read_into(self, fname: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with bytes ``offset..`` of ``fname``, every block checked against its CRC-32.

        A block that ``out`` covers whole is read straight into ``out`` and checked there (no copy of
        its bytes); the partial blocks at either end go through the file's :class:`Reader`, which
        keeps the last one for the next range. A block whose bytes do not check is read again through
        the :class:`Reader`, which raises the file's error.
        """
        r = self.reader(fname)
        end, pos = offset + len(out), offset
        if not hasattr(os, "preadv") or end > r.size:
            r.read_into(offset, out)
            return
        if fname not in self._fds:
            self._fds[fname] = os.open(os.path.join(self.path, fname), os.O_RDONLY)
        fd = self._fds[fname]
        while pos < end:
            i = pos // r.block
            b0, b1 = i * r.block, min((i + 1) * r.block, r.size)
            if pos == b0 and b1 <= end:
                dst = out[pos - offset : b1 - offset]
                if os.preadv(fd, [dst], pos) != len(dst) or zlib.crc32(dst) != r.crcs[i]:
                    r.read_into(pos, dst)
            else:
                b1 = min(b1, end)
                r.read_into(pos, out[pos - offset : b1 - offset])
            pos = b1

    def has(self, key: str) -> bool:
        return key in self.keys

    def entries(self) -> list[tuple[str, str, str]]:
        """The model's ``state_dict`` entries saved: (name, ``"param"`` or ``"buffer"``, the name held under)."""
        return [tuple(e) for e in self.m["model"]] or [
            (n, "buffer" if e.kind == BUFFERS else "param", n) for n, e in self.index.items()
        ]

    def dtype(self, source: Source) -> torch.dtype:
        """The dtype ``source`` was saved in."""
        pieces = self.pieces.get(source, [])
        return pieces[0].dtype if pieces else self.layouts[source.kind][source.bucket].dtype

    def read(self, source: Source, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of a saved bucket of a quantity, in the saved dtype.

        ``out``: a contiguous 1-D CPU tensor of ``hi - lo`` elements in the saved dtype to read into
        (by default a new one); returned.
        """
        pieces = self.pieces.get(source, [])
        if out is None:
            out = torch.empty(hi - lo, dtype=self.dtype(source))
        if hi == lo:
            return out
        size = out.element_size()
        view = memoryview(out.view(torch.uint8).numpy())
        pos = lo
        for p in pieces:
            if p.hi <= pos or p.lo >= hi:
                continue
            if p.lo > pos:
                break
            end = min(hi, p.hi)
            self._read_into(p.file, p.offset + (pos - p.lo) * size, view[(pos - lo) * size : (end - lo) * size])
            pos = end
            if pos == hi:
                return out
        raise IntegrityError(
            f"{self.what}: no saved piece holds elements {pos}..{hi} of {source.key} bucket {source.bucket} "
            f"({source.kind}); the manifest is incomplete"
        )

    def small_for(self, key: str) -> str | None:
        """The saved small tensor that fills small tensor ``key`` of the state being loaded (None: none).

        Itself; else, for an optimizer-state key, the one saved under another grouping of the same
        parameters (:func:`zerofn.keys.unscoped`): its unscoped form (saved without groups), or the
        saved keys equal to it once scopes are removed (saved under other groups), which must agree.
        """
        if key in self.small:
            return key
        if not key.startswith(keys.OPT):
            return None
        plain = keys.unscoped(key)
        if plain in self.small:
            return plain
        found = sorted(k for k in self.small if k.startswith(keys.OPT) and keys.unscoped(k) == plain)
        if len(found) > 1:
            values = [self.read_small(k) for k in found]
            if any(v.shape != values[0].shape or not torch.equal(v, values[0]) for v in values[1:]):
                shown = ", ".join(f"{k} = {v.tolist()}" for k, v in zip(found[:4], values))
                raise CheckpointError(
                    f"{self.what}: the optimizer's {key} could come from any of {len(found)} groups saved, which "
                    f"disagree ({shown}); the groups' step counts or schedules differ, so the checkpoint does "
                    "not say which to take. Load with the grouping it was saved with."
                )
        return found[0] if found else None

    def read_small(self, key: str) -> torch.Tensor:
        r = self.small[key]
        t = torch.empty(r.shape, dtype=r.dtype)
        self.reader(r.file).read_into(r.offset, memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return t


def complete(directory: str) -> list[Complete]:
    """The complete checkpoints directly under ``directory``, oldest first."""
    out = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return out
    for n in names:
        full = os.path.join(directory, n)
        if n.endswith(PARTIAL) or ".deleting" in n:
            continue
        try:
            with open(os.path.join(full, MANIFEST)) as f:
                m = json.load(f)
        except (OSError, ValueError):
            try:  # a split model's checkpoint (zerofn.checkpoint.partitioned): complete once this is written
                with open(os.path.join(full, "partitions.json")) as f:
                    m = json.load(f)
                m["count"] = m["model_count"]
            except (OSError, ValueError, KeyError):
                continue
        if m.get("format") == FORMAT:
            out.append(Complete(int(m["count"]), float(m.get("time", 0.0)), full))
    return sorted(out)


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint (highest update count) under ``directory``, or None.

    A checkpoint is complete once its manifest is written, which happens
    last; directories a crash left behind (``*.partial``) are ignored.
    """
    found = complete(os.fspath(directory))
    return found[-1].path if found else None
