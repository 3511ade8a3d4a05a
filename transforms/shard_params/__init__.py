"""``shard_params`` (ZeRO stage 3): parameters sharded at rest, gathered per unit just in time.

Implies ``shard_grads`` and ``shard_optimizer``. Between steps a rank holds
only its shard of every parameter (frozen ones too), of the gradient
partition while accumulating, and of the optimizer state.

The model is cut into *units*: by default its natural blocks, the children
of every outermost ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``
at any depth (a block holding most of the parameters is cut into its own
children), plus the root (every parameter in no block: embeddings, final
norm, head; and any parameter two units share). Each unit's parameters form
one flat buffer per dtype, padded to a multiple of N and sharded like a
``shard_optimizer`` bucket.

It replaces two parts of the step (see ``zerofn.step``): the ``reduction``,
with a stage-3 ``ShardedReduction`` (unit buckets reduce-scattered as
their gradients land, as in ``shard_grads``), and the ``storage``, with a
:class:`UnitStorage`:

- ``bind``: ``loss_fn`` receives meta placeholders; ``apply`` (from
  ``zf.functional``) sees that a sharded step is running and calls the
  module with leaves that view per-unit full buffers whose storage is
  empty. A forward pre-hook all-gathers a unit's buffer just before the unit
  runs, and starts the gathers of the next ``prefetch`` units (in the order
  the previous step ran them, which the state carries under
  ``state.extra["shard_params.order"]``) so they overlap compute; a forward
  hook releases it (``storage.resize_(0)``: autograd keeps its saved views,
  whose memory is gone; the root and the forward's last block, which
  backward needs first, stay gathered into backward, as FSDP2 keeps its
  root) and hooks the unit's outputs, whose gradient marks
  the start of the unit's backward: there the buffer is gathered again
  (with the next units in backward order prefetched). As backward hands
  over a unit's gradients they go into its bucket, which is reduce-scattered
  while backward goes on; when the unit's last gradient is in and backward
  has computed the gradients of its inputs (through its frozen weights too:
  a LoRA block's adapters' gradients are in before the frozen layers under
  them have run backward), its full buffer is released. A unit whose
  outputs needed no gradient (a frozen embedding) is not gathered in
  backward at all. A module compiled with ``module.compile()`` gets no
  hooks: its unit opens and closes around its compiled call, in eager code
  (:class:`~zerofn.transforms._units.Intercept`), and the modules inside it
  run in the open unit, so dynamo never traces zerofn's work (docs/compile.md).
  Nothing stays on the modules after the step.
- ``opt_view`` / ``publish``: the state holds shards, which the optimizer
  updates in place; nothing is gathered after the update.
- ``init``: the state is built shard by shard, one module's parameters at
  a time, also from a model built on the meta device (initialised by
  ``init_fn``, a Hugging Face model's own ``_init_weights``, or the module's
  ``reset_parameters``).
- ``full_params`` and ``forward`` (``step.apply``): gather one unit at a time;
  inside :func:`gathered` (``zf.generate(..., gather_once=True)``) every
  unit is gathered once on entering the block, each ``step.apply`` of that
  state runs on the whole parameters with no collective of its own, and
  they are released on leaving it.
- ``param_placement="cpu"`` (``offload(params=True)``): shards rest in host memory and each
  is copied in just before its unit's all-gather.

Why module hooks and not autograd-aware gathers under selective
recomputation (the "JAX road" in docs/design.md): ``torch.func`` refuses the
saved-tensor hooks that checkpointing needs, the recomputed collective
needs ``wait_tensor`` bookkeeping, and the hook road gives the same
traffic with any ``nn.Module`` and lets a unit's gradients flow straight
into the bucket machinery that ``shard_grads`` already has. Its known traps
are handled: a unit used twice (gathered again if released, released only
when its last gradient is in), tied parameters (moved to the root unit
when two units share one), parameters read outside their unit (in
``loss_fn``, or by another unit's code: the model shows placeholders but
in the unit whose modules run, and computing with one gathers its unit for
the read and hands over a copy whose gradient flows into the unit's
bucket), and ranks that run different units (they agree on each unit the
forward runs, each outside read and each backward gather before its
collective, and on the forward's end, so ranks that diverge raise together
at the first differing point instead of hanging; while the forward follows
the order the last step recorded, every rank issues the gathers that order
predicts at each unit, so the agreement on the unit stays in flight and is
checked at the next point instead of costing a round trip per unit), and a
``loss_fn`` that differentiates inside itself (a gradient penalty's
``torch.autograd.grad(..., create_graph=True)``: each unit that inner grad
gathers stays gathered until its backward is over, or the step's end if it
holds frozen parameters, since the graph it builds reads the unit's
parameters in the step's backward; a placeholder among its inputs is the
parameter's leaf; see ``_Runner._inner``).

Collectives per step: all-gather of every unit in forward and again in
backward (but the root and the last block, kept from the forward), and a
reduce-scatter of every unit's gradient: at most 3 x parameter bytes
(frozen parameters: 2 x, they have no gradient), plus tiny ones: the
unit-order agreement with each gather and at the forward's end (32 bytes
each, on a group of its own), batch-shape agreement, and loss, gradient
norm and finiteness; a read outside a released unit adds its gather.

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import shard_params
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    >>> state = step.init(apply.params)
    >>> state, metrics = step(state, torch.ones(2, 4))
    >>> step.full_params(state)["weight"].shape
    torch.Size([1, 4])
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from zerofn.transforms._param_files import ShardFiles, ShardReads
from zerofn.transforms._units import (
    ROOT,
    Intercept,
    Materialiser,
    MinUnitBytes,
    Unit,
    assign_units,
    compiled,
    compiles_children,
    inside,
    unit_buckets,
    unit_names,
)
from zerofn.transforms.shard_grads import shard_grads

from zerofn import alloc, counters
from zerofn import collectives as C
from zerofn import tree as T
from zerofn._io import FileTensor
from zerofn.functional import ACTIVE_RUN, Functional
from zerofn.reduction import GradSink
from zerofn.state import Bucket, Layout, TrainState
from zerofn.step import Step, reapply, transform
from zerofn.storage import Held, ParamSplit, Storage, to_host, whole_params

__all__ = ["MinUnitBytes", "UnitStorage", "gathered", "shard_params"]

ORDER = "shard_params.order"  # state.extra key: unit indices in the order the last step ran them
_OPEN, _OUTSIDE, _BACKWARD, _END = range(4)  # the points of a step at which the ranks agree (see _Runner._agree)


@transform
def shard_params(
    step: Step,
    /,
    *,
    units: Callable[[str, nn.Module], bool] | list[str] | None = None,
    prefetch: int = 1,
    init_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Step:
    """Shard parameters at rest and gather them per unit just in time (ZeRO stage 3).

    Args:
        step: a Step from ``zf.train_step`` (possibly already transformed).
            Called without it, returns a decorator.
        units: which modules are gathered as one: a list of module paths, a
            predicate ``(path, module) -> bool``, or a size policy
            ``MinUnitBytes(n)`` (each unit the smallest module holding at
            least n parameter bytes); default: the model's natural blocks
            (children of ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict``
            containers). Parameters in no unit form the root unit. A policy
            that leaves the model one unit warns.
        prefetch: how many units ahead to gather while the current one
            computes (forward and backward), >= 0.
        init_fn: ``init_fn(name, meta_tensor) -> tensor`` to materialise
            every parameter given on the meta device (it takes precedence over
            a Hugging Face model's ``_init_weights`` and over
            ``reset_parameters``, which are used without it, and for each
            parameter it returns None for); ``zf.checkpoint.pretrained_init(
            directory)`` reads a Hugging Face checkpoint's tensors one at a time.

    Returns:
        The rewritten Step, named ``shard_params(...)`` whatever shard
        transforms it was combined with. Applied to a step that already
        shards parameters with the same options it returns that step unchanged.

    Raises:
        TypeError: ``step`` is not a Step.
        ValueError: a negative ``prefetch``, or a step that already shards
            parameters with other options.
    """
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"shard_params: prefetch must be an int >= 0, got {prefetch!r}")
    units = tuple(units) if isinstance(units, (list, tuple)) else units  # hashable, like the rest of a Step
    storage = UnitStorage(
        param_placement=step.storage.param_placement,
        param_path=step.storage.param_path,
        units=units,
        prefetch=prefetch,
        init_fn=init_fn,
    )
    have = step.storage if step.storage.gathers_units else None
    if reapply(step, "shard_params", have, storage, "shards parameters"):
        return step
    sharded = shard_grads(step)
    return sharded.replace(reduction=sharded.reduction.replace(name="shard_params"), storage=storage)


# ---------------------------------------------------------------- the storage


@dataclass(frozen=True)
class UnitStorage(Storage):
    """Parameter shards at rest, gathered per unit around the module's calls (see the module docs)."""

    units: Any = None

    @property
    def gathers_units(self) -> bool:
        return True

    prefetch: int = 1
    init_fn: Any = None

    def init(self, split: ParamSplit, *, shards: int, bucket_bytes: int, model: Callable) -> Held:
        functional = model()
        named, trainable = split.named, split.trainable
        world, rank = C.world_size(), C.rank()
        names = unit_names(functional.module, self.units)
        unit_of = assign_units(functional, named, names)
        buckets: list[Bucket] = []
        frozen_buckets: list[Bucket] = []
        units: list[Unit] = []
        # Backward meets the last unit first and the root last: buckets in that order.
        for uname in list(reversed(names)) + [ROOT]:
            mine_t = {k: v for k, v in trainable.items() if unit_of[k] == uname}
            mine_f = {k: v for k, v in named.items() if unit_of[k] == uname and k not in trainable}
            tb = unit_buckets(mine_t, world, split.labels)
            fb = unit_buckets(mine_f, world)
            units.append(
                Unit(
                    uname,
                    tuple(range(len(buckets), len(buckets) + len(tb))),
                    tuple(range(len(frozen_buckets), len(frozen_buckets) + len(fb))),
                )
            )
            buckets.extend(tb)
            frozen_buckets.extend(fb)
        layout = Layout(
            tuple(buckets),
            tuple(named),
            tuple(k for k in named if k not in trainable),
            frozen_buckets=tuple(frozen_buckets),
            units=tuple(units),
        )
        fill = Materialiser(functional.module, named, self.init_fn).fill
        every = buckets + frozen_buckets
        shards: list = [None] * len(every)
        if self.param_placement == "nvme":  # shards at rest in files, each written as soon as it is filled
            files = ShardFiles(self.param_path, buckets, frozen_buckets, rank, world)
            fill(every, rank, done=lambda i, t: shards.__setitem__(i, files.store(i, t)))
            files.done()
        elif self.param_placement == "cpu":  # in host memory, each moved there as soon as it is filled
            pin = torch.cuda.is_available()
            fill(every, rank, done=lambda i, t: shards.__setitem__(i, _host_shard(t, every[i], rank, pin)))
        else:
            shards = fill(every, rank)
        flats, frozen = tuple(shards[: len(buckets)]), tuple(shards[len(buckets) :])
        return Held(flats, frozen, layout, {ORDER: counters.new_like(())})

    @contextlib.contextmanager
    def bind(self, state: TrainState, sink: GradSink, model: Callable, extra: dict):
        runner = _Runner(state, model(), self.prefetch, sink, self.param_placement != "device")
        token = ACTIVE_RUN.set(runner)
        try:
            yield runner.placeholders()
        finally:
            ACTIVE_RUN.reset(token)
            runner.close()
            if runner.forward_order:
                extra[ORDER] = counters.new_like(u.index for u in dict.fromkeys(runner.forward_order))

    def adopt(self, functional: Functional, state: TrainState, share: bool, updates_late: bool = False) -> None:
        functional.adopt({})  # the state holds shards: every parameter becomes a placeholder

    def opt_view(self, flat: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
        return flat  # the state holds shards already

    def publish(self, flats: tuple, layout: Layout, rank: int, inflight: Any) -> None:
        return None  # updated in place, gathered when used

    def forward(self, state: TrainState, model: Callable, args: tuple, kwargs: dict) -> Any:
        held = _HELD.get()
        if held is not None and held.state is state and held.functional is model():  # inside gathered(...)
            with torch.no_grad():
                return held.functional(held.params, *args, **kwargs)
        runner = _Runner(state, model(), self.prefetch, None, self.param_placement != "device")
        try:
            with torch.no_grad():
                return runner.run(args, kwargs)
        finally:
            runner.close()

    def full_params(self, state: TrainState, model: Callable, masters: tuple | None = None) -> Any:
        layout = state.spec.layout
        dtype = masters[0].dtype if masters else None
        frozen = (f.to(dtype) if dtype is not None and f.is_floating_point() else f for f in _resident(state.frozen))
        # One unit's buffer at a time (and a shard in a file read only when its bucket's turn comes).
        out = whole_params(_resident(masters or state.params), layout.buckets, to_device=True)
        out.update(whole_params(frozen, layout.frozen_buckets, to_device=True))
        return T.tree_unflatten(state.spec.treedef, [out[n] for n in layout.names])


# ---------------------------------------------------------------- gathered once


@dataclass(frozen=True)
class _Held:
    """A state's units, every one gathered, for :func:`gathered`'s block: the model's params tree on them."""

    state: TrainState
    functional: Functional
    params: Any


_HELD: contextvars.ContextVar = contextvars.ContextVar("zerofn_shard_params_held", default=None)


@contextlib.contextmanager
def gathered(step: Step, state: TrainState, /, *, max_bytes: int | None = None):
    """Gather every unit of ``state`` once, for a block of ``step.apply`` calls (generation), then release.

    Under ``shard_params`` each ``step.apply`` gathers every unit and releases
    it: a model's whole bytes cross the ranks for every call, so for every
    token ``zf.generate`` chooses. Inside this block each ``step.apply(state,
    ...)`` of this state runs on the parameters gathered on entering it and
    issues no collective of its own; they are released on leaving it.
    ``zf.generate(..., gather_once=True)`` runs its loop inside it.

    Memory: the whole model, as the state holds it (amp's compute dtype,
    quantize's codes), on every rank for the block's span, where a call
    gathers one unit at a time (and ``prefetch`` more). Without
    ``shard_params`` the rank holds it already and this does nothing.

    Collective: every rank of the step's group enters it with the same
    step and state (it all-gathers every unit, in order). The block is for
    that state: a step that trains it (donating it) leaves the block
    nothing to run on; a step's ``apply`` of another state gathers per call.

    Args:
        step, state: a Step and its state (any composition).
        max_bytes: the most bytes the gathered units may take on a rank;
            None: no limit. Exceeding it raises before anything is gathered.

    Raises:
        ValueError: ``max_bytes`` is not an int >= 0, or the whole model
            takes more bytes than it on a rank.

    Example:
        >>> import torch, zerofn as zf
        >>> from zerofn.transforms import shard_params
        >>> from zerofn.transforms.shard_params import gathered
        >>> apply = zf.functional(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
        >>> step = shard_params(zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.adamw(1e-3)))
        >>> state = step.init(apply.params)
        >>> with gathered(step, state, max_bytes=2**20):
        ...     outs = [step.apply(state, torch.ones(1, 4)) for _ in range(3)]
        >>> outs[0].shape
        torch.Size([1, 1])
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"shard_params.gathered: max_bytes must be an int >= 0 or None, got {max_bytes!r}")
    storage = getattr(step, "storage", None)
    if not isinstance(storage, UnitStorage):  # the rank holds the whole parameters already
        yield
        return
    held = _HELD.get()
    if held is not None and held.state is state:  # gathered already, by an enclosing block
        yield
        return
    with C.group_scope(step.group):
        step.check_state(state)
        layout = state.spec.layout
        whole = C.world_size() == 1 and storage.param_placement == "device"  # nothing to gather: views
        need = 0 if whole else sum(b.nbytes for b in (*layout.buckets, *layout.frozen_buckets))
        if max_bytes is not None and need > max_bytes:
            raise ValueError(
                f"shard_params.gathered: gathering every unit takes {need:,} bytes ({need / 2**30:.2f} GiB) on "
                f"each rank, more than max_bytes={max_bytes:,}. Gather per call instead, one unit at a time "
                "(zf.generate without gather_once, step.apply outside the block), or raise max_bytes."
            )
        functional = step.model()
        runner = _Runner(state, functional, storage.prefetch, None, storage.param_placement != "device")
        try:
            runner._unwatch()  # the block's calls run on whole parameters: no unit opens or closes
            for unit in runner.units:  # every gather in flight, in the same order on every rank
                runner._gather(unit)
            for unit in runner.units:
                runner._ensure(unit)
            params = T.tree_unflatten(state.spec.treedef, [runner.leaves[n] for n in layout.names])
        except BaseException:
            runner.close()
            raise
    token = _HELD.set(_Held(state, functional, params))
    try:
        yield
    finally:
        _HELD.reset(token)
        runner.close()


def _host_shard(shard: torch.Tensor | None, bucket: Bucket, rank: int, pin: bool) -> torch.Tensor:
    """A filled shard in its own host buffer; None (nothing written: a state to be loaded into): a buffer."""
    if shard is not None:
        return to_host(shard, pin)
    lo, hi = bucket.shard_range(rank)
    return alloc.zeros(hi - lo, dtype=bucket.dtype, device="cpu", pin_memory=pin)


def _resident(pieces: Any) -> Any:
    """``pieces`` with each shard that rests in a file read in, one at a time as they are taken."""
    return (p.read() if isinstance(p, FileTensor) else p for p in pieces)


# ---------------------------------------------------------------- the run


_METADATA = {  # what a placeholder answers itself, with no gather
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}


# Differentiating with respect to a placeholder (torch.autograd.grad(loss, params["w"]) in loss_fn, a penalty on a
# parameter's gradient) differentiates with respect to the parameter's leaf: every use of the parameter, in its
# unit or through a gathered copy read outside it, leads back to that leaf in the graph.
_DIFFERENTIATE = {torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward}


class _Placeholder(torch.Tensor):
    """A parameter that lives sharded (a meta tensor of its shape and dtype): computing with it gathers
    the parameter (:meth:`_Runner.outside`) and computes with that copy. ``loss_fn`` receives these, and
    the model's modules show them but while their own unit runs."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, runner: Any, name: str):
        meta = torch.empty(like.shape, dtype=like.dtype, device="meta")
        out = torch.Tensor._make_subclass(cls, meta, False)
        out._runner, out._name, out._where = runner, name, like.device
        return out

    # Where the parameter lives when gathered, so that code placing new tensors by a parameter's device
    # (a model's own ``self.device``) places them right.
    device = property(lambda self: self._where)
    is_meta = property(lambda self: False)
    is_cuda = property(lambda self: self._where.type == "cuda")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _DIFFERENTIATE:  # a gradient with respect to a parameter: its leaf, which the graph holds
            args, kwargs = torch.utils._pytree.tree_map(
                lambda a: a._runner.leaves[a._name] if isinstance(a, _Placeholder) else a, (args, kwargs)
            )
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or "out" in kwargs or name in ("__setitem__", "set_"):
            held = next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, _Placeholder))
            held._runner.refuse_write(held._name, name)
        args, kwargs = torch.utils._pytree.tree_map(
            lambda a: a._runner.outside(a._name) if isinstance(a, _Placeholder) else a, (args, kwargs)
        )
        return func(*args, **kwargs)


