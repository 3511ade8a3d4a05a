"""How gradients are reduced across ranks: the :class:`Reduction` part of a Step, and the engine that runs it.

A Step's ``reduction`` says how a gradient bucket is reduced over the ranks
and how many shards the optimizer splits each bucket into. The default here
is DDP's: every bucket all-reduced, every rank holding and updating the
whole of it (ZeRO stage 0). A transform that shards optimizer state replaces
it with a subclass that says so through named capabilities
(``shards_optimizer``, ``shards_grads``); transforms that imply one another
read those, never names or stage numbers.

:class:`GradSink` is the engine: backward hands it each parameter's
gradient through a post-accumulate-grad hook on a leaf the step created
(:meth:`GradSink.leaf`); it copies the gradient into its bucket, frees it,
and launches the bucket's reduction as soon as the bucket is complete, in
bucket order, while backward goes on.

Example:
    >>> from zerofn.reduction import Reduction
    >>> r = Reduction()
    >>> r.shards_optimizer, r.shards_grads, r.shards(world=4), r.replicated, r.every_micro
    (False, False, 1, True, False)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._utils import _flatten_dense_tensors

from zerofn import collectives as C
from zerofn import counters, keys
from zerofn.state import Bucket, Layout

__all__ = ["GradSink", "Reduction", "bucket_group", "bucket_rank", "replica"]


def _apart_axes(bucket: Bucket) -> tuple[str, ...]:
    return tuple(a for a in (bucket.apart, bucket.replicate) if a)


def bucket_group(bucket: Bucket) -> object:
    """The group ``bucket`` is sharded over (and, but across its replicas, reduced over): the current one
    (None), or for a bucket of parameters cut along an axis of it (:attr:`Bucket.apart`) or replicated
    across one (:attr:`Bucket.replicate`), its ranks that share this rank's coordinate there."""
    axes = _apart_axes(bucket)
    return C.without(axes[0] if len(axes) == 1 else axes) if axes else None


def bucket_rank(bucket: Bucket, rank: int) -> int:
    """This rank's place in :func:`bucket_group` (``rank``: its place in the current group): which shard
    of ``bucket`` it holds."""
    return C.rank(bucket_group(bucket)) if _apart_axes(bucket) else rank


def replica(bucket: Bucket) -> int:
    """This rank's coordinate across ``bucket``'s replicas (0 without any): the first replica counts the
    bucket's shard in the gradient norm and saves it."""
    return C.rank(C.along(bucket.replicate)) if bucket.replicate else 0


@dataclass(frozen=True)
class Reduction:
    """Replicated gradients (DDP): each bucket is all-reduced; the optimizer updates all of it.

    Attributes:
        name: this part's piece of the step's name (None: it adds none).
    """

    name: str | None = None

    @property
    def shards_optimizer(self) -> bool:
        """Each rank updates (and holds the optimizer state of) its shard of every bucket only."""
        return False

    @property
    def shards_grads(self) -> bool:
        """Gradients are sharded for the whole step: no rank holds a whole reduced gradient."""
        return False

    def shards(self, world: int) -> int:
        """How many shards each bucket is split into for the optimizer."""
        return 1

    @property
    def replicate(self) -> str:
        """The mesh axis across which each bucket's shards are replicas (hybrid sharding's ``dp_replicate``:
        :attr:`zerofn.state.Bucket.replicate`); empty: none."""
        return ""

    @property
    def replicated(self) -> bool:
        """True when every rank ends with the same reduced gradient (one rank's norm is the global norm)."""
        return True

    @property
    def every_micro(self) -> bool:
        """Reduce on every accumulation micro-step and carry the reduced partition (sharded
        gradients), instead of carrying full local sums and reducing once."""
        return False

    def folds(self, bucket: Bucket) -> bool:
        """Whether a running partition (sharded gradients' ``out``) is folded into this rank's slice of the
        bucket before the reduction, which then lands the new total in place; False: the reduction adds
        it after (a quantized reduction, which would quantize the running sum too)."""
        return True

    def reduce(self, grad: torch.Tensor, bucket: Bucket, rank: int, out: torch.Tensor | None) -> C.Handle:
        """Launch the reduction of a bucket's gradient; ``wait()`` gives the summed gradient the optimizer sees.

        ``out``, when given, is this rank's running partition, which the
        reduction overwrites with the new total (sharded reductions only).
        """
        if out is not None:
            raise ValueError("a replicated (all-reduce) bucket is reduced in place; it takes no out tensor")
        return C.all_reduce(grad, "sum", async_op=True, group=bucket_group(bucket))

    def replace(self, **changes) -> Reduction:
        return dataclasses.replace(self, **changes)


