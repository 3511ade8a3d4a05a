"""The checkpoint's format: its names on disk, the layout record and its signature, the roles saved
quantities are recorded with, and the error every part of :mod:`zerofn.checkpoint` raises."""

from __future__ import annotations

from typing import NamedTuple

from zerofn._io import digest
from zerofn._safetensors import DTYPES, dtype_from_name
from zerofn.state import Bucket, Slot

__all__ = [
    "FORMAT",
    "MANIFEST",
    "PARTIAL",
    "CheckpointError",
    "Role",
    "data_file",
    "failed_rank",
    "failure_file",
    "frozen_file",
    "layout_json",
    "layouts_from_json",
    "nvme_file",
    "record_file",
    "signature",
]

FORMAT = "zerofn-checkpoint-1"
MANIFEST = "manifest.json"
PARTIAL = ".partial"
_FAILED = "failed"


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, or loaded into this step; the message says what differs."""


class Role(NamedTuple):
    """What a quantity a wrapper state declares stands for (:class:`zerofn.roles.Quantity`'s flags).

    ``precise`` and ``newer`` are recorded in the manifest for each saved quantity, so a load decides
    from them, never from the quantity's name; ``mirror`` quantities are never saved.
    """

    precise: bool = False
    newer: bool = False
    mirror: bool = False

    def to_json(self) -> dict:
        return {"precise": self.precise, "newer": self.newer}

    @classmethod
    def from_json(cls, rec: dict) -> Role:
        return cls(precise=bool(rec.get("precise", False)), newer=bool(rec.get("newer", False)))


def data_file(rank: int) -> str:
    """Rank ``rank``'s safetensors file of pieces."""
    return f"rank{rank}.safetensors"


def frozen_file(rank: int) -> str:
    """Rank ``rank``'s file of frozen pieces, with ``save(..., frozen="once")`` (linked by later saves)."""
    return f"rank{rank}.frozen.safetensors"


def nvme_file(rank: int, n: int) -> str:
    """Rank ``rank``'s ``n``-th file-held (NVMe) piece, linked or copied whole."""
    return f"rank{rank}.nvme{n}.bin"


def record_file(rank: int) -> str:
    """Rank ``rank``'s record of the files it wrote (merged into the manifest by rank 0)."""
    return f"rank{rank}.json"


def failure_file(rank: int) -> str:
    """Where rank ``rank`` says why its part of a save failed."""
    return f"{_FAILED}{rank}.txt"


def failed_rank(fname: str) -> int | None:
    """The rank a :func:`failure_file` name belongs to (None: another file)."""
    stem = fname[len(_FAILED) : -len(".txt")]
    if fname.startswith(_FAILED) and fname.endswith(".txt") and stem.isdigit():
        return int(stem)
    return None


def layout_json(layouts: dict[str, tuple[Bucket, ...]]) -> dict:
    """The manifest's record of the bucket layouts (``params``, ``frozen``, ``buffers``)."""
    return {
        kind: [
            {
                "dtype": DTYPES[b.dtype],
                "padded": b.padded,
                "shards": b.shards,
                "slots": [[s.name, list(s.shape), s.offset, s.numel] for s in b.slots],
            }
            for b in buckets
        ]
        for kind, buckets in layouts.items()
    }


def layouts_from_json(rec: dict) -> dict[str, list[Bucket]]:
    """The inverse of :func:`layout_json` (buckets placed on the CPU)."""
    out: dict[str, list[Bucket]] = {}
    for kind, buckets in rec.items():
        out[kind] = []
        for b in buckets:
            slots = tuple(Slot(name, tuple(shape), offset, numel) for name, shape, offset, numel in b["slots"])
            numel = sum(s.numel for s in slots)
            out[kind].append(Bucket(dtype_from_name(b["dtype"]), "cpu", slots, numel, b["padded"], b["shards"]))
    return out


def signature(layout: dict) -> str:
    """The digest of a :func:`layout_json` record's trainable and frozen layouts: equal signatures, the
    same parameters in the same buckets at the same offsets."""
    return digest({k: layout[k] for k in ("params", "frozen")})
