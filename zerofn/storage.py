"""How a step holds its parameters: the :class:`Storage` part of a Step.

A storage builds the parameter part of a fresh state (``init``), binds the
parameters for a forward and backward (``bind``: the tree ``loss_fn``
receives, whose gradients flow into a :class:`~zerofn.reduction.GradSink`),
says which tensor the optimizer updates (``opt_view``), makes updated
parameters whole again (``publish``), and reads them back (``full_params``,
``forward`` for ``step.apply``).

The default here keeps the full parameters on every rank in flat buckets
(:class:`~zerofn.state.Layout`). When the reduction shards a bucket, the
optimizer updates this rank's slice of it and ``publish`` all-gathers the
updated slices in place. ``shard_params`` replaces this part with one that
keeps only shards and gathers them per unit.

Publish off the critical path: by default (``defer_publish``) ``publish``
launches the all-gathers, in the order the forward uses the buckets, and
returns; the step returns with them in flight, as handles the new state
carries (``state.inflight``). Whatever reads the parameters waits first:
the next step's forward waits for each bucket when a module first reads
one of its parameters, so the gathers overlap that forward; reading
``state.params``, ``full_params``, ``step.apply``, a checkpoint, a copy of
the state and ``zf.block_until_ready`` wait for all of them. The module
the state adopted then holds placeholders (it would read buffers in flight).

Example:
    >>> import torch
    >>> from zerofn.storage import Storage, split_params
    >>> split = split_params({"w": torch.ones(2, 3, requires_grad=True), "n": torch.zeros(1)}, "init")
    >>> held = Storage().init(split, shards=1, bucket_bytes=1 << 20, model=None)
    >>> [t.shape for t in held.params], sorted(held.frozen)
    ([torch.Size([6])], ['n'])
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from zerofn import alloc
from zerofn import collectives as C
from zerofn import tree as T
from zerofn.functional import Functional, PendingParams
from zerofn.reduction import GradSink, bucket_group, bucket_rank
from zerofn.state import Bucket, InFlight, Layout, TrainState

__all__ = [
    "FIRST_BUCKET_BYTES",
    "Held",
    "ParamSplit",
    "Storage",
    "gathered",
    "split_params",
    "to_host",
    "whole_params",
]

FIRST_BUCKET_BYTES = 1024 * 1024  # torch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)


class ParamSplit(NamedTuple):
    """A params tree taken apart for ``init``.

    Attributes:
        named: key path -> tensor, every leaf, in the tree's leaf order.
        trainable: the leaves that get gradients, in registration order.
        treedef: the tree's structure, to rebuild it for ``loss_fn``.
        labels: trainable name -> the optimizer's label for it (its masks and groups; empty: none):
            parameters of different labels go into different buckets.
        apart: name -> (mesh axis, shards) for each parameter cut along an axis of the step's group (expert
            parallelism's experts; ``step.init`` fills it from the claims): it goes into buckets of its own,
            reduced and sharded over that group's ranks that share this rank's coordinate on the axis
            (:attr:`zerofn.state.Bucket.apart`).
        cut: name -> (mesh axis, share) for each parameter a model-parallel axis outside the step's group
            cuts (tensor parallelism's; ``step.init`` fills it from the claims): it goes into buckets of its
            own, whose gradient norm is summed over that axis (:attr:`zerofn.state.Bucket.cut`).
        replicate: the mesh axis across which every bucket's shards are replicas (hybrid sharding's
            ``dp_replicate``; ``step.init`` fills it from the reduction): :attr:`zerofn.state.Bucket.replicate`.
    """

    named: dict
    trainable: dict
    treedef: Any
    labels: dict = {}
    apart: dict = {}
    cut: dict = {}
    replicate: str = ""


class Held(NamedTuple):
    """What a storage's ``init`` returns: the parameter part of a fresh state."""

    params: tuple
    frozen: Any
    layout: Layout
    extra: dict = {}


