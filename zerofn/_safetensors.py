"""The safetensors file format, written one tensor at a time and read by byte range.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``name -> {dtype, shape, data_offsets}`` plus ``__metadata__``), then the
tensors' bytes back to back. The ``safetensors`` package writes a file from a
dict of tensors held in memory at once and reads whole tensors; checkpoints
need the other two things, so zerofn writes the format itself (a header is
known before any data, so each tensor is written as it comes and freed) and
reads only the byte ranges it needs. Files written here load with
``safetensors.torch.load_file``; the tests check that.

While writing, :class:`_Sink` keeps a CRC-32 per block of the file, which a
checkpoint's manifest records; :class:`Reader` checks each block it reads
against it, so a flipped byte or a short file is an error that names the
file, and reading a byte range reads only the blocks around it.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterable

import torch

from zerofn._io import IntegrityError

__all__ = ["BLOCK", "DTYPES", "IntegrityError", "Reader", "Writer", "dtype_from_name", "tensor_bytes"]

BLOCK = 4 * 2**20  # bytes per checksummed block

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    return _BY_NAME[name]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy when it is contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class _Sink:
    """A file being written, with a CRC-32 per ``BLOCK`` bytes."""

    def __init__(self, path: str):
        self.path = path
        self.f = open(path, "wb")
        self.size = 0
        self.crcs: list[int] = []
        self._crc = 0

    def write(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        self.f.write(data)
        pos = 0
        while pos < len(data):
            room = BLOCK - self.size % BLOCK
            piece = data[pos : pos + room]
            self._crc = zlib.crc32(piece, self._crc)
            self.size += len(piece)
            pos += len(piece)
            if self.size % BLOCK == 0:
                self.crcs.append(self._crc)
                self._crc = 0

    def close(self) -> dict:
        if self.size % BLOCK:
            self.crcs.append(self._crc)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"size": self.size, "block": BLOCK, "crc32": self.crcs}


def checksum_file(path: str) -> dict:
    """Size and block checksums of an existing file, read in blocks."""
    crcs, size = [], 0
    with open(path, "rb") as f:
        while True:
            data = f.read(BLOCK)
            if not data:
                break
            crcs.append(zlib.crc32(data))
            size += len(data)
    return {"size": size, "block": BLOCK, "crc32": crcs}


class Writer:
    """Write a safetensors file whose tensors are all declared first, then streamed in order.

    ``Writer(path, [(name, dtype, shape), ...], metadata)``; then
    ``write(tensor)`` once per declared tensor, in order; ``close()``
    returns the file's size and block checksums. ``offsets[name]`` is each
    tensor's byte offset from the start of the file.
    """

    def __init__(self, path: str, entries: Iterable[tuple[str, torch.dtype, tuple]], metadata: dict | None = None):
        header: dict = {}
        if metadata:
            header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        pos = 0
        self._order: list[tuple[str, int]] = []
        for name, dtype, shape in entries:
            n = _numel(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
            self._order.append((name, n))
            pos += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        start = 8 + len(text)
        self.offsets = {name: start + header[name]["data_offsets"][0] for name, _ in self._order}
        self._sink = _Sink(path)
        self._sink.write(struct.pack("<Q", len(text)) + text)
        self._next = 0

    def write(self, t: torch.Tensor) -> None:
        name, n = self._order[self._next]
        data = tensor_bytes(t)
        if len(data) != n:
            raise ValueError(f"{self._sink.path}: tensor {name} has {len(data)} bytes, {n} declared")
        self._sink.write(data)
        self._next += 1

    def close(self) -> dict:
        if self._next != len(self._order):
            raise ValueError(f"{self._sink.path}: {len(self._order) - self._next} declared tensors not written")
        return self._sink.close()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class Reader:
    """Byte ranges of one file, each block checked against its recorded CRC-32 as it is read.

    ``record`` is what :class:`Writer.close` (or :func:`checksum_file`)
    returned for the file; ``what`` names the checkpoint in errors.
    """

    def __init__(self, path: str, record: dict, what: str):
        self.path, self.what = path, what
        self.size, self.block, self.crcs = int(record["size"]), int(record["block"]), list(record["crc32"])
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise IntegrityError(f"{what}: file {path} is missing (a deleted or never written shard)") from None
        found = os.fstat(self._fd).st_size
        if found != self.size:
            os.close(self._fd)
            raise IntegrityError(
                f"{what}: file {path} has {found} bytes, the manifest recorded {self.size} (a truncated or "
                "overwritten file)"
            )
        self._cached: tuple[int, bytes] | None = None

    def _block(self, i: int) -> bytes:
        if self._cached is not None and self._cached[0] == i:
            return self._cached[1]
        want = min(self.block, self.size - i * self.block)
        data = os.pread(self._fd, want, i * self.block)
        if len(data) != want:
            raise IntegrityError(f"{self.what}: file {self.path} ended early at block {i} (truncated while read)")
        if zlib.crc32(data) != self.crcs[i]:
            raise IntegrityError(
                f"{self.what}: file {self.path} is corrupted: bytes {i * self.block}..{i * self.block + want} do "
                "not match the checksum the manifest recorded for them. Restore the file from a copy, or load an "
                "earlier checkpoint (zf.checkpoint.latest lists complete ones)."
            )
        self._cached = (i, data)
        return data

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``offset``."""
        end = offset + len(out)
        if end > self.size:
            raise IntegrityError(f"{self.what}: file {self.path}: bytes {offset}..{end} lie past its end ({self.size})")
        pos = offset
        while pos < end:
            i = pos // self.block
            data = self._block(i)
            lo = pos - i * self.block
            n = min(end - pos, len(data) - lo)
            out[pos - offset : pos - offset + n] = data[lo : lo + n]
            pos += n

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    def verify(self) -> None:
        """Read and check every block."""
        for i in range(len(self.crcs)):
            self._block(i)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