class GradSink:
    """Gradient buckets that backward fills and that are reduced as they complete.

    A bucket's buffer is allocated when the bucket is complete (reduced or
    carried): until then its gradients wait as autograd handed them over, so
    that, as with torch's own ``.grad``, gradient memory grows only as
    backward hands gradients over. The buffer is not zero-filled first
    (``torch.empty``): each pending gradient is copied into its slot, and
    only what none wrote (the padding, the slots of parameters that got no
    gradient) is zeroed, so the bucket is written once instead of zeroed
    and then read and written again by an add. ``copy_`` gives the
    gradient's own value, as ``0 + g`` did (it keeps the sign of a ``-0.0``
    that ``0 + g`` turns into ``+0.0``; the two compare equal).

    When ``reduce`` is set, a completed bucket is reduced at once, in bucket
    order (so every rank issues the same collectives in the same order),
    while backward goes on. A sharded reduction writes a new partition-sized
    tensor, so its full bucket is dropped as soon as it lands; at most one
    such reduction is in flight, which bounds the full-size gradient memory
    to two buckets (the one in flight and the one filling) plus the
    gradient autograd is handing over.

    Args:
        layout: the state's bucket layout.
        reduction: the step's :class:`Reduction`.
        grad_dtype: bucket dtype -> the dtype its gradient travels in.
        rank: this rank.
        reduce: reduce completed buckets (False: only accumulate local sums).
        carried: full local gradient sums from earlier micro-steps, or None.
        reduced_sums: reduced partitions from earlier micro-steps, or None;
            each reduction updates its partition in place, so only one
            partition is ever alive.
        on_result: ``on_result(i, reduced)``, called with each bucket's
            reduced gradient as soon as it is waited for (during backward:
            a bucket is waited for when the next one is launched), which
            takes it over: the sink keeps no result of its own (``finish``
            gives None for each bucket).
    """

    def __init__(
        self,
        layout: Layout,
        reduction: Reduction,
        grad_dtype: Callable[[torch.dtype], torch.dtype],
        rank: int,
        reduce: bool,
        carried=None,
        reduced_sums=None,
        on_result: Callable[[int, torch.Tensor], None] | None = None,
    ):
        n = len(layout.buckets)
        self.sums = list(reduced_sums) if reduced_sums is not None else None
        self.layout, self.reduction, self.rank, self.reduce = layout, reduction, rank, reduce
        self.dtypes = [grad_dtype(b.dtype) for b in layout.buckets]
        self.buffers: list[torch.Tensor | None] = list(carried) if carried is not None else [None] * n
        # Gradients of a bucket whose buffer does not exist yet: the buffer is allocated when the bucket
        # is reduced (or carried), so that, as with torch's own .grad, gradient memory grows only as
        # backward hands gradients over.
        self.pending: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(n)]
        self.views: dict[str, torch.Tensor] = {}
        self.where = layout.bucket_of
        self.remaining = [len(b.slots) for b in layout.buckets]
        self.handles: list[C.Handle | None] = [None] * n
        self.results: list[torch.Tensor | None] = [None] * n
        self.launched = 0
        self.received = 0  # gradients handed over in this micro-step
        self.got: set[str] = set()  # the parameters they were for
        self.release = not reduction.replicated
        self.on_result = on_result
        # Set by the step just before its own backward: gradients computed before it (a gradient penalty's
        # torch.autograd.grad inside loss_fn) are no gradients of the step's, and never reach the sink.
        self.backward_started = False
        # fp16 gradients are divided by the world size before the reduction, so that
        # summing N ranks' scaled gradients does not overflow fp16's range.
        world = C.world_size()
        self.predivide = [world if d == torch.float16 else 1 for d in self.dtypes]

    def leaf(self, name: str, view: torch.Tensor, then: Callable[[torch.Tensor], None] | None = None):
        """A fresh leaf over ``view`` whose gradient goes into parameter ``name``'s bucket slot.

        Returns ``(leaf, hooks)``; ``then(leaf)`` runs after the gradient is
        taken. Remove the hooks when the step is over.
        """
        leaf = view.detach().requires_grad_(True)
        # In the step's process group also where autograd runs the hook on a thread of its own (CUDA).
        hooks = [leaf.register_post_accumulate_grad_hook(C.with_current_group(self._take(name)))]
        if then is not None:
            hooks.append(leaf.register_post_accumulate_grad_hook(C.with_current_group(then)))
        return leaf, hooks

    def buffer(self, i: int) -> torch.Tensor:
        """Bucket ``i``'s gradient buffer, made on first use: its pending gradients copied into unfilled
        storage, and only what none of them wrote (padding, parameters without a gradient) zeroed."""
        buf = self.buffers[i]
        if buf is None:
            b, dtype = self.layout.buckets[i], self.dtypes[i]
            pending, self.pending[i] = self.pending[i], []
            whole = self._in_slot_order(b, pending, dtype)
            if whole:  # one gradient for every slot (the usual case): one copy, no view per slot
                if b.padded > b.numel:
                    whole.append(torch.zeros(b.padded - b.numel, dtype=dtype, device=b.device))
                # torch's own concatenation of flattened tensors (DDP's, apex's): no Python call per gradient
                self.buffers[i] = buf = _flatten_dense_tensors(whole)
            else:
                buf = self.buffers[i] = torch.empty(b.padded, dtype=dtype, device=b.device)
                written: set[str] = set()
                for name, grad in pending:
                    if name in written:  # a second gradient for the same slot
                        self._add(name, grad)
                    else:
                        view = self._view(name)
                        view.copy_(grad.reshape(view.shape))
                        written.add(name)
                if len(written) < len(b.slots):
                    for s in b.slots:
                        if s.name not in written:
                            buf[s.offset : s.offset + s.numel].zero_()
                if b.padded > b.numel:
                    buf[b.numel :].zero_()
        return buf

    @staticmethod
    def _in_slot_order(bucket: Bucket, pending: list, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The pending gradients in the bucket's slot order when they are one of the buffer's dtype for each of
        its slots, which lie end to end from its start; None otherwise."""
        slots = bucket.slots
        if len(pending) != len(slots):
            return None
        in_order = True
        for s, (name, g) in zip(slots, pending):
            if g.dtype != dtype:
                return None
            in_order = in_order and s.name == name
        if in_order:
            return [g for _, g in pending]
        by_name = dict(pending)
        if len(by_name) != len(slots) or any(s.name not in by_name for s in slots):
            return None
        return [by_name[s.name] for s in slots]

    def _view(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s slot in its bucket's buffer (the bucket's views made on first use)."""
        view = self.views.get(name)
        if view is None:
            i = self.where[name]
            self.views.update(self.layout.bucket_views(i, self.buffers[i]))
            view = self.views[name]
        return view

    def _add(self, name: str, grad: torch.Tensor) -> None:
        view = self._view(name)
        view.add_(grad.reshape(view.shape))

    def _take(self, name: str) -> Callable[[torch.Tensor], None]:
        return functools.partial(self.take, name)

    def take(self, name: str, leaf: torch.Tensor) -> None:
        """Take parameter ``name``'s gradient from ``leaf`` (its post-accumulate-grad hook): into its bucket,
        and launch the bucket's reduction once it is complete."""
        self.take_bucket(self.where[name], [(name, leaf)])

    def take_bucket(self, i: int, leaves: list[tuple[str, torch.Tensor]]) -> None:
        """:meth:`take` for several parameters of bucket ``i`` at once, ``(name, leaf)`` each: one call for a
        bucket's gradients, not one per parameter."""
        if self.buffers[i] is None:
            self.pending[i] += [(name, leaf.grad) for name, leaf in leaves]
        else:
            self.buffer(i)
            for name, leaf in leaves:
                self._add(name, leaf.grad)
        for name, leaf in leaves:
            leaf.grad = None
            self.got.add(name)
        self.received += len(leaves)
        self.remaining[i] -= len(leaves)
        if self.reduce and self.remaining[i] == 0:
            j = self.launched
            while j < len(self.remaining) and self.remaining[j] == 0:
                j += 1
            self._launch_upto(j)

    def _launch_upto(self, upto: int) -> None:
        while self.launched < upto:
            i = self.launched
            if (self.release or self.on_result is not None) and i > 0:
                if i > 1:  # a reduction left in flight by the last launch (see below) lands now
                    self._settle(i - 2)
                if hasattr(self.handles[i - 1], "progress"):
                    # a reduction of two collectives (hybrid sharding's across-node all-reduce after the
                    # reduce-scatter): its second stays in flight beside this bucket's reduction
                    self._progress(i - 1)
                else:
                    self._settle(i - 1)
            bucket, out = self.layout.buckets[i], None
            if self.predivide[i] != 1:
                self.buffer(i).mul_(1.0 / self.predivide[i])
            if self.sums is not None:
                # Fold the running sum into this rank's own slice of the input: the
                # reduction then lands the new total in place, with no temporary. Replicas
                # hold the same sum: one of them folds it, the sum across them adds it once.
                if replica(bucket) == 0 and self.reduction.folds(bucket):
                    lo, hi = bucket.shard_range(bucket_rank(bucket, self.rank))
                    self.buffer(i)[lo:hi].add_(self.sums[i])
                out = self.sums[i]
            self.handles[i] = self.reduction.reduce(self.buffer(i), bucket, self.rank, out)
            self.launched += 1

    def _progress(self, i: int) -> None:
        """Bucket ``i``'s first collective landed and its second started; its full buffer, which the first
        read, goes (a sharded reduction's result is a partition of its own)."""
        self.handles[i].progress()
        if self.release:
            self.buffers[i] = None
            for s in self.layout.buckets[i].slots:
                self.views.pop(s.name, None)

    def _settle(self, i: int) -> None:
        if self.results[i] is None and self.handles[i] is not None:
            result = self.handles[i].wait()
            if self.on_result is None:
                self.results[i] = result
            else:
                self.on_result(i, result)
                self.results[i] = None
            self.handles[i] = None
            if self.release or self.on_result is not None:
                self.buffers[i] = None
                for s in self.layout.buckets[i].slots:
                    self.views.pop(s.name, None)

    def seen(self, before: torch.Tensor | None) -> torch.Tensor | None:
        """Which trainable parameters (``layout.trainable_names`` order, uint8) got a gradient in this
        micro-step or the ones ``before`` covers; None when every one did (the usual case)."""
        names = self.layout.trainable_names
        if before is None and len(self.got) == len(names):
            return None
        prev = counters.values(before) if before is not None else (0,) * len(names)  # carried: no read
        now = tuple(int(bool(p) or n in self.got) for p, n in zip(prev, names))
        return None if all(now) else counters.new_like(now, dtype=torch.uint8)

    def launch(self) -> None:
        """Start reducing every bucket not started yet (a bucket with an unused parameter keeps zeros there)."""
        self._launch_upto(len(self.layout.buckets))

    def finish(self) -> dict[str, torch.Tensor]:
        """Reduce what is left (see :meth:`launch`); return every result."""
        self.launch()
        for i in range(len(self.layout.buckets)):
            self._settle(i)
        out = {keys.bucket(i): r for i, r in enumerate(self.results)}
        self.results = []  # the caller owns them now: they die when it lets go
        return out

    def full_buffers(self) -> tuple[torch.Tensor, ...]:
        """The local (unreduced) gradient sums, one per bucket, to carry to the next micro-step."""
        return tuple(self.buffer(i) for i in range(len(self.layout.buckets)))
