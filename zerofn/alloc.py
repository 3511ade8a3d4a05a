"""Allocation for ``init`` functions: zeros (or a copy of the seed), or nothing written at all when the
state is built only to be overwritten.

``step.init(params, structure_only=True)``, which ``zf.checkpoint.load`` calls, builds a state whose
values the load then replaces. Zero-filling the optimizer's moments and copying the seed parameters
into the buckets (and into amp's fp32 masters, offload's host copies) would touch every byte of the
state once for nothing, which costs about as much as the load itself. Inside :func:`unfilled` the
init functions that allocate through :func:`zeros`, :func:`zeros_like`, :func:`copy_of` and
:func:`zeros_file` get tensors (and files) with nothing written in them, and :func:`filling` tells
an init whether to write its values at all.

Why a context rather than a keyword: an optimizer's ``init(params)`` is a public protocol
(``zf.optim.GradientTransformation``) that users write their own of, and wrappers (amp's masters,
offload, ``multi_transform``) call their inner one's. A keyword would have to pass through every one
of them; a context reaches the ones that ask for it, and an ``init`` that does not (a user's own)
keeps zero-filling, which is always safe.

What may be left unwritten: only what ``zf.checkpoint.load`` writes in full. It writes every element
of every range a state holds of a bucket-shaped quantity (the parameters, frozen tensors, each
parameter-shaped optimizer leaf under a bucket key, each quantity a wrapper declares): the saved
values over each parameter's elements, zeros over the padding. Scratch that a wrapper leaves out of
its ``state_parts()`` (offload's gradient buffers) and small tensors (counts, the loss scale) are
allocated filled, as always: a load that finds none of them saved leaves them as ``init`` made them.

``unfilled(poison=float("nan"))`` fills what would be left unwritten with ``poison`` instead (integer
tensors with their dtype's largest value), so a test can show that a load writes every element of
it: the loaded state is then finite and equal to the saved one.

Example:
    >>> import torch
    >>> from zerofn import alloc
    >>> alloc.zeros(3, dtype=torch.float32).tolist(), alloc.filling()
    ([0.0, 0.0, 0.0], True)
    >>> with alloc.unfilled(poison=float("nan")):
    ...     alloc.zeros(2, dtype=torch.float32).isnan().all().item(), alloc.filling()
    (True, False)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import NamedTuple

import torch

from zerofn._io import new_file, write_at

__all__ = ["copy_of", "filling", "unfilled", "zeros", "zeros_file", "zeros_like"]


class _Mode(NamedTuple):
    poison: float | None  # None: nothing written


_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar("zerofn_alloc", default=None)


@contextlib.contextmanager
def unfilled(poison: float | None = None) -> Iterator[None]:
    """Inside: :func:`zeros`, :func:`zeros_like`, :func:`copy_of` and :func:`zeros_file` allocate without
    writing (see the module docs for what may be allocated so). ``poison``: fill with it instead (None:
    write nothing); nested inside another, an ``unfilled()`` without one keeps the outer one's."""
    outer = _MODE.get()
    if poison is None and outer is not None:
        poison = outer.poison
    token = _MODE.set(_Mode(poison))
    try:
        yield
    finally:
        _MODE.reset(token)


def filling() -> bool:
    """Whether ``init`` functions write their values (False inside :func:`unfilled`)."""
    return _MODE.get() is None


def zeros(
    *shape, dtype: torch.dtype, device: torch.device | str | None = None, pin_memory: bool = False
) -> torch.Tensor:
    """``torch.zeros(*shape, ...)``; inside :func:`unfilled`, ``torch.empty``."""
    mode = _MODE.get()
    if mode is None:
        return torch.zeros(*shape, dtype=dtype, device=device, pin_memory=pin_memory)
    return _unwritten(torch.empty(*shape, dtype=dtype, device=device, pin_memory=pin_memory), mode, pin_memory)


def zeros_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.zeros_like(t, dtype=dtype)`` (t's memory format kept); inside :func:`unfilled`,
    ``torch.empty_like``."""
    mode = _MODE.get()
    if mode is None:
        return torch.zeros_like(t, dtype=dtype, memory_format=torch.preserve_format)
    return _unwritten(torch.empty_like(t, dtype=dtype, memory_format=torch.preserve_format), mode, False)


def copy_of(
    t: torch.Tensor,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    pin_memory: bool = False,
) -> torch.Tensor:
    """A new tensor holding ``t``'s values (in ``dtype``, on ``device``: by default ``t``'s; copied
    without blocking when ``pin_memory``); inside :func:`unfilled`, one of its shape, nothing written."""
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device=device or t.device, pin_memory=pin_memory)
    mode = _MODE.get()
    if mode is None:
        return out.copy_(t.detach(), non_blocking=pin_memory)
    return _unwritten(out, mode, pin_memory)


def zeros_file(path: str, dtype: torch.dtype, numel: int) -> None:
    """Make ``path`` a new file of ``numel`` zeros of ``dtype``, at its size with nothing written (its
    holes read as zeros); inside :func:`unfilled` with a ``poison``, filled with that instead."""
    new_file(path, numel * dtype.itemsize)
    mode = _MODE.get()
    if mode is not None and mode.poison is not None:
        chunk = max(1, 2**22 // dtype.itemsize)
        for a in range(0, numel, chunk):
            write_at(path, _unwritten(torch.empty(min(chunk, numel - a), dtype=dtype), mode, False), a)


def _unwritten(t: torch.Tensor, mode: _Mode, pinned: bool) -> torch.Tensor:
    """``t`` as :func:`unfilled` leaves it: as it is, or poisoned if asked."""
    if t.device.type == "meta" or mode.poison is None:
        return t
    if t.is_floating_point() or t.is_complex():
        return t.fill_(mode.poison)
    return t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)
