"""The one module that talks to torch.distributed, and the byte accounting.

Every collective here is the identity at world size 1 with no process group,
so a single-process reference costs nothing. Under torchrun the default
process group is joined by :func:`init` (``step.init`` calls it, and so does
the first collective), from the environment torchrun sets: gloo for CPU
tensors, nccl when CUDA is present; ``zf.spawn`` and ``zf.RankPool`` ranks
have joined when they start. Asking :func:`rank` or :func:`world_size` joins
nothing: before the join they read torchrun's ``RANK`` and ``WORLD_SIZE``.

Every function takes ``group=``, a torch ``ProcessGroup``; the default is the
*current group*: the one :func:`group_scope` made current around the call
(a ``contextvars`` variable, so it holds per thread and per asyncio task),
else the default group. :func:`rank` and :func:`world_size` are this rank's
place and the size within it; the small CPU messages go on a gloo group of
its own over the same ranks (made on its first use, only by its members),
:func:`counting` counts the current group's traffic, and timeouts are the
group's. A thread started inside a scope does not inherit it: wrap the
function it runs with :func:`with_current_group` where it is launched.

Every wait on another rank is bounded by ``ZEROFN_TIMEOUT_S`` seconds
(default 600), read when the group is created: under torchrun by
:func:`init`, under ``zf.spawn`` and ``zf.RankPool`` in each rank as it
starts, for a subgroup by :func:`new_group` (one from ``dist.new_group``
keeps the timeout given there). A collective
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
import contextvars
import datetime
import os
import re
import sys
import threading
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
    "NonMember",
    "all_gather",
    "all_gather_tree",
    "all_reduce",
    "all_reduce_tree",
    "any_of",
    "barrier",
    "broadcast_object",
    "counting",
    "current_group",
    "data_rank",
    "ensure_initialized",
    "gather_objects",
    "group_scope",
    "init",
    "max_min",
    "new_group",
    "rank",
    "reduce_scatter",
    "reduce_scatter_tree",
    "set_group_timeout",
    "timeout_s",
    "with_current_group",
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

    Read from the environment when a process group is created (so set it
    before :func:`init`, ``step.init`` or the first collective, or before
    ``zf.spawn``/``zf.RankPool``, whose ranks inherit the caller's
    environment).
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


# The timeout each group was given (what a timed-out collective reports), by _key: the default group's
# from init or set_group_timeout, a subgroup's from new_group or set_group_timeout.
_TIMEOUTS: dict = {}


class _Default:
    """The key of the default group in this module's tables, whether or not it is joined yet."""

    def __repr__(self) -> str:
        return "the default group"


_DEFAULT = _Default()


def _key(group: Any) -> Any:
    return _DEFAULT if group is None or group is dist.group.WORLD else group


def _is_default(group: Any) -> bool:
    return _key(group) is _DEFAULT


def set_group_timeout(seconds: float | None = None, *, group: Any = None) -> float:
    """Bound every later collective of ``group`` (default: the current group) by ``seconds``
    (default :func:`timeout_s`).

    ``zf.spawn``'s ranks join with the generous start timeout (interpreters
    start unevenly) and then call this.
    """
    seconds = timeout_s() if seconds is None else seconds
    from torch.distributed.distributed_c10d import _set_pg_timeout

    g = _group(group, "set_group_timeout")
    _set_pg_timeout(datetime.timedelta(seconds=seconds), None if _is_default(g) else g)
    control = _CONTROL.get(_key(g)) if _CONTROL_WORLD[0] is dist.group.WORLD else None
    if control is not None:
        _set_pg_timeout(datetime.timedelta(seconds=seconds), control)
    _TIMEOUTS[_key(g)] = seconds
    return seconds


