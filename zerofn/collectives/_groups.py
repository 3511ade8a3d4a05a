"""Process groups: joining and leaving, membership, the current group, rank and size, the control group.

:func:`init` joins the default group under torchrun (and ``_leave`` leaves
it at exit); :func:`new_group` makes a subgroup with zerofn's timeout, and
a :class:`NonMember` on the ranks outside it; :func:`set_group_timeout`
bounds a group's later collectives. :func:`group_scope` makes a group
current (a ``contextvars`` variable) and :func:`with_current_group` carries
it to another thread; :func:`joined` is the group a collective runs on.
:func:`rank`, :func:`world_size` and :func:`data_rank` are this rank's
place in a group. :func:`control_group` is the second gloo group over a
group's ranks that small checks travel on.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from zerofn.collectives._errors import JOIN, translate
from zerofn.collectives._timeouts import DEFAULT_GROUP, TIMEOUTS, group_key, is_default, timeout_s

# ---------------------------------------------------------------- process group


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def set_group_timeout(seconds: float | None = None, *, group: Any = None) -> float:
    """Bound every later collective of ``group`` (default: the current group) by ``seconds``
    (default :func:`timeout_s`).

    ``zf.spawn``'s ranks join with the generous start timeout (interpreters
    start unevenly) and then call this.
    """
    seconds = timeout_s() if seconds is None else seconds
    from torch.distributed.distributed_c10d import _set_pg_timeout

    g = _group(group, "set_group_timeout")
    _set_pg_timeout(datetime.timedelta(seconds=seconds), None if is_default(g) else g)
    control = _CONTROL.get(group_key(g)) if _CONTROL_WORLD[0] is dist.group.WORLD else None
    if control is not None:
        _set_pg_timeout(datetime.timedelta(seconds=seconds), control)
    TIMEOUTS[group_key(g)] = seconds
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
        new = translate(err, JOIN, start, rank=rank, world=world, limit=seconds)
        if new is None:
            raise
        raise new from err
    TIMEOUTS[DEFAULT_GROUP] = seconds
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
    TIMEOUTS.clear()
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


def describe(group: Any) -> str:
    """The group, for messages: its global ranks."""
    if is_default(group):
        return "the default group"
    if isinstance(group, NonMember):
        return f"the group of ranks {group.ranks}"
    try:
        return f"the group of ranks {dist.get_process_group_ranks(group)}"
    except Exception:  # not registered (made by another process group's world)
        return f"the group {group!r}"


def member(group: Any, what: str) -> Any:
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
        return member(group, what)
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
        f"{what} ran on thread {here.name!r} outside any zf.collectives.group_scope while {describe(group)} is "
        f"the current group of thread {thread.name!r}: it would have run on the default group instead. A "
        "thread does not inherit the group of the code that started it (contextvars stay with their thread): "
        "wrap what the thread runs where it is launched, pool.submit(zf.collectives.with_current_group(fn)), "
        "or pass group= explicitly (group=torch.distributed.group.WORLD for the default group)."
    )


def joined(group: Any, what: str) -> Any:
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
        self.group = None if group is None else member(group, "group_scope")
        self._token = self._entry = None

    def __enter__(self) -> Any:
        if self.group is None:
            return current_group()
        self._token = _CURRENT.set(self.group)
        if not is_default(self.group):
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
    g = _CURRENT.get() if group is None else member(group, "with_current_group")
    if g is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # not a call of its own in error messages (see _errors._where)
        if _CURRENT.get() is g:  # run where it was made (autograd's CPU backward, a gradient hook's): in it now
            return fn(*args, **kwargs)
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
    timeout = datetime.timedelta(seconds=seconds)
    g = dist.new_group(members, timeout=timeout, backend=backend)
    # its control group now, while every rank takes part (see control_group)
    control = dist.new_group(members, timeout=timeout, backend="gloo")
    if isinstance(g, int) and g == _NON_MEMBER:
        return NonMember(members)
    TIMEOUTS[g] = seconds
    _controls()[group_key(g)] = control
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


# ---------------------------------------------------------------- a group without one of its axes

# (the group's key, an axis or a sorted tuple of axes) -> this rank's group over the group's ranks that share
# its coordinate on that axis (those axes): registered by the step when its group spans an axis whose ranks
# hold different pieces of some parameters (expert parallelism's experts) or replicas of every shard (hybrid
# sharding's dp_replicate), read by the buckets of those parameters.
_WITHOUT: dict = {}
# (the group's key, an axis) -> this rank's group over the group's ranks that share its coordinates on every
# axis but that one: the line across it (hybrid sharding's replicas of one shard).
_ALONG: dict = {}


def _axes_key(axis: str | tuple[str, ...]) -> str | tuple[str, ...]:
    return axis if isinstance(axis, str) else tuple(sorted(axis))


def set_without(group: Any, axis: str | tuple[str, ...], subgroup: Any) -> None:
    """Record ``subgroup`` as :func:`without` ``(axis)`` of ``group``: the ranks of ``group`` that share this
    rank's coordinate on ``axis`` (on each of several axes, given as a tuple); the step does, for its group."""
    _WITHOUT[(group_key(group), _axes_key(axis))] = subgroup


