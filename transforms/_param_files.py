"""Parameter shards in files: ``offload(..., "nvme", params="nvme")`` under ``shard_params``.

Each bucket's shard (this rank's slice of a unit's trainable or frozen
parameters) is a file per rank under ``root/rank{r}``: ``param_{i}.g{n}`` for
trainable bucket ``i`` (``n`` the generation: the NVMe engine's update
writes the new shard to the other generation, a new file, and switches to
it once every write has succeeded) and ``frozen_{i}.g0`` for a frozen one
(never rewritten). The state holds a :class:`~zerofn._io.FileTensor` per
shard, never the bytes. ``params.json`` records what the files are for (the
layout, world size and rank), so a directory of another run is refused
before anything in it is touched.

:class:`ShardReads` reads shards into host buffers on an I/O thread, ahead of
the gathers that need them (``shard_params`` asks for the units it predicts
next), and holds at most ``limit`` of them at once.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections import OrderedDict
from typing import Any

import torch

from zerofn import alloc
from zerofn._io import FileTensor, digest, generation_file, read_exact, remove, write_at, write_json
from zerofn.state import Bucket

__all__ = ["PARAMS_MANIFEST", "ShardFiles", "ShardReads"]

PARAMS_MANIFEST = "params.json"
FORMAT = "zerofn-params-1"


class ShardFiles:
    """Where this rank's parameter shards go at ``init`` (see the module docs)."""

    def __init__(self, root: str, buckets: list[Bucket], frozen: list[Bucket], rank: int, world: int) -> None:
        self.dir = os.path.join(root, f"rank{rank}")
        self.buckets, self.trainable, self.rank = buckets + frozen, len(buckets), rank
        sizes = [[str(b.dtype), b.padded, b.shards] for b in self.buckets]
        self.signature = digest({"buckets": sizes, "trainable": len(buckets), "world": world, "rank": rank})
        os.makedirs(self.dir, exist_ok=True)
        _check(self.dir, self.signature)

    def stem(self, i: int) -> str:
        return f"param_{i}" if i < self.trainable else f"frozen_{i - self.trainable}"

    def store(self, i: int, shard: torch.Tensor | None) -> FileTensor:
        """Bucket ``i``'s shard as a new file of generation 0 (``None``: a state to be loaded into, the file
        at its size with nothing written)."""
        b = self.buckets[i]
        lo, hi = b.shard_range(self.rank)
        path = generation_file(self.dir, self.stem(i), 0)
        for g in (0, 1):  # new files, never old ones changed: a checkpoint's hard link keeps its bytes
            remove(generation_file(self.dir, self.stem(i), g))
        if shard is None:
            alloc.zeros_file(path, b.dtype, hi - lo)
        else:
            write_at(path, shard.detach().to("cpu"), 0)
        return FileTensor(path, b.dtype, hi - lo)

    def done(self) -> None:
        write_json(os.path.join(self.dir, PARAMS_MANIFEST), {"format": FORMAT, "signature": self.signature})


def _check(rank_dir: str, signature: str) -> None:
    name = os.path.join(rank_dir, PARAMS_MANIFEST)
    if not os.path.exists(name):
        return
    try:
        with open(name) as f:
            found = json.load(f).get("signature")
    except (OSError, ValueError):
        found = None
    if found != signature:
        raise ValueError(
            f"offload(params='nvme'): {rank_dir} holds parameter files of another model, world size or rank "
            f"(signature {found!r}, this one {signature!r}). Use an empty directory for this run, or delete those "
            "files if they are no longer needed."
        )


class ShardReads:
    """Shards read from their files into host buffers (pinned when ``pin``) on an I/O thread, at most
    ``limit`` read or being read at once: ``ahead(key, files)`` starts a read, ``take(key, files)``
    returns its buffers (reading now if none was started)."""

    def __init__(self, limit: int, pin: bool) -> None:
        self.limit, self.pin = max(1, limit), pin
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.started: OrderedDict[Any, concurrent.futures.Future] = OrderedDict()

    def ahead(self, key: Any, files: list[FileTensor]) -> None:
        if key in self.started or len(self.started) >= self.limit or not files:
            return
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerofn-param-reads")
        self.started[key] = self.pool.submit(self._read, files)

    def take(self, key: Any, files: list[FileTensor]) -> list[torch.Tensor]:
        started = self.started.pop(key, None)
        return started.result() if started is not None else self._read(files)

    def _read(self, files: list[FileTensor]) -> list[torch.Tensor]:
        out = []
        for f in files:
            buf = torch.empty(f.numel(), dtype=f.dtype, pin_memory=self.pin)
            read_exact(f.path, buf, 0)
            out.append(buf)
        return out

    def close(self) -> None:
        for started in self.started.values():
            started.cancel()
        self.started.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
