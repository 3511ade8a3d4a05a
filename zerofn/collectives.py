"""The one module that talks to torch.distributed, and the byte accounting.

Every collective here is the identity at world size 1 with no process group,
so a single-process reference costs nothing. Under torchrun (or ``zf.spawn``)
the default process group is created on first use from the environment
torchrun sets: gloo for CPU tensors, nccl when CUDA is present.

Every wait on another rank is bounded by ``ZEROFN_TIMEOUT_S`` seconds
(default 600), read when the group is created: under torchrun here, under
``zf.spawn`` and ``zf.RankPool`` in each rank as it starts. A collective
that some rank never joins (a rank calling ``step.full_params`` alone, a save
on some ranks only) then raises :class:`CollectiveTimeoutError` on the ranks
that wait, naming the call; one that fails because another rank is gone
raises :class:`CollectiveError`.

Traffic is counted the way the ZeRO paper counts it: an all-reduce of a
tensor of n bytes costs 2n (a reduce-scatter plus an all-gather), a
reduce-scatter or an all-gather whose full tensor has n bytes costs n. At
world size 1 nothing travels and nothing is counted.

Example:
    >>> import torch
    >>> from zerofn import collectives as C
    >>> with C.counting() as c:
    ...     x = C.all_reduce(torch.ones(4), op="mean")
    >>> x.tolist(), c.bytes   # world size 1: identity, no traffic
    ([1.0, 1.0, 1.0, 1.0], 0)
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerofn import tree as T

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "Handle",
    "all_gather",
    "all_gather_tree",
    "all_reduce",
    "all_reduce_tree",
    "barrier",
    "broadcast_object",
    "counting",
    "ensure_initialized",
    "gather_objects",
    "any_of",
    "max_min",
    "rank",
    "reduce_scatter",
    "reduce_scatter_tree",
    "set_group_timeout",
    "timeout_s",
    "world_size",
]

# Seconds a collective waits for the other ranks when ZEROFN_TIMEOUT_S is not set.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "ZEROFN_TIMEOUT_S"

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------- process group


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def timeout_s() -> float:
    """Seconds a collective waits for the other ranks: ``ZEROFN_TIMEOUT_S``, default 600.

    Read from the environment when the process group is created (so set it
    before the first collective, or before ``zf.spawn``/``zf.RankPool``,
    whose ranks inherit the caller's environment).
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds that a collective "
            f"may wait for the other ranks (default {DEFAULT_TIMEOUT_S:g})."
        )
    return seconds


# The timeout the default group was given (what a timed-out collective reports).
_group_timeout_s: float | None = None


def set_group_timeout(seconds: float | None = None) -> float:
    """Bound every later collective of the default group by ``seconds`` (default :func:`timeout_s`).

    ``zf.spawn``'s ranks join with the generous start timeout (interpreters
    start unevenly) and then call this.
    """
    global _group_timeout_s
    seconds = timeout_s() if seconds is None else seconds
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(datetime.timedelta(seconds=seconds))
    _group_timeout_s = seconds
    return seconds


def ensure_initialized() -> bool:
    """Join the default process group if the environment asks for one.

    Under torchrun (``WORLD_SIZE`` > 1 in the environment) this initialises
    the default group once: nccl when CUDA is available, gloo otherwise,
    with :func:`timeout_s` bounding both the join and every collective.
    Returns True when a process group is active.
    """
    global _group_timeout_s
    if dist.is_available() and dist.is_initialized():
        return True
    if _env_world_size() <= 1:
        return False
    seconds = timeout_s()
    # On GPUs, CPU tensors (the small agreement checks and statistics) travel over gloo.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    start = time.monotonic()
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as err:
        env_rank = os.environ.get("RANK", "")
        rank, world = (int(env_rank) if env_rank.isdigit() else "?"), _env_world_size()
        new = _translate(err, _JOIN, start, rank=rank, world=world, limit=seconds)
        if new is None:
            raise
        raise new from err
    _group_timeout_s = seconds
    atexit.register(_leave)
    return True


def _leave() -> None:
    """At exit, leave the group that :func:`ensure_initialized` joined, while Python is still whole.

    Otherwise gloo's threads may drop their last collective's tensors after
    the interpreter began to shut down, need the GIL, not get it, and abort
    the process ("terminate called without an active exception", exit code
    -6) now and then, after a run that succeeded.
    """
    _CONTROL.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def world_size() -> int:
    """Ranks in the default group; 1 when there is none."""
    return dist.get_world_size() if ensure_initialized() else 1