def split_params(params: Any, where: str) -> ParamSplit:
    """Take ``params`` apart; ``where`` names the caller in errors."""
    paths, leaves, treedef = T.tree_flatten_with_path(params)
    if not leaves:
        raise ValueError(f"{where}: params holds no tensors; pass apply.params from zf.functional(model)")
    named: dict[str, torch.Tensor] = {}
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{where}: params leaf {T.keystr(path)} is a {type(leaf).__name__}, expected a "
                "torch.Tensor. Pass a tree of tensors such as apply.params."
            )
        named[T.keystr(path)] = leaf
    trainable = {k: v for k, v in named.items() if v.requires_grad and v.is_floating_point()}
    if isinstance(params, dict):
        # Flattening sorts dict keys ("layers.10" before "layers.2"); buckets follow
        # registration order instead, which is the reverse of backward's.
        position = {T.keystr((k,)): i for i, k in enumerate(params)}
        trainable = dict(sorted(trainable.items(), key=lambda kv: position.get(kv[0], -1)))
    return ParamSplit(named, trainable, treedef)


def to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A copy of ``t`` in its own host buffer (pinned when ``pin``; non-blocking from a device then);
    inside :func:`zerofn.alloc.unfilled`, the buffer only (its values are to be overwritten)."""
    return alloc.copy_of(t, device="cpu", pin_memory=pin)


@dataclass(frozen=True)
class Storage:
    """Full parameters in flat buckets on every rank.

    Attributes:
        name: this part's piece of the step's name (None: it adds none).
        param_placement: where parameters rest between uses: ``"device"``
            (where they compute) or ``"cpu"`` (host memory, brought in when
            used). Only a storage that gathers units (``gathers_units``)
            can keep them away from the device; this one refuses ``"cpu"``
            at ``init`` (a transform that asks for it checks first). ``"nvme"``:
            files under ``param_path`` (a :class:`~zerofn._io.FileTensor` per
            shard), read in per use.
        param_path: the directory of the parameter files, for ``"nvme"``.
        defer_publish: let the all-gathers of updated shards run on after the
            step returns, each waited for when the parameters are first read
            (the next forward, per bucket); False waits for them before the
            step returns.
    """

    name: str | None = None
    param_placement: str = "device"
    param_path: str | None = None
    defer_publish: bool = True

    @property
    def gathers_units(self) -> bool:
        """Parameters are held as shards and gathered unit by unit when a module uses them."""
        return False

    def init(self, split: ParamSplit, *, shards: int, bucket_bytes: int, model: Callable | None) -> Held:
        """The parameter part of a fresh state; ``model()`` returns the ``zf.functional`` apply, if needed."""
        trainable = split.trainable
        if self.param_placement != "device":
            raise ValueError(
                f"init: parameters cannot rest on {self.param_placement!r} here: this storage keeps full parameters "
                "where they compute; a storage that gathers units (gathers_units) brings them in when used"
            )
        meta = [k for k, v in split.named.items() if v.device.type == "meta"]
        if meta:
            raise ValueError(
                f"init: params {meta[0]!r}{' and others' if len(meta) > 1 else ''} are on the meta device (a model "
                "built on meta, or a module whose parameters a state already holds). This step keeps full "
                "parameters, so it needs real tensors: pass step.full_params(state, requires_grad=True) of the state that holds "
                "them, build the model on a real device, or shard the parameters (ZeRO-3), which materialises "
                "them shard by shard."
            )
        # Frozen tensors are never written, so the state shares them rather than copying.
        frozen = {k: v.detach() for k, v in split.named.items() if k not in trainable}
        layout = Layout.build(
            trainable,
            shards=shards,
            bucket_bytes=bucket_bytes,
            names=tuple(split.named),
            frozen=tuple(frozen),
            first_bucket_bytes=FIRST_BUCKET_BYTES,
            labels=split.labels,
            apart=split.apart,
            cut=split.cut,
            replicate=split.replicate,
        )
        flats = []
        for b in layout.buckets:
            # Inside alloc.unfilled (a state built to be loaded into): allocated only, no seed copied.
            flat = alloc.zeros(b.padded, dtype=b.dtype, device=b.device)
            if alloc.filling():
                for s in b.slots:
                    flat[s.offset : s.offset + s.numel].copy_(trainable[s.name].detach().reshape(-1))
            flats.append(flat)
        return Held(tuple(flats), frozen, layout)

    @contextlib.contextmanager
    def bind(self, state: TrainState, sink: GradSink, model: Callable, extra: dict):
        """Yield the params tree ``loss_fn`` receives, alive through backward.

        Each trainable parameter is a leaf viewing its bucket, made once
        per run and set of buckets (:func:`_kept_leaves`); its gradient goes
        to ``sink``. A storage may record entries for the next
        state in ``extra``. Buckets whose publish is still in flight are
        waited for when first read (see :class:`~zerofn.functional.PendingParams`),
        and all of them before backward's gradients are used.
        """
        layout = state.spec.layout
        flats = state.arriving_params()
        made = _kept_leaves(state, flats)
        made.sink = sink
        made.closers.start(sink)
        leaves = made.leaves
        inflight = state.inflight
        try:
            tree = _tree(state, leaves)
            if inflight.params:
                if isinstance(tree, dict) and len(tree) == len(layout.names):
                    tree = PendingParams(tree, _waiter(inflight, layout))
                else:  # a tree the reads cannot be followed through: whole before the forward
                    inflight.wait_params()
            yield tree
            made.closers.end()
        finally:
            made.closers.stop()  # a backward after the step (a graph kept past it) reaches no sink
            made.sink = None
            inflight.wait_params()

    def opt_view(self, flat: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
        """The tensor the optimizer updates for one bucket: all of it, or this rank's shard."""
        if bucket.shards == 1:
            return flat
        lo, hi = bucket.shard_range(bucket_rank(bucket, rank))
        return flat[lo:hi]

    def publish(self, flats: tuple, layout: Layout, rank: int, inflight: InFlight) -> None:
        """Make updated parameters whole on every rank: all-gather each sharded bucket in place.

        The gathers go out last bucket first, the order the next forward
        reads them (buckets are in backward order). With ``defer_publish``
        they are left in flight, as handles in ``inflight`` (the new
        state's). A bucket whose update is still running elsewhere (a handle
        there already) is gathered once it has finished, so the gather of one
        bucket overlaps the update of the next.
        """
        for i in reversed(range(len(flats))):
            flat, bucket = flats[i], layout.buckets[i]
            if bucket.shards > 1:
                lo, hi = bucket.shard_range(bucket_rank(bucket, rank))
                inflight.wait_bucket(i)  # an update still writing this shard (on another thread) finishes first
                # In place: the input is this rank's slice of the output, so no temporary.
                inflight.params[i] = C.all_gather(flat, flat[lo:hi], async_op=True, group=bucket_group(bucket))
        if not self.defer_publish:
            inflight.wait_params()

    def full_params(self, state: TrainState, model: Callable, masters: tuple | None = None) -> Any:
        """The full parameters, a new tree shaped like the ``init`` input.

        ``masters``, when given, replaces each bucket by the tensor the
        optimizer updates for it (fp32 master weights under amp: the whole
        bucket, or this rank's shard, gathered here); frozen parameters,
        which have none, come as held, in the masters' dtype.
        """
        layout = state.spec.layout
        if masters is None:
            return _tree(state, {k: v.detach().clone() for k, v in layout.views(state.params).items()})
        out = whole_params(masters, layout.buckets)
        frozen = {k: v.to(masters[0].dtype) if v.is_floating_point() else v for k, v in state.frozen.items()}
        names = layout.names
        return T.tree_unflatten(state.spec.treedef, [out[n] if n in out else frozen[n].clone() for n in names])

    def forward(self, state: TrainState, model: Callable, args: tuple, kwargs: dict) -> Any:
        """The model's forward on the state's parameters, without gradients."""
        with torch.no_grad():
            return model()(_tree(state, state.spec.layout.views(state.params)), *args, **kwargs)

    def adopt(self, functional: Functional, state: TrainState, share: bool, updates_late: bool = False) -> None:
        """Take the module's parameters over after ``init``: the module keeps no storage of its own.

        With ``share``, a parameter the state holds whole, in the module's
        dtype and on its device, stays in the module as a view of the
        state's buffer (the module then reads the state's current values);
        every other parameter becomes a placeholder. ``updates_late``: the
        optimizer may still be writing the buffers after a step returns.
        """
        # A module sharing buffers that a step returns with work still in flight on them (a publish, a
        # host update) could read them half written: it holds placeholders instead, and step.apply waits.
        publishes = self.defer_publish and any(b.shards > 1 for b in state.spec.layout.buckets)
        views: dict[str, torch.Tensor] = {}
        if share and not (publishes or updates_late):
            held = {**state.spec.layout.views(state.params), **state.frozen}
            for name, p in functional.params.items():
                v = held.get(name)
                if v is not None and v.dtype == p.dtype and v.device == p.device and v.shape == p.shape:
                    views[name] = v
        functional.adopt(views)

    def replace(self, **changes) -> Storage:
        return dataclasses.replace(self, **changes)


