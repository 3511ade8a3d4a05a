"""Saving: snapshot this rank's state, write it on a background thread into ``path.partial``, and
commit (rank 0 writes the manifest once every rank has recorded its files, then renames the
directory into place)."""

from __future__ import annotations

import atexit
import contextvars
import json
import math
import os
import shutil
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zerofn import collectives as C
from zerofn import keys, mesh
from zerofn._io import FileTensor, fsync_dir, write_json
from zerofn._safetensors import BLOCK, DTYPES, Writer, checksum_file
from zerofn.checkpoint._format import (
    FORMAT,
    MANIFEST,
    PARTIAL,
    CheckpointError,
    data_file,
    failed_rank,
    failure_file,
    frozen_file,
    layout_json,
    nvme_file,
    record_file,
    signature,
)
from zerofn.checkpoint.manifest import complete
from zerofn.checkpoint.partitioned import PARTITIONS, of_spec, record
from zerofn.checkpoint.parts import FROZEN, Part, frozen_crc, layouts, quantities, state_parts
from zerofn.state import TrainState

__all__ = ["SPLIT_MIN", "SaveHandle", "save", "wait_saves"]

SPLIT_MIN = 1 << 16  # a replicated bucket smaller than this (elements) is written by rank 0 alone


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

    def wait(self, timeout: float | None = None) -> SaveHandle:
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


_RUNNING: list[SaveHandle] = []


def wait_saves() -> None:
    """Wait for every background save of this process (errors stay with their handles)."""
    while _RUNNING:
        h = _RUNNING.pop()
        try:
            h.wait()
        except Exception:  # noqa: BLE001 - reported by the handle's own wait(); the next save goes on
            pass


atexit.register(wait_saves)  # a background save finishes before the interpreter exits