def rank() -> int:
    """This process's rank in the default group; 0 when there is none."""
    return dist.get_rank() if ensure_initialized() else 0


# ---------------------------------------------------------------- accounting


@dataclass
class Counter:
    """Bytes this rank moved through collectives while it was active."""

    bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes += nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1


_counters: list[Counter] = []


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count the collective traffic issued inside the block (nests)."""
    c = Counter()
    _counters.append(c)
    try:
        yield c
    finally:
        _counters.remove(c)


def _count(kind: str, nbytes: int) -> None:
    for c in _counters:
        c.add(kind, nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- errors


class CollectiveError(RuntimeError):
    """A collective failed on this rank because another rank is gone or never joined.

    The message names the collective, the zerofn call it ran in and where
    that was called, this rank, the world size and how long it waited; the
    backend's own error is chained (``__cause__``).

    Attributes:
        call: the collective, the zerofn call it ran in and where that was
            called (``"all_gather (144 bytes) in Step.full_params, called
            from main (train.py:41)"``).
        rank, world_size: this rank and the group's size.
        waited_s: seconds from issuing the collective to the failure.
    """

    def __init__(
        self, message: str, *, call: str = "", rank: Any = None, world_size: Any = None, waited_s: float = 0.0
    ):
        super().__init__(message)
        self.call, self.rank, self.world_size, self.waited_s = call, rank, world_size, waited_s

    def __reduce__(self):
        kwargs = dict(call=self.call, rank=self.rank, world_size=self.world_size, waited_s=self.waited_s)
        return (_make_error, (type(self), self.args[0], kwargs))


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective waited ``ZEROFN_TIMEOUT_S`` for a rank that did not join it.

    Both a :class:`CollectiveError` (a ``RuntimeError``, as torch's own error
    was) and a ``TimeoutError``.
    """


def _make_error(cls: type, message: str, kwargs: dict) -> CollectiveError:
    return cls(message, **kwargs)


_JOIN = "joining the process group"
_SAME_CALLS = (
    "Every rank must make the same collective calls in the same order: step(state, batch), "
    "step.init, step.full_params and step.apply are collective; call them on every rank"
)
# Backend messages that say a peer's connection is gone (gloo), or that this
# rank's group was closed by its own earlier timeout ("pair closure").
_GONE = re.compile(r"closed by peer|reset by peer|pair closure|broken pipe|connection refused|socket closed", re.I)
_TIMED_OUT = re.compile(r"timed? ?out|timeout", re.I)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
# This process's first collective failure, quoted by later ones.
_first_failure: str | None = None


@contextlib.contextmanager
def _named(kind: str, nbytes: int = 0, started: float | None = None) -> Iterator[float]:
    """Issue or wait for collective ``kind`` inside: a backend timeout or lost peer becomes a
    :class:`CollectiveError` naming it. Yields the time it was issued (``started``, or now)."""
    started = time.monotonic() if started is None else started
    try:
        yield started
    except RuntimeError as err:
        _reraise(err, kind, nbytes, started)


def _reraise(err: RuntimeError, kind: str, nbytes: int, started: float):
    """Raise ``err`` as a :class:`CollectiveError` naming the collective, or unchanged."""
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # the group is gone as well
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    what = f"{kind} ({nbytes:,} bytes)" if nbytes else kind
    new = _translate(err, what, started, rank=rank, world=world, limit=_group_timeout_s)
    if new is None:
        raise err
    raise new from err


def _translate(err: RuntimeError, what: str, started: float, *, rank, world, limit: float | None):
    """The :class:`CollectiveError` for a backend error ``err`` in collective ``what``;
    None when ``err`` is not a timeout or a lost connection (it then goes up unchanged).

    ``limit``: the group's timeout, None for a group zerofn did not create.
    """
    global _first_failure
    if isinstance(err, CollectiveError):
        return None
    text = str(err)
    gone, timed_out = bool(_GONE.search(text)), bool(_TIMED_OUT.search(text))
    if not (gone or timed_out or isinstance(err, getattr(dist, "DistError", ()))):
        return None
    waited = time.monotonic() - started
    call = what + _where()
    here = f"on rank {rank} of world size {world} after {waited:.1f} s"
    limit_text = f"{TIMEOUT_ENV}={limit:g} s" if limit is not None else "the process group's timeout"
    if gone:
        earlier = f" Earlier on this rank: {_first_failure}." if _first_failure else ""
        cls, message = (
            CollectiveError,
            (
                f"{call} failed {here}: the connection to another rank is gone. Another rank exited or "
                f"failed (its own error is in its log), or gave up waiting in a collective after "
                f"{limit_text}, as it does when the ranks do not make the same collective calls.{earlier} "
                f"{_SAME_CALLS}."
            ),
        )
        summary = f"{call} lost a peer after {waited:.1f} s"
    elif timed_out:
        joined = "joined within that time" if what == _JOIN else "joined it"
        cls, message = (
            CollectiveTimeoutError,
            (
                f"{call} timed out {here} ({limit_text}): not every rank {joined}. {_SAME_CALLS}, "
                f"not under `if rank == 0:`. A rank busy for longer than {TIMEOUT_ENV} (loading data, "
                f"writing a file) looks the same: then raise {TIMEOUT_ENV}."
            ),
        )
        summary = f"{call} timed out after {waited:.1f} s"
    else:
        cls, message = CollectiveError, f"{call} failed {here}."
        summary = f"{call} failed after {waited:.1f} s"
    first_line = _SOURCE_PREFIX.sub("", text.strip().splitlines()[0] if text.strip() else "")
    backend = dist.get_backend() if dist.is_initialized() else "torch.distributed"
    message += f" [{backend}: {type(err).__name__}: {first_line[:300]}]"
    if _first_failure is None:
        _first_failure = summary
    return cls(message, call=call, rank=rank, world_size=world, waited_s=waited)


def _where() -> str:
    """Which zerofn call the failing collective ran in, and where the user called it.

    The outermost frame of a zerofn module (the launch machinery aside) is
    the call (``Step.full_params``); the frame above it is the call site.
    """
    frame = sys._getframe(1)
    entry = caller = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if (module == "zerofn" or module.startswith("zerofn.")) and not module.startswith("zerofn.launch"):
            entry, caller = frame, frame.f_back
        frame = frame.f_back
    if entry is None:
        return ""
    text = ""
    if entry.f_globals.get("__name__") != __name__:
        code = entry.f_code
        name = getattr(code, "co_qualname", None)
        if name is None:  # Python 3.10
            owner = entry.f_locals.get("self")
            name = f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
        text = f" in {name}"
    if caller is not None:
        path = caller.f_code.co_filename
        with contextlib.suppress(ValueError):  # another drive on Windows
            rel = os.path.relpath(path) if os.path.isabs(path) else path
            path = path if rel.startswith("..") else rel
        text += f", called from {caller.f_code.co_name} ({path}:{caller.f_lineno})"
    return text


# ---------------------------------------------------------------- handles


class Handle:
    """An in-flight collective; ``wait()`` returns its result.

    ``wait()`` raises :class:`CollectiveTimeoutError` or
    :class:`CollectiveError` (naming the collective) when the collective
    timed out or lost a rank.
    """

    __slots__ = ("_work", "_result", "_after", "_kind", "_nbytes", "_started")

    def __init__(
        self, work: Any, result: Any, after=None, kind: str = "collective", nbytes: int = 0, started: float = 0.0
    ):
        self._work, self._result, self._after = work, result, after
        self._kind, self._nbytes, self._started = kind, nbytes, started

    def wait(self) -> Any:
        if self._work is not None:
            with _named(self._kind, self._nbytes, self._started):
                self._work.wait()
            self._work = None
            if self._after is not None:
                self._after(self._result)
                self._after = None
        return self._result


def _done(result: Any) -> Handle:
    return Handle(None, result)


_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN", "bor": "BOR"}


def _reduce_op(op: str):
    if op not in _OPS:
        raise ValueError(f"collective op {op!r} is not supported; expected one of {sorted(_OPS)}")
    return getattr(dist.ReduceOp, _OPS[op])


# ---------------------------------------------------------------- tensor collectives


def all_reduce(t: torch.Tensor, op: str = "sum", *, async_op: bool = False, control: bool = False):
    """Reduce ``t`` in place across ranks (``op``: sum, mean, max, min; bor, bitwise or, for integer
    tensors on the control group).

    Returns ``t`` (or a Handle whose ``wait()`` returns it with ``async_op``).
    Counts 2 x bytes(t). ``control``: a small check on a CPU tensor, sent on
    a group of its own (:func:`_control_group`) so that it does not wait
    behind the data collectives issued before it.
    """
    n = world_size()
    if n == 1:
        return _done(t) if async_op else t
    _count("all_reduce", 2 * _nbytes(t))
    with _named("all_reduce", _nbytes(t)) as started:
        work = dist.all_reduce(t, op=_reduce_op(op), async_op=True, group=_control_group() if control else None)
    after = (lambda r: r.div_(n)) if op == "mean" else None
    h = Handle(work, t, after, "all_reduce", _nbytes(t), started)
    return h if async_op else h.wait()


_CONTROL: dict = {}  # the default group -> its control group


def _control_group():
    """A second gloo group over every rank, for small checks that must not queue behind the data.

    Collectives on one group run in the order they were issued: a check at
    the start of a step would otherwise wait for the previous step's
    parameter all-gathers, which are meant to overlap the forward. Made on
    first use, which every rank reaches together (a collective call).
    """
    world = dist.group.WORLD
    if world not in _CONTROL:  # first use, or the default group was made anew
        _CONTROL.clear()
        seconds = _group_timeout_s or timeout_s()
        _CONTROL[world] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
    return _CONTROL[world]


def any_of(flags: torch.Tensor) -> torch.Tensor:
    """The elementwise OR over the ranks of ``flags`` (a 1-D uint8 tensor of 0s and 1s), sent as bits:
    one all-reduce (bitwise OR) of ``ceil(n / 8)`` bytes on the control group. Returns a new uint8 tensor."""
    n = flags.numel()
    if world_size() == 1 or n == 0:
        return flags.clone()
    pad = (-n) % 8
    bits = torch.cat([flags.to(torch.uint8).cpu(), torch.zeros(pad, dtype=torch.uint8)]).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    packed = (bits * weights).sum(1, dtype=torch.int64).to(torch.uint8)
    all_reduce(packed, "bor", control=True)
    unpacked = (packed.view(-1, 1) & weights).ne(0).to(torch.uint8).reshape(-1)
    return unpacked[:n]


def max_min(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise max and min of ``t`` over the ranks, in one all-reduce (of ``t`` and ``-t``).

    Equal max and min say that every rank holds the same values, which is how
    ranks check they agree before trusting each other. It travels on a group
    of its own (:func:`_control_group`), beside whatever data is in flight;
    ``t`` is moved to the CPU for it.
    """
    probe = torch.cat([t.reshape(-1), -t.reshape(-1)]).cpu()
    all_reduce(probe, "max", control=True)
    n = t.numel()
    return probe[:n].view_as(t), -probe[n:].view_as(t)


def _check_split(kind: str, full: torch.Tensor, part: torch.Tensor) -> int:
    """The world size, once ``full`` is checked to hold one ``part`` per rank."""
    n = world_size()
    if full.numel() != n * part.numel():
        raise ValueError(
            f"{kind}: full tensor has {full.numel()} elements, expected world_size {n} x {part.numel()} "
            f"= {n * part.numel()}; pad the full tensor to a multiple of the world size"
        )
    return n


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, op: str = "sum", *, async_op: bool = False):
    """Reduce ``full`` across ranks and keep this rank's ``1/N`` slice in ``out``.

    ``full.numel() == N * out.numel()``; rank r receives the reduction of
    ``full[r * k:(r + 1) * k]``. Counts bytes(full).
    """
    n = _check_split("reduce_scatter", full, out)
    if n == 1:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full)
        return _done(out) if async_op else out
    _count("reduce_scatter", _nbytes(full))
    if n == 2 and op in ("sum", "mean") and dist.get_backend() == "gloo" and not _overlap(out, full):
        return _pair_reduce_scatter(out, full, op, async_op)
    with _named("reduce_scatter", _nbytes(full)) as started:
        work = _reduce_scatter_single(out, full, op=_reduce_op(op), async_op=True)
    after = (lambda r: r.div_(n)) if op == "mean" else None
    h = Handle(work, out, after, "reduce_scatter", _nbytes(full), started)
    return h if async_op else h.wait()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _pair_reduce_scatter(out: torch.Tensor, full: torch.Tensor, op: str, async_op: bool):
    """A reduce-scatter over two gloo ranks as one exchange: each rank sends the other its half and
    receives the other's copy of its own half straight into ``out``, then adds its own.

    The same bytes as gloo's reduce-scatter, which measures slower than gloo's all-reduce of the whole
    tensor (on 2 ranks, 12 MB: 13 ms against 10; this path: 7 ms); no temporary; a + b is the same sum
    in either order, so the result is the reduce-scatter's to the bit.
    """
    me, k = rank(), out.numel()
    sizes = [0, k] if me == 0 else [k, 0]  # nothing to or from this rank itself
    with _named("reduce_scatter", _nbytes(full)) as started:
        work = dist.all_to_all_single(out, full[(1 - me) * k : (2 - me) * k], sizes, sizes, async_op=True)

    def add_own(r: torch.Tensor) -> None:
        r.add_(full[me * k : (me + 1) * k])
        if op == "mean":
            r.div_(2)

    h = Handle(work, out, add_own, "reduce_scatter", _nbytes(full), started)
    return h if async_op else h.wait()


def all_gather(full: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False):
    """Gather every rank's ``shard`` into ``full`` (rank r's at ``[r * k:(r + 1) * k]``).

    ``shard`` may be this rank's own slice of ``full`` (in place, no
    temporary): NCCL documents it, and gloo copies the input into place
    first (``tests/test_collectives.py`` checks it). Counts bytes(full).
    """
    n = _check_split("all_gather", full, shard)
    if n == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return _done(full) if async_op else full
    _count("all_gather", _nbytes(full))
    with _named("all_gather", _nbytes(full)) as started:
        work = _all_gather_single(full, shard, async_op=True)
    h = Handle(work, full, None, "all_gather", _nbytes(full), started)
    return h if async_op else h.wait()


def barrier() -> None:
    """Wait until every rank reached its ``barrier()``."""
    if world_size() > 1:
        with _named("barrier"):
            dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (rank order); for error messages, not data."""
    n = world_size()
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    with _named("gather_objects"):
        dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    with _named("broadcast_object"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


# ---------------------------------------------------------------- tree collectives


def _check_same_tree(where: str, tree: Any) -> None:
    """In debug mode (ZEROFN_DEBUG=1), compare tree digests across ranks first.

    Ranks that disagree on a tree's structure would otherwise hang inside
    the collective; here they fail together with both structures shown.
    """
    if os.environ.get("ZEROFN_DEBUG", "0") in ("", "0") or world_size() == 1:
        return
    mine = (T.treespec_digest(tree), str(T.tree_structure(tree)))
    everyone = gather_objects(mine)
    if len({d for d, _ in everyone}) > 1:
        lines = "\n".join(f"  rank {r}: {s}" for r, (_, s) in enumerate(everyone))
        raise ValueError(f"{where}: ranks disagree on the tree's structure, shapes or dtypes:\n{lines}")


def all_reduce_tree(tree: Any, op: str = "sum") -> Any:
    """``all_reduce`` every tensor leaf of ``tree`` in place; returns ``tree``."""
    _check_same_tree("all_reduce_tree", tree)
    handles = [all_reduce(t, op, async_op=True) for t in T.tree_leaves(tree)]
    for h in handles:
        h.wait()
    return tree


def reduce_scatter_tree(outs: Any, fulls: Any, op: str = "sum") -> Any:
    """``reduce_scatter`` leaf by leaf from ``fulls`` into ``outs``; returns ``outs``."""
    _check_same_tree("reduce_scatter_tree", fulls)
    handles = [reduce_scatter(o, f, op, async_op=True) for o, f in zip(T.tree_leaves(outs), T.tree_leaves(fulls))]
    for h in handles:
        h.wait()
    return outs


def all_gather_tree(fulls: Any, shards: Any) -> Any:
    """``all_gather`` leaf by leaf from ``shards`` into ``fulls``; returns ``fulls``."""
    _check_same_tree("all_gather_tree", shards)
    handles = [all_gather(f, s, async_op=True) for f, s in zip(T.tree_leaves(fulls), T.tree_leaves(shards))]
    for h in handles:
        h.wait()
    return fulls
