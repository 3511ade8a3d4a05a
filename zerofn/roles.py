"""What a transform's state stands for, declared by the state itself: the records persistence and the
printout read, so that nothing outside a transform needs its name or the meaning of its fields.

An optimizer wrapper's state (a node in ``state.opt_state``) declares its parts with a method
``state_parts()`` returning a tuple of records:

- :class:`Inner`: the wrapped optimizer's own state continues here (its leaves are saved under the
  optimizer's path, as if the wrapper were not there).
- :class:`Quantity`: a parameter-shaped tree of its own, keyed by bucket (``"b0"``, ...): what it
  stands for is said by its flags, not by its name.

What a node leaves out of ``state_parts()`` is scratch (gradient buffers, spare copies): not saved,
left as ``init`` built it on load.

A node may also declare ``placement`` (``"cpu"``, ``"nvme"``): where it keeps the state below it,
which the state's printout shows. Leaves that are not tensors but stand for bytes held elsewhere
(:class:`zerofn._io.FileTensor`'s owners, NVMe files) declare ``placement`` and ``nbytes``
themselves; :func:`zerofn.placement.held_bytes` counts them.

Example (a wrapper keeping a second copy of the parameters, as fp32 masters do)::

    class MyState(NamedTuple):
        copy: dict      # bucket key -> tensor
        inner: Any

        def state_parts(self):
            return (Quantity("mycopy", self.copy, precise=True), Inner(self.inner))
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zerofn import keys
from zerofn import tree as T

__all__ = ["Inner", "Quantity", "find_quantity", "parts_of", "placement_of"]


class Inner(NamedTuple):
    """The wrapped optimizer's state: saved and loaded under the optimizer's own path.

    Attributes:
        tree: the state.
        scope: for one of several inner states side by side (a group's, under ``multi_transform``):
            its small leaves (counts) are saved under the scope, its parameter-shaped leaves without it,
            so that the latter load under another grouping of the same parameters.
    """

    tree: Any
    scope: str | None = None


class Quantity(NamedTuple):
    """A parameter-shaped quantity a wrapper state holds: bucket key -> tensor (or ``FileTensor``).

    Attributes:
        name: the key it is saved under; two transforms must not declare the same one.
        tree: bucket key -> this rank's piece of the bucket (the whole bucket, or its shard).
        precise: it holds the parameters themselves at full precision (fp32 master weights): a
            step whose parameters are full precision loads them from it, a step that declares one
            loads it from the parameters when a checkpoint lacks it, and an export writes it.
        newer: it holds the parameters one update ahead of ``state.params`` (a delayed update):
            a step that declares none takes its parameters from it; one that declares it and loads
            a checkpoint without it starts it from the parameters.
        mirror: a copy of the parameters kept elsewhere (host memory): filled from the
            parameters on load, never saved.
    """

    name: str
    tree: Any
    precise: bool = False
    newer: bool = False
    mirror: bool = False

    def by_bucket(self) -> dict[int, Any]:
        """Bucket index -> this rank's piece; raises a ValueError for a leaf not keyed by bucket."""
        out = {}
        paths, leaves, _ = T.tree_flatten_with_path(self.tree)
        for path, leaf in zip(paths, leaves):
            i = keys.bucket_index(path[-1]) if path else None
            if i is None:
                raise ValueError(f"{self.name}: a declared quantity's leaf at {path} is not keyed by bucket")
            out[i] = leaf
        return out


def parts_of(node: Any) -> tuple | None:
    """The records ``node`` declares (None: it declares none, an ordinary subtree)."""
    declare = getattr(type(node), "state_parts", None)
    return tuple(node.state_parts()) if callable(declare) else None


def placement_of(node: Any) -> str | None:
    """The first placement declared by ``node`` or the nodes its :class:`Inner` records lead to."""
    while node is not None:
        placement = getattr(node, "placement", None)
        if isinstance(placement, str):
            return placement
        parts = parts_of(node)
        node = next((p.tree for p in parts or () if isinstance(p, Inner)), None)
    return None


def find_quantity(tree: Any, name: str) -> dict[int, Any]:
    """Bucket index -> this rank's piece of the :class:`Quantity` called ``name`` declared anywhere in
    ``tree`` (an optimizer state), following :class:`Inner` records; empty when none is declared."""
    found: dict[int, Any] = {}
    for node in T.tree_leaves(tree, is_leaf=lambda x: parts_of(x) is not None):
        for part in parts_of(node) or ():
            if isinstance(part, Inner):
                found.update(find_quantity(part.tree, name))
            elif part.name == name:
                found.update(part.by_bucket())
    return found
