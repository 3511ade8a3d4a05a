"""Counters the host reads without a device read: step counts, micro-steps, loss-scale counters.

A step decides on the host how many micro-steps are left and what the
optimizer's step count is; reading those numbers from their tensors would be
a ``Tensor.item()`` (``aten._local_scalar_dense``) on every step. Each counter
tensor made or advanced here carries its value on the host beside it (an
attribute of the tensor, valid while the tensor's version counter says it
was not written since), so reading it costs nothing; a counter that arrives
some other way (loaded from a checkpoint, written in place by other code,
copied) is read once and then carried.

A counter the device advances on a decision the host did not read (an update
skipped on the device, :func:`advance_`) carries bounds instead: the host knows
it lies between what it was and that plus the number of such advances, and
whether a 1-dim counter's elements are still all equal; reading its value
(:func:`value`) then waits for the device, once.

Example:
    >>> import torch
    >>> from zerofn import counters
    >>> c = counters.new(3)
    >>> counters.value(c), counters.value(counters.add_(c, 2)), int(c)
    (3, 5, 5)
    >>> counters.bounds(counters.advance_(c, torch.tensor(True))), counters.known(c), counters.value(c)
    ((5, 6), False, 6)
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import torch

__all__ = ["add_", "advance_", "bounds", "clone", "known", "new", "new_like", "uniform", "value", "values"]

_ATTR = "_zerofn_host"


class _Bounds(NamedTuple):
    """What the host knows of a counter the device advanced by numbers it did not read."""

    lo: Any  # the value (0-dim) or the values' common minimum (1-dim) before those advances
    advances: int  # how many 0-or-1 advances the device made since
    uniform: bool  # a 1-dim counter whose elements were all equal then (each advance adds one number to all)


def _carry(t: torch.Tensor, value: Any) -> torch.Tensor:
    setattr(t, _ATTR, (t._version, value))
    return t


def _held(t: torch.Tensor) -> Any:
    held = getattr(t, _ATTR, None)
    return held[1] if held is not None and held[0] == t._version else None


def new(value: int | float, dtype: torch.dtype = torch.int64, device: Any = None) -> torch.Tensor:
    """A 0-dim counter tensor (on the CPU, or ``device``) that carries ``value`` on the host (as the tensor
    holds it: a float32 counter carries ``value`` rounded to float32)."""
    if dtype == torch.float32:
        value = struct.unpack("f", struct.pack("f", value))[0]
    # a fill on the device, not a copy of a host number: on a GPU that copy is one the host waits for
    return _carry(torch.full((), value, dtype=dtype, device=device), value)


def new_like(values: tuple | list, dtype: torch.dtype = torch.int64, device: Any = None) -> torch.Tensor:
    """A 1-dim counter tensor (one count per parameter) carrying ``values`` on the host."""
    values = tuple(values)
    host = torch.tensor(values, dtype=dtype)
    if device is not None and torch.device(device).type == "cuda":  # from pinned memory: the host need not wait
        host = host.pin_memory().to(device, non_blocking=True)
    elif device is not None:
        host = host.to(device)
    return _carry(host, values)


def value(t: torch.Tensor) -> Any:
    """The number a 0-dim counter holds, read on the host (once, for a counter that carries none or only
    bounds: that read waits for the device); a Python number as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    held = _held(t)
    if held is not None and not isinstance(held, _Bounds):
        return held
    v = t.item()
    _carry(t, v)
    return v


def values(t: torch.Tensor) -> tuple:
    """The numbers a 1-dim counter holds, as a tuple (see :func:`value`)."""
    held = _held(t)
    if held is not None and not isinstance(held, _Bounds):
        return held
    v = tuple(t.tolist())
    _carry(t, v)
    return v


def known(t: Any) -> bool:
    """Whether the host holds the counter's exact value (reading it costs nothing)."""
    if not isinstance(t, torch.Tensor):
        return True
    held = _held(t)
    return held is not None and not isinstance(held, _Bounds)


def bounds(t: torch.Tensor) -> tuple:
    """``(lo, hi)``: the least and greatest value a 0-dim counter may hold, as the host knows it without a
    read (equal when :func:`known`); a counter that carries nothing is read once."""
    held = _held(t)
    if isinstance(held, _Bounds):
        return held.lo, held.lo + held.advances
    v = value(t)
    return v, v


def uniform(t: torch.Tensor) -> bool:
    """Whether a 1-dim counter's elements are all equal (read once when the host knows nothing of it)."""
    held = _held(t)
    if isinstance(held, _Bounds):
        return held.uniform
    return len(set(values(t))) <= 1


def clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that carries what ``t`` carries on the host (its value or bounds, and the tables of
    schedule values kept beside a count): a copied state reads no more than the original would."""
    c = t.clone()
    held = _held(t)
    if held is not None:
        _carry(c, held)
    for name in _KEPT:
        if hasattr(t, name):
            setattr(c, name, getattr(t, name))
    return c


TABLES = "_zerofn_tables"  # on a count: a schedule's values on the device, by count (zerofn.optim)
_KEPT = (TABLES,)  # the host-side attributes a counter keeps besides its value


def advance_(t: torch.Tensor, by: torch.Tensor) -> torch.Tensor:
    """``t += by`` in place, ``by`` a 0-or-1 tensor on ``t``'s device that the host does not read (an
    update the device decided on; one number for all elements, or one per element of a 1-dim counter): the
    counter then carries bounds (see :func:`bounds`)."""
    held = _held(t)
    alike = by.dim() == 0  # every element advances by the same number: equal ones stay equal
    if isinstance(held, _Bounds):
        after = held._replace(advances=held.advances + 1, uniform=held.uniform and alike)
    elif t.dim() == 0:
        after = _Bounds(value(t), 1, True)
    else:
        v = values(t)
        after = _Bounds(min(v, default=0), 1, len(set(v)) <= 1 and alike)
    t.add_(by.to(t.dtype))
    return _carry(t, after)


def add_(t: torch.Tensor, by: int | float = 1) -> torch.Tensor:
    """``t += by`` in place, carrying the new value."""
    before = value(t)
    t.add_(by)
    return _carry(t, before + by)
