"""Tree assertions for tests of steps and transforms, chex-style, on torch pytrees.

Each names the key path (and, under ``torch.distributed``, the rank) of the
first leaf that fails, so a failing comparison of two states says where.

Example:
    >>> import torch
    >>> from zerofn import testing
    >>> testing.assert_trees_all_close({"w": torch.ones(2)}, {"w": torch.ones(2) + 1e-9})
    >>> testing.assert_trees_all_close({"w": torch.ones(2)}, {"w": torch.zeros(2)})
    Traceback (most recent call last):
    ...
    AssertionError: assert_trees_all_close: leaf w differs at flat index 0: 1.0 against 0.0 (max abs difference 1, rtol=1e-06, atol=1e-06)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerofn import collectives as C
from zerofn import tree as T

__all__ = [
    "assert_tree_all_finite",
    "assert_trees_all_close",
    "assert_trees_all_equal",
    "assert_trees_all_equal_dtypes",
    "assert_trees_all_equal_shapes",
    "assert_trees_all_equal_structs",
]


def _where() -> str:
    return f" on rank {C.rank()} of {C.world_size()}" if C.world_size() > 1 else ""


def _pairs(name: str, a: Any, b: Any):
    pa, la, sa = T.tree_flatten_with_path(a)
    _, lb, sb = T.tree_flatten_with_path(b)
    if sa != sb:
        raise AssertionError(f"{name}: tree structures differ{_where()}:\n  {sa}\n  {sb}")
    return [(T.keystr(p), x, y) for p, x, y in zip(pa, la, lb)]


def assert_trees_all_equal_structs(a: Any, b: Any) -> None:
    """Same tree structure (static fields included)."""
    _pairs("assert_trees_all_equal_structs", a, b)


def assert_trees_all_equal_shapes(a: Any, b: Any) -> None:
    """Same structure, and every pair of tensor leaves has one shape."""
    for path, x, y in _pairs("assert_trees_all_equal_shapes", a, b):
        if tuple(getattr(x, "shape", ())) != tuple(getattr(y, "shape", ())):
            raise AssertionError(
                f"assert_trees_all_equal_shapes: leaf {path} has shape {list(x.shape)} against {list(y.shape)}{_where()}"
            )


def assert_trees_all_equal_dtypes(a: Any, b: Any) -> None:
    """Same structure, and every pair of tensor leaves has one dtype."""
    for path, x, y in _pairs("assert_trees_all_equal_dtypes", a, b):
        if getattr(x, "dtype", None) != getattr(y, "dtype", None):
            raise AssertionError(
                f"assert_trees_all_equal_dtypes: leaf {path} has dtype {x.dtype} against {y.dtype}{_where()}"
            )


def assert_trees_all_close(a: Any, b: Any, *, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Same structure and shapes, and ``|a - b| <= atol + rtol * |b|`` leaf by leaf."""
    assert_trees_all_equal_shapes(a, b)
    for path, x, y in _pairs("assert_trees_all_close", a, b):
        if not isinstance(x, torch.Tensor):
            if x != y:
                raise AssertionError(f"assert_trees_all_close: leaf {path} is {x!r} against {y!r}{_where()}")
            continue
        xd, yd = x.detach().double(), y.detach().double()
        bad = ~((xd - yd).abs() <= atol + rtol * yd.abs())
        bad &= ~(xd.isnan() & yd.isnan())
        if bad.any():
            i = int(bad.reshape(-1).nonzero()[0])
            raise AssertionError(
                f"assert_trees_all_close: leaf {path} differs{_where()} at flat index {i}: "
                f"{xd.reshape(-1)[i].item()!r} against {yd.reshape(-1)[i].item()!r} "
                f"(max abs difference {(xd - yd).abs().nan_to_num(math.inf).max().item():.3g}, "
                f"rtol={rtol}, atol={atol})"
            )


def assert_trees_all_equal(a: Any, b: Any) -> None:
    """Bit for bit: same structure, shapes, dtypes and values."""
    assert_trees_all_equal_dtypes(a, b)
    assert_trees_all_close(a, b, rtol=0.0, atol=0.0)


def assert_tree_all_finite(a: Any) -> None:
    """No inf or nan in any floating leaf."""
    for path, x in ((T.keystr(p), x) for p, x in zip(*T.tree_flatten_with_path(a)[:2])):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not torch.isfinite(x).all():
            raise AssertionError(f"assert_tree_all_finite: leaf {path} holds inf or nan{_where()}")
