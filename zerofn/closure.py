"""Finding the model a loss function calls: the ``zf.functional`` apply in its closure or globals.

A step needs the model itself only for what is not a call of ``loss_fn``:
``step.apply`` (evaluation), and storages that gather parameters around
the model's modules. It finds it the way a reader of ``loss_fn`` would,
from the names ``loss_fn`` (and functions it calls, two levels down)
refers to.

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.closure import find_functional
    >>> apply = zf.functional(torch.nn.Linear(2, 1))
    >>> find_functional(lambda p, b: apply(p, b).sum()) is apply
    True
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from zerofn.functional import Functional

__all__ = ["find_functional"]


def find_functional(loss_fn: Callable) -> Functional:
    """The ``zf.functional`` apply that ``loss_fn`` calls (found in its closure or globals).

    Raises:
        ValueError: ``loss_fn`` refers to no apply, or to several.
    """
    found = _functionals_in(loss_fn, depth=2)
    if len(found) == 1:
        return found[0]
    what = "no zf.functional apply" if not found else f"{len(found)} different zf.functional applies"
    raise ValueError(
        f"could not find the model: loss_fn {getattr(loss_fn, '__qualname__', loss_fn)!r} refers to {what}. "
        "Write loss_fn to call apply = zf.functional(model), defined in the enclosing scope or at module level."
    )


def _functionals_in(fn: Any, depth: int) -> list:
    out: list = []
    try:
        cv = inspect.getclosurevars(fn)
    except TypeError:
        return out
    for v in list(cv.nonlocals.values()) + list(cv.globals.values()):
        if isinstance(v, Functional) and all(v is not o for o in out):
            out.append(v)
        elif depth > 0 and inspect.isfunction(v):
            out.extend(x for x in _functionals_in(v, depth - 1) if all(x is not o for o in out))
    return out
