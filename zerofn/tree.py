"""Pytree helpers over optree, in one registry namespace.

Every zerofn state class is a frozen dataclass registered with optree under
the ``"zerofn"`` namespace, so ``tree_map`` and friends here see through it
while optree's global registry stays untouched. Shards and counters are
leaves; configuration (world size, dtypes, names) is static and lives in the
tree structure.

Example:
    >>> import torch
    >>> from zerofn import tree
    >>> @tree.state_class
    ... class Pair:
    ...     a: torch.Tensor
    ...     b: torch.Tensor
    ...     name: str = tree.field(static=True, default="x")
    >>> p = tree.tree_map(lambda t: t + 1, Pair(torch.zeros(1), torch.ones(1)))
    >>> p.b.item(), p.name
    (2.0, 'x')
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import optree
import optree.dataclasses

NAMESPACE = "zerofn"

Tree = Any
PyTreeSpec = optree.PyTreeSpec

__all__ = [
    "NAMESPACE",
    "field",
    "state_class",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_map_",
    "tree_map_with_path",
    "tree_structure",
    "tree_unflatten",
    "treespec_digest",
    "keystr",
]


def field(*, static: bool = False, **kwargs: Any) -> Any:
    """A dataclass field; ``static=True`` keeps it out of the leaves (in the treespec)."""
    return optree.dataclasses.field(pytree_node=not static, **kwargs)


def state_class(cls: type | None = None, /) -> Any:
    """Make ``cls`` a frozen dataclass registered as a pytree node under zerofn's namespace.

    Flatten and unflatten are derived from the dataclass fields, so every
    field survives a round trip; fields declared ``field(static=True)`` go
    into the treespec instead of the leaves.
    """
    if cls is None:
        return state_class
    return optree.dataclasses.dataclass(cls, frozen=True, namespace=NAMESPACE)


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree, is_leaf=None) -> Tree:
    return optree.tree_map(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_map_(fn: Callable[..., Any], tree: Tree, *rest: Tree, is_leaf=None) -> Tree:
    """Call ``fn`` on every leaf for its side effect (in-place work); returns ``tree``."""
    return optree.tree_map_(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_map_with_path(fn: Callable[..., Any], tree: Tree, *rest: Tree, is_leaf=None) -> Tree:
    """Like ``tree_map`` with the leaf's key path (a tuple of entries) as first argument."""
    return optree.tree_map_with_path(fn, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_flatten(tree: Tree, is_leaf=None) -> tuple[list[Any], PyTreeSpec]:
    return optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_flatten_with_path(tree: Tree, is_leaf=None) -> tuple[list[tuple], list[Any], PyTreeSpec]:
    return optree.tree_flatten_with_path(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_unflatten(spec: PyTreeSpec, leaves: list[Any]) -> Tree:
    return optree.tree_unflatten(spec, leaves)


def tree_leaves(tree: Tree, is_leaf=None) -> list[Any]:
    return optree.tree_leaves(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_structure(tree: Tree, is_leaf=None) -> PyTreeSpec:
    return optree.tree_structure(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def keystr(path: tuple) -> str:
    """A readable key path: ``('params', 'w', 0)`` -> ``params.w[0]``."""
    out = ""
    for entry in path:
        if isinstance(entry, int):
            out += f"[{entry}]"
        else:
            out += ("." if out else "") + str(entry)
    return out or "<root>"


def treespec_digest(tree: Tree) -> int:
    """A 48-bit digest of a tree's structure and its leaves' shapes and dtypes.

    Equal on two ranks exactly when their trees agree on structure, shapes and
    dtypes (up to hash collisions), so ranks can compare trees with one small
    collective before trusting each other's layout.
    """
    paths, leaves, spec = tree_flatten_with_path(tree)
    parts = [str(spec)]
    for path, leaf in zip(paths, leaves):
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = str(getattr(leaf, "dtype", type(leaf).__name__))
        parts.append(f"{keystr(path)}:{shape}:{dtype}")
    return int.from_bytes(hashlib.blake2b("|".join(parts).encode(), digest_size=6).digest(), "big")


def describe_leaf(leaf: Any) -> str:
    """``float32[3, 4]`` for a tensor, the type name otherwise."""
    shape = getattr(leaf, "shape", None)
    if shape is None:
        return type(leaf).__name__
    dtype = str(getattr(leaf, "dtype", "")).replace("torch.", "")
    return f"{dtype}{list(shape)}"
