"""Checkpoints: each rank saves what it holds, in the background, atomically; load on any world size
and any composition; export to safetensors.

``save(state, path)`` writes a directory::

    path/
      rank0.safetensors      this rank's pieces of the state (safetensors format)
      rank1.safetensors
      rank1.nvme0.bin ...    NVMe-offloaded optimizer state, hard-linked (or copied) file by file
      manifest.json          written last: layouts, where every piece lies, sizes, block checksums

Every state is described the same way, whatever made it: a *quantity*
(``params``, ``frozen``, ``buffers``, ``master`` for amp's fp32 weights,
``opt:<path>`` for each parameter-shaped leaf of the optimizer's state) is
laid out in flat buckets of named parameters (``zerofn.state.Layout``), and
a rank holds an element range of each bucket (all of it, or its shard). A
rank writes the ranges it holds; a range every rank holds (a replicated
bucket) is split so that rank r writes the r-th of N pieces: every byte is
written once, by N ranks in parallel, and no rank gathers anything.

``load(path, step)`` builds the state for ``step`` (``step.init`` on the
model's parameters, or a state you pass) and fills every range this rank
holds, parameter by parameter: it looks each parameter up in the saved
layout, maps its element range onto the saved pieces, and reads only those
byte ranges (checking each 4 MiB block it reads against the manifest's
CRC-32). So a checkpoint saved under ``shard_params`` on 4 ranks loads under
``shard_optimizer`` on 2, or plain on 1, with its optimizer moments. Across
precisions: a step without ``amp`` gets amp's fp32 master weights as its
parameters; a step with ``amp`` gets them as its masters (or, from a
checkpoint without amp, the fp32 parameters).

Scalars (the update count, the loss scale and its counters, the optimizer's
step counts, the entries of ``state.extra``) are written by rank 0; each
rank's RNG states by that rank, restored when the world size is the same.

Atomic and in the background: ``save`` snapshots this rank's state (a
device-to-host copy on GPU, a memory copy on CPU, a hard link for NVMe
files, which the offload writes afresh rather than in place) and, with
``blocking=False``, returns a handle while a thread writes the files into
``path.partial``; every rank then records its files (sizes, checksums) in a
small JSON file there, and rank 0, once all N have, writes ``manifest.json``
and renames the directory into place. A crash at any moment leaves
``path.partial`` without a manifest and every earlier checkpoint intact;
``latest(directory)`` finds the newest complete one. Coordination goes
through the file system, so the checkpoint directory must be one every rank
sees (a shared file system across machines, as with DCP).

Example:
    >>> import tempfile, torch, zerofn as zf
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> step = zf.train_step(lambda p, b: apply(p, b).square().mean(), zf.optim.adamw(1e-3))
    >>> state, _ = step(step.init(apply.params), torch.ones(2, 4))
    >>> d = tempfile.mkdtemp()
    >>> handle = zf.checkpoint.save(state, f"{d}/step_1", blocking=False)  # returns after the snapshot
    >>> handle.wait().done()
    True
    >>> again = zf.checkpoint.load(zf.checkpoint.latest(d), step)
    >>> int(again.count), torch.equal(again.params[0], state.params[0])
    (1, True)
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from zerofn import collectives as C
from zerofn import tree as T
from zerofn._safetensors import BLOCK, IntegrityError, Reader, Writer, checksum_file, dtype_from_name, DTYPES
from zerofn.functional import owner_of
from zerofn.state import Bucket, Slot, TrainState

__all__ = [
    "CheckpointError", "FileTensor", "IntegrityError", "SaveHandle", "consolidate", "find_quantity", "latest", "load",
    "read_at", "save", "verify", "write_at",
]  # fmt: skip

FORMAT = "zerofn-checkpoint-1"
MANIFEST = "manifest.json"
PARTIAL = ".partial"
SPLIT_MIN = 1 << 16  # a replicated bucket smaller than this (elements) is written by rank 0 alone
CHUNK_BYTES = 64 * 2**20  # bytes read, cast and copied at a time on load


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, or loaded into this step; the message says what differs."""


@dataclass(eq=False)
class FileTensor:
    """A 1-D tensor kept in a file rather than in memory (NVMe-offloaded state), as a pytree leaf.

    ``write(offset, t)`` and ``read(offset, n)`` work on elements.
    """

    path: str
    dtype: torch.dtype
    numel_: int

    def numel(self) -> int:
        return self.numel_

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def read(self, offset: int = 0, n: int | None = None) -> torch.Tensor:
        """Elements ``[offset, offset + n)`` (default: to the end) into a new CPU tensor."""
        out = torch.empty(self.numel_ - offset if n is None else n, dtype=self.dtype)
        if read_at(self.path, out, offset) != out.numel() * self.itemsize:
            raise IntegrityError(f"{self.path}: shorter than the {self.numel_} elements expected")
        return out

    def write(self, offset: int, t: torch.Tensor) -> None:
        write_at(self.path, t.detach().to("cpu", self.dtype), offset)


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


# ---------------------------------------------------------------- what a state holds, as pieces


