"""The one module that talks to torch.distributed, and the byte accounting.

Every collective here is the identity at world size 1 with no process group,
so a single-process reference costs nothing. Under torchrun (or ``zf.spawn``)
the default process group is created on first use from the environment
torchrun sets: gloo for CPU tensors, nccl when CUDA is present.

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

import contextlib
import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from zerofn import tree as T

__all__ = [
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
    "rank",
    "reduce_scatter",
    "reduce_scatter_tree",
    "world_size",
]

DEFAULT_TIMEOUT_S = float(os.environ.get("ZEROFN_TIMEOUT_S", "600"))

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---------------------------------------------------------------- process group


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def ensure_initialized() -> bool:
    """Join the default process group if the environment asks for one.

    Under torchrun (``WORLD_SIZE`` > 1 in the environment) this initialises
    the default group once: nccl when CUDA is available, gloo otherwise.
    Returns True when a process group is active.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if _env_world_size() <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    return True


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


# ---------------------------------------------------------------- handles


class Handle:
    """An in-flight collective; ``wait()`` returns its result."""

    __slots__ = ("_work", "_result", "_after")

    def __init__(self, work: Any, result: Any, after=None):
        self._work, self._result, self._after = work, result, after

    def wait(self) -> Any:
        if self._work is not None:
            self._work.wait()
            self._work = None
            if self._after is not None:
                self._after(self._result)
                self._after = None
        return self._result


def _done(result: Any) -> Handle:
    return Handle(None, result)


_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def _reduce_op(op: str):
    if op not in _OPS:
        raise ValueError(f"collective op {op!r} is not supported; expected one of {sorted(_OPS)}")
    return getattr(dist.ReduceOp, _OPS[op])


# ---------------------------------------------------------------- tensor collectives


def all_reduce(t: torch.Tensor, op: str = "sum", *, async_op: bool = False):
    """Reduce ``t`` in place across ranks (``op``: sum, mean, max, min).

    Returns ``t`` (or a Handle whose ``wait()`` returns it with ``async_op``).
    Counts 2 x bytes(t).
    """
    n = world_size()
    if n == 1:
        return _done(t) if async_op else t
    _count("all_reduce", 2 * _nbytes(t))
    work = dist.all_reduce(t, op=_reduce_op(op), async_op=True)
    after = (lambda r: r.div_(n)) if op == "mean" else None
    h = Handle(work, t, after)
    return h if async_op else h.wait()


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
    work = _reduce_scatter_single(out, full, op=_reduce_op(op), async_op=True)
    after = (lambda r: r.div_(n)) if op == "mean" else None
    h = Handle(work, out, after)
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
    work = _all_gather_single(full, shard, async_op=True)
    h = Handle(work, full)
    return h if async_op else h.wait()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (rank order); for error messages, not data."""
    n = world_size()
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
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
