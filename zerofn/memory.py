"""Memory: estimates of what a state holds, and measurement of what a block allocates.

``estimate(...)`` (from ``zerofn.plan``) predicts, from a parameter count or
a model's shapes, the bytes per GPU, CPU RAM and NVMe of every ZeRO stage and
offload; ``state_bytes(state)`` counts what a real state holds.

``track()`` measures, on any device (CPU included, so tests need no GPU), the
live bytes of tensor storages allocated inside a ``with`` block, and their
peak over time.

What is counted:

* every storage that an operator creates inside the block, whichever op made
  it: forward ops, factory functions (``torch.empty``, ``torch.tensor``), and
  the ops the autograd engine runs during ``loss.backward()`` (gradients,
  intermediate gradients), including ops run in autograd hooks such as
  ``register_post_accumulate_grad_hook``;
* a storage once, however many views or outputs alias it; views and in-place
  ops add nothing;
* growth of a storage inside the block (``Tensor.resize_``, ``out=`` ops that
  resize, ``UntypedStorage.resize_``), and shrinking of one that is counted
  (``untyped_storage().resize_(0)`` frees its bytes);
* tensors registered by hand with ``Tracker.add``.

A counted storage stops counting when it dies (a weak reference to its
``UntypedStorage``, whose Python object torch keeps unique and alive as long as
the storage lives), even after the block has exited, so ``current`` stays
valid after exit.

What is not counted:

* storages that existed before entering the block (unless they grow inside,
  then only the growth), and tensors made outside torch's dispatcher, such as
  ``torch.from_numpy`` or storages built by ``torch.load``'s unpickler;
* memory that C++ libraries hold for themselves: gloo/NCCL buffers, the CUDA
  caching allocator's reserve and fragmentation, workspaces of cuBLAS/cuDNN;
* ops run on threads other than the one that entered the block, except the
  autograd engine's own threads (torch carries the dispatch mode to them);
* ``meta`` and fake tensors, which hold no memory.

Sizes are storage sizes (``UntypedStorage.nbytes()``): a view of a large
tensor keeps the whole storage alive and counted, exactly as the allocator
sees it; the allocator's rounding is not modelled.

Example:
    >>> import torch
    >>> from zerofn import memory
    >>> with memory.track() as t:
    ...     a = torch.empty(1024, dtype=torch.float32)  # 4 KiB
    ...     b = torch.empty(512, dtype=torch.float32)   # 2 KiB
    ...     del a
    >>> t.peak, t.current
    (6144, 2048)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)

from zerofn.placement import held_bytes
from zerofn.plan import estimate

__all__ = ["Tracker", "estimate", "state_bytes", "track"]


# --------------------------------------------------------------------------
# Measurement: track()
# --------------------------------------------------------------------------

# Ops whose output storage was made just before them, outside the dispatcher,
# and is therefore new although it is also their input (``torch.tensor(...)``).
_FRESH_OPS = frozenset(
    op for name in ("lift_fresh", "lift_fresh_copy") for op in (getattr(torch.ops.aten, name, None),) if op is not None
)


class _Record:
    """One counted storage: its weak reference, device and counted bytes."""

    __slots__ = ("ref", "device", "base", "counted")

    def __init__(self, ref: weakref.ref, device: str, base: int, counted: int):
        self.ref = ref
        self.device = device
        self.base = base  # bytes it had before we counted it (not ours)
        self.counted = counted  # bytes we currently count for it


class Tracker:
    """Live and peak bytes of tensor storages allocated inside a ``with`` block.

    Made by ``track()``; see the module docstring for what is counted. All
    numbers are in bytes. ``current`` and ``current_by_device`` keep falling
    after the block exits as counted storages die.

    Attributes:
        peak: Maximum over time of ``current`` (all devices together).
        current: Bytes allocated inside the block and still alive now.
        peak_by_device: ``{"cpu": ..., "cuda:0": ...}``, each device's own
            maximum over time (they need not peak at the same moment).
        current_by_device: Like ``current``, per device.
        allocated: Total bytes ever allocated inside (never decreases).
        marks: ``{name: current}`` recorded by ``mark``.

    Example:
        >>> import torch
        >>> from zerofn import memory
        >>> with memory.track() as t:
        ...     x = torch.ones(256)          # 1 KiB
        ...     t.mark("after x")
        ...     y = x * 2                    # 1 KiB more
        1024
        >>> t.marks, t.peak, t.peak_by_device
        ({'after x': 1024}, 2048, {'cpu': 2048})
    """

    def __init__(self) -> None:
        self.peak = 0
        self.current = 0
        self.allocated = 0
        self.peak_by_device: dict[str, int] = {}
        self.current_by_device: dict[str, int] = {}
        self.marks: dict[str, int] = {}
        self._records: dict[int, _Record] = {}  # id(UntypedStorage) -> record
        self._lock = threading.RLock()  # frees may run on autograd threads
        self._mode: _TrackMode | None = None
        self._used = False

    # -- public ------------------------------------------------------------

    def mark(self, name: str) -> int:
        """Record the current live bytes under a label in ``marks``.

        Args:
            name: The label; marking the same name again overwrites it.

        Returns:
            The live bytes recorded (``current`` now).

        Example:
            >>> import torch
            >>> from zerofn import memory
            >>> with memory.track() as t:
            ...     x = torch.zeros(8)
            ...     _ = t.mark("x")
            >>> t.marks["x"]
            32
        """
        with self._lock:
            self.marks[name] = self.current
            return self.current

    def add(self, tensor: torch.Tensor) -> int:
        """Count a tensor made elsewhere (for example before the block) until it dies.

        Its storage is counted once, like any storage made inside; adding a
        tensor whose storage is already counted adds nothing.

        Args:
            tensor: The tensor whose storage to count.

        Returns:
            The bytes newly counted (0 if its storage was already counted).

        Raises:
            TypeError: If ``tensor`` is not a ``torch.Tensor``.

        Example:
            >>> import torch
            >>> from zerofn import memory
            >>> w = torch.zeros(4)
            >>> with memory.track() as t:
            ...     _ = t.add(w)
            >>> t.current
            16
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Tracker.add(tensor): expected a torch.Tensor, got {type(tensor).__name__}.")
        before = self.current
        for st in _storages(tensor):
            self._see(st, base=0)
        return self.current - before

    def __enter__(self) -> Tracker:
        if self._used:
            raise RuntimeError(
                "track(): this Tracker was already entered once; a tracker "
                "measures one block. Make a new one with zerofn.memory.track()."
            )
        self._used = True
        self._mode = _TrackMode(self)
        _resize_hook_acquire(self)
        try:
            self._mode.__enter__()
        except BaseException:
            _resize_hook_release(self)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        try:
            mode.__exit__(*exc)
        finally:
            _resize_hook_release(self)

    def __repr__(self) -> str:
        return (
            f"Tracker(peak={self.peak}, current={self.current}, "
            f"allocated={self.allocated}, peak_by_device={self.peak_by_device})"
        )

    # -- private -----------------------------------------------------------

    def _see(self, st: torch.UntypedStorage, base: int) -> None:
        """Count ``st`` if new (its bytes above ``base``), or update its size."""
        key = id(st)
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and rec.ref() is st:
                self._set(rec, max(0, st.nbytes() - rec.base))
                return
            device = str(st.device)
            ref = weakref.ref(st, lambda r, key=key: self._free(key, r))
            rec = _Record(ref, device, base, 0)
            self._records[key] = rec
            self._set(rec, max(0, st.nbytes() - base))

    def _resized(self, st: torch.UntypedStorage, before: int) -> None:
        """After ``st`` was resized from ``before`` bytes, update what is counted."""
        with self._lock:
            rec = self._records.get(id(st))
            if rec is not None and rec.ref() is st:
                self._set(rec, max(0, st.nbytes() - rec.base))
            elif st.nbytes() > before:
                self._see(st, base=before)

    def _set(self, rec: _Record, counted: int) -> None:
        delta = counted - rec.counted
        if delta == 0:
            return
        rec.counted = counted
        dev = rec.device
        self.current += delta
        cur_dev = self.current_by_device.get(dev, 0) + delta
        self.current_by_device[dev] = cur_dev
        if delta > 0:
            self.allocated += delta
            if self.current > self.peak:
                self.peak = self.current
            if cur_dev > self.peak_by_device.get(dev, 0):
                self.peak_by_device[dev] = cur_dev

    def _free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            rec = self._records.get(key)
            if rec is None or rec.ref is not ref:
                return
            del self._records[key]
            self._set(rec, 0)


