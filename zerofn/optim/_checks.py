"""Argument and state checks shared by the ``zerofn.optim`` modules (private).

Each raises a TypeError or ValueError that names the function and argument at
fault and says how to fix the call.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from zerofn import counters
from zerofn.tree import Tree, describe_leaf, keystr, tree_flatten, tree_flatten_with_path, tree_leaves

Schedule = Callable[[int], float]  # a learning rate (or any scalar) as a function of the update count


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_number(
    where: str,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    low_open: bool = False,
    high: float | None = None,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """``value`` as a float, or a TypeError/ValueError naming ``where`` and ``name``."""
    if not is_real(value):
        raise TypeError(
            f"{where}: {name} must be a real number, got {type(value).__name__} {value!r}. "
            f"Pass a Python float{hint and '; ' + hint}."
        )
    value = float(value)
    bad = math.isnan(value)
    if low is not None:
        bad |= value <= low if low_open else value < low
    if high is not None:
        bad |= value >= high if high_open else value > high
    if bad:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        lo_s = "-inf" if low is None else f"{low:g}"
        hi_s = "inf" if high is None else f"{high:g}"
        raise ValueError(
            f"{where}: {name} must be in {lo}{lo_s}, {hi_s}{hi}, got {value!r}." + (f" {hint}" if hint else "")
        )
    return value


def schedule_value(where: str, schedule: Schedule, count: int) -> float:
    """Call ``schedule(count)`` and check that it returned a finite real number."""
    value = schedule(count)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if not is_real(value):
        raise TypeError(
            f"{where}: the schedule {getattr(schedule, '__name__', schedule)!r} returned "
            f"{type(value).__name__} {value!r} at count {count}; expected a Python float. "
            f"A schedule is a function of the int step count (0 for the first update) "
            f"returning a float, e.g. lambda count: 1e-3 * min(1.0, (count + 1) / 100)."
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(
            f"{where}: the schedule {getattr(schedule, '__name__', schedule)!r} returned "
            f"{value} at count {count}; expected a finite float."
        )
    return value


def flat(where: str, what: str, tree: Tree):
    leaves, spec = tree_flatten(tree)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            paths, _, _ = tree_flatten_with_path(tree)
            path = next(p for p, lf in zip(paths, leaves) if lf is leaf)
            raise TypeError(
                f"{where}: every leaf of {what} must be a torch.Tensor, but {what} at "
                f"{keystr(path)} is {type(leaf).__name__} {leaf!r}. Convert it with "
                f"torch.as_tensor, or keep it out of the tree."
            )
    return leaves, spec


_FIX_STATE = (
    "Build the state with init(params) on the params (or shards) whose gradients you "
    "pass, and pass updates shaped like those params."
)


def check_same(
    where: str,
    what: str,
    spec,
    other: str,
    other_spec,
    other_leaves,
    leaves,
    *,
    fix: str = _FIX_STATE,
    dtypes: bool = False,
):
    """Raise unless ``leaves`` (of ``what``) match ``other_leaves`` in structure and shapes."""
    if spec != other_spec:
        raise ValueError(
            f"{where}: {what} has tree structure\n  {spec}\nbut {other} has\n  {other_spec}\n"
            f"They must match leaf for leaf. {fix}"
        )
    for i, (a, b) in enumerate(zip(leaves, other_leaves)):
        if a.shape != b.shape or (dtypes and a.dtype != b.dtype):
            paths = other_spec.paths()
            kind = "shapes" if a.shape != b.shape else "dtypes"
            raise ValueError(
                f"{where}: {what} at {keystr(paths[i])} is {describe_leaf(a)} but {other} "
                f"there is {describe_leaf(b)}; {kind} must match. {fix}"
                + (
                    " To keep the state in a wider dtype, cast the gradients first: "
                    "tree_map(lambda g, m: g.to(m.dtype), grads, state.mu)."
                    if kind == "dtypes"
                    else ""
                )
            )


FIX_PARAMS = "Pass the params (or this rank's shards of them) that the updates are for."


def count_device(params: Any) -> torch.device | None:
    """Where an optimizer's counts live: on the parameters' accelerator (None: the CPU)."""
    for leaf in tree_leaves(params) if params is not None else ():
        if isinstance(leaf, torch.Tensor):
            return leaf.device if leaf.device.type not in ("cpu", "meta") else None
    return None


_TABLES = counters.TABLES  # on a count tensor: schedule -> its values on the device, by count


def schedule_at(
    where: str, schedule: Schedule, count: torch.Tensor, check: Callable[[float, int], None] | None = None
) -> float | torch.Tensor:
    """``schedule`` at ``count``'s value before this update: a float while the host holds the count, else a
    0-dim float64 tensor on the count's device (the count advanced on the device's decisions, which the
    host did not read). The schedule still runs on the host, on every count the host cannot rule out; its
    values go into a table on the device, which the count indexes there (8 bytes per update; the same
    floats the host would pass). ``check(value, count)`` raises on a value the caller refuses."""

    def at(c: int) -> float:
        v = schedule_value(where, schedule, c)
        if check is not None:
            check(v, c)
        return v

    lo, hi = counters.bounds(count)
    if lo == hi:
        return at(lo)
    tables = getattr(count, _TABLES, None)
    if tables is None:
        tables = {}
        setattr(count, _TABLES, tables)
    base, values, filled = tables.get(schedule, (lo, None, 0))
    if values is None or base > lo:
        base, values, filled = lo, torch.empty(64, dtype=torch.float64, device=count.device), 0
    need = hi - base + 1
    if need > values.numel():
        grown = torch.empty(max(need, 2 * values.numel()), dtype=torch.float64, device=count.device)
        grown[:filled].copy_(values[:filled])
        values = grown
    for c in range(base + filled, hi + 1):
        values[c - base] = at(c)  # a fill on the device: no read
    tables[schedule] = (base, values, need)
    return values.index_select(0, (count - base).view(1)).view(())


def check_count(where: str, count: Any) -> int:
    if not (isinstance(count, torch.Tensor) and count.dim() == 0 and count.dtype == torch.int64):
        raise TypeError(
            f"{where}: state.count must be an int64 0-dim tensor, got "
            f"{describe_leaf(count) if isinstance(count, torch.Tensor) else repr(count)}. "
            f"Build the state with this transform's init(params)."
        )
    return counters.value(count)  # carried on the host: no read


def check_state(where: str, state: Any, cls: type) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{where}: expected a {cls.__name__} as state, got {type(state).__name__}. "
            f"Pass the state made by this transform's init(params) (or the state "
            f"returned by its previous update)."
        )
