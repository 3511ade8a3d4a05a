"""Files: every file zerofn writes goes through here (a leaf: it imports nothing of zerofn).

- :class:`FileTensor`: a 1-D tensor kept in a file (NVMe-offloaded state), a pytree leaf.
- :func:`write_at` / :func:`read_at` / :func:`read_exact`: positional writes and reads of a
  CPU tensor's bytes at an element offset (``pwrite``/``preadv``: no seek, safe from threads).
- :func:`write_json` / :func:`fsync_dir`: a JSON file replaced atomically (written to a
  temporary name, flushed and fsynced, renamed), so a crash leaves the old file or the new,
  never half of one.
- :func:`digest`: a short stable hash of a JSON-able value (signatures of layouts and files).

A short read is an :class:`IntegrityError` (a ``ValueError``) naming the file, wherever it happens.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = [
    "FileTensor",
    "IntegrityError",
    "digest",
    "fsync_dir",
    "generation_file",
    "new_file",
    "other_generation",
    "read_at",
    "read_exact",
    "remove",
    "write_at",
    "write_json",
]


class IntegrityError(ValueError):
    """A file is missing, short, or its bytes do not match the checksums recorded for it."""


@dataclass(eq=False)
class FileTensor:
    """A 1-D tensor kept in a file rather than in memory (NVMe-offloaded state), as a pytree leaf.

    ``write(offset, t)`` and ``read(offset, n)`` work on elements. As a leaf of a state it declares
    where its bytes are (``placement``, ``nbytes``: see :mod:`zerofn.placement`).
    """

    path: str
    dtype: torch.dtype
    numel_: int
    placement: ClassVar[str] = "nvme"

    def numel(self) -> int:
        return self.numel_

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.numel_])

    @property
    def nbytes(self) -> int:
        return self.numel_ * self.dtype.itemsize

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def read(self, offset: int = 0, n: int | None = None) -> torch.Tensor:
        """Elements ``[offset, offset + n)`` (default: to the end) into a new CPU tensor."""
        out = torch.empty(self.numel_ - offset if n is None else n, dtype=self.dtype)
        read_exact(self.path, out, offset)
        return out

    def write(self, offset: int, t: torch.Tensor) -> None:
        write_at(self.path, t.detach().to("cpu", self.dtype), offset)


def generation_file(root: str, stem: str, generation: int) -> str:
    """The file of ``stem``'s ``generation`` under ``root``: state rewritten per update alternates
    between two generations of new files, so a hard link a checkpoint took keeps the bytes it saw."""
    return os.path.join(root, f"{stem}.g{generation}")


def other_generation(path: str) -> str:
    """The other generation's file of a :func:`generation_file` name."""
    stem, _, g = path.rpartition(".g")
    return f"{stem}.g{1 - int(g)}"


def remove(path: str) -> None:
    """Unlink ``path`` if it exists (a hard link to it elsewhere keeps its bytes)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def new_file(path: str, nbytes: int) -> None:
    """Make ``path`` a new file of ``nbytes`` with nothing written: its holes read as zeros."""
    with open(path, "wb") as f:
        f.truncate(nbytes)


def write_at(path: str, t: torch.Tensor, offset_elems: int) -> None:
    """Write a CPU tensor's bytes into ``path`` at element ``offset_elems`` (created if missing)."""
    data = memoryview(t.contiguous().view(torch.uint8).numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset_elems * t.element_size() + done)
    finally:
        os.close(fd)


def read_at(path: str, t: torch.Tensor, offset_elems: int) -> int:
    """Fill the CPU tensor ``t`` from ``path`` at element ``offset_elems``; returns the bytes read."""
    view = memoryview(t.view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.preadv(fd, [view], offset_elems * t.element_size())
    finally:
        os.close(fd)


def read_exact(path: str, t: torch.Tensor, offset_elems: int) -> None:
    """:func:`read_at`, all of ``t`` or an :class:`IntegrityError` naming the file."""
    want = t.numel() * t.element_size()
    got = read_at(path, t, offset_elems)
    if got != want:
        raise IntegrityError(
            f"{path}: {got} bytes where {want} were expected at element {offset_elems} (a partial or foreign file)"
        )


def write_json(path: str, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON atomically: a crash leaves the old file or the new."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest(obj: Any) -> str:
    """A short, stable hash of a JSON-able value (keys sorted): what a signature records."""
    text = json.dumps(obj, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
