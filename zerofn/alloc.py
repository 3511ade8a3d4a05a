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

:class:`HostPool` is the other allocation here: a fixed number of host buffers of one size, reused
step after step by the offload paths (shards read from files, the NVMe update's sub-groups, gradients
on their way to files). A process that allocated and freed those buffers each time would leave the
resident memory to the allocator: glibc, once a freed buffer has raised its mmap threshold, serves the
next ones from its heap, which fragments and grows with the number of buffers a step goes through,
that is with the model. A pool's memory is its ``count`` buffers, whatever the model and the
allocator's settings. A step that computes on the CPU still allocates its own buffers there (gathered
units, gradients) through the C allocator, whose freed memory the same fragmentation keeps resident:
:func:`return_freed` hands it back to the system (glibc's ``malloc_trim``), which ``offload`` does
after each update that ran on the CPU.

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
import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from zerofn._io import new_file, write_at

__all__ = [
    "ALIGN",
    "HostPool",
    "Lease",
    "copy_of",
    "filling",
    "slot_bytes",
    "unfilled",
    "zeros",
    "zeros_file",
    "zeros_like",
]

ALIGN = 256  # bytes: where each tensor of a pool buffer starts (a multiple of every CPU vector width)


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


def slot_bytes(layout: Sequence[tuple[torch.dtype, int]]) -> int:
    """Bytes of a pool buffer that holds one tensor of each ``(dtype, numel)`` of ``layout``, each starting
    at a multiple of :data:`ALIGN`."""
    return sum(-(-n * dtype.itemsize // ALIGN) * ALIGN for dtype, n in layout)


class Lease:
    """Tensors carved from one buffer of a :class:`HostPool` (``tensors``), until :meth:`release`."""

    def __init__(self, pool: HostPool, buffer: torch.Tensor, tensors: list[torch.Tensor], pooled: bool) -> None:
        self.pool, self.buffer, self.tensors, self.pooled = pool, buffer, tensors, pooled

    def release(self, after: Any = None) -> None:
        """Give the buffer back (once; again does nothing). ``after``: a CUDA event that work still
        reading or writing the buffer (a copy queued from it) records; the buffer's next lease waits for it."""
        if self.buffer is not None:
            self.pool._give(self.buffer, after, self.pooled)
            self.buffer, self.tensors = None, []


class HostPool:
    """``count`` host buffers of ``nbytes`` each (pinned when ``pin``), reused from lease to lease.

    A buffer is allocated the first time it is needed, never freed while the pool lives: the pool holds
    at most ``count * nbytes``, however many leases a step takes. :meth:`take` carves tensors of the
    dtypes and sizes asked for from a free buffer; :meth:`Lease.release` gives it back, from any thread.
    A lease asked for when every buffer is out (or larger than ``nbytes``) gets a buffer of its own,
    freed when released: counted in ``overflows``, which the callers' sizing keeps at 0 (the tests
    check), so that a mistake costs memory, never a deadlock.

    Example:
        >>> import torch
        >>> from zerofn.alloc import HostPool
        >>> pool = HostPool(2, 1024)
        >>> a = pool.take([(torch.float32, 4), (torch.int64, 2)])
        >>> [tuple(t.shape) for t in a.tensors], pool.in_use
        ([(4,), (2,)], 1)
        >>> a.release(); b = pool.take([(torch.float32, 8)])
        >>> pool.allocated, pool.overflows  # the same buffer again
        (1, 0)
    """

    def __init__(self, count: int, nbytes: int, *, pin: bool = False) -> None:
        if count < 1 or nbytes < 0:
            raise ValueError(f"HostPool: count must be >= 1 and nbytes >= 0, got count={count}, nbytes={nbytes}")
        self.count, self.nbytes, self.pin = count, nbytes, pin
        self.allocated = 0  # buffers made so far (at most count)
        self.in_use = 0  # pooled buffers out on lease now
        self.peak = 0  # the most pooled buffers out at once
        self.overflows = 0  # leases served outside the pool
        self._free: list[tuple[torch.Tensor, Any]] = []  # (buffer, the event its last lease left, or None)
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        """Bytes the pool holds now (its buffers made so far)."""
        return self.allocated * self.nbytes

    def take(self, layout: Sequence[tuple[torch.dtype, int]]) -> Lease:
        """A lease of one buffer, as a tensor per ``(dtype, numel)`` of ``layout`` (contents undefined)."""
        need = slot_bytes(layout)
        buffer, after, pooled = None, None, need <= self.nbytes
        with self._lock:
            if pooled and self._free:
                buffer, after = self._free.pop()
            elif pooled and self.allocated < self.count:
                self.allocated += 1
            else:
                pooled = False
                self.overflows += 1
            if pooled:
                self.in_use += 1
                self.peak = max(self.peak, self.in_use)
        if after is not None:
            after.synchronize()
        if buffer is None:
            buffer = torch.empty(self.nbytes if pooled else need, dtype=torch.uint8, pin_memory=self.pin)
        tensors, at = [], 0
        for dtype, n in layout:
            tensors.append(buffer[at : at + n * dtype.itemsize].view(dtype))
            at += -(-n * dtype.itemsize // ALIGN) * ALIGN
        return Lease(self, buffer, tensors, pooled)

    def _give(self, buffer: torch.Tensor, after: Any, pooled: bool) -> None:
        if not pooled:
            return  # a buffer of its own: freed with the lease
        with self._lock:
            self._free.append((buffer, after))
            self.in_use -= 1

    def __repr__(self) -> str:
        return f"HostPool({self.count} x {self.nbytes / 2**20:.2f} MiB, {self.allocated} made, {self.in_use} in use)"


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def return_freed() -> bool:
    """Give the memory the C allocator holds free back to the system (glibc's ``malloc_trim(0)``, which
    releases free pages inside its heaps, not only at their tops); False where the C library has no
    such call. Pooled buffers are held, so they stay; what it returns is the step's own freed buffers."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
