"""What a state holds, as pieces: every element range of every bucket of every quantity this rank
holds, and the small tensors (counts, the loss scale, the optimizer's scalars, ``state.extra``).

A *quantity* is laid out in the buckets of a layout (``zerofn.state.Layout``): ``params``,
``frozen`` and ``buffers`` are the state's own fields; each parameter-shaped leaf of the
optimizer's state is the quantity ``opt:<path>`` (its path with each bucket key as ``*``,
:func:`zerofn.keys.opt`); a wrapper state's :class:`zerofn.roles.Quantity` is the quantity of its
name, and carries its :class:`Role`. Wrapper states are read through the records they declare
(:func:`zerofn.roles.parts_of`), so nothing here knows which transform made them.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import torch

from zerofn import keys
from zerofn import tree as T
from zerofn._io import FileTensor
from zerofn._safetensors import tensor_bytes
from zerofn.checkpoint._format import CheckpointError, Role
from zerofn.roles import Inner, Quantity, parts_of
from zerofn.state import Bucket, Slot, TrainState

__all__ = [
    "BUFFERS",
    "FROZEN",
    "PARAMS",
    "PARAM_STEPS",
    "Held",
    "Part",
    "frozen_crc",
    "held_range",
    "layouts",
    "quantities",
    "state_parts",
]

PARAMS, FROZEN, BUFFERS = "params", "frozen", "buffers"  # the state's own quantities, and their layouts
PARAM_STEPS = "param_steps"  # each trainable parameter's update count, in the params tree's order


class Part(NamedTuple):
    """An element range ``[lo, hi)`` of bucket ``bucket`` of quantity ``key`` that this rank holds."""

    key: str  # params, frozen, buffers, opt:<path>, or a declared quantity's name
    kind: str  # whose layout: params, frozen or buffers
    bucket: int
    lo: int
    hi: int
    value: Any  # a 1-D tensor (or a tensor shaped like a pseudo-bucket's one slot), or a FileTensor
    role: Role | None = None  # a declared quantity's role (None: the state's own fields, optimizer leaves)
    write: bool = True  # False: another rank writes the same range (experts held alike by their group)


class Held(NamedTuple):
    """What a state holds: its bucket ranges and its small tensors by checkpoint key."""

    parts: list[Part]
    small: dict[str, torch.Tensor]


def _pseudo(named: dict) -> tuple[Bucket, ...]:
    """One unsharded bucket per tensor of a name -> tensor dict (frozen tensors, buffers)."""
    return tuple(
        Bucket(t.dtype, str(t.device), (Slot(n, tuple(t.shape), 0, t.numel()),), t.numel(), t.numel(), 1)
        for n, t in named.items()
    )


def layouts(state: TrainState) -> dict[str, tuple[Bucket, ...]]:
    """The state's layouts by kind: ``params``, ``frozen`` and ``buffers``. A bucket of parameters cut along
    an axis of the step's group (``Bucket.apart``: expert parallelism's experts, cut along dim 0) is
    described whole: each parameter at its whole shape, one after another (see :func:`state_parts`)."""
    lay = state.spec.layout
    frozen = lay.frozen_buckets if isinstance(state.frozen, tuple) else _pseudo(state.frozen)
    sizes = {axis: size for axis, size, _ in state.spec.mesh}
    whole = lambda buckets: tuple(_whole(b, sizes[b.apart]) if b.apart else b for b in buckets)  # noqa: E731
    return {PARAMS: whole(lay.buckets), FROZEN: whole(frozen), BUFFERS: _pseudo(state.buffers)}


def _whole(bucket: Bucket, size: int) -> Bucket:
    """A bucket of parameters cut along dim 0 over ``size`` ranks, as the whole parameters: each slot at its
    whole shape, the slots one after another (no padding, one shard). Rank ``c`` of the axis holds elements
    ``[c n, (c + 1) n)`` of a slot of ``n`` elements here: a piece along dim 0 is a contiguous range."""
    slots, at = [], 0
    for s in bucket.slots:
        shape = (s.shape[0] * size, *s.shape[1:])
        slots.append(Slot(s.name, shape, at, s.numel * size))
        at += s.numel * size
    return Bucket(bucket.dtype, bucket.device, tuple(slots), at, at, 1, bucket.apart)


def _apart_rank(spec: Any, *axes: str) -> int:
    """This rank's place among the ranks of its step's group that hold the same pieces along ``axes`` (or
    replicas across them): its coordinates on the mesh's other axes of the step's group (all but the
    model-parallel ``tp`` and ``pp``), row-major."""
    out = 0
    for a, size, coord in spec.mesh:
        if a not in (*axes, "tp", "pp"):
            out = out * size + coord
    return out


def _replica(spec: Any, bucket: Bucket) -> int:
    """This rank's coordinate across ``bucket``'s replicas (hybrid sharding; 0 without): replica 0 saves."""
    return next((c for a, _, c in spec.mesh if a == bucket.replicate), 0) if bucket.replicate else 0


def _parts(key: str, kind: str, i: int, value: Any, local: Bucket, rank: int, role: Any, spec: Any) -> list[Part]:
    """The :class:`Part` (or, for a bucket cut along an axis of the step's group, the parts, one per
    parameter, placed in its :func:`_whole` description) of this rank's ``value`` of bucket ``i``."""
    what = f"{key} of bucket {i}"
    first = _replica(spec, local) == 0  # hybrid sharding: every replica holds the shard, the first saves it
    if not local.apart:
        if local.replicate:  # its shards are numbered within a replica
            rank = _apart_rank(spec, local.replicate)
        return [Part(key, kind, i, *held_range(value.numel(), local, rank, what), value, role, first)]
    if isinstance(value, FileTensor):
        raise CheckpointError(
            f"checkpoint: {what} is held in a file, and its parameters are cut along the mesh axis "
            f"{local.apart!r} of the step's group; such a state is not saved or loaded yet. Hold them in memory."
        )
    size, coord = next((n, c) for a, n, c in spec.mesh if a == local.apart)
    mine = _apart_rank(spec, local.apart, local.replicate)
    lo, hi = held_range(value.numel(), local, mine, what)
    group = spec.world_size // size  # the ranks that hold the same pieces
    write = first and not (hi - lo == local.padded and group > 1 and mine != 0)  # held alike: one writes
    flat = value.detach().view(-1) if value.dim() != 1 else value
    out, at = [], 0
    for s in local.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            start = at + coord * s.numel + (a - s.offset)
            out.append(Part(key, kind, i, start, start + (b - a), flat[a - lo : b - lo], role, write))
        at += s.numel * size
    return out


