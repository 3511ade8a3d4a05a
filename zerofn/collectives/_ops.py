"""The operations: tensor collectives, the small checks on the control group, objects, and trees.

:func:`all_reduce`, :func:`reduce_scatter` (as one exchange on two gloo
ranks), :func:`all_gather`, :func:`all_to_all` and :func:`ring_shift` on tensors; :func:`any_of` and
:func:`max_min`, small agreement checks that travel on the control group;
:func:`barrier`, :func:`gather_objects` and :func:`broadcast_object`; and
the same three tensor collectives leaf by leaf over trees. Each is the
identity at world size 1, runs on the current group unless given
``group=``, counts its bytes (``_accounting``: an all-reduce of n bytes
counts 2n, a reduce-scatter or all-gather of a full tensor of n bytes
counts n) and names itself when it fails (``_handle.named``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from zerofn import tree as T
from zerofn.collectives._accounting import count, tensor_bytes
from zerofn.collectives._groups import control_group, joined
from zerofn.collectives._handle import Handle, done, named
from zerofn.collectives._timeouts import is_default

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN", "bor": "BOR"}


def _reduce_op(op: str):
    if op not in _OPS:
        raise ValueError(f"collective op {op!r} is not supported; expected one of {sorted(_OPS)}")
    return getattr(dist.ReduceOp, _OPS[op])


# ---------------------------------------------------------------- tensor collectives


def _size(g: Any) -> int:
    return g.size() if g is not None else 1


def all_reduce(t: torch.Tensor, op: str = "sum", *, async_op: bool = False, control: bool = False, group: Any = None):
    """Reduce ``t`` in place across the ranks of ``group`` (default: the current group; ``op``: sum, mean,
    max, min; bor, bitwise or, for integer tensors on the control group).

    Returns ``t`` (or a Handle whose ``wait()`` returns it with ``async_op``).
    Counts 2 x bytes(t). ``control``: a small check on a CPU tensor, sent on
    a group of its own (:func:`control_group`) so that it does not wait
    behind the data collectives issued before it.
    """
    g = joined(group, "all_reduce")
    n = _size(g)
    if n == 1:
        return done(t) if async_op else t
    count("all_reduce", 2 * tensor_bytes(t), g)
    with named("all_reduce", tensor_bytes(t), group=g) as started:
        work = dist.all_reduce(t, op=_reduce_op(op), async_op=True, group=control_group(g) if control else g)
    after = (lambda r: r.div_(n)) if op == "mean" else None
    h = Handle(work, t, after, "all_reduce", tensor_bytes(t), started, g)
    return h if async_op else h.wait()


def any_of(flags: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """The elementwise OR over the ranks of ``flags`` (a 1-D uint8 tensor of 0s and 1s), sent as bits:
    one all-reduce (bitwise OR) of ``ceil(n / 8)`` bytes on the control group. Returns a new uint8 tensor."""
    n = flags.numel()
    g = joined(group, "any_of")
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
    of its own (:func:`control_group`), beside whatever data is in flight;
    ``t`` is moved to the CPU for it.
    """
    probe = torch.cat([t.reshape(-1), -t.reshape(-1)]).cpu()
    all_reduce(probe, "max", control=True, group=joined(group, "max_min"))
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
    g = joined(group, "reduce_scatter")
    n = _size(g)
    _check_split("reduce_scatter", full, out, n)
    if n == 1:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full)
        return done(out) if async_op else out
    count("reduce_scatter", tensor_bytes(full), g)
    if n == 2 and op in ("sum", "mean") and dist.get_backend(g) == "gloo" and not _overlap(out, full):
        return _pair_reduce_scatter(out, full, op, async_op, g)
    with named("reduce_scatter", tensor_bytes(full), group=g) as started:
        work = _reduce_scatter_single(out, full, op=_reduce_op(op), async_op=True, group=g)
    after = (lambda r: r.div_(n)) if op == "mean" else None
    h = Handle(work, out, after, "reduce_scatter", tensor_bytes(full), started, g)
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
    with named("reduce_scatter", tensor_bytes(full), group=g) as started:
        work = dist.all_to_all_single(out, full[(1 - me) * k : (2 - me) * k], sizes, sizes, group=g, async_op=True)

    def add_own(r: torch.Tensor) -> None:
        r.add_(full[me * k : (me + 1) * k])
        if op == "mean":
            r.div_(2)

    h = Handle(work, out, add_own, "reduce_scatter", tensor_bytes(full), started, g)
    return h if async_op else h.wait()


