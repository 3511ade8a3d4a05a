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
next), at most ``limit`` reads at once. The buffers come from
:class:`~zerofn.alloc.HostPool` s: one buffer per unit's shards, as many as
the reads ahead and the gathers still reading them need, allocated once and
reused step after step, so the memory they take is those pools whatever the
model.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import threading
import weakref
from typing import Any

import torch

from zerofn import alloc
from zerofn._io import FileTensor, digest, generation_file, read_exact, remove, write_at, write_json
from zerofn.state import Bucket

__all__ = ["PARAMS_MANIFEST", "ShardFiles", "ShardReads", "read_buffers"]

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


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # owner -> {buffer bytes: its HostPool}
_POOLS_LOCK = threading.Lock()


def _pools(owner: Any, counts: dict[int, int], pin: bool) -> dict[int, alloc.HostPool]:
    """A pool per size of buffer (``counts``: bytes -> how many buffers), those of ``owner`` (the model's
    layout: the same from step to step, whose reads they serve) made once and kept; without an owner,
    pools of their own."""
    if owner is None:
        return {n: alloc.HostPool(c, n, pin=pin) for n, c in counts.items()}
    with _POOLS_LOCK:
        pools = _POOLS.setdefault(owner, {})
        for n, c in counts.items():
            if n not in pools or pools[n].count < c or pools[n].pin != pin:
                pools[n] = alloc.HostPool(c, n, pin=pin)
        return {n: pools[n] for n in counts}


def read_buffers(limit: int, held: int) -> int:
    """The buffers of :class:`ShardReads` with ``limit`` reads ahead and at most ``held`` units' shards
    read and still being gathered: one per unit's shards in either state."""
    return max(1, limit) + held


class ShardReads:
    """Shards read from their files into host buffers on an I/O thread, at most ``limit`` read or being
    read at once: ``ahead(key, files)`` starts a read, ``take(key, files)`` returns its
    :class:`~zerofn.alloc.Lease` (reading now if none was started), whose tensors are the shards, to be
    released once the gather has read them.

    The buffers: a :class:`~zerofn.alloc.HostPool` (pinned when ``pin``) per size of a unit's shards
    (``units``: the files of each unit that has some), of :func:`read_buffers` ``(limit, held)`` buffers
    or as many as there are units of that size (a root unit larger than the blocks gets one of its own),
    kept for ``owner`` (the model's layout) from step to step: each step's reads reuse the buffers of
    the steps before."""

    def __init__(self, limit: int, held: int, units: list, pin: bool, owner: Any = None) -> None:
        self.limit = max(1, limit)
        sizes = collections.Counter(alloc.slot_bytes(self.layout(files)) for files in units)
        counts = {n: min(read_buffers(limit, held), c) for n, c in sizes.items()}
        self.buffers = _pools(owner, counts, pin)
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.started: collections.OrderedDict[Any, tuple[concurrent.futures.Future, alloc.Lease]] = (
            collections.OrderedDict()
        )

    @staticmethod
    def layout(files: list[FileTensor]) -> list[tuple[torch.dtype, int]]:
        return [(f.dtype, f.numel()) for f in files]

    def ahead(self, key: Any, files: list[FileTensor]) -> None:
        if key in self.started or len(self.started) >= self.limit or not files:
            return
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerofn-param-reads")
        lease = self._lease(files)
        self.started[key] = (self.pool.submit(self._read, files, lease), lease)

    def take(self, key: Any, files: list[FileTensor]) -> alloc.Lease:
        started = self.started.pop(key, None)
        if started is not None:
            return started[0].result()
        return self._read(files, self._lease(files))

    def _lease(self, files: list[FileTensor]) -> alloc.Lease:
        layout = self.layout(files)
        return self.buffers[alloc.slot_bytes(layout)].take(layout)

    @staticmethod
    def _read(files: list[FileTensor], lease: alloc.Lease) -> alloc.Lease:
        try:
            for f, buf in zip(files, lease.tensors):
                read_exact(f.path, buf, 0)
        except BaseException:
            lease.release()
            raise
        return lease

    def close(self) -> None:
        """Reads not taken are cancelled (or waited for), their buffers given back."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        for _, lease in self.started.values():
            lease.release()
        self.started.clear()