def save(
    state: TrainState,
    path: str | os.PathLike,
    *,
    blocking: bool = True,
    keep: int | None = None,
    group: Any = None,
    frozen: bool | str = True,
) -> SaveHandle:
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
        group: the process group the state's step runs on (``step.group``;
            default: the current group, see ``zf.collectives.group_scope``):
            its ranks write the checkpoint, its rank 0 commits it. Ranks of
            other groups save to other paths.
        frozen: what becomes of the frozen parameters (a LoRA model's base,
            ``quantize``'s parts), which no update changes. True: written
            every time. ``"once"``: written by the first save of this run;
            each later save of the same (unchanged) tensors hard-links that
            file into its own directory, so every checkpoint is whole but the
            base's bytes are written and stored once. False: not written;
            ``load`` rebuilds them with ``step.init`` from the params it is
            given (the source model: its files through ``init_fn=
            zf.checkpoint.pretrained_init(directory)``, or its weights), and
            checks them against a CRC-32 per rank recorded here when the
            world size and layout are the ones saved.

    Returns:
        A :class:`SaveHandle` (already complete when ``blocking``).

    Collective: every rank of the group calls it with the same path (one
    small broadcast); a rank that does not makes the others fail after
    ``ZEROFN_TIMEOUT_S``.
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
    state.inflight.check()  # a check the device made and no one read yet (a bad batch): raised before writing
    part = of_spec(state.spec)
    if part is not None and not _IN_PART.get():
        return _save_partition(state, path, part, keep=keep, group=group, frozen=frozen)
    if frozen not in (True, False, ONCE) or not isinstance(frozen, (bool, str)):
        raise ValueError(f"checkpoint.save: frozen must be True, False or {ONCE!r}, got {frozen!r}")
    wait_saves()
    path = os.path.abspath(os.fspath(path))
    partial = path + PARTIAL
    rank, world = C.rank(group=group), C.world_size(group=group)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        nonce = uuid.uuid4().hex
    else:
        nonce = None
    if world > 1:  # every rank is saving, and the directory exists
        nonce = C.broadcast_object(nonce, group=group)
    handle = SaveHandle(path, nonce, rank, world)
    job = _snapshot(state, partial, rank, world, frozen)

    def run() -> None:
        try:
            handle.bytes_written = _write(job, partial, rank, nonce)
            if rank == 0:
                _commit(partial, path, world, nonce, keep)
            else:
                _await_commit(partial, path, nonce)
            if job.once is not None:  # the next save of these tensors links this file
                _ONCE[rank] = job.once._replace(path=os.path.join(path, frozen_file(rank)))
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            handle._error = e
            try:
                with open(os.path.join(partial, failure_file(rank)), "w") as f:
                    f.write(f"{type(e).__name__}: {e}")
            except OSError:
                pass
        finally:
            handle._finished = True

    handle._thread = threading.Thread(target=run, name=f"zerofn-save-{rank}", daemon=True)
    handle._thread.start()
    _RUNNING.append(handle)
    handle.blocked_s = time.perf_counter() - start
    if blocking:
        handle.wait()
        _RUNNING.remove(handle)
        handle.blocked_s = time.perf_counter() - start
    return handle


_IN_PART: contextvars.ContextVar[bool] = contextvars.ContextVar("zerofn_saving_a_part", default=False)


def _save_partition(
    state: TrainState, path: Any, part: tuple, *, keep: int | None, group: Any, frozen: bool | str
) -> SaveHandle:
    """A state holding one part of a model cut over the axes of a mesh (``part``: its index and cuts, from
    the state's spec): each part's ranks (its step's group: the mesh's axes but the cutting ones) save it as a
    checkpoint of its
    own, ``path/part{index}``; once all have, the world's rank 0 writes ``partitions.json`` (the cutting
    axes, and each part's coordinates and placements) and renames the directory into place. Blocking;
    collective over the world."""
    index, cuts = part
    world = dist.group.WORLD
    if group is None:  # the mesh the state was made on, made already (zerofn.mesh keeps each shape's groups)
        made = mesh.make(**{axis: size for axis, size, _ in state.spec.mesh})
        # the part's ranks: those of the step's group, over every axis but the cutting ones (and a pipeline's)
        group = made.group_over(*(axis for axis, _, _ in state.spec.mesh if axis not in cuts.axes and axis != "pp"))
    if C.world_size(group=group) != state.spec.world_size:
        raise CheckpointError(
            f"checkpoint.save: this state holds part {index} of a model cut over the mesh axes {list(cuts.axes)}; "
            f"each part's data-parallel ranks save it, {state.spec.world_size} of them, but the group given has "
            f"{C.world_size(group=group)}: leave group= out"
        )
    if frozen is False:
        raise CheckpointError(
            "checkpoint.save: frozen=False is not supported for a state split over groups of ranks yet; "
            "save with frozen=True or 'once'"
        )
    wait_saves()
    path = os.path.abspath(os.fspath(path))
    partial = path + PARTIAL
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    C.barrier(group=world)
    token = _IN_PART.set(True)  # the part itself is an ordinary checkpoint of its group
    try:
        handle = save(state, os.path.join(partial, f"part{index}"), blocking=True, group=group, frozen=frozen)
    finally:
        _IN_PART.reset(token)
    every = C.gather_objects((index, record(cuts)), group=world)
    if dist.get_rank() == 0:
        write_json(
            os.path.join(partial, PARTITIONS),
            {
                "format": FORMAT,
                "count": math.prod(cuts.sizes),
                "mesh": {"axes": list(cuts.axes), "sizes": list(cuts.sizes)},
                "parts": {str(i): part for i, part in every},
                "model_count": int(state.count),
                "time": time.time(),
            },
        )
        fsync_dir(partial)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(partial, path)
        fsync_dir(os.path.dirname(path))
        if keep is not None:
            _prune(os.path.dirname(path), keep)
    C.barrier(group=world)
    handle.path = path
    return handle


class _OpenFile(str):
    """A source file held open until it is copied."""

    def __new__(cls, path: str):
        obj = super().__new__(cls, path)
        obj.fd = os.open(path, os.O_RDONLY)
        return obj


class _Linked(NamedTuple):
    """A file-held piece in the checkpoint: hard-linked already, or its source held open to be copied."""

    name: str  # in the checkpoint directory
    source: _OpenFile | None  # None: linked


@dataclass
class _Job:
    """What a rank's background writer writes: its snapshot, the records of its pieces, linked files."""

    tensors: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)  # manifest records (JSON), their files filled in by _write
    files: list[_Linked] = field(default_factory=list)
    named: dict[int, str] = field(default_factory=dict)  # record position -> its tensor's name in the data file
    head: dict | None = None  # rank 0: the manifest's head
    frozen: list[tuple[str, torch.Tensor | None]] = field(default_factory=list)  # the frozen file's tensors
    frozen_named: dict[int, str] = field(default_factory=dict)  # record position -> its name in the frozen file
    frozen_linked: dict | None = None  # the frozen file's record (size, checksums): linked from an earlier save
    once: _Once | None = None  # frozen="once": what the frozen file holds, for the next save to link
    frozen_crc: int | None = None  # frozen=False: this rank's frozen values' CRC-32, for load to check


class _Once(NamedTuple):
    """A frozen file written (or linked) by a save with ``frozen="once"``: the tensors it holds (weakly, with
    their version counters: any change, or another tensor, writes afresh), its records and its own record."""

    tensors: tuple  # (weakref to the tensor, its _version) per frozen part, in order
    records: list[dict]
    file: dict | None  # size and checksums
    path: str = ""  # in the committed checkpoint


ONCE = "once"
_ONCE: dict[int, _Once] = {}  # rank -> the newest frozen file written with frozen="once" in this process
_CRC: dict[int, tuple[tuple, int]] = {}  # rank -> (tensors as in _Once, their CRC-32): computed once per run