def all_gather(full: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False, group: Any = None):
    """Gather every rank's ``shard`` into ``full`` (rank r's at ``[r * k:(r + 1) * k]``), over the ranks of
    ``group`` (default: the current group).

    ``shard`` may be this rank's own slice of ``full`` (in place, no
    temporary): NCCL documents it, and gloo copies the input into place
    first (``tests/core/test_collectives.py`` checks it). Counts bytes(full).
    """
    g = joined(group, "all_gather")
    n = _size(g)
    _check_split("all_gather", full, shard, n)
    if n == 1:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard)
        return done(full) if async_op else full
    count("all_gather", tensor_bytes(full), g)
    with named("all_gather", tensor_bytes(full), group=g) as started:
        work = _all_gather_single(full, shard, async_op=True, group=g)
    h = Handle(work, full, None, "all_gather", tensor_bytes(full), started, g)
    return h if async_op else h.wait()


def all_to_all(
    out: torch.Tensor,
    inp: torch.Tensor,
    *,
    out_splits: list[int] | None = None,
    in_splits: list[int] | None = None,
    async_op: bool = False,
    group: Any = None,
):
    """Send ``inp``'s ``j``-th of N blocks along dim 0 to rank ``j`` of ``group`` (default: the current group)
    and receive rank ``j``'s block for this rank into ``out``'s ``j``-th (this rank is ``r``).

    Without splits the blocks are equal: ``out`` and ``inp`` have the same shape, dim 0 a multiple of N (the
    exchange context parallelism's Ulysses makes between sequence slices and head slices). With
    ``in_splits`` and ``out_splits`` (N row counts each, summing to ``inp``'s and ``out``'s dim 0; the other
    dims equal) the blocks are as long as they say, any of them empty: expert parallelism's token dispatch,
    whose sizes the ranks exchanged first. Counts bytes(inp), what this rank sends (its own block included,
    as the all-gather counts its own shard).
    """
    g = joined(group, "all_to_all")
    n = _size(g)
    if in_splits is None and out_splits is None:
        if out.shape != inp.shape or inp.shape[0] % n:
            raise ValueError(
                f"all_to_all: out {list(out.shape)} and inp {list(inp.shape)} must have one shape whose dim 0 is a "
                f"multiple of the {n} ranks (one block per rank); pad dim 0 to a multiple of {n}"
            )
    elif (
        in_splits is None
        or out_splits is None
        or len(in_splits) != n
        or len(out_splits) != n
        or sum(in_splits) != inp.shape[0]
        or sum(out_splits) != out.shape[0]
        or out.shape[1:] != inp.shape[1:]
    ):
        raise ValueError(
            f"all_to_all: in_splits {in_splits} and out_splits {out_splits} must be given together, {n} row "
            f"counts each (one per rank), summing to inp's {inp.shape[0]} and out's {out.shape[0]} rows, with "
            f"the other dims equal (inp {list(inp.shape)}, out {list(out.shape)})"
        )
    if n == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return done(out) if async_op else out
    count("all_to_all", tensor_bytes(inp), g)
    with named("all_to_all", tensor_bytes(inp), group=g) as started:
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=g, async_op=True)
    h = Handle(work, out, None, "all_to_all", tensor_bytes(inp), started, g)
    return h if async_op else h.wait()


def ring_shift(recv: torch.Tensor, send: torch.Tensor, *, shift: int = 1, async_op: bool = False, group: Any = None):
    """Send ``send`` to the rank ``shift`` places after this one in ``group`` (default: the current group;
    around the ring) and receive the tensor of the rank ``shift`` places before it into ``recv``.

    One exchange (an all-to-all whose other blocks are empty), so a ring of any size is one collective on
    gloo and NCCL alike: ring attention passes key/value blocks this way. ``recv`` and ``send`` have one
    shape and must not share memory. Counts bytes(send).
    """
    g = joined(group, "ring_shift")
    n = _size(g)
    if recv.shape != send.shape or recv.dtype != send.dtype:
        raise ValueError(
            f"ring_shift: recv {list(recv.shape)} {recv.dtype} and send {list(send.shape)} {send.dtype} must have "
            "one shape and dtype (every rank passes a block of the same size)"
        )
    if n == 1 or shift % n == 0:
        recv.copy_(send)
        return done(recv) if async_op else recv
    if _overlap(recv, send):
        raise ValueError("ring_shift: recv and send share memory; receive into a buffer of its own")
    me, k = g.rank(), send.numel()
    to, frm = (me + shift) % n, (me - shift) % n
    ins = [k if j == to else 0 for j in range(n)]
    outs = [k if j == frm else 0 for j in range(n)]
    count("ring_shift", tensor_bytes(send), g)
    with named("ring_shift", tensor_bytes(send), group=g) as started:
        work = dist.all_to_all_single(recv.view(-1), send.reshape(-1), outs, ins, group=g, async_op=True)
    h = Handle(work, recv, None, "ring_shift", tensor_bytes(send), started, g)
    return h if async_op else h.wait()