@dataclass
class _Part:
    """An element range ``[lo, hi)`` of bucket ``bucket`` of quantity ``key`` that this rank holds."""

    key: str  # params, frozen, buffers, master, opt:<path>
    kind: str  # whose layout: params, frozen or buffers
    bucket: int
    lo: int
    hi: int
    value: Any  # a 1-D tensor (or a tensor shaped like a pseudo-bucket's one slot), or a FileTensor
    mirror: bool = False  # a copy of another quantity (offload's host parameters): loaded, never saved


def _pseudo(named: dict) -> tuple[Bucket, ...]:
    """One unsharded bucket per tensor of a name -> tensor dict (frozen tensors, buffers)."""
    return tuple(
        Bucket(t.dtype, str(t.device), (Slot(n, tuple(t.shape), 0, t.numel()),), t.numel(), t.numel(), 1)
        for n, t in named.items()
    )


def _layouts(state: TrainState) -> dict[str, tuple[Bucket, ...]]:
    lay = state.spec.layout
    frozen = lay.frozen_buckets if isinstance(state.frozen, tuple) else _pseudo(state.frozen)
    return {"params": lay.buckets, "frozen": frozen, "buffers": _pseudo(state.buffers)}


def _held_range(numel: int, bucket: Bucket, rank: int, what: str) -> tuple[int, int]:
    if numel == bucket.padded:
        return 0, bucket.padded
    if bucket.shards > 1 and numel == bucket.shard_numel:
        return bucket.shard_range(rank)
    raise CheckpointError(f"checkpoint: {what} holds {numel} elements of a bucket of {bucket.padded}; cannot place it")


_BUCKET_KEY = re.compile(r"b(\d+)$")


def _is_node(x: Any) -> bool:
    return isinstance(x, FileTensor) or callable(getattr(type(x), "checkpoint_parts", None))


def _walk_opt(tree: Any, path: tuple, buckets: tuple[Bucket, ...], rank: int, parts: list, small: dict, mirror: bool):
    """Parts and small leaves of an optimizer state, by canonical key (bucket keys replaced by ``*``).

    A node whose class defines ``checkpoint_parts()`` (a wrapper's state:
    amp's master weights, offload's host or file state) says what it holds:
    ``""`` a subtree that continues the optimizer's path, ``"@q"`` a
    parameter-shaped quantity ``q`` of its own (``@master``), ``"=q"`` a copy
    of quantity ``q`` (loaded, not saved). What it leaves out is scratch.
    """
    paths, leaves, _ = T.tree_flatten_with_path(tree, is_leaf=_is_node)
    for sub, leaf in zip(paths, leaves):
        full = path + tuple(sub)
        if not isinstance(leaf, FileTensor) and _is_node(leaf):
            for label, inner in leaf.checkpoint_parts().items():
                if label == "":
                    _walk_opt(inner, full, buckets, rank, parts, small, mirror)
                elif label[0] in "@=":
                    for key, b in _bucket_leaves(inner):
                        parts.append(_bucket_part(label[1:], b, key, buckets, rank, mirror or label[0] == "="))
            continue
        i = next((int(m.group(1)) for c in full if isinstance(c, str) and (m := _BUCKET_KEY.match(c))), None)
        canon = "opt:" + "/".join("*" if (isinstance(c, str) and _BUCKET_KEY.match(c)) else str(c) for c in full)
        if i is None:
            if isinstance(leaf, torch.Tensor):
                small[canon] = leaf
            continue
        parts.append(_bucket_part(canon, i, leaf, buckets, rank, mirror))


def _bucket_leaves(tree: Any) -> Iterator[tuple[Any, int]]:
    paths, leaves, _ = T.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, FileTensor))
    for p, leaf in zip(paths, leaves):
        m = _BUCKET_KEY.match(str(p[-1])) if p else None
        if m is None:
            raise CheckpointError(f"checkpoint: a parameter-shaped optimizer entry at {p} is not keyed by bucket")
        yield leaf, int(m.group(1))


def _bucket_part(key: str, i: int, value: Any, buckets, rank: int, mirror: bool) -> _Part:
    b = buckets[i]
    lo, hi = _held_range(value.numel(), b, rank, f"optimizer state {key} of bucket {i}")
    return _Part(key, "params", i, lo, hi, value, mirror)


def find_quantity(opt_state: Any, key: str) -> dict[int, Any]:
    """Bucket index -> tensor (or :class:`FileTensor`) of a quantity an optimizer-state wrapper names
    (``"master"``: amp's fp32 master weights), wherever the wrappers keep it."""
    found: dict[int, Any] = {}

    def walk(tree: Any) -> None:
        for leaf in T.tree_leaves(tree, is_leaf=_is_node):
            if isinstance(leaf, FileTensor) or not _is_node(leaf):
                continue
            for label, inner in leaf.checkpoint_parts().items():
                if label == "@" + key:
                    found.update((i, t) for t, i in _bucket_leaves(inner))
                elif label == "":
                    walk(inner)

    walk(opt_state)
    return found