class _LiveUnit:
    """One unit's full buffers during a step: empty, being gathered, or ready."""

    def __init__(self, spec: Unit, index: int):
        self.spec, self.index = spec, index
        self.fulls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (full buffer, this rank's shard)
        self.handles: list[C.Handle] = []
        self.ready = False
        self.remaining = 0  # trainable leaves whose gradient has not arrived yet
        self.inputs = 0  # its calls whose inputs' gradients backward has not computed yet
        self.backward = False  # an output of its forward needs a gradient: backward runs through it
        self.depth = 0  # module calls of this unit now running
        # Gathered by an inner torch.autograd.grad (a gradient penalty in loss_fn): kept until its backward
        # is over (with frozen parameters: until the step ends), since the graph that grad built with
        # create_graph=True reads the parameters in an order that no hook of the unit's own sees coming
        # (see _Runner._inner).
        self.pinned = False
        self.lease: alloc.Lease | None = None  # the host buffer its shards were read into, while gathered

    def give_back(self) -> None:
        """The gather is done: the buffer its shards were read into goes back to the pool."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    @property
    def needed_in_backward(self) -> bool:
        """Backward still needs its parameters: gradients of its own to come, or frozen weights that
        backward runs through (not a frozen unit whose outputs needed no gradient: an embedding left frozen)."""
        return bool(self.remaining) or (bool(self.spec.frozen) and self.backward)

    @property
    def idle(self) -> bool:
        """Neither gathered nor on its way: gathering it now issues a collective."""
        return not (self.ready or self.handles)

    @property
    def files(self) -> list[FileTensor]:
        """Its shards that rest in files (``offload(..., params="nvme")``), in the order of ``fulls``."""
        return [shard for _, shard in self.fulls if isinstance(shard, FileTensor)]


def _grad_node(t: torch.Tensor) -> Any:
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or a leaf's gradient accumulator."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


def _last_block(order: list) -> Any:
    """The last unit other than the root in a forward order (None if there is none)."""
    return next((u for u in reversed(order) if u.spec.name != ROOT), None)


class _Runner:
    """Gathers and releases units around the module's forward and backward."""

    def __init__(self, state: TrainState, functional: Functional, prefetch: int, sink: Any, host_shards: bool):
        spec = state.spec
        self.functional = functional
        self.module = functional.module
        self.layout = spec.layout
        self.treedef = spec.treedef
        self.prefetch = prefetch
        self.sink = sink
        self.host_shards = host_shards
        self.units = [_LiveUnit(u, i) for i, u in enumerate(self.layout.units)]
        # The shards without waiting for an update still writing them (offload's, on its worker thread):
        # each unit waits for its own buckets before it is gathered.
        self.flats, self.inflight = state.arriving_params(), state.inflight
        self.by_name = {u.spec.name: u for u in self.units}
        self.leaves: dict[str, torch.Tensor] = {}
        self.unit_of: dict[str, _LiveUnit] = {}  # parameter name -> its unit
        self.hooks: list[Any] = []
        self.forward_order: list[_LiveUnit] = []
        self.last_order = state.extra.get(ORDER)
        self.expected: list[_LiveUnit] | None = None
        self.backward_queue: list[_LiveUnit] | None = None
        self.queue_inner = False  # the queue is an inner torch.autograd.grad's (see _inner)
        self.probe: tuple | None = None  # the agreement in flight: (handle, its values on the host, code)
        self.next_open = 0  # where the forward is in the recorded order (among units with parameters)
        self.recorded: list[_LiveUnit] | None = None  # that order, units with parameters only
        trainable = sink is not None and torch.is_grad_enabled()
        # One rank holds whole buckets: the leaves view them where they lie, with nothing to gather or release.
        whole = C.world_size() == 1 and not host_shards
        for unit in self.units:
            pairs = [(self.flats[i], self.layout.buckets[i], True) for i in unit.spec.buckets]
            pairs += [(state.frozen[i], self.layout.frozen_buckets[i], False) for i in unit.spec.frozen]
            for shard, bucket, grads in pairs:
                full = shard if whole else torch.empty(bucket.padded, dtype=bucket.dtype, device=bucket.device)
                raw = full.data  # leaves view this alias: refilling `full` bumps no version they saved
                for s in bucket.slots:
                    leaf = raw[s.offset : s.offset + s.numel].view(s.shape)
                    if grads and trainable:
                        leaf, hooks = sink.leaf(s.name, leaf, then=self._grad_in(unit))
                        self.hooks += hooks
                        unit.remaining += 1
                    self.leaves[s.name] = leaf
                    self.unit_of[s.name] = unit
                if not whole:
                    full.untyped_storage().resize_(0)
                    unit.fulls.append((full, shard))
        # Shards in files: read on an I/O thread ahead of their gathers (a few units' worth at most).
        # The host buffers they are read into: pools of one per unit's shards read ahead (prefetch + 2 reads)
        # or still being gathered (prefetch + 1 units).
        on_disk = [u.files for u in self.units if u.files]
        self.reads = (
            ShardReads(prefetch + 2, prefetch + 1, on_disk, torch.cuda.is_available(), owner=self.layout)
            if on_disk
            else None
        )
        self.copies_stream: Any = None  # CUDA: where host shards are copied in (see _to_device)
        self.intercepts: list[Intercept] = []
        try:
            self._watch_calls()
        except BaseException:
            self._unwatch()
            raise
        self.open_block: _LiveUnit | None = None
        self._placeholders = None
        self.calls = 0  # model calls running (forward); none while backward recomputes
        self.input_hooks: list = []  # see _watch_inputs
        # Each unit's places in the model (module, attribute): they hold the unit's leaves while it is
        # gathered and placeholders otherwise, so that a read from outside the unit gathers it (see outside).
        self.places: dict[int, list] = {u.index: [] for u in self.units}
        for owner_, attr, name in functional._slots.values():
            if name in self.unit_of:
                self.places[self.unit_of[name].index].append((owner_, attr, name))
        self.stand_ins = {n: _Placeholder(self.leaves[n], self, n) for n in self.leaves}
        self.copies: dict[str, torch.Tensor] = {}  # parameters read outside their unit: gathered copies
        self.showing = False  # the model's places hold what the runner puts there (between run and close)
        self.closed = False

    def _watch_calls(self) -> None:
        """Make every module call inside a unit open the unit (the unit's own module or any of its submodules:
        a model may call a block's layers without calling the block); modules in no unit belong to the root.

        An eager module gets a forward pre-hook and hook. A module compiled with ``module.compile()`` gets an
        :class:`Intercept` instead, so that the unit opens and closes in eager code around the compiled call
        (its hooks would run inside the compiled region, where dynamo would trace them); its submodules in the
        same unit get nothing (they run inside that call, with the unit open). A module in a compiled region
        whose unit differs from its parent's (a block of a model compiled whole) can only be reached by hooks,
        which dynamo traces: the graph breaks there (docs/compile.md)."""
        owner: dict[int, _LiveUnit] = {}
        for name, m in self.module.named_modules():
            best = self.by_name[ROOT]
            for unit in self.units:
                if unit.spec.name and inside(name, unit.spec.name):
                    best = unit
            owner[id(m)] = best
        seen: set[int] = set()

        def walk(m: nn.Module, parent: _LiveUnit | None, in_region: bool) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            unit = owner[id(m)]
            top = bool((unit.spec.name and self.module.get_submodule(unit.spec.name) is m) or m is self.module)
            if not in_region and compiled(m):
                self.intercepts.append(Intercept(m, C.with_current_group(functools.partial(self._call, unit, top, m))))
            elif not in_region or unit is not parent:
                # In the step's group also where autograd recomputes on a thread of its own (CUDA).
                before = C.with_current_group(functools.partial(self._before, unit))
                after = C.with_current_group(functools.partial(self._after, unit, top))
                if in_region:  # dynamo would trace them: it calls them outside the graph instead (a break)
                    before, after = torch.compiler.disable(before), torch.compiler.disable(after)
                self.hooks.append(m.register_forward_pre_hook(before))
                self.hooks.append(m.register_forward_hook(after))
            region = in_region or compiled(m) or compiles_children(m)
            for child in m.children():
                walk(child, unit, region)

        walk(self.module, None, False)

    def _call(self, unit: _LiveUnit, top: bool, module: nn.Module, call: Callable, args: tuple, kwargs: dict) -> Any:
        """A compiled module's call (see :meth:`_watch_calls`): the unit's hooks around it, in eager code."""
        self._before(unit, module, args)
        out = call(*args, **kwargs)
        self._after(unit, top, module, args, out)
        return out

    def _unwatch(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for i in reversed(self.intercepts):
            i.remove()
        self.intercepts = []

    # ---------------------------------------------------------- entry points

    def placeholders(self) -> Any:
        """What loss_fn receives: placeholders shaped like the parameters (meta tensors), for apply to
        recognise; a placeholder that loss_fn computes with gathers its parameter (see :meth:`outside`)."""
        if self._placeholders is None:
            self._placeholders = T.tree_unflatten(self.treedef, [self.stand_ins[n] for n in self.layout.names])
        return self._placeholders

    def outside(self, name: str) -> torch.Tensor:
        """Parameter ``name``, read outside its unit's modules (in loss_fn, or by another unit): a gathered
        copy whose gradient flows into the parameter's, so into the unit's bucket before its reduction.

        The unit is gathered for the read if it is not (one all-gather, agreed on by every rank first) and
        released again unless it was gathered or on its way; the copy lives as long as what uses it (autograd
        keeps it until backward passes it). One copy per parameter and step.
        """
        if self.closed:
            raise RuntimeError(
                f"shard_params: parameter {name!r} (a placeholder loss_fn received) was used after its step ended; "
                "the parameters live sharded across the ranks. Read them with step.full_params(state)."
            )
        copy = self.copies.get(name)
        if copy is not None:
            return copy
        unit = self.unit_of[name]
        idle = unit.idle
        if idle:
            self._agree(_OUTSIDE, unit)
        self._ensure(unit)
        leaf = self.leaves[name]
        copy = leaf.clone() if leaf.requires_grad and torch.is_grad_enabled() else leaf.detach().clone()
        if idle and unit.depth == 0 and unit is not self.open_block:
            self._release(unit)
        self.copies[name] = copy
        return copy

    def refuse_write(self, name: str, op: str) -> None:
        unit = self.unit_of[name].spec.name or "<root>"
        raise RuntimeError(
            f"shard_params: {op} writes into parameter {name!r} (of unit {unit!r}) from outside its unit's modules; "
            "the parameters live sharded across the ranks and a read from outside the unit is a gathered copy, so "
            "the write would be lost. Compute a new tensor instead (w = params[name] * 2, not params[name].mul_(2)); "
            "to change parameters between steps, build a new state: step.init(new_params). Nothing was updated."
        )

    def _show(self, unit: _LiveUnit, inside: bool) -> None:
        """Put the unit's leaves (while its own modules run) or placeholders (otherwise) in its places in the
        model: a read from anywhere else then goes through :meth:`outside`, never to a released buffer."""
        if not self.showing:
            return
        held = self.leaves if inside else self.stand_ins
        for owner_, attr, name in self.places[unit.index]:
            owner_._parameters[attr] = held[name]

    def __call__(self, functional: Functional, params: Any, args: tuple, kwargs: dict) -> Any:
        if params is not self._placeholders:
            raise ValueError(
                "under shard_params, call apply with the params the step passed to loss_fn: they are "
                "placeholders for parameters that live sharded across the ranks and are gathered unit by "
                "unit inside apply. To read full parameters, use step.full_params(state)."
            )
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        self.showing = True
        try:
            # The model shows placeholders but in the unit whose modules run, so a parameter read from outside
            # its unit is gathered for the read (outside), wherever the read is.
            out = self.functional.call_with(self.stand_ins, args, kwargs)
        finally:
            self.calls -= 1
        self._agree(_END, None)  # every rank's forward ends here, having run the same units
        return out

    def close(self) -> None:
        self.showing = False  # the model has its own parameters back
        self._unwatch()
        for h in self.input_hooks:
            h.remove()
        self.input_hooks = []
        for unit in self.units:
            self._release(unit, final=True)
        if self.probe is not None:  # a forward that raised left its last agreement in flight: end it alike
            with contextlib.suppress(RuntimeError):
                self._settled()
        self.copies = {}
        if self.reads is not None:
            self.reads.close()
        self.closed = True

    # ---------------------------------------------------------- gather and release

    def _gather(self, unit: _LiveUnit) -> None:
        if unit.ready or unit.handles:
            return
        for i in unit.spec.buckets:  # an update still writing a shard finishes first (on every rank alike)
            self.inflight.wait_bucket(i)
        if not unit.fulls:
            return
        lease = self.reads.take(unit.index, unit.files) if self.reads is not None and unit.files else None
        unit.lease = lease  # given back once the gather is done (or the unit released, however it ends)
        read = iter(lease.tensors if lease is not None else ())
        copied = None
        for full, shard in unit.fulls:
            full.untyped_storage().resize_(full.numel() * full.element_size())
            if isinstance(shard, FileTensor):  # read from its file (ahead, on the I/O thread), into a host buffer
                shard = next(read)
            if self.host_shards and shard.device != full.device:  # brought in from host memory
                shard = self._to_device(shard, full.device)
                copied = full.device
            unit.handles.append(C.all_gather(full, shard, async_op=True))
        if lease is not None and copied is not None and copied.type == "cuda":
            # Copied to the device: the buffer is free for another read once the copies are done (otherwise
            # the gather reads the buffer itself).
            done = torch.cuda.Event()
            done.record(self.copies_stream)
            lease.release(after=done)
            unit.lease = None
        self._read_ahead(unit)

    def _to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host shard copied to ``device`` without blocking. On CUDA the copy runs on a side stream, so it
        overlaps the kernels already queued on the compute stream (the unit before this one); the compute
        stream waits for it where this unit's all-gather is queued, before anything that reads it."""
        if device.type != "cuda":
            return torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host, non_blocking=True)
        if self.copies_stream is None:
            self.copies_stream = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.copies_stream):
            # Allocated from the side stream's own blocks, so no kernel still queued on the compute stream can
            # be reading this memory; the pinned source is kept until the copy is done (torch's host allocator
            # records the stream it was copied on).
            out = torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        compute.wait_event(done)
        out.record_stream(compute)  # used there next: not reused by the side stream before that work is done
        return out

    def _read_ahead(self, unit: _LiveUnit) -> None:
        """Start reading the shards of the units expected after ``unit`` (``prefetch + 1`` of them): the
        forward's recorded order, then backward's (the forward's reversed), or what backward has left."""
        if self.reads is None:
            return
        if self.backward_queue is not None:
            order = [u for u in self.backward_queue if u.needed_in_backward]
        else:
            forward = self.recorded if self.recorded is not None else self._expected_forward()
            order = forward[forward.index(unit) + 1 :] if unit in forward else forward
            if self.sink is not None and torch.is_grad_enabled():  # a backward follows
                order = order + list(reversed(forward))
        for u in [u for u in order if u is not unit and u.idle and u.files][: self.prefetch + 1]:
            self.reads.ahead(u.index, u.files)

    def _ensure(self, unit: _LiveUnit) -> None:
        self._gather(unit)
        for h in unit.handles:
            h.wait()
        unit.handles = []
        unit.give_back()
        unit.ready = True

    def _agree(self, kind: int, unit: _LiveUnit | None, wait: bool = True) -> None:
        """Every rank must be at the same point: opening the same unit, reading the same unit's parameter
        from outside it, gathering the same unit for backward, or ending the forward. One max-reduce of
        (code, -code) on the control group, which ranks that took different paths see differ, so that they
        raise together instead of waiting in mismatched collectives.

        ``wait``: wait for it here, before any gather this point issues. Otherwise it stays in flight until
        the next agreement (or :meth:`_settled`): a forward that follows the recorded order issues the same
        gathers on every rank whichever unit each one opened (see :meth:`_opened`), so it checks each point
        one point later, and no rank waits for a round trip per unit. The values are read from the probe's
        host buffer (a CPU tensor of the control group), no device read."""
        if C.world_size() == 1:
            return
        self._settled()
        n = len(self.units)
        code = kind * (n + 1) + (unit.index if unit is not None else n)
        values = np.array([code, -code], dtype=np.int64)
        handle = C.all_reduce(torch.from_numpy(values), "max", async_op=True, control=True)
        self.probe = (handle, values, code)
        if wait:
            self._settled()

    def _settled(self) -> None:
        """Wait for the agreement in flight, if any; raise if the ranks were at different points."""
        if self.probe is None:
            return
        handle, values, code = self.probe
        self.probe = None
        handle.wait()
        hi, lo = int(values[0]), -int(values[1])
        if hi != lo:
            raise RuntimeError(
                f"shard_params: ranks gathered different units at the same point of the step: rank {C.rank()} "
                f"{self._point(code)} while another rank {self._point(hi if hi != code else lo)} (world size "
                f"{C.world_size()}). Every rank must run the same units in the same order: make control flow that "
                "skips or repeats a unit the same on every rank (for example decide it from a value broadcast from "
                "rank 0)."
            )

    def _point(self, code: int) -> str:
        n = len(self.units)
        kind, index = divmod(code, n + 1)
        if index >= n:
            return "ended the model's forward"
        name = repr(self.units[index].spec.name or "<root>")
        return {
            _OPEN: f"ran unit {name}",
            _OUTSIDE: f"read a parameter of unit {name} from outside it",
            _BACKWARD: f"gathered unit {name} for backward",
        }[kind]

    def _release(self, unit: _LiveUnit, final: bool = False, over: bool = False) -> None:
        """Free the unit's full buffers. A pinned unit's only at the step's end (``final``) or, if it has no
        frozen parameters, when its backward is over (``over``: its last gradient is in; see :meth:`_inner`)."""
        if unit.pinned and not (final or (over and not unit.spec.frozen)):
            self._show(unit, False)
            return
        for h in unit.handles:
            h.wait()
        unit.handles = []
        unit.give_back()
        for full, _ in unit.fulls:
            full.untyped_storage().resize_(0)
        if self.host_shards and unit.fulls and unit.fulls[0][0].device.type == "cpu":
            # Computing on the CPU with the shards off the device (offload's params): the unit's buffers came
            # from the C allocator, whose heap would keep them resident, fragmented, one more per unit
            # gathered; handed back to the system, the step holds the units in flight and no more.
            alloc.return_freed()
        unit.ready = False
        self._show(unit, False)

    def _prefetch(self, candidates: list[_LiveUnit], current: _LiveUnit, agree: bool = False) -> None:
        """Have the next ``prefetch`` units (after ``current``) gathered or on their way; ``agree``: each
        gather this issues is agreed on first (in backward, whose order autograd decides)."""
        for u in [u for u in candidates if u is not current and u.fulls][: self.prefetch]:
            if agree and u.idle:
                self._agree(_BACKWARD, u)
            self._gather(u)

    def _ensure_backward(self, unit: _LiveUnit) -> None:
        if unit.idle and unit.fulls:
            self._agree(_BACKWARD, unit)
        self._ensure(unit)
        if self._inner():
            unit.pinned = True

    def _inner(self) -> bool:
        """Whether autograd is running a backward other than the step's: a ``torch.autograd.grad`` inside
        ``loss_fn`` (a gradient penalty, a Jacobian regulariser), before the step's own backward.

        Such a grad runs through the units like a backward (their hooks gather them) but accumulates no
        gradient, so no unit's last gradient arrives to release it; with ``create_graph=True`` it builds
        a graph that the step's backward then runs, whose nodes read the parameters of every unit the grad ran
        through, in an order that the units' own hooks do not see coming (a node of it may run before any
        hook of the unit has run in the step's backward). So each unit it gathers is pinned: no forward (a
        second model call in ``loss_fn``) releases it. Its backward's end still does: every node of that
        graph that reads a trainable parameter also computes a gradient for it (the parameter is one of its
        inputs), so autograd runs it before the parameter's gradient is in. Not so for a frozen parameter,
        which has no gradient to wait for: a unit that holds one stays gathered until the step ends."""
        return self.sink is not None and not self.sink.backward_started and torch._C._current_graph_task_id() != -1

    # ---------------------------------------------------------- hooks

    def _expected_forward(self) -> list[_LiveUnit]:
        if self.expected is None:
            if self.last_order is not None and self.last_order.numel():
                self.expected = [self.units[i] for i in counters.values(self.last_order)]  # carried: no read
            else:  # first step: the root runs first, then the blocks in registration order
                self.expected = [self.by_name[ROOT]] + [u for u in reversed(self.units) if u.spec.name != ROOT]
        return self.expected

    def _before(self, unit: _LiveUnit, module: nn.Module, args: Any) -> None:
        if not self.calls:
            # Outside the model's call: a recompute in backward (activation checkpointing).
            # The unit's backward is under way: have it gathered, and release it only
            # when its last gradient is in (a recompute may stop early, so no depth count).
            self._ensure_backward(unit)
            self._show(unit, True)  # until the unit is released
            return
        if unit.spec.name != ROOT and unit is not self.open_block:
            # Entering another block: the previous one is done if none of its calls is running.
            prev = self.open_block
            if prev is not None and prev.depth == 0:
                self._release(prev)
            self.open_block = unit
            self._opened(unit)
        elif unit.spec.name == ROOT and unit.depth == 0 and not unit.ready:
            self._opened(unit)
        if unit.depth == 0:
            self._show(unit, True)
            if torch.is_grad_enabled() and self.sink is not None:
                self._watch_inputs(unit, args)
        unit.depth += 1

    def _watch_inputs(self, unit: _LiveUnit, args: Any) -> None:
        """Count the call until backward has computed its inputs' gradients: the unit's backward is over only
        then. A unit whose frozen weights compute those gradients (a LoRA block: its adapters' gradients can
        all be in before backward reaches the frozen layers below them) must stay gathered until it is."""
        inputs = [t for t in T.tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            return
        unit.inputs += 1
        # torch.autograd.graph.register_multi_grad_hook(inputs, done, mode="all") but for the step's own backward
        # only: an inner torch.autograd.grad (see _inner) runs these hooks too, where that one raises on an input
        # that is a leaf (torch cannot tell which leaves a grad reaches), and would count the call done early.
        nodes = [_grad_node(t) for t in inputs]
        left: list[int] = []  # the step's backward: how many of the inputs it computes a gradient for, still to come

        def arrived(_grad: torch.Tensor) -> None:
            if self._inner() or self.closed:
                return
            if not left:
                left.append(sum(map(torch._C._will_engine_execute_node, nodes)))
            left[0] -= 1
            if left[0] == 0:
                unit.inputs -= 1
                if unit.inputs == 0 and unit.remaining == 0:
                    self._release(unit, over=True)

        self.input_hooks += [t.register_hook(C.with_current_group(arrived)) for t in inputs]

    def _opened(self, unit: _LiveUnit) -> None:
        self.forward_order.append(unit)
        expected = self._expected_forward()
        if not unit.fulls:  # a unit without parameters issues no collective to disagree on
            self._ensure(unit)
            return
        if self.last_order is not None and self.last_order.numel():
            # The order the last step recorded (every rank's, agreed on then): every rank issues the gathers
            # it predicts at this point, the next unit in it and `prefetch` after that, whichever unit it opened,
            # so the agreement on the unit can stay in flight; a rank that opened another unit waits for it.
            if self.recorded is None:
                self.recorded = [u for u in expected if u.fulls]
            order = self.recorded
            self._agree(_OPEN, unit, wait=False)
            for u in order[self.next_open : self.next_open + 1 + self.prefetch]:
                self._gather(u)
            if self.next_open < len(order) and unit is order[self.next_open]:
                self.next_open += 1
                self._ensure(unit)
                return
            self._settled()  # ranks that opened different units raise here together
            if unit in order[self.next_open :]:
                self.next_open = order.index(unit, self.next_open) + 1
        else:  # the first step: no order agreed on yet, each point waits for its agreement
            self._agree(_OPEN, unit)
        self._ensure(unit)
        if unit in expected:
            self._prefetch(expected[expected.index(unit) + 1 :], unit)

    def _after(self, unit: _LiveUnit, top: bool, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and self.sink is not None:
            for t in T.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    unit.backward = True
                    t.register_hook(C.with_current_group(functools.partial(self._before_backward, unit)))
        if not self.calls:  # a recompute in backward: see _before
            return
        unit.depth -= 1
        if unit.depth == 0:
            self._show(unit, False)
        if top and unit.depth == 0:
            # The root and the forward's last block are the first backward needs: they stay gathered
            # (as FSDP2 keeps its root), saving their gathers at backward's start and the wait for them.
            backward = torch.is_grad_enabled() and self.sink is not None
            expected = self._expected_forward()
            backward_next = backward and (unit.spec.name == ROOT or unit is _last_block(expected))
            if not backward_next:
                self._release(unit)
            if unit is self.open_block:
                self.open_block = None
            if unit.spec.name == ROOT and self.open_block is not None:
                if not backward_next:
                    self._release(self.open_block)  # the model's forward is over
                self.open_block = None

    def _before_backward(self, unit: _LiveUnit, grad: torch.Tensor) -> None:
        inner = self._inner()
        if self.backward_queue is None or self.queue_inner != inner:  # the step's backward after an inner grad
            self.backward_queue = list(dict.fromkeys(reversed(self.forward_order)))
            self.queue_inner = inner
        if unit in self.backward_queue:
            self.backward_queue.remove(unit)
        if unit.remaining or unit.spec.frozen:
            self._ensure_backward(unit)
        self._prefetch([u for u in self.backward_queue if u.needed_in_backward], unit, agree=True)

    def _grad_in(self, unit: _LiveUnit) -> Callable[[torch.Tensor], None]:
        def on_grad(leaf: torch.Tensor) -> None:
            unit.remaining -= 1
            if unit.remaining == 0 and unit.inputs == 0:  # its backward is over: the full parameters can go
                self._release(unit, over=True)

        return on_grad
