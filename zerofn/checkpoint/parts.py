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
    """The state's layouts by kind: ``params``, ``frozen`` and ``buffers``."""
    lay = state.spec.layout
    frozen = lay.frozen_buckets if isinstance(state.frozen, tuple) else _pseudo(state.frozen)
    return {PARAMS: lay.buckets, FROZEN: frozen, BUFFERS: _pseudo(state.buffers)}


def held_range(numel: int, bucket: Bucket, rank: int, what: str) -> tuple[int, int]:
    """The element range of ``bucket`` a piece of ``numel`` elements on ``rank`` holds: all, or its shard."""
    if numel == bucket.padded:
        return 0, bucket.padded
    if bucket.shards > 1 and numel == bucket.shard_numel:
        return bucket.shard_range(rank)
    raise CheckpointError(f"checkpoint: {what} holds {numel} elements of a bucket of {bucket.padded}; cannot place it")


def _is_node(x: Any) -> bool:
    return isinstance(x, FileTensor) or parts_of(x) is not None


def _walk_opt(tree: Any, path: tuple, buckets: tuple[Bucket, ...], rank: int, held: Held, scoped: tuple = ()) -> None:
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
                    _walk_opt(record.tree, full, buckets, rank, held, inside)
                elif isinstance(record, Quantity):
                    role = Role(record.precise, record.newer, record.mirror)
                    for i, value in record.by_bucket().items():
                        held.parts.append(_bucket_part(record.name, i, value, buckets, rank, role))
            continue
        i = keys.opt_bucket(full)
        if i is None:
            if isinstance(leaf, torch.Tensor):
                held.small[keys.opt(full_scoped)] = leaf
            continue
        held.parts.append(_bucket_part(keys.opt(full), i, leaf, buckets, rank, None))


def _bucket_part(key: str, i: int, value: Any, buckets, rank: int, role: Role | None) -> Part:
    lo, hi = held_range(value.numel(), buckets[i], rank, f"optimizer state {key} of bucket {i}")
    return Part(key, PARAMS, i, lo, hi, value, role)


def state_parts(state: TrainState, rank: int, lays: dict) -> Held:
    """Every bucket range this rank holds (``lays``: the state's :func:`layouts`), and the small tensors
    (counts, loss scale, optimizer scalars, ``state.extra``)."""
    held = Held([], {"count": state.count, PARAM_STEPS: state.param_steps})
    for i, (t, b) in enumerate(zip(state.params, lays[PARAMS])):
        held.parts.append(Part(PARAMS, PARAMS, i, *held_range(t.numel(), b, rank, f"params bucket {i}"), t))
    frozen = state.frozen if isinstance(state.frozen, tuple) else tuple(state.frozen.values())
    for i, (t, b) in enumerate(zip(frozen, lays[FROZEN])):
        held.parts.append(Part(FROZEN, FROZEN, i, *held_range(t.numel(), b, rank, f"frozen bucket {i}"), t))
    for i, t in enumerate(state.buffers.values()):
        held.parts.append(Part(BUFFERS, BUFFERS, i, 0, t.numel(), t))
    _walk_opt(state.opt_state, (), lays[PARAMS], rank, held)
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