def _state_parts(state: TrainState, rank: int, layouts: dict) -> tuple[list[_Part], dict[str, torch.Tensor]]:
    """Every bucket range this rank holds (``layouts``: the state's :func:`_layouts`), and the small tensors
    (counts, loss scale, optimizer scalars)."""
    parts: list[_Part] = []
    for i, (t, b) in enumerate(zip(state.params, layouts["params"])):
        parts.append(_Part("params", "params", i, *_held_range(t.numel(), b, rank, f"params bucket {i}"), t))
    frozen = state.frozen if isinstance(state.frozen, tuple) else tuple(state.frozen.values())
    for i, (t, b) in enumerate(zip(frozen, layouts["frozen"])):
        parts.append(_Part("frozen", "frozen", i, *_held_range(t.numel(), b, rank, f"frozen bucket {i}"), t))
    for i, t in enumerate(state.buffers.values()):
        parts.append(_Part("buffers", "buffers", i, 0, t.numel(), t))
    small: dict[str, torch.Tensor] = {"count": state.count}
    _walk_opt(state.opt_state, (), layouts["params"], rank, parts, small, False)
    if state.loss_scale is not None:
        for p, leaf in zip(*T.tree_flatten_with_path(state.loss_scale)[:2]):
            small["loss_scale:" + T.keystr(p)] = leaf
    for k, v in state.extra.items():
        for p, leaf in zip(*T.tree_flatten_with_path(v)[:2]):
            if isinstance(leaf, torch.Tensor):
                small[f"extra:{k}:{T.keystr(p)}"] = leaf
    return parts, small


def _layout_json(layouts: dict) -> dict:
    return {
        kind: [
            {"dtype": DTYPES[b.dtype], "padded": b.padded, "shards": b.shards,
             "slots": [[s.name, list(s.shape), s.offset, s.numel] for s in b.slots]}
            for b in buckets
        ]
        for kind, buckets in layouts.items()
    }  # fmt: skip