def _waiter(inflight: InFlight, layout: Layout) -> Callable[[str | None], None]:
    """``ready(name)``: wait for the bucket holding parameter ``name`` (None: every bucket)."""
    where = layout.bucket_of

    def ready(name: str | None) -> None:
        if not inflight.params:
            return
        if name is None:
            inflight.wait_params()
            return
        i = where.get(name)
        if i is not None:
            inflight.wait_bucket(i)

    return ready


def whole_params(pieces, buckets, *, to_device: bool = False) -> dict[str, torch.Tensor]:
    """name -> a new tensor for each parameter of ``buckets``, from this rank's ``pieces`` of them (each
    bucket whole, or its shard, gathered here one bucket at a time; ``to_device``: moved to the bucket's
    device first, one at a time). Collective where a piece is a shard."""
    out: dict[str, torch.Tensor] = {}
    for piece, bucket in zip(pieces, buckets):
        full = gathered(piece.to(bucket.device) if to_device else piece, bucket)
        out.update({s.name: full[s.offset : s.offset + s.numel].view(s.shape).clone() for s in bucket.slots})
        del full
    return out


def gathered(part: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """A bucket whole, in ``part``'s dtype: ``part`` itself, or the all-gather of every rank's shard."""
    if part.numel() == bucket.padded:
        return part.detach().clone()
    full = torch.empty(bucket.padded, dtype=part.dtype, device=part.device)
    C.all_gather(full, part.detach(), group=bucket_group(bucket))
    return full


class _Leaves:
    """A run's parameter leaves over its buckets, made once (see :func:`_kept_leaves`): each views its slot of
    ``flats`` and hands its gradient to ``sink``, the running step's, through hooks registered once (see
    :class:`Closers`)."""

    def __init__(self, flats: tuple, layout: Layout):
        self.flats, self.sink = flats, None
        self.leaves: dict[str, torch.Tensor] = {
            name: view.detach().requires_grad_(True) for name, view in layout.views(flats).items()
        }
        members = [[(s.name, self.leaves[s.name]) for s in b.slots if s.name in self.leaves] for b in layout.buckets]
        self.closers = Closers(members, self._take, self._take_bucket)

    def _take(self, name: str, leaf: torch.Tensor) -> None:
        self.sink.take(name, leaf)

    def _take_bucket(self, i: int, leaves: list[tuple[str, torch.Tensor]]) -> None:
        self.sink.take_bucket(i, leaves)


class Closers:
    """Gradient hooks on a run's leaves, registered once, that make one Python call per bucket and step where
    the buckets' gradients arrive in the order they arrived in the last step, not one per parameter.

    A bucket's gradients are whole when the last of them arrives: its "closer", the last to arrive in the last
    step. Only the closer has a hook; it hands the bucket's gradients over at once (``take_bucket(i, [(name,
    leaf), ...])``, from the leaves' ``.grad``), when a hook on each leaf would have completed the bucket. The
    first step, and the step after one where a bucket's closer got no gradient, hooks every leaf of the bucket
    (``take(name, leaf)`` each) and learns its order. A gradient that arrives after its closer's (the order
    changed) is taken by a hook registered on its leaf then, and the last of them is the next step's closer; a
    closer that gets no gradient leaves its bucket's gradients to :meth:`end`, after backward. A step whose sink
    must see each leaf's gradient (a pipeline's, which counts each leaf's micro-batches) hooks every leaf.

    ``buckets``: per bucket (the layout's index), its trainable leaves as ``(name, leaf)`` in slot order.
    """

    def __init__(self, buckets: list[list[tuple[str, torch.Tensor]]], take: Callable, take_bucket: Callable):
        self.members, self.take, self.take_bucket = buckets, take, take_bucket
        self.closer: list[str | None] = [None] * len(buckets)  # None: a hook on every leaf (learning the order)
        self.handles: list[dict[str, Any]] = [{} for _ in buckets]  # per bucket: leaf name -> its hook's handle
        # this step's arrivals by their own hook, in order: every one while learning, else those after the closer
        self.arrived: list[list[str]] = [[] for _ in buckets]
        self.closed = [False] * len(buckets)  # this step's closer arrived
        self.active = False  # a step is running (see start)
        self.batched = False  # its gradients may go over a bucket at once
        for i in range(len(buckets)):
            self._hook_all(i)

    def _hook(self, i: int, name: str, leaf: torch.Tensor) -> None:
        if name not in self.handles[i]:
            # In the step's process group also where autograd runs the hook on a thread of its own (CUDA).
            hook = C.with_current_group(functools.partial(self._arrive, i, name))
            self.handles[i][name] = leaf.register_post_accumulate_grad_hook(hook)

    def _hook_all(self, i: int) -> None:
        self.closer[i] = None
        for name, leaf in self.members[i]:
            self._hook(i, name, leaf)

    def start(self, sink: Any) -> None:
        """A step begins, its gradients going to ``sink``: a bucket at once where it is a ``GradSink``
        (``take_bucket``); each leaf's where it is another (a pipeline's, which counts each leaf's micro-batches)."""
        self.active = True
        self.batched = batched = type(sink) is GradSink
        for i, c in enumerate(self.closer):
            if c is not None and not batched:
                self._hook_all(i)
            self.arrived[i] = []
            self.closed[i] = False

    def stop(self) -> None:
        """The step is over, well or not: a backward after it (a graph kept past it) hands nothing over."""
        self.active = False

    def _arrive(self, i: int, name: str, leaf: torch.Tensor) -> None:
        if not self.active:
            return
        if name != self.closer[i] or not self.batched:
            if self.closer[i] is None or self.closed[i]:  # learning the order, or arriving after the closer
                self.arrived[i].append(name)
            self.take(name, leaf)
            return
        self.closed[i] = True
        here = [(n, t) for n, t in self.members[i] if t.grad is not None]
        if len(here) < len(self.members[i]):  # arriving after their closer (the order changed): hooked now
            for n, t in self.members[i]:
                if t.grad is None:
                    self._hook(i, n, t)
        self.take_bucket(i, here)

    def end(self) -> None:
        """The step's backward is over: a bucket whose closer got no gradient hands over what its leaves hold,
        and learns its order again next step; each other bucket's next closer is its last gradient to arrive,
        its other hooks removed."""
        for i, members in enumerate(self.members):
            if self.closer[i] is not None and not self.closed[i]:
                here = [(n, t) for n, t in members if t.grad is not None]
                if here:
                    self.take_bucket(i, here)
                self._hook_all(i)
                continue
            if not self.batched:
                continue
            if self.arrived[i]:
                self.closer[i] = self.arrived[i][-1]
            hooked = self.handles[i]
            if self.closer[i] is not None and len(hooked) > 1:  # its hook alone
                for n in [n for n in hooked if n != self.closer[i]]:
                    hooked.pop(n).remove()


_LEAVES = "storage.leaves"  # the state.run entry of the kept leaves


def _kept_leaves(state: TrainState, flats: tuple) -> _Leaves:
    """The leaves over ``flats`` for this step: made when the run's buckets are new (the first step, a state
    copied, loaded or moved), else the ones the run's last step used, their gradients cleared (a step that
    raised in backward may have left some). Leaves and hooks made once per layout, not per step, as torch's
    own parameters are: a step no longer detaches a view and registers a hook for every parameter."""
    kept = state.run.entries.get(_LEAVES)
    if kept is None or len(kept.flats) != len(flats) or any(a is not b for a, b in zip(kept.flats, flats)):
        kept = state.run.entries[_LEAVES] = _Leaves(flats, state.spec.layout)
    else:
        for leaf in kept.leaves.values():
            leaf.grad = None
    return kept


def _tree(state: TrainState, trainable: dict) -> Any:
    """The params tree: ``trainable`` where given, the state's frozen tensors elsewhere."""
    names = state.spec.layout.names
    return T.tree_unflatten(state.spec.treedef, [trainable[n] if n in trainable else state.frozen[n] for n in names])