def track() -> Tracker:
    """Measure live and peak tensor bytes allocated inside a ``with`` block.

    Works on every device, CPU included, through a ``TorchDispatchMode`` that
    sees each op's outputs, forward and backward. Trackers nest; each counts
    everything allocated inside its own block. Plain ``torch.distributed``
    collectives keep working inside (they write into tensors made beforehand;
    the functional ones' outputs are counted).

    Returns:
        A fresh ``Tracker``; enter it with ``with``. Read ``peak``,
        ``current``, ``peak_by_device``, ``allocated`` and ``marks`` inside or
        after the block.

    Example:
        >>> import torch
        >>> from zerofn import memory
        >>> model = torch.nn.Linear(256, 256)                 # made outside
        >>> with memory.track() as t:
        ...     model(torch.ones(8, 256)).sum().backward()
        >>> grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters())
        >>> t.peak >= grads, t.current == grads
        (True, True)
    """
    return Tracker()


class _TrackMode(TorchDispatchMode):
    """Dispatch mode that reports the storages each op creates or grows."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Sizes of the input storages: an output aliasing one of them (a view,
        # an in-place or out= op) is not new, unless it grew.
        before: dict[int, int] = {}
        for t in _tensors((args, kwargs)):
            for st in _storages(t):
                before[id(st)] = st.nbytes()
        out = func(*args, **kwargs)
        fresh = getattr(func, "overloadpacket", None) in _FRESH_OPS
        seen: set[int] = set()
        for t in _tensors(out):
            for st in _storages(t):
                key = id(st)
                if key in seen:
                    continue
                seen.add(key)
                if fresh or key not in before:
                    self.tracker._see(st, base=0)
                else:
                    self.tracker._resized(st, before[key])
        return out


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors in an op's arguments or outputs (nested lists/tuples/dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """Yield the untyped storages holding ``t``'s memory (inner ones for wrapper subclasses)."""
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    if t.device.type == "meta" or getattr(t, "fake_mode", None) is not None:
        return
    try:
        st = t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse, nested, functional
        return
    if st.device.type != "meta":
        yield st