def held_range(numel: int, bucket: Bucket, rank: int, what: str) -> tuple[int, int]:
    """The element range of ``bucket`` a piece of ``numel`` elements on ``rank`` holds: all, or its shard."""
    if numel == bucket.padded:
        return 0, bucket.padded
    if bucket.shards > 1 and numel == bucket.shard_numel:
        return bucket.shard_range(rank)
    raise CheckpointError(f"checkpoint: {what} holds {numel} elements of a bucket of {bucket.padded}; cannot place it")


def _is_node(x: Any) -> bool:
    return isinstance(x, FileTensor) or parts_of(x) is not None


def _walk_opt(
    tree: Any, path: tuple, buckets: tuple[Bucket, ...], rank: int, held: Held, spec: Any, scoped: tuple = ()
) -> None:
    """Parts and small leaves of an optimizer state, by :func:`zerofn.keys.opt` key.

    A node that declares ``state_parts()`` (a wrapper's state) says what it holds: an :class:`Inner`
    continues the optimizer's path, a :class:`Quantity` is a parameter-shaped quantity of its own.
    What it leaves out is scratch. An :class:`Inner` with a scope (a group's state under
    ``multi_transform``) keys its small leaves under the scope (``opt:[decay]/0/0``: each group its own
    count) and its parameter-shaped leaves without it (``opt:0/1/*``: each parameter's moments under
    the key they have in any grouping, told apart by the bucket they lie in). ``scoped`` is ``path``
    with the scopes on the way in.
    """
    paths, leaves, _ = T.tree_flatten_with_path(tree, is_leaf=_is_node)
    for sub, leaf in zip(paths, leaves):
        full, full_scoped = path + tuple(sub), (scoped or path) + tuple(sub)
        records = None if isinstance(leaf, FileTensor) else parts_of(leaf)
        if records is not None:
            for record in records:
                if isinstance(record, Inner):
                    inside = full_scoped + ((keys.scope(record.scope),) if record.scope is not None else ())
                    _walk_opt(record.tree, full, buckets, rank, held, spec, inside)
                elif isinstance(record, Quantity):
                    role = Role(record.precise, record.newer, record.mirror)
                    for i, value in record.by_bucket().items():
                        held.parts.extend(_parts(record.name, PARAMS, i, value, buckets[i], rank, role, spec))
            continue
        i = keys.opt_bucket(full)
        if i is None:
            if isinstance(leaf, torch.Tensor):
                held.small[keys.opt(full_scoped)] = leaf
            continue
        held.parts.extend(_parts(keys.opt(full), PARAMS, i, leaf, buckets[i], rank, None, spec))


def state_parts(state: TrainState, rank: int, lays: dict) -> Held:
    """Every bucket range this rank holds (``lays``: the state's :func:`layouts`), and the small tensors
    (counts, loss scale, optimizer scalars, ``state.extra``)."""
    held = Held([], {"count": state.count, PARAM_STEPS: state.param_steps})
    spec, lay = state.spec, state.spec.layout
    local_frozen = lay.frozen_buckets if isinstance(state.frozen, tuple) else lays[FROZEN]
    for i, (t, b) in enumerate(zip(state.params, lay.buckets)):
        held.parts.extend(_parts(PARAMS, PARAMS, i, t, b, rank, None, spec))
    frozen = state.frozen if isinstance(state.frozen, tuple) else tuple(state.frozen.values())
    for i, (t, b) in enumerate(zip(frozen, local_frozen)):
        held.parts.extend(_parts(FROZEN, FROZEN, i, t, b, rank, None, spec))
    for i, t in enumerate(state.buffers.values()):
        held.parts.append(Part(BUFFERS, BUFFERS, i, 0, t.numel(), t))
    _walk_opt(state.opt_state, (), lay.buckets, rank, held, spec)
    if state.loss_scale is not None:
        for p, leaf in zip(*T.tree_flatten_with_path(state.loss_scale)[:2]):
            held.small[keys.loss_scale(T.keystr(p))] = leaf
    for k, v in state.extra.items():
        for p, leaf in zip(*T.tree_flatten_with_path(v)[:2]):
            if isinstance(leaf, torch.Tensor):
                held.small[keys.extra(k, T.keystr(p))] = leaf
    return held


def frozen_crc(parts: list[Part]) -> int:
    """CRC-32 of the bytes of the frozen parts among ``parts`` held in memory, in order (``save(...,
    frozen=False)`` records it; ``load`` checks the frozen values it rebuilt against it)."""
    crc = 0
    for p in parts:
        if p.key == FROZEN and not isinstance(p.value, FileTensor):
            crc = zlib.crc32(tensor_bytes(p.value.detach().cpu()), crc)
    return crc


def quantities(parts: list[Part]) -> dict[str, Role]:
    """The declared quantities among ``parts``, by name (mirrors included: they are loaded, not saved)."""
    return {p.key: p.role for p in parts if p.role is not None}