def _pieces(part: Part, padded: int, rank: int, world: int) -> list[tuple[int, int]]:
    """The ranges of ``part`` (of a bucket ``padded`` long) this rank writes: all of it, or (replicated) its
    1/N piece."""
    if part.hi - part.lo == 0 or not part.write:
        return []
    if (part.lo, part.hi) != (0, padded) or world == 1:  # a shard, or one rank: all of it
        return [(part.lo, part.hi)]
    n = part.hi - part.lo  # replicated on every rank
    if n < SPLIT_MIN:
        return [(part.lo, part.hi)] if rank == 0 else []
    k = -(-n // world)
    lo, hi = part.lo + rank * k, min(part.hi, part.lo + (rank + 1) * k)
    return [(lo, hi)] if lo < hi else []


def _tensor_name(part: Part, lo: int) -> str:
    """A piece's tensor name in the data file (unique in it; records point at offsets, not names)."""
    return f"{part.key}|{part.kind}|{part.bucket}|{lo}"


def _add(job: _Job, record: dict, name: str, t: torch.Tensor) -> None:
    job.named[len(job.records)] = name
    job.records.append(record)
    job.tensors.append((name, t))


def _same(tensors: tuple, parts: list[Part]) -> bool:
    return len(tensors) == len(parts) and all(
        r() is p.value and v == p.value._version for (r, v), p in zip(tensors, parts)
    )


def _frozen_crc(parts: list[Part], rank: int) -> int:
    """CRC-32 of this rank's frozen parts' bytes, in order (once per run: frozen tensors do not change;
    parts held in files are not read)."""
    found = _CRC.get(rank)
    if found is not None and _same(found[0], parts):
        return found[1]
    crc = frozen_crc(parts)
    _CRC[rank] = (tuple((weakref.ref(p.value), p.value._version) for p in parts), crc)
    return crc


def _snapshot(state: TrainState, partial: str, rank: int, world: int, frozen: bool | str = True) -> _Job:
    """Copy (or link) what this rank writes, so that the caller may go on changing the state."""
    lays = layouts(state)
    held = state_parts(state, rank, lays)
    cuda = any(isinstance(p.value, torch.Tensor) and p.value.is_cuda for p in held.parts)
    job = _Job()
    frozen_parts = [p for p in held.parts if p.key == FROZEN]
    in_memory = [p for p in frozen_parts if not isinstance(p.value, FileTensor)]
    skip_frozen = frozen is False
    if frozen is False:
        job.frozen_crc = _frozen_crc(in_memory, rank)
    elif frozen == ONCE and in_memory:
        last = _ONCE.get(rank)
        if last is not None and _same(last.tensors, in_memory) and _hard_link(last.path, partial, rank):
            job.records.extend(dict(r) for r in last.records)
            job.frozen_linked = last.file
            job.once = last._replace(path="")
            skip_frozen = True
        else:
            job.once = _Once(tuple((weakref.ref(p.value), p.value._version) for p in in_memory), [], None)
    for part in held.parts:
        if part.role is not None and part.role.mirror:
            continue
        if part.key == FROZEN and (skip_frozen or (job.once is not None and not isinstance(part.value, FileTensor))):
            if not skip_frozen:  # frozen="once", written now: into the frozen file, which later saves link
                for lo, hi in _pieces(part, lays[part.kind][part.bucket].padded, rank, world):
                    flat = part.value.detach().reshape(-1)[lo - part.lo : hi - part.lo]
                    rec = {"key": part.key, "kind": part.kind, "bucket": part.bucket, "lo": lo, "hi": hi}
                    job.frozen_named[len(job.records)] = _tensor_name(part, lo)
                    job.records.append({**rec, "dtype": DTYPES[flat.dtype]})
                    job.frozen.append((_tensor_name(part, lo), _copy(flat)))
            continue
        for lo, hi in _pieces(part, lays[part.kind][part.bucket].padded, rank, world):
            rec = {"key": part.key, "kind": part.kind, "bucket": part.bucket, "lo": lo, "hi": hi}
            if isinstance(part.value, FileTensor):
                name = nvme_file(rank, len(job.files))
                job.files.append(_Linked(name, _link(part.value.path, os.path.join(partial, name))))
                offset = (lo - part.lo) * part.value.itemsize
                job.records.append({**rec, "file": name, "offset": offset, "dtype": DTYPES[part.value.dtype]})
                continue
            flat = part.value.detach().reshape(-1)[lo - part.lo : hi - part.lo]
            _add(job, {**rec, "dtype": DTYPES[flat.dtype]}, _tensor_name(part, lo), _copy(flat))
    if rank == 0:
        for key, t in held.small.items():
            _add(job, {"key": key, "dtype": DTYPES[t.dtype], "shape": list(t.shape)}, key, _copy(t.detach()))
    rng = {keys.rng("torch", rank): torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng[keys.rng("cuda", rank)] = torch.cuda.get_rng_state()
    for key, t in rng.items():
        _add(job, {"key": key, "dtype": "U8", "shape": list(t.shape)}, key, t)
    if cuda:
        torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
    if rank == 0:
        lay = layout_json(lays)
        job.head = {
            "format": FORMAT,
            "chain": state.spec.chain,
            "world_size": world,
            "count": int(state.count),
            "layouts": lay,
            "signature": signature(lay),
            "quantities": {k: r.to_json() for k, r in quantities(held.parts).items() if not r.mirror},
            "model": [list(e) for e in state.spec.model],
            "buffers": list(state.buffers),
            "frozen": frozen is not False,
            "time": time.time(),
        }
    return job


def _hard_link(src: str, partial: str, rank: int) -> bool:
    """Link an earlier checkpoint's frozen file into this one; False (write it afresh) when it is gone."""
    try:
        os.link(src, os.path.join(partial, frozen_file(rank)))
        return True
    except OSError:
        return False


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


def _link(src: str, dst: str) -> _OpenFile | None:
    """Hard-link ``src`` at ``dst`` (O(1): the offload writes new files rather than changing these);
    across file systems, keep ``src`` open so the background copy reads these bytes even if it is
    replaced meanwhile."""
    try:
        os.link(src, dst)
        return None
    except OSError:
        return _OpenFile(src)


def _write(job: _Job, partial: str, rank: int, nonce: str) -> int:
    """Write this rank's file(s) and its record of them; returns bytes written."""
    tensors = job.tensors
    name = data_file(rank)
    w = Writer(os.path.join(partial, name), [(n, t.dtype, tuple(t.shape)) for n, t in tensors], {"format": FORMAT})
    for i, (tname, t) in enumerate(tensors):
        w.write(t)
        _release(t)
        tensors[i] = (tname, None)  # freed as written
    files = {name: w.close()}
    for i, tname in job.named.items():
        job.records[i].update(file=name, offset=w.offsets[tname])
    fname = frozen_file(rank)
    if job.frozen:
        fw = Writer(
            os.path.join(partial, fname), [(n, t.dtype, tuple(t.shape)) for n, t in job.frozen], {"format": FORMAT}
        )
        for i, (tname, t) in enumerate(job.frozen):
            fw.write(t)
            _release(t)
            job.frozen[i] = (tname, None)
        files[fname] = fw.close()
        for i, tname in job.frozen_named.items():
            job.records[i].update(file=fname, offset=fw.offsets[tname])
        job.once = job.once._replace(records=[job.records[i] for i in job.frozen_named], file=files[fname])
    elif job.frozen_linked is not None:
        files[fname] = job.frozen_linked
    written = sum(f["size"] for n, f in files.items() if not (n == fname and job.frozen_linked is not None))
    for linked in job.files:
        dst = os.path.join(partial, linked.name)
        if linked.source is not None:
            with open(dst, "wb") as out, os.fdopen(linked.source.fd, "rb") as f:
                shutil.copyfileobj(f, out, BLOCK)
                out.flush()
                os.fsync(out.fileno())
        files[linked.name] = checksum_file(dst)
    record = {"rank": rank, "nonce": nonce, "records": job.records, "files": files, "head": job.head}
    if job.frozen_crc is not None:
        record["frozen_crc"] = job.frozen_crc
    write_json(os.path.join(partial, record_file(rank)), record)
    return written


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
        names = os.listdir(partial)
    except FileNotFoundError:
        return None
    for n in names:
        r = failed_rank(n)
        if r is not None:
            with open(os.path.join(partial, n)) as f:
                return f"rank {r} failed to write its part: {f.read()}"
    return None


def _commit(partial: str, path: str, world: int, nonce: str, keep: int | None) -> None:
    """Rank 0: once every rank's record is there, write the manifest and rename the directory into place."""
    names = [os.path.join(partial, record_file(r)) for r in range(world)]
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
    if not manifest.get("frozen", True):
        manifest["frozen_crc"] = [r.get("frozen_crc") for r in ranks]
    write_json(os.path.join(partial, MANIFEST), manifest)
    for n in names:
        os.remove(n)
    fsync_dir(partial)
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{nonce[:8]}"
        os.rename(path, old)
    os.rename(partial, path)
    fsync_dir(os.path.dirname(path))
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


def _prune(directory: str, keep: int) -> None:
    for found in complete(directory)[:-keep]:
        gone = f"{found.path}.deleting"
        os.rename(found.path, gone)  # never seen half-deleted
        shutil.rmtree(gone, ignore_errors=True)