# ``UntypedStorage.resize_`` (how FSDP-style code frees gathered parameters)
# bypasses the dispatcher, so while any tracker is active it is wrapped to
# report resizes to every active tracker.
_RESIZE_LOCK = threading.Lock()
_RESIZE_TRACKERS: list[Tracker] = []
_ORIG_RESIZE = None
_OWN_RESIZE = False  # whether UntypedStorage defined resize_ itself before


def _resize_hook_acquire(tracker: Tracker) -> None:
    global _ORIG_RESIZE, _OWN_RESIZE
    with _RESIZE_LOCK:
        if not _RESIZE_TRACKERS:
            orig = torch.UntypedStorage.resize_
            _ORIG_RESIZE = orig
            _OWN_RESIZE = "resize_" in torch.UntypedStorage.__dict__

            def resize_(st, size):
                before = st.nbytes()
                result = orig(st, size)
                for tr in list(_RESIZE_TRACKERS):
                    tr._resized(st, before)
                return result

            torch.UntypedStorage.resize_ = resize_
        _RESIZE_TRACKERS.append(tracker)


def _resize_hook_release(tracker: Tracker) -> None:
    global _ORIG_RESIZE
    with _RESIZE_LOCK:
        if tracker in _RESIZE_TRACKERS:
            _RESIZE_TRACKERS.remove(tracker)
        if not _RESIZE_TRACKERS and _ORIG_RESIZE is not None:
            if _OWN_RESIZE:
                torch.UntypedStorage.resize_ = _ORIG_RESIZE
            else:  # inherited from torch._C.StorageBase: just unshadow it
                del torch.UntypedStorage.resize_
            _ORIG_RESIZE = None


# --------------------------------------------------------------------------
# Estimates: state_bytes() (below)
# --------------------------------------------------------------------------


def state_bytes(state: Any) -> dict[str, int]:
    """Bytes a TrainState holds on this rank between steps.

    Gradients live only inside a step, so they are not here (their peak is
    what :func:`track` measures); gradient sums carried between accumulation
    micro-steps are reported under ``"grad_accum"``.

    Args:
        state: a ``zerofn.TrainState``.

    Returns:
        ``{"params", "buffers", "optimizer", "grad_accum", "total"}`` in bytes, plus
        ``"by_placement"``: total bytes per device type (``"cpu"``, ``"cuda"``)
        or other placement (``"nvme"``: files of ``offload(device="nvme")``).
        Storages shared between leaves count once.

    Example:
        >>> import torch, zerofn as zf
        >>> apply = zf.functional(torch.nn.Linear(4, 2))
        >>> step = zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.adamw(1e-3))
        >>> zf.memory.state_bytes(step.init(apply.params))["optimizer"]   # 10 params x 2 moments x 4 B + the count
        88
    """
    from zerofn.state import TrainState

    if not isinstance(state, TrainState):
        raise TypeError(f"state_bytes expects a zerofn TrainState, got {type(state).__name__}")
    groups = {
        "params": held_bytes((state.arriving_params(), state.frozen)),
        "buffers": held_bytes(state.buffers),
        "optimizer": held_bytes(state.opt_state),
        "grad_accum": held_bytes(state.grad_accum),
    }
    out: dict[str, Any] = {k: sum(v.values()) for k, v in groups.items()}
    out["total"] = sum(out.values())
    placement: dict[str, int] = {}
    for v in groups.values():
        for dev, n in v.items():
            placement[dev] = placement.get(dev, 0) + n
    out["by_placement"] = placement
    return out