def init(backend: str | None = None) -> bool:
    """Join the default process group if the environment asks for one; True when a process group is active.

    Under torchrun (``WORLD_SIZE`` > 1 in the environment) this joins the
    default group once: ``backend`` (default: nccl for CUDA tensors and gloo
    for CPU ones when CUDA is available, gloo otherwise), with
    :func:`timeout_s` bounding both the join and every collective. Joined
    already (``zf.spawn``'s ranks, your own ``init_process_group``), or
    outside torchrun, it does nothing. ``step.init`` calls it, and so does a
    collective on the default group before the join; :func:`rank` and
    :func:`world_size` do not.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if _env_world_size() <= 1:
        return False
    seconds = timeout_s()
    cuda = torch.cuda.is_available()
    if backend is None:  # on GPUs, CPU tensors (the small agreement checks and statistics) travel over gloo
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
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
    _TIMEOUTS[_DEFAULT] = seconds
    atexit.register(_leave)
    return True


def ensure_initialized() -> bool:
    """The former name of :func:`init` (with its default backend)."""
    return init()


def _leave() -> None:
    """At exit, leave the group that :func:`init` joined, while Python is still whole.

    Otherwise gloo's threads may drop their last collective's tensors after
    the interpreter began to shut down, need the GIL, not get it, and abort
    the process ("terminate called without an active exception", exit code
    -6) now and then, after a run that succeeded.
    """
    _CONTROL.clear()
    _TIMEOUTS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------- the current group

# The group that group_scope made current here; None: none, the default group is.
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("zerofn_group", default=None)
# Scopes of a group other than the default one now open on some thread: (thread, group) entries.
_OPEN: list = []
_NON_MEMBER = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", -100)
_PROCESS_GROUP = getattr(dist, "ProcessGroup", ())


class NonMember:
    """What :func:`new_group` returns on a rank outside ``ranks``; a call given it raises, naming ``ranks``.

    torch's ``dist.new_group`` returns ``GroupMember.NON_GROUP_MEMBER``
    there, which says nothing of the group.
    """

    __slots__ = ("ranks",)

    def __init__(self, ranks: list[int]):
        self.ranks = list(ranks)

    def __repr__(self) -> str:
        return f"NonMember(ranks={self.ranks})"


def _describe(group: Any) -> str:
    """The group, for messages: its global ranks."""
    if _is_default(group):
        return "the default group"
    if isinstance(group, NonMember):
        return f"the group of ranks {group.ranks}"
    try:
        return f"the group of ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # not registered (made by another process group's world)
        return f"the group {group!r}"


def _member(group: Any, what: str) -> Any:
    """``group`` itself once checked to be a process group this rank is in."""
    if isinstance(group, _PROCESS_GROUP):
        return group
    if isinstance(group, NonMember) or (isinstance(group, int) and group == _NON_MEMBER):
        which = (
            f"the group of ranks {group.ranks}"
            if isinstance(group, NonMember)
            else "GroupMember.NON_GROUP_MEMBER (what dist.new_group returns on the ranks outside the group)"
        )
        here = dist.get_rank() if dist.is_available() and dist.is_initialized() else os.environ.get("RANK", "?")
        raise ValueError(
            f"{what}: rank {here} is not in {which}: a group's collectives run on its members only. Call it (and "
            "enter group_scope, or build a step with group=) only on the ranks in the group: give each rank its "
            "own group, for example mine = zf.collectives.new_group([0, 1]) and "
            "theirs = zf.collectives.new_group([2, 3]) on every rank, then group = mine if rank < 2 else theirs."
        )
    raise TypeError(
        f"{what}: group must be a torch.distributed ProcessGroup (from dist.new_group or "
        f"zf.collectives.new_group) or None for the current group, got {type(group).__name__} {group!r}."
    )


def _group(group: Any, what: str) -> Any:
    """The process group a call ``what`` runs on: ``group``, else the current one; None when there is none
    (nothing joined: one process, or torchrun's ranks before :func:`init`)."""
    if group is not None:
        return _member(group, what)
    group = _CURRENT.get()
    if group is not None:
        return group
    if _OPEN:
        _check_thread(what)
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _check_thread(what: str) -> None:
    """A thread other than the main one, outside any scope while a subgroup's scope is open elsewhere, would
    run on the default group instead of the one its work was launched in: raise rather than mix the groups."""
    here = threading.current_thread()
    if here is threading.main_thread():
        return
    opened = [(t, g) for t, g in list(_OPEN) if t is not here]
    if not opened:
        return
    thread, group = opened[-1]
    raise RuntimeError(
        f"{what} ran on thread {here.name!r} outside any zf.collectives.group_scope while {_describe(group)} is "
        f"the current group of thread {thread.name!r}: it would have run on the default group instead. A "
        "thread does not inherit the group of the code that started it (contextvars stay with their thread): "
        "wrap what the thread runs where it is launched, pool.submit(zf.collectives.with_current_group(fn)), "
        "or pass group= explicitly (group=torch.distributed.group.WORLD for the default group)."
    )


def _joined(group: Any, what: str) -> Any:
    """:func:`_group` for a collective: under torchrun the default group is joined first (:func:`init`)."""
    g = _group(group, what)
    if g is None and _env_world_size() > 1 and init():
        g = dist.group.WORLD
    return g


def current_group() -> Any:
    """The group collectives use here: the innermost :func:`group_scope`'s, else the default group
    (``torch.distributed.group.WORLD``; None while nothing is joined)."""
    group = _CURRENT.get()
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class group_scope:  # noqa: N801 - a context manager, named as a function
    """Make ``group`` the current group inside the block: every call of this module (and every step method,
    checkpoint and tool built on it) without ``group=`` runs on it, :func:`rank` and :func:`world_size`
    are this rank's place and the size within it.

    ``group``: a torch ``ProcessGroup`` this rank is in (``dist.new_group``,
    :func:`new_group`, ``dist.new_subgroups_by_enumeration``); None leaves
    the current group as it is. Scopes nest; the value is a
    ``contextvars`` variable, so it holds in this thread (and asyncio task)
    only: see :func:`with_current_group` for work handed to other threads.

    Example:
        >>> import zerofn as zf
        >>> with zf.collectives.group_scope(None) as g:   # one process: no group, rank 0 of 1
        ...     g, zf.collectives.rank(), zf.collectives.world_size()
        (None, 0, 1)
    """

    __slots__ = ("group", "_token", "_entry")

    def __init__(self, group: Any):
        self.group = None if group is None else _member(group, "group_scope")
        self._token = self._entry = None

    def __enter__(self) -> Any:
        if self.group is None:
            return current_group()
        self._token = _CURRENT.set(self.group)
        if not _is_default(self.group):
            self._entry = (threading.current_thread(), self.group)
            _OPEN.append(self._entry)
        return self.group

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        if self._entry is not None:
            with contextlib.suppress(ValueError):
                _OPEN.remove(self._entry)
            self._entry = None


def with_current_group(fn: Any, group: Any = None) -> Any:
    """``fn``, to run in ``group`` (default: the group current here, now) on whatever thread runs it.

    A thread does not inherit the current group (``contextvars`` stay with
    their thread): wrap what you hand to a thread pool or register as a
    gradient hook (autograd runs CUDA backward on threads of its own) where
    you launch it. Outside any scope this returns ``fn`` itself.
    """
    g = _CURRENT.get() if group is None else _member(group, "with_current_group")
    if g is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # not a call of its own in error messages (see _where)
        with group_scope(g):
            return fn(*args, **kwargs)

    return run


def new_group(ranks: list[int], *, backend: str | None = None, timeout_s: float | None = None) -> Any:
    """A process group over the global ``ranks``, for ``group=`` and :func:`group_scope`.

    torch's ``dist.new_group`` with zerofn's timeout (``timeout_s``, default
    ``ZEROFN_TIMEOUT_S``, which its timeout errors then quote) and the
    default group's backend unless ``backend``. As ``dist.new_group``, it is
    collective over the whole world: every rank calls it, members or not,
    and every rank creates its groups in the same order. On a rank outside
    ``ranks`` it returns a :class:`NonMember`, which zerofn's calls reject
    with an error naming the group's ranks and this rank.
    """
    if not init():
        raise RuntimeError(
            f"new_group({list(ranks)}): no process group is joined and this is not a torchrun rank "
            "(WORLD_SIZE is not set above 1). Run under torchrun, zf.spawn or zf.RankPool, or join with "
            "torch.distributed.init_process_group first."
        )
    seconds = _timeout_env() if timeout_s is None else float(timeout_s)
    members = sorted(int(r) for r in ranks)
    g = dist.new_group(members, timeout=datetime.timedelta(seconds=seconds), backend=backend)
    if isinstance(g, int) and g == _NON_MEMBER:
        return NonMember(members)
    _TIMEOUTS[g] = seconds
    return g


_timeout_env = timeout_s  # new_group's keyword shadows the function


def world_size(group: Any = None) -> int:
    """Ranks in ``group`` (default: the current group); 1 when there is none.

    Before the default group is joined, torchrun's ``WORLD_SIZE`` (asking joins nothing).
    """
    g = _group(group, "world_size")
    if g is not None:
        return g.size()
    return max(_env_world_size(), 1)


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the current group); 0 when there is none.

    Before the default group is joined, torchrun's ``RANK`` (asking joins nothing).
    """
    g = _group(group, "rank")
    if g is not None:
        return g.rank()
    env = os.environ.get("RANK", "")
    return int(env) if env.isdigit() and _env_world_size() > 1 else 0


# ---------------------------------------------------------------- accounting


@dataclass(eq=False)  # compared by identity: counting() removes its own counter, not an equal one
class Counter:
    """Bytes this rank moved through collectives while it was active."""

    bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes += nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1


_counters: dict = {}  # _key(group) -> the counters open on it


@contextlib.contextmanager
def counting(group: Any = None, *, also: tuple = ()) -> Iterator[Counter]:
    """Count the collective traffic this rank issues on ``group`` (default: the current group) inside the
    block, from any thread (nests). Its small CPU messages (the control group's) count as its own.
    ``also``: more groups whose traffic counts in the same counter (a tensor-parallel group beside the
    data-parallel one a step runs on)."""
    keys_ = [_key(_CURRENT.get() if group is None else _member(group, "counting"))]
    keys_ += [_key(_member(g, "counting")) for g in also if g is not None and _key(g) not in keys_]
    c = Counter()
    for key in keys_:
        _counters.setdefault(key, []).append(c)
    try:
        yield c
    finally:
        for key in keys_:
            _counters[key].remove(c)
            if not _counters[key]:
                del _counters[key]


def _count(kind: str, nbytes: int, group: Any) -> None:
    for c in _counters.get(_key(group), ()):
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
def _named(kind: str, nbytes: int = 0, started: float | None = None, group: Any = None) -> Iterator[float]:
    """Issue or wait for collective ``kind`` on ``group`` inside: a backend timeout or lost peer becomes a
    :class:`CollectiveError` naming it. Yields the time it was issued (``started``, or now)."""
    started = time.monotonic() if started is None else started
    try:
        yield started
    except RuntimeError as err:
        _reraise(err, kind, nbytes, started, group)


def _reraise(err: RuntimeError, kind: str, nbytes: int, started: float, group: Any = None):
    """Raise ``err`` as a :class:`CollectiveError` naming the collective, or unchanged."""
    sub = not _is_default(group)
    try:
        rank, world = (group.rank(), group.size()) if sub else (dist.get_rank(), dist.get_world_size())
    except Exception:  # the group is gone as well
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    which = ""
    if sub:
        with contextlib.suppress(Exception):
            which = f" (in {_describe(group)}; global rank {dist.get_rank()})"
    what = f"{kind} ({nbytes:,} bytes)" if nbytes else kind
    new = _translate(
        err, what, started, rank=rank, world=world, limit=_TIMEOUTS.get(_key(group)), group=group, which=which
    )
    if new is None:
        raise err
    raise new from err


def _translate(
    err: RuntimeError,
    what: str,
    started: float,
    *,
    rank,
    world,
    limit: float | None,
    group: Any = None,
    which: str = "",
):
    """The :class:`CollectiveError` for a backend error ``err`` in collective ``what``;
    None when ``err`` is not a timeout or a lost connection (it then goes up unchanged).

    ``limit``: the group's timeout, None for a group zerofn did not create. ``group``: the group it ran
    on (None: the default one), which ``which`` describes after the rank and size.
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
    here = f"on rank {rank} of world size {world}{which} after {waited:.1f} s"
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
    try:
        backend = dist.get_backend(None if _is_default(group) else group) if dist.is_initialized() else None
    except Exception:  # the group is gone
        backend = None
    backend = backend or "torch.distributed"
    message += f" [{backend}: {type(err).__name__}: {first_line[:300]}]"
    if _first_failure is None:
        _first_failure = summary
    return cls(message, call=call, rank=rank, world_size=world, waited_s=waited)


def _where() -> str:
    """Which zerofn call the failing collective ran in, and where the user called it.

    The outermost frame of a zerofn module (the launch machinery aside) is
    the call (``Step.full_params``); the frame above it is the call site.
    A zerofn frame that hides itself from tracebacks (a local
    ``__tracebackhide__``, pytest's convention: a decorator's wrapper, such
    as the one that runs a step's method in its group) is neither.
    """
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        ours = module == "zerofn" or module.startswith("zerofn.")
        if not (ours and "__tracebackhide__" in frame.f_code.co_varnames):
            frames.append((frame, ours and not module.startswith("zerofn.launch")))
        frame = frame.f_back
    entry = caller = None
    for i, (frame, call) in enumerate(frames):
        if call:
            entry, caller = frame, frames[i + 1][0] if i + 1 < len(frames) else None
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

    __slots__ = ("_work", "_result", "_after", "_kind", "_nbytes", "_started", "_group")

    def __init__(
        self,
        work: Any,
        result: Any,
        after=None,
        kind: str = "collective",
        nbytes: int = 0,
        started: float = 0.0,
        group: Any = None,
    ):
        self._work, self._result, self._after = work, result, after
        self._kind, self._nbytes, self._started, self._group = kind, nbytes, started, group

    def wait(self) -> Any:
        if self._work is not None:
            with _named(self._kind, self._nbytes, self._started, self._group):
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


def _size(g: Any) -> int:
    return g.size() if g is not None else 1


def data_rank(step: Any = None) -> int:
    """The data-parallel rank of this process for ``step``: which micro-batch it feeds.

    ``step`` runs on a group (``step.group``: the world by default; its data-parallel group under
    ``tensor_parallel``, whose ranks ``t, t + size, ...`` make this the global rank ``// size``, so the
    ranks of one tensor-parallel group feed the same micro-batch); its rank there. Without a step, the rank
    in the current group.

    Example:
        >>> import zerofn as zf
        >>> zf.collectives.data_rank()  # one process
        0
    """
    return rank(getattr(step, "group", None))


def all_reduce(t: torch.Tensor, op: str = "sum", *, async_op: bool = False, control: bool = False, group: Any = None):
    """Reduce ``t`` in place across the ranks of ``group`` (default: the current group; ``op``: sum, mean,
    max, min; bor, bitwise or, for integer tensors on the control group).

    Returns ``t`` (or a Handle whose ``wait()`` returns it with ``async_op``).
    Counts 2 x bytes(t). ``control``: a small check on a CPU tensor, sent on
    a group of its own (:func:`_control_group`) so that it does not wait
    behind the data collectives issued before it.
    """
    g = _joined(group, "all_reduce")
    n = _size(g)
    if n == 1:
        return _done(t) if async_op else t
    _count("all_reduce", 2 * _nbytes(t), g)
    with _named("all_reduce", _nbytes(t), group=g) as started:
        work = dist.all_reduce(t, op=_reduce_op(op), async_op=True, group=_control_group(g) if control else g)
    after = (lambda r: r.div_(n)) if op == "mean" else None
    h = Handle(work, t, after, "all_reduce", _nbytes(t), started, g)
    return h if async_op else h.wait()


_CONTROL: dict = {}  # _key(group) -> its control group
_CONTROL_WORLD: list = [None]  # the default group _CONTROL's groups were made in


def _control_group(group: Any):
    """A second gloo group over ``group``'s ranks, for small checks that must not queue behind the data.

    Collectives on one group run in the order they were issued: a check at
    the start of a step would otherwise wait for the previous step's
    parameter all-gathers, which are meant to overlap the forward. Made on
    its first use, which every rank of ``group`` reaches together (a
    collective call), and by them only (``use_local_synchronization``: its
    name comes from its ranks, so the ranks outside it neither take part nor
    fall out of step in numbering the groups they make).
    """
    world = dist.group.WORLD
    if _CONTROL_WORLD[0] is not world:  # first use, or the default group was made anew
        _CONTROL.clear()
        _CONTROL_WORLD[0] = world
    key = _key(group)
    if key not in _CONTROL:
        seconds = _TIMEOUTS.get(key) or timeout_s()
        ranks = list(range(world.size())) if key is _DEFAULT else dist.get_process_group_ranks(group)
        _CONTROL[key] = dist.new_group(
            ranks, backend="gloo", timeout=datetime.timedelta(seconds=seconds), use_local_synchronization=True
        )
    return _CONTROL[key]


def any_of(flags: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The elementwise OR over the ranks of ``flags`` (a 1-D uint8 tensor of 0s and 1s), sent as bits:
    one all-reduce (bitwise OR) of ``ceil(n / 8)`` bytes on the control group. Returns a new uint8 tensor."""
    n = flags.numel()
    g = _joined(group, "any_of")
    if _size(g) == 1 or n == 0:
        return flags.clone()
    pad = (-n) % 8
    bits = torch.cat([flags.to(torch.uint8).cpu(), torch.zeros(pad, dtype=torch.uint8)]).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
    packed = (bits * weights).sum(1, dtype=torch.int64).to(torch.uint8)
    all_reduce(packed, "bor", control=True, group=g)
    unpacked = (packed.view(-1, 1) & weights).ne(0).to(torch.uint8).reshape(-1)
    return unpacked[:n]


def max_min(t: torch.Tensor, *, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise max and min of ``t`` over the ranks, in one all-reduce (of ``t`` and ``-t``).

    Equal max and min say that every rank holds the same values, which is how
    ranks check they agree before trusting each other. It travels on a group
    of its own (:func:`_control_group`), beside whatever data is in flight;
    ``t`` is moved to the CPU for it.
    """
    probe = torch.cat([t.reshape(-1), -t.reshape(-1)]).cpu()
    all_reduce(probe, "max", control=True, group=_joined(group, "max_min"))
    n = t.numel()
    return probe[:n].view_as(t), -probe[n:].view_as(t)


def _check_split(kind: str, full: torch.Tensor, part: torch.Tensor, n: int) -> None:
    """Check that ``full`` holds one ``part`` per rank (``n`` ranks)."""
    if full.numel() != n * part.numel():
        raise ValueError(
            f"{kind}: full tensor has {full.numel()} elements, expected world_size {n} x {part.numel()} "
            f"= {n * part.numel()}; pad the full tensor to a multiple of the world size"
        )


def reduce_scatter(
    out: torch.Tensor, full: torch.Tensor, op: str = "sum", *, async_op: bool = False, group: Any = None
):
    """Reduce ``full`` across the ranks of ``group`` (default: the current group) and keep this rank's
    ``1/N`` slice in ``out``.

    ``full.numel() == N * out.numel()``; rank r receives the reduction of
    ``full[r * k:(r + 1) * k]``. Counts bytes(full).
    """
    g = _joined(group, "reduce_scatter")
    n = _size(g)
    _check_split("reduce_scatter", full, out, n)
    if n == 1:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full)
        return _done(out) if async_op else out
    _count("reduce_scatter", _nbytes(full), g)
    if n == 2 and op in ("sum", "mean") and dist.get_backend(g) == "gloo" and not _overlap(out, full):
        return _pair_reduce_scatter(out, full, op, async_op, g)
    with _named("reduce_scatter", _nbytes(full), group=g) as started:
        work = _reduce_scatter_single(out, full, op=_reduce_op(op), async_op=True, group=g)
    after = (lambda r: r.div_(n)) if op == "mean" else None
    h = Handle(work, out, after, "reduce_scatter", _nbytes(full), started, g)
    return h if async_op else h.wait()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _pair_reduce_scatter(out: torch.Tensor, full: torch.Tensor, op: str, async_op: bool, g: Any):
    """A reduce-scatter over two gloo ranks as one exchange: each rank sends the other its half and
    receives the other's copy of its own half straight into ``out``, then adds its own.

    The same bytes as gloo's reduce-scatter, which measures slower than gloo's all-reduce of the whole
    tensor (on 2 ranks, 12 MB: 13 ms against 10; this path: 7 ms); no temporary; a + b is the same sum
    in either order, so the result is the reduce-scatter's to the bit.
    """
    me, k = g.rank(), out.numel()
    sizes = [0, k] if me == 0 else [k, 0]  # nothing to or from this rank itself
    with _named("reduce_scatter", _nbytes(full), group=g) as started:
        work = dist.all_to_all_single(out, full[(1 - me) * k : (2 - me) * k], sizes, sizes, group=g, async_op=True)

    def add_own(r: torch.Tensor) -> None:
        r.add_(full[me * k : (me + 1) * k])
        if op == "mean":
            r.div_(2)

    h = Handle(work, out, add_own, "reduce_scatter", _nbytes(full), started, g)
    return h if async_op else h.wait()


def all_gather(full: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False, group: Any = None):
    """Gather every rank's ``shard`` into ``full`` (rank r's at ``[r * k:(r + 1) * k]``), over the ranks of
    ``group`` (default: the current group).

    ``shard`` may be this rank's own slice of ``full`` (in place, no
    temporary): NCCL documents it, and gloo copies the input into place
    first (``tests/test_collectives.py`` checks it). Counts bytes(full).
    """
    g = _joined(group, "all_gather")
    n = _size(g)
    _check_split("all_gather", full, shard, n)
    if n == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return _done(full) if async_op else full
    _count("all_gather", _nbytes(full), g)
    with _named("all_gather", _nbytes(full), group=g) as started:
        work = _all_gather_single(full, shard, async_op=True, group=g)
    h = Handle(work, full, None, "all_gather", _nbytes(full), started, g)
    return h if async_op else h.wait()


def barrier(*, group: Any = None) -> None:
    """Wait until every rank of ``group`` (default: the current group) reached its ``barrier()``."""
    g = _joined(group, "barrier")
    if _size(g) > 1:
        with _named("barrier", group=g):
            dist.barrier(group=g)


def gather_objects(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` on every rank of ``group`` (default: the current group; in its rank order);
    for error messages, not data."""
    g = _joined(group, "gather_objects")
    n = _size(g)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    with _named("gather_objects", group=g):
        dist.all_gather_object(out, obj, group=g)
    return out


def broadcast_object(obj: Any, src: int = 0, *, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` (``src``: its rank in ``group``, default the current group) on every rank of it."""
    g = _joined(group, "broadcast_object")
    if _size(g) == 1:
        return obj
    box = [obj]
    with _named("broadcast_object", group=g):
        dist.broadcast_object_list(box, src=src if _is_default(g) else dist.get_global_rank(g, src), group=g)
    return box[0]


# ---------------------------------------------------------------- tree collectives


def _check_same_tree(where: str, tree: Any, group: Any) -> None:
    """In debug mode (ZEROFN_DEBUG=1), compare tree digests across ranks first.

    Ranks that disagree on a tree's structure would otherwise hang inside
    the collective; here they fail together with both structures shown.
    """
    if os.environ.get("ZEROFN_DEBUG", "0") in ("", "0") or _size(group) == 1:
        return
    mine = (T.treespec_digest(tree), str(T.tree_structure(tree)))
    everyone = gather_objects(mine, group=group)
    if len({d for d, _ in everyone}) > 1:
        lines = "\n".join(f"  rank {r}: {s}" for r, (_, s) in enumerate(everyone))
        raise ValueError(f"{where}: ranks disagree on the tree's structure, shapes or dtypes:\n{lines}")


def all_reduce_tree(tree: Any, op: str = "sum", *, group: Any = None) -> Any:
    """``all_reduce`` every tensor leaf of ``tree`` in place (over ``group``, default the current group);
    returns ``tree``."""
    g = _joined(group, "all_reduce_tree")
    _check_same_tree("all_reduce_tree", tree, g)
    handles = [all_reduce(t, op, async_op=True, group=g) for t in T.tree_leaves(tree)]
    for h in handles:
        h.wait()
    return tree


def reduce_scatter_tree(outs: Any, fulls: Any, op: str = "sum", *, group: Any = None) -> Any:
    """``reduce_scatter`` leaf by leaf from ``fulls`` into ``outs`` (over ``group``, default the current
    group); returns ``outs``."""
    g = _joined(group, "reduce_scatter_tree")
    _check_same_tree("reduce_scatter_tree", fulls, g)
    pairs = zip(T.tree_leaves(outs), T.tree_leaves(fulls))
    handles = [reduce_scatter(o, f, op, async_op=True, group=g) for o, f in pairs]
    for h in handles:
        h.wait()
    return outs


def all_gather_tree(fulls: Any, shards: Any, *, group: Any = None) -> Any:
    """``all_gather`` leaf by leaf from ``shards`` into ``fulls`` (over ``group``, default the current
    group); returns ``fulls``."""
    g = _joined(group, "all_gather_tree")
    _check_same_tree("all_gather_tree", shards, g)
    handles = [all_gather(f, s, async_op=True, group=g) for f, s in zip(T.tree_leaves(fulls), T.tree_leaves(shards))]
    for h in handles:
        h.wait()
    return fulls
