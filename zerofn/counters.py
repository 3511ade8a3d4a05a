"""Counters the host reads without a device read: step counts, micro-steps, loss-scale counters.

A step decides on the host how many micro-steps are left and what the
optimizer's step count is; reading those numbers from their tensors would be
a ``Tensor.item()`` (``aten._local_scalar_dense``) on every step. Each counter
tensor made or advanced here carries its value on the host beside it (an
attribute of the tensor, valid while the tensor's version counter says it
was not written since), so reading it costs nothing; a counter that arrives
some other way (loaded from a checkpoint, written in place by other code,
copied) is read once and then carried.

Example:
    >>> from zerofn import counters
    >>> c = counters.new(3)
    >>> counters.value(c), counters.value(counters.add_(c, 2)), int(c)
    (3, 5, 5)
"""

from __future__ import annotations

import struct
from typing import Any

import torch

__all__ = ["add_", "new", "new_like", "value", "values"]

_ATTR = "_zerofn_host"


def _carry(t: torch.Tensor, value: Any) -> torch.Tensor:
    setattr(t, _ATTR, (t._version, value))
    return t


def new(value: int | float, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 0-dim CPU counter tensor that carries ``value`` on the host (as the tensor holds it: a float32
    counter carries ``value`` rounded to float32)."""
    if dtype == torch.float32:
        value = struct.unpack("f", struct.pack("f", value))[0]
    return _carry(torch.tensor(value, dtype=dtype), value)


def new_like(values: tuple | list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-dim CPU counter tensor (one count per parameter) carrying ``values`` on the host."""
    values = tuple(values)
    return _carry(torch.tensor(values, dtype=dtype), values)


def value(t: torch.Tensor) -> Any:
    """The number a 0-dim counter holds, read on the host (once, for a counter that carries none); a
    Python number as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    held = getattr(t, _ATTR, None)
    if held is not None and held[0] == t._version:
        return held[1]
    v = t.item()
    _carry(t, v)
    return v


def values(t: torch.Tensor) -> tuple:
    """The numbers a 1-dim counter holds, as a tuple (see :func:`value`)."""
    held = getattr(t, _ATTR, None)
    if held is not None and held[0] == t._version:
        return held[1]
    v = tuple(t.tolist())
    _carry(t, v)
    return v


def add_(t: torch.Tensor, by: int | float = 1) -> torch.Tensor:
    """``t += by`` in place, carrying the new value."""
    before = value(t)
    t.add_(by)
    return _carry(t, before + by)