def _signature(layout_json: dict) -> str:
    import hashlib

    text = json.dumps({k: layout_json[k] for k in ("params", "frozen")}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


# ---------------------------------------------------------------- save


class SaveHandle:
    """A save in progress: ``wait()`` returns once the checkpoint is complete (committed) on disk.

    Attributes:
        path: the checkpoint directory.
        blocked_s: seconds ``save`` held the caller (the snapshot).
        bytes_written: bytes this rank wrote (after ``wait()``).
    """

    def __init__(self, path: str, nonce: str, rank: int, world: int):
        self.path, self.nonce, self.rank, self.world = path, nonce, rank, world
        self.blocked_s = 0.0
        self.bytes_written = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._finished = False

    def done(self) -> bool:
        """True when this rank's part is written and the checkpoint committed (or the save failed)."""
        return self._finished

    def wait(self, timeout: float | None = None) -> "SaveHandle":
        """Block until the checkpoint is complete on disk; re-raise what went wrong while writing."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint.save({self.path!r}): still writing after {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, {'done' if self._finished else 'writing'})"


_PENDING: list[SaveHandle] = []


def _wait_pending() -> None:
    while _PENDING:
        h = _PENDING.pop()
        try:
            h.wait()
        except Exception:  # noqa: BLE001 - reported by the handle's own wait(); the next save goes on
            pass


atexit.register(_wait_pending)  # a background save finishes before the interpreter exits


def save(state: TrainState, path: str | os.PathLike, *, blocking: bool = True, keep: int | None = None) -> SaveHandle:
    """Write ``state`` to the checkpoint directory ``path``; each rank writes what it holds.

    Args:
        state: a TrainState between updates (``state.micro == 0``).
        path: the checkpoint's directory (for example ``f"ckpt/step_{int(state.count):06d}"``);
            an existing checkpoint there is replaced when the new one is complete.
        blocking: False returns once this rank's state is snapshotted and
            writes on a background thread; the returned handle's ``wait()``
            blocks until the checkpoint is complete. The next ``save`` waits
            for the previous one first.
        keep: after this checkpoint is complete, keep only the newest ``keep``
            complete checkpoints in ``path``'s parent directory (by update count).

    Returns:
        A :class:`SaveHandle` (already complete when ``blocking``).

    Collective: every rank calls it with the same path (one small broadcast);
    a rank that does not makes the others fail after ``ZEROFN_TIMEOUT_S``.
    """
    start = time.perf_counter()
    if not isinstance(state, TrainState):
        raise TypeError(f"checkpoint.save: state is a {type(state).__name__}, expected a TrainState")
    if int(state.micro) != 0:
        raise CheckpointError(
            f"checkpoint.save: the state is {int(state.micro)} micro-step(s) into an update of accumulated "
            "gradients; save after the update (when state.micro == 0), as the step counts reach it"
        )
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"checkpoint.save: keep must be an int >= 1 or None, got {keep!r}")
    _wait_pending()
    path = os.path.abspath(os.fspath(path))
    partial = path + PARTIAL
    rank, world = C.rank(), C.world_size()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        nonce = uuid.uuid4().hex
    else:
        nonce = None
    nonce = C.broadcast_object(nonce) if world > 1 else nonce  # every rank is saving, and the directory exists
    handle = SaveHandle(path, nonce, rank, world)
    job = _snapshot(state, partial, rank, world)
    job["nonce"] = nonce

    def run() -> None:
        try:
            handle.bytes_written = _write(job, partial, rank)
            if rank == 0:
                _commit(partial, path, world, nonce, keep)
            else:
                _await_commit(partial, path, nonce)
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            handle._error = e
            try:
                with open(os.path.join(partial, f"failed{rank}.txt"), "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
            except OSError:
                pass
        finally:
            handle._finished = True

    handle._thread = threading.Thread(target=run, name=f"zerofn-save-{rank}", daemon=True)
    handle._thread.start()
    _PENDING.append(handle)
    handle.blocked_s = time.perf_counter() - start
    if blocking:
        handle.wait()
        _PENDING.remove(handle)
        handle.blocked_s = time.perf_counter() - start
    return handle


def _pieces(part: _Part, padded: int, rank: int, world: int) -> list[tuple[int, int]]:
    """The ranges of ``part`` (of a bucket ``padded`` long) this rank writes: all of it, or (replicated) its
    1/N piece."""
    if part.hi - part.lo == 0:
        return []
    if (part.lo, part.hi) != (0, padded) or world == 1:  # a shard, or one rank: all of it
        return [(part.lo, part.hi)]
    n = part.hi - part.lo  # replicated on every rank
    if n < SPLIT_MIN:
        return [(part.lo, part.hi)] if rank == 0 else []
    k = -(-n // world)
    lo, hi = part.lo + rank * k, min(part.hi, part.lo + (rank + 1) * k)
    return [(lo, hi)] if lo < hi else []


def _snapshot(state: TrainState, partial: str, rank: int, world: int) -> dict:
    """Copy (or link) what this rank writes, so that the caller may go on changing the state."""
    layouts = _layouts(state)
    parts, small = _state_parts(state, rank, layouts)
    cuda = any(isinstance(p.value, torch.Tensor) and p.value.is_cuda for p in parts)
    tensors: list[tuple[str, torch.Tensor]] = []
    records: list[dict] = []
    files: list[tuple[str, str]] = []  # (name in the checkpoint, source kept open or linked)
    for part in parts:
        if part.mirror:
            continue
        for lo, hi in _pieces(part, layouts[part.kind][part.bucket].padded, rank, world):
            rec = {"key": part.key, "kind": part.kind, "bucket": part.bucket, "lo": lo, "hi": hi}
            if isinstance(part.value, FileTensor):
                name = f"rank{rank}.nvme{len(files)}.bin"
                files.append((name, _link(part.value.path, os.path.join(partial, name))))
                records.append({**rec, "file": name, "offset": (lo - part.lo) * part.value.itemsize,
                                "dtype": DTYPES[part.value.dtype]})  # fmt: skip
                continue
            flat = part.value.detach().reshape(-1)[lo - part.lo : hi - part.lo]
            name = f"{part.key}|{part.kind}|{part.bucket}|{lo}"
            tensors.append((name, _copy(flat)))
            records.append({**rec, "name": name, "dtype": DTYPES[flat.dtype]})
    if rank == 0:
        for key, t in small.items():
            tensors.append((key, _copy(t.detach())))
            records.append({"key": key, "name": key, "dtype": DTYPES[t.dtype], "shape": list(t.shape)})
    rng = {f"rng:torch:{rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng[f"rng:cuda:{rank}"] = torch.cuda.get_rng_state()
    for key, t in rng.items():
        tensors.append((key, t))
        records.append({"key": key, "name": key, "dtype": "U8", "shape": list(t.shape)})
    if cuda:
        torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
    job = {"tensors": tensors, "records": records, "files": files}
    if rank == 0:
        lay = _layout_json(layouts)
        job["head"] = {
            "format": FORMAT, "chain": state.spec.chain, "world_size": world, "count": int(state.count),
            "layouts": lay, "signature": _signature(lay), "model": [list(e) for e in state.spec.model],
            "buffers": list(state.buffers), "time": time.time(),
        }  # fmt: skip
    return job


_PINNED: dict[tuple, list[torch.Tensor]] = {}  # pinned host buffers, reused from one save to the next


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy the caller cannot change: pinned and non-blocking from a GPU, a memory copy on the CPU.

    Pinned buffers are kept for the next save (pinning memory costs more than the copy): a run saves
    the same shapes each time, and a save starts only when the previous one has finished writing.
    """
    if not t.is_cuda:
        return t.clone()
    free = _PINNED.get((t.dtype, t.numel()))
    out = free.pop() if free else torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
    out = out.view(t.shape)
    out.copy_(t, non_blocking=True)
    return out


def _release(t: torch.Tensor) -> None:
    if t.is_pinned():
        _PINNED.setdefault((t.dtype, t.numel()), []).append(t.reshape(-1))


def _link(src: str, dst: str) -> str:
    """Hard-link ``src`` at ``dst`` (O(1): the offload writes new files rather than changing these);
    across file systems, keep ``src`` open so the background copy reads these bytes even if it is
    replaced meanwhile."""
    try:
        os.link(src, dst)
        return ""
    except OSError:
        return _OpenFile(src)  # type: ignore[return-value]


class _OpenFile(str):
    """A source file held open until it is copied."""

    def __new__(cls, path: str):
        obj = super().__new__(cls, path)
        obj.fd = os.open(path, os.O_RDONLY)
        return obj


def _write(job: dict, partial: str, rank: int) -> int:
    """Write this rank's file(s) and its record of them; returns bytes written."""
    tensors = job["tensors"]
    name = f"rank{rank}.safetensors"
    w = Writer(os.path.join(partial, name), [(n, t.dtype, tuple(t.shape)) for n, t in tensors], {"format": FORMAT})
    for i, (_, t) in enumerate(tensors):
        w.write(t)
        _release(t)
        tensors[i] = (tensors[i][0], None)  # freed as written
    files = {name: w.close()}
    for rec in job["records"]:
        if "name" in rec:
            rec["file"], rec["offset"] = name, w.offsets[rec.pop("name")]
    for fname, src in job["files"]:
        dst = os.path.join(partial, fname)
        if isinstance(src, _OpenFile):
            with open(dst, "wb") as out, os.fdopen(src.fd, "rb") as f:
                shutil.copyfileobj(f, out, BLOCK)
                out.flush()
                os.fsync(out.fileno())
        files[fname] = checksum_file(dst)
    record = {"rank": rank, "nonce": job["nonce"], "records": job["records"], "files": files, "head": job.get("head")}
    _write_json(os.path.join(partial, f"rank{rank}.json"), record)
    return sum(f["size"] for f in files.values())


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Late(CheckpointError):
    """A wait on the file system ran past ZEROFN_TIMEOUT_S."""


def _poll(what: str, done, failed) -> None:
    limit = C.timeout_s()
    start = time.monotonic()
    delay = 0.002
    while not done():
        err = failed()
        if err:
            raise CheckpointError(f"{what}: {err}")
        if time.monotonic() - start > limit:
            raise _Late(f"{what}: not done after {limit:.0f} s (ZEROFN_TIMEOUT_S)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _failure(partial: str) -> str | None:
    try:
        names = [n for n in os.listdir(partial) if n.startswith("failed")]
    except FileNotFoundError:
        return None
    for n in names:
        with open(os.path.join(partial, n)) as f:
            return f"rank {n[6:-4]} failed to write its part: {f.read()}"
    return None


def _commit(partial: str, path: str, world: int, nonce: str, keep: int | None) -> None:
    """Rank 0: once every rank's record is there, write the manifest and rename the directory into place."""
    names = [os.path.join(partial, f"rank{r}.json") for r in range(world)]
    try:
        _poll(
            f"checkpoint.save({path!r}) waiting for every rank's files",
            lambda: all(os.path.exists(n) for n in names),
            lambda: _failure(partial),
        )
    except _Late as e:
        missing = [r for r, n in enumerate(names) if not os.path.exists(n)]
        raise CheckpointError(
            f"{e}: rank(s) {missing} did not record their files in {partial}. Every rank must call save, and "
            "the directory must be on a file system every rank sees (a shared one across machines)."
        ) from None
    ranks = []
    for n in names:
        with open(n) as f:
            ranks.append(json.load(f))
    manifest = dict(ranks[0]["head"], nonce=nonce, records=[], files={})
    for r in ranks:
        manifest["records"] += r["records"]
        manifest["files"].update(r["files"])
    _write_json(os.path.join(partial, MANIFEST), manifest)
    for n in names:
        os.remove(n)
    _fsync_dir(partial)
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{nonce[:8]}"
        os.rename(path, old)
    os.rename(partial, path)
    _fsync_dir(os.path.dirname(path))
    if old:
        shutil.rmtree(old, ignore_errors=True)
    if keep is not None:
        _prune(os.path.dirname(path), keep)


def _await_commit(partial: str, path: str, nonce: str) -> None:
    def committed() -> bool:
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                return json.load(f).get("nonce") == nonce
        except (OSError, ValueError):
            return False

    _poll(f"checkpoint.save({path!r}) waiting for rank 0 to commit", committed, lambda: _failure(partial))


def _complete(directory: str) -> list[tuple[int, float, str]]:
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
            continue
        if m.get("format") == FORMAT:
            out.append((int(m["count"]), float(m.get("time", 0.0)), full))
    return sorted(out)


def _prune(directory: str, keep: int) -> None:
    for _, _, full in _complete(directory)[:-keep]:
        gone = f"{full}.deleting"
        os.rename(full, gone)  # never seen half-deleted
        shutil.rmtree(gone, ignore_errors=True)


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint (highest update count) under ``directory``, or None.

    A checkpoint is complete once its manifest is written, which happens
    last; directories a crash left behind (``*.partial``) are ignored.
    """
    found = _complete(os.fspath(directory))
    return found[-1][2] if found else None


# ---------------------------------------------------------------- load


class _Saved:
    """A checkpoint on disk: its manifest, checked files, and byte-range reads of its pieces."""

    def __init__(self, path: str):
        self.path = os.path.abspath(os.fspath(path))
        self.what = f"checkpoint {self.path}"
        self.newest_params = False  # read the parameters from "pending" (set by load)
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
        self.layouts = {
            kind: [
                Bucket(dtype_from_name(b["dtype"]), "cpu", tuple(Slot(s[0], tuple(s[1]), s[2], s[3]) for s in b["slots"]),
                       sum(s[3] for s in b["slots"]), b["padded"], b["shards"])
                for b in buckets
            ]
            for kind, buckets in m["layouts"].items()
        }  # fmt: skip
        # name -> (kind, bucket index, offset, numel, shape, dtype)
        self.index: dict[str, tuple] = {}
        for kind, buckets in self.layouts.items():
            for i, b in enumerate(buckets):
                for s in b.slots:
                    self.index[s.name] = (kind, i, s.offset, s.numel, s.shape, b.dtype)
        self.pieces: dict[tuple, list[dict]] = {}
        self.small: dict[str, dict] = {}
        for r in m["records"]:
            if "bucket" in r:
                self.pieces.setdefault((r["key"], r["kind"], r["bucket"]), []).append(r)
            else:
                self.small[r["key"]] = r
        for v in self.pieces.values():
            v.sort(key=lambda r: r["lo"])
        self.keys = {k for k, _, _ in self.pieces} | {k for k in self.small}
        self._readers: dict[str, Reader] = {}
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

    def has(self, key: str) -> bool:
        return key in self.keys

    def read(self, key: str, kind: str, bucket: int, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of a saved bucket of quantity ``key``, in the saved dtype."""
        pieces = self.pieces.get((key, kind, bucket), [])
        dtype = dtype_from_name(pieces[0]["dtype"]) if pieces else self.layouts[kind][bucket].dtype
        out = torch.empty(hi - lo, dtype=dtype)
        if hi == lo:
            return out
        size = out.element_size()
        view = memoryview(out.view(torch.uint8).numpy())
        pos = lo
        for r in pieces:
            if r["hi"] <= pos or r["lo"] >= hi:
                continue
            if r["lo"] > pos:
                break
            end = min(hi, r["hi"])
            self.reader(r["file"]).read_into(r["offset"] + (pos - r["lo"]) * size, view[(pos - lo) * size : (end - lo) * size])
            pos = end
            if pos == hi:
                return out
        raise IntegrityError(
            f"{self.what}: no saved piece holds elements {pos}..{hi} of {key} bucket {bucket} ({kind}); the "
            "manifest is incomplete"
        )

    def read_small(self, key: str) -> torch.Tensor:
        r = self.small[key]
        t = torch.empty(tuple(r["shape"]), dtype=dtype_from_name(r["dtype"]))
        self.reader(r["file"]).read_into(r["offset"], memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return t


def _check_model(saved: _Saved, layouts: dict, state: TrainState) -> None:
    """The same model: parameter names, shapes and (up to a float cast) dtypes, and buffer names."""
    mine = {s.name: (tuple(s.shape), b.dtype) for k in ("params", "frozen") for b in layouts[k] for s in b.slots}
    theirs = {n: (tuple(v[4]), v[5]) for n, v in saved.index.items() if v[0] != "buffers"}
    problems = []
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing:
        problems.append(f"parameters this model has and the checkpoint lacks: {missing[:5]}")
    if extra:
        problems.append(f"parameters the checkpoint has and this model lacks: {extra[:5]}")
    for n in sorted(set(mine) & set(theirs)):
        (sa, da), (sb, db) = mine[n], theirs[n]
        if sa != sb:
            problems.append(f"{n}: shape {list(sb)} saved, {list(sa)} here")
        elif da != db and not (da.is_floating_point and db.is_floating_point):
            problems.append(f"{n}: dtype {db} saved, {da} here")
    if state.buffers:
        saved_buffers = {s.name: (tuple(s.shape), b.dtype) for b in saved.layouts["buffers"] for s in b.slots}
        for n, t in state.buffers.items():
            if n not in saved_buffers:
                problems.append(f"buffer {n} is not in the checkpoint")
            elif saved_buffers[n][0] != tuple(t.shape):
                problems.append(f"buffer {n}: shape {list(saved_buffers[n][0])} saved, {list(t.shape)} here")
    if problems:
        raise CheckpointError(
            f"{saved.what} is of another model (saved by {saved.m['chain']} on {saved.m['world_size']} "
            "rank(s)):\n  " + "\n  ".join(problems[:10]) + "\nLoad a checkpoint of this model, or build the model "
            "with the configuration the checkpoint was saved with."
        )


def _source(saved: _Saved, key: str, kind: str, name: str, dtype: torch.dtype) -> tuple[str, str]:
    """Which saved quantity fills parameter ``name`` of quantity ``key``: (saved key, saved kind)."""
    skind = saved.index[name][0]
    if kind == "buffers":
        return "buffers", "buffers"
    if key == "params" and skind == "params" and saved.newest_params:
        return "pending", "params"  # a delayed update's newest parameters, for a step that does not delay
    if key in ("params", "frozen"):
        full = dtype in (torch.float32, torch.float64)
        if skind == "params" and full and saved.has("master") and saved.index[name][5] != dtype:
            return "master", "params"  # amp's fp32 masters come back as the parameters
        return skind, skind
    if skind != "params":
        raise CheckpointError(f"{saved.what}: parameter {name} was frozen when saved; it has no {key}")
    if key == "master":
        return ("master", "params") if saved.has("master") else ("params", "params")
    if key == "pending" and not saved.has("pending"):
        return "params", "params"  # saved without a delayed update: nothing pending beyond the parameters
    return key, "params"


def _fill(saved: _Saved, part: _Part, layouts: dict) -> None:
    bucket = layouts[part.kind][part.bucket]
    value = part.value
    target_dtype = value.dtype
    flat = None
    if isinstance(value, torch.Tensor):
        flat = value.detach().view(-1) if value.is_contiguous() else None
    staged = torch.empty(part.hi - part.lo, dtype=target_dtype) if flat is None and not isinstance(value, FileTensor) else None
    segs: list[list] = []  # [target lo, target hi, saved key, saved kind, saved bucket, saved lo]
    for s in bucket.slots:
        a0, a1 = max(part.lo, s.offset), min(part.hi, s.offset + s.numel)
        if a0 >= a1:
            continue
        skey, skind = _source(saved, part.key, part.kind, s.name, target_dtype)
        _, sb, soff, *_ = saved.index[s.name]
        src_lo = soff + (a0 - s.offset)
        last = segs[-1] if segs else None
        if last and last[1] == a0 - part.lo and last[2:5] == [skey, skind, sb] and last[5] + (last[1] - last[0]) == src_lo:
            last[1] = a1 - part.lo
        else:
            segs.append([a0 - part.lo, a1 - part.lo, skey, skind, sb, src_lo])
    if isinstance(value, FileTensor) and len(segs) == 1 and _link_whole(saved, value, segs[0], part):
        return
    for t0, t1, skey, skind, sb, s0 in segs:
        step = max(1, CHUNK_BYTES // 4)
        for a in range(t0, t1, step):
            b = min(t1, a + step)
            data = saved.read(skey, skind, sb, s0 + (a - t0), s0 + (b - t0))
            if isinstance(value, FileTensor):
                value.write(a, data)
            elif flat is not None:
                flat[a:b].copy_(data)
            else:
                staged[a:b].copy_(data)
    if staged is not None:
        with torch.no_grad():
            value.copy_(staged.view(value.shape))


def _link_whole(saved: _Saved, value: FileTensor, seg: list, part: _Part) -> bool:
    """A file-held range that equals one saved file: hard-link (or copy) that file, checked, in its place."""
    t0, t1, skey, skind, sb, s0 = seg
    if (t0, t1) != (0, part.hi - part.lo):
        return False
    for r in saved.pieces.get((skey, skind, sb), []):
        if r["lo"] == s0 and r["hi"] == s0 + t1 and r["offset"] == 0 and dtype_from_name(r["dtype"]) == value.dtype:
            if saved.m["files"][r["file"]]["size"] != t1 * value.itemsize:
                return False
            src = os.path.join(saved.path, r["file"])
            saved.reader(r["file"]).verify()
            if os.path.exists(value.path):
                os.unlink(value.path)
            try:
                os.link(src, value.path)
            except OSError:
                shutil.copyfile(src, value.path)
            return True
    return False


def load(
    path: str | os.PathLike,
    step: Any,
    *,
    state: TrainState | None = None,
    params: Any = None,
    rng: bool = True,
) -> TrainState:
    """The state for ``step`` from the checkpoint at ``path``, on any world size and composition.

    Args:
        path: a checkpoint directory (``latest(directory)`` finds the newest).
        step: the Step to load for: any composition of transforms, on any
            world size; its optimizer must be the one saved (its state has
            the same entries).
        state: a state of ``step`` to fill in place (for example one you
            just built); by default ``step.init(params)``.
        params: the params tree for ``step.init`` (default: the parameters
            of the model ``loss_fn`` calls, ``apply.params``); their values
            are overwritten, so a freshly built model, or one on the meta
            device under ``shard_params``, will do.
        rng: restore this rank's RNG states (when the world size is the one saved).

    Returns:
        The TrainState, equal to the saved one where the composition is the
        same (bit for bit), and the same model and optimizer state otherwise.

    Raises:
        IntegrityError: a missing, truncated or corrupted file.
        CheckpointError: a checkpoint of another model, or one whose
            optimizer state this step's optimizer does not have.

    Collective (through ``step.init``): every rank calls it.
    """
    saved = _Saved(path)
    try:
        if state is None:
            if params is None:
                params = step.model().params
            owner = owner_of(params)
            if owner is not None and owner.adopted:
                raise CheckpointError(
                    f"checkpoint.load: the model's parameters are held by a state already (step.init took them "
                    "over), so they cannot seed another. Pass that state to fill in place: "
                    "load(path, step, state=state), or build a fresh model for the step."
                )
            state = step.init(params, structure_only=True)  # the values are overwritten below
        else:
            step.check_state(state)
        layouts = _layouts(state)
        _check_model(saved, layouts, state)
        parts, small = _state_parts(state, C.rank(), layouts)
        wanted = {p.key for p in parts if p.key.startswith("opt:")} | {k for k in small if k.startswith("opt:")}
        lacking = sorted(k for k in wanted if k not in saved.keys)
        surplus = sorted(k for k in saved.keys if k.startswith("opt:") and k not in wanted)
        if lacking or surplus:
            raise CheckpointError(
                f"{saved.what}: its optimizer state does not map onto {step.name}'s: entries this optimizer has "
                f"and the checkpoint lacks: {lacking[:5]}; entries saved that this optimizer lacks: {surplus[:5]}. "
                "Load with the optimizer the checkpoint was saved with."
            )
        # A delayed update (offload's delay=1) saves its newest parameters as "pending"; a step that
        # does not delay takes those as its parameters.
        saved.newest_params = saved.has("pending") and not any(p.key == "pending" for p in parts)
        with torch.no_grad():
            for part in parts:
                _fill(saved, part, layouts)
            same_layout = saved.m["signature"] == _signature(_layout_json(layouts))
            for key, t in small.items():
                if key not in saved.small or (key.startswith("extra:") and not same_layout):
                    continue  # entries tied to a layout (shard_params' unit order) start afresh on another
                src = saved.read_small(key)
                if src.shape == t.shape:
                    t.copy_(src)
        if rng and saved.m["world_size"] == C.world_size():
            r = C.rank()
            if f"rng:torch:{r}" in saved.small:
                torch.set_rng_state(saved.read_small(f"rng:torch:{r}"))
            if f"rng:cuda:{r}" in saved.small and torch.cuda.is_available():
                torch.cuda.set_rng_state(saved.read_small(f"rng:cuda:{r}"))
        return state
    finally:
        saved.close()


def verify(path: str | os.PathLike) -> dict:
    """Check every file of a checkpoint against its manifest (sizes and every block's checksum).

    Returns the manifest; raises :class:`IntegrityError` naming the first bad file.
    """
    saved = _Saved(path)
    try:
        for fname in saved.m["files"]:
            saved.reader(fname).verify()
        return saved.m
    finally:
        saved.close()


# ---------------------------------------------------------------- export


def consolidate(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write the full model (parameters and persistent buffers, by ``state_dict`` names) as safetensors.

    One process, no process group: each tensor is read from the pieces that
    hold it, written, and freed, so peak memory is about the largest tensor.
    Parameters come as the optimizer updates them (amp's fp32 masters where
    saved), cast to ``dtype`` when given; tied weights appear under each of
    their names, so ``model.load_state_dict(safetensors.torch.load_file(out))``
    accepts the file with ``strict=True``.

    Args:
        path: a checkpoint directory.
        out: the ``.safetensors`` file to write; with ``max_shard_bytes``
            and a larger model, a directory of ``model-0000k-of-0000n.safetensors``
            files and ``model.safetensors.index.json`` (the Hugging Face layout).
        dtype: cast floating tensors to this dtype (e.g. ``torch.bfloat16``).
        max_shard_bytes: the most bytes per file.

    Returns:
        The files written.
    """
    saved = _Saved(path)
    try:
        entries = [tuple(e) for e in saved.m["model"]] or [
            (n, "buffer" if v[0] == "buffers" else "param", n) for n, v in saved.index.items()
        ]
        plan = []
        for name, kind, held in entries:
            if held not in saved.index:
                raise CheckpointError(f"{saved.what}: {name} ({held}) is not in the checkpoint")
            skind, sb, soff, numel, shape, sdtype = saved.index[held]
            key = "master" if skind == "params" and saved.has("master") else skind
            src_dtype = torch.float32 if key == "master" else sdtype
            to = dtype if dtype is not None and src_dtype.is_floating_point else src_dtype
            plan.append((name, key, skind, sb, soff, numel, shape, to))
        out = os.fspath(out)
        total = sum(p[5] * torch.empty((), dtype=p[7]).element_size() for p in plan)
        groups = [plan]
        if max_shard_bytes is not None and total > max_shard_bytes:
            groups, size = [[]], 0
            for p in plan:
                n = p[5] * torch.empty((), dtype=p[7]).element_size()
                if groups[-1] and size + n > max_shard_bytes:
                    groups.append([])
                    size = 0
                groups[-1].append(p)
                size += n
        written = []
        if len(groups) == 1:
            targets = [out]
        else:
            os.makedirs(out, exist_ok=True)
            targets = [os.path.join(out, f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors") for i in range(len(groups))]
        weight_map = {}
        for target, group in zip(targets, groups):
            w = Writer(target, [(p[0], p[7], p[6]) for p in group], {"format": "pt"})
            for name, key, skind, sb, soff, numel, shape, to in group:
                w.write(saved.read(key, skind, sb, soff, soff + numel).to(to).view(shape))
                weight_map[name] = os.path.basename(target)
            w.close()
            written.append(target)
        if len(groups) > 1:
            index = os.path.join(out, "model.safetensors.index.json")
            with open(index, "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
            written.append(index)
        return written
    finally:
        saved.close()