def set_along(group: Any, axis: str, line: Any) -> None:
    """Record ``line`` as :func:`along` ``(axis)`` of ``group`` (the step does, for its group)."""
    _ALONG[(group_key(group), axis)] = line


def without(axis: str | tuple[str, ...], group: Any = None) -> Any:
    """The ranks of ``group`` (default: the current group) that share this rank's coordinate on the mesh axis
    ``axis`` (or on each of a tuple of axes): the group over which the parameters cut along ``axis`` are
    reduced and sharded (expert parallelism's experts: the ranks that hold the same experts, DeepSpeed's
    expert-data-parallel group), or over which hybrid sharding shards every bucket (``dp_replicate``: the
    ranks of one replica). The group itself where it is one rank; None where there is no group (one process).

    Raises:
        ValueError: no such group was made for ``group`` (a step whose group spans ``axis`` makes it).
    """
    g = _group(group, "without")
    if g is None or g.size() == 1:  # one rank: it is all there is
        return g
    key = (group_key(g), _axes_key(axis))
    if key not in _WITHOUT:
        raise ValueError(
            f"zerofn.collectives.without({axis!r}): the current group spans no mesh axis {axis!r} whose ranks "
            "hold different pieces of a parameter; run it inside the step whose group does (a step on a mesh "
            f"with a claim on {axis!r} makes it)"
        )
    return _WITHOUT[key]


def along(axis: str, group: Any = None) -> Any:
    """The ranks of ``group`` (default: the current group) that share this rank's coordinates on every mesh
    axis but ``axis``: the line across it, over which hybrid sharding sums each shard's gradient across the
    replicas (``dp_replicate``). None where there is no group (one process) or it is one rank.

    Raises:
        ValueError: no such group was made for ``group`` (a step whose group spans ``axis`` makes it).
    """
    g = _group(group, "along")
    if g is None or g.size() == 1:
        return None
    key = (group_key(g), axis)
    if key not in _ALONG:
        raise ValueError(
            f"zerofn.collectives.along({axis!r}): the current group spans no mesh axis {axis!r} across which "
            f"its shards are replicated; run it inside the step whose group does (a step sharded with "
            f"replicate= makes it)"
        )
    return _ALONG[key]


def data_rank(step: Any = None) -> int:
    """The data-parallel rank of this process for ``step``: which micro-batch it feeds.

    A step laid out on a mesh (``step.mesh``, once a parallelism claims an axis) reads it there: the rank's
    place on the mesh's data-parallel axes, so that the ranks of one tensor-parallel group (or any group
    of ranks that split one model) feed the same micro-batch, and on the axes of parallelisms whose ranks
    feed micro-batches of their own (expert parallelism's ``ep``), row-major in the mesh's order. Otherwise
    ``step`` runs on a group (``step.group``: the world by default); its rank there. Without a step, the rank in the current group.

    Example:
        >>> import zerofn as zf
        >>> zf.collectives.data_rank()  # one process
        0
    """
    mesh = getattr(step, "mesh", None)
    if mesh is None:
        return rank(getattr(step, "group", None))
    feeding = [c.axis for c in getattr(step, "claims", ()) if getattr(c, "feeds", False) and c.axis in mesh.axes]
    if not feeding:
        return mesh.data_rank
    # axes whose ranks feed micro-batches of their own (expert parallelism's ep) count as data-parallel too:
    # this rank's place in the data-parallel axes and those, row-major in the mesh's order
    out = 0
    for axis in mesh.axes:
        if axis in ("dp_replicate", "dp_shard") or axis in feeding:
            out = out * mesh.size(axis) + mesh.coordinate(axis)
    return out


# ---------------------------------------------------------------- the control group

_CONTROL: dict = {}  # group_key(group) -> its control group
_CONTROL_WORLD: list = [None]  # the default group _CONTROL's groups were made in


def _controls() -> dict:
    """``_CONTROL``, emptied first where the default group was made anew since its groups were made."""
    world = dist.group.WORLD
    if _CONTROL_WORLD[0] is not world:
        _CONTROL.clear()
        _CONTROL_WORLD[0] = world
    return _CONTROL


def control_group(group: Any):
    """A second gloo group over ``group``'s ranks, for small checks that must not queue behind the data.

    Collectives on one group run in the order they were issued: a check at
    the start of a step would otherwise wait for the previous step's
    parameter all-gathers, which are meant to overlap the forward.

    A group from :func:`new_group` (every group of a step's mesh) has had
    its control group since it was made, by every rank together, as torch
    numbers the groups the whole world makes. The default group's is made
    on its first use, which every rank reaches together (a collective
    call). Another group's (one from ``dist.new_group``) is made on its
    first use by its ranks only (``use_local_synchronization``): torch names
    such a group from its ranks and the number of groups each of them holds,
    so its ranks must hold as many groups when they make it; a group made
    with :func:`new_group` has no such condition.
    """
    controls = _controls()
    key = group_key(group)
    if key not in controls:
        seconds = TIMEOUTS.get(key) or timeout_s()
        world = key is DEFAULT_GROUP or group.size() == dist.get_world_size()
        ranks = list(range(dist.get_world_size())) if key is DEFAULT_GROUP else dist.get_process_group_ranks(group)
        controls[key] = dist.new_group(
            ranks, backend="gloo", timeout=datetime.timedelta(seconds=seconds), use_local_synchronization=not world
        )
    return controls[key]