def _peer(g: Any, peer: int) -> int:
    """The global rank of ``peer``, a rank of ``g``."""
    return peer if is_default(g) else dist.get_global_rank(g, peer)


def send(t: torch.Tensor, to: int, *, async_op: bool = False, group: Any = None):
    """Send ``t`` to rank ``to`` of ``group`` (default: the current group), which receives it with
    :func:`recv`. Counts bytes(t) on the sender. Returns ``t`` (a Handle with ``async_op``)."""
    g = joined(group, "send")
    if _size(g) == 1:
        return done(t) if async_op else t
    count("send", tensor_bytes(t), g)
    with named("send", tensor_bytes(t), group=g) as started:
        work = dist.isend(t.contiguous(), _peer(g, to), group=g)
    h = Handle(work, t, None, "send", tensor_bytes(t), started, g)
    return h if async_op else h.wait()


def recv(t: torch.Tensor, frm: int, *, async_op: bool = False, group: Any = None):
    """Receive into ``t`` (contiguous, of the shape and dtype sent) what rank ``frm`` of ``group`` (default:
    the current group) sends with :func:`send`. Counts nothing (the sender counts). Returns ``t`` (a Handle
    with ``async_op``)."""
    g = joined(group, "recv")
    if _size(g) == 1:
        return done(t) if async_op else t
    if not t.is_contiguous():
        raise ValueError("recv: receive into a contiguous tensor")
    with named("recv", tensor_bytes(t), group=g) as started:
        work = dist.irecv(t, _peer(g, frm), group=g)
    h = Handle(work, t, None, "recv", tensor_bytes(t), started, g)
    return h if async_op else h.wait()


def account(kind: str, nbytes: int, *, group: Any = None) -> None:
    """Count ``nbytes`` this rank sent on ``group`` (default: the current group) by a library's own
    communication, outside these functions (``torch.distributed.pipelining``'s sends of activations), in
    every :func:`counting` open on it."""
    g = joined(group, "account")
    if _size(g) > 1 and nbytes:
        count(kind, int(nbytes), g)


def barrier(*, group: Any = None) -> None:
    """Wait until every rank of ``group`` (default: the current group) reached its ``barrier()``."""
    g = joined(group, "barrier")
    if _size(g) > 1:
        with named("barrier", group=g):
            dist.barrier(group=g)


def gather_objects(obj: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` on every rank of ``group`` (default: the current group; in its rank order);
    for error messages, not data."""
    g = joined(group, "gather_objects")
    n = _size(g)
    if n == 1:
        return [obj]
    out: list[Any] = [None] * n
    with named("gather_objects", group=g):
        dist.all_gather_object(out, obj, group=g)
    return out


def broadcast_object(obj: Any, src: int = 0, *, group: Any = None) -> Any:
    """Rank ``src``'s ``obj`` (``src``: its rank in ``group``, default the current group) on every rank of it."""
    g = joined(group, "broadcast_object")
    if _size(g) == 1:
        return obj
    box = [obj]
    with named("broadcast_object", group=g):
        dist.broadcast_object_list(box, src=src if is_default(g) else dist.get_global_rank(g, src), group=g)
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
    g = joined(group, "all_reduce_tree")
    _check_same_tree("all_reduce_tree", tree, g)
    handles = [all_reduce(t, op, async_op=True, group=g) for t in T.tree_leaves(tree)]
    for h in handles:
        h.wait()
    return tree


def reduce_scatter_tree(outs: Any, fulls: Any, op: str = "sum", *, group: Any = None) -> Any:
    """``reduce_scatter`` leaf by leaf from ``fulls`` into ``outs`` (over ``group``, default the current
    group); returns ``outs``."""
    g = joined(group, "reduce_scatter_tree")
    _check_same_tree("reduce_scatter_tree", fulls, g)
    pairs = zip(T.tree_leaves(outs), T.tree_leaves(fulls))
    handles = [reduce_scatter(o, f, op, async_op=True, group=g) for o, f in pairs]
    for h in handles:
        h.wait()
    return outs


def all_gather_tree(fulls: Any, shards: Any, *, group: Any = None) -> Any:
    """``all_gather`` leaf by leaf from ``shards`` into ``fulls`` (over ``group``, default the current
    group); returns ``fulls``."""
    g = joined(group, "all_gather_tree")
    _check_same_tree("all_gather_tree", shards, g)
    handles = [all_gather(f, s, async_op=True, group=g) for f, s in zip(T.tree_leaves(fulls), T.tree_leaves(shards))]
    for h in handles:
        h.wait()
    return fulls
