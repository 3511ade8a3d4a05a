"""TrainState and the flat bucket layout every Step shares.

Trainable parameters live in flat 1-D buffers, one per *bucket*: a run of
parameters of one dtype and device, at most ``bucket_bytes`` long (a larger
parameter gets a bucket of its own), in the reverse of registration order so
that backward fills buckets roughly one after another. A bucket is padded to
a multiple of its shard count; shard ``r`` of a bucket is the contiguous
slice ``[r * k, (r + 1) * k)``. Without sharding the shard count is 1.

This one layout serves every stage: gradients are reduced bucket by bucket
as backward produces them, the optimizer sees a dict of per-bucket tensors
(the full buffer, or this rank's slice of it), and publishing updated
parameters is one all-gather per bucket.

Example:
    >>> import torch
    >>> from zerofn.state import Layout
    >>> lay = Layout.build({"w": torch.zeros(3, 5), "b": torch.zeros(5)}, shards=4, bucket_bytes=1 << 20)
    >>> [(b.numel, b.padded, b.shard_numel) for b in lay.buckets]
    [(20, 20, 5)]
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zerofn import tree as T
from zerofn.placement import format_bytes, held_bytes
from zerofn.roles import placement_of

__all__ = [
    "Bucket",
    "DonatedStateError",
    "Layout",
    "Slot",
    "StateSpec",
    "InFlight",
    "RunCache",
    "TrainState",
    "arriving",
    "block_until_ready",
    "collecting",
]


@dataclass(frozen=True)
class Slot:
    """Where one trainable parameter lives inside its bucket's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    """A flat buffer of parameters of one dtype and device.

    ``apart``: the mesh axis of the step's group along which its parameters are cut (expert parallelism's
    ``ep``: the ranks of that axis hold different experts), so that it is reduced and sharded over the ranks
    of the step's group that share this rank's coordinate there (``zerofn.collectives.without(apart)``),
    ``shards`` of them; empty: over the step's group.

    ``cut``: the mesh axis outside the step's group along which its parameters are cut (tensor
    parallelism's ``tp``), ``share`` consecutive ranks of it holding the same piece (key/value heads fewer
    than the ranks): its gradient's elements differ between the axis's pieces, so the gradient norm sums
    them over the axis, one rank of each piece counting it, where a bucket of parameters whole along the
    axis is counted once.

    ``replicate``: the mesh axis of the step's group across which its shards are replicas (hybrid
    sharding's ``dp_replicate``): it is sharded over the ranks of the step's group that share this rank's
    coordinate there (``zerofn.collectives.without(replicate)``, as ``apart`` is), each shard's reduced
    gradient is summed across the axis (``zerofn.collectives.along(replicate)``), and its shard is counted
    once in the gradient norm (on the axis's first coordinate) and saved once.
    """

    dtype: torch.dtype
    device: str
    slots: tuple[Slot, ...]
    numel: int
    padded: int
    shards: int
    apart: str = ""
    cut: str = ""
    share: int = 1
    replicate: str = ""

    @property
    def shard_numel(self) -> int:
        return self.padded // self.shards

    @property
    def nbytes(self) -> int:
        return self.padded * self.dtype.itemsize

    def shard_range(self, rank: int) -> tuple[int, int]:
        k = self.shard_numel
        return rank * k, (rank + 1) * k


@dataclass(frozen=True)
class Layout:
    """How a params tree maps onto flat buckets (static, hashable)."""

    buckets: tuple[Bucket, ...]
    names: tuple[str, ...]  # every parameter, in the params tree's leaf order
    frozen: tuple[str, ...]  # parameters with no gradient and no optimizer state
    frozen_buckets: tuple[Bucket, ...] = ()  # frozen parameters, when they are sharded too
    units: tuple = ()  # groups of buckets gathered together (shard_params)

    @staticmethod
    def build(
        trainable: Mapping[str, torch.Tensor],
        *,
        shards: int,
        bucket_bytes: int,
        names: tuple[str, ...] | None = None,
        frozen: tuple[str, ...] = (),
        first_bucket_bytes: int | None = None,
        labels: Mapping[str, Any] | None = None,
        apart: Mapping[str, tuple[str, int]] | None = None,
        cut: Mapping[str, tuple[str, int]] | None = None,
        replicate: str = "",
    ) -> Layout:
        """Group ``trainable`` into buckets, last-registered first (backward order).

        ``first_bucket_bytes`` caps the first bucket of each dtype (the one
        backward fills first), as DDP's 1 MiB first bucket does: its
        gradient buffer is allocated while the forward's activations are
        all alive, and its reduction starts early.

        ``labels`` (name -> a hashable, the optimizer's groups) keeps
        parameters of different labels in different buckets; the buckets of
        all labels are then ordered by when backward completes them (the
        position of their last parameter in backward order), so that a
        group spread over the whole model (biases, norms) does not hold the
        reductions of the others back.

        ``apart`` (name -> (axis, shards)) puts the parameters cut along a
        mesh axis of the step's group (expert parallelism's experts) in
        buckets of their own, ``shards`` shards each (see :class:`Bucket`),
        ordered among the others in the same way; ``cut`` (name -> (axis, share)) does
        the same for the parameters a model-parallel axis cuts (see
        :class:`Bucket`); ``replicate`` names the axis across which every
        bucket's shards are replicas (hybrid sharding; see :class:`Bucket`).
        """
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        order = {name: i for i, name in enumerate(reversed(list(trainable)))}
        for name, p in reversed(list(trainable.items())):
            label = labels.get(name) if labels else None
            axis = apart[name] if apart and name in apart else ("", shards)
            along = cut.get(name, ("", 1)) if cut else ("", 1)
            groups.setdefault((p.dtype, str(p.device), label, axis, along), []).append((name, p))
        buckets: list[Bucket] = []
        for (dtype, device, _, (axis, n_shards), along), items in groups.items():
            limit = max(1, min(bucket_bytes, first_bucket_bytes or bucket_bytes) // dtype.itemsize)
            run: list[Slot] = []
            size = 0
            for name, p in items:
                n = p.numel()
                if run and size + n > limit:
                    buckets.append(_bucket(dtype, device, run, size, n_shards, axis, along, replicate))
                    run, size = [], 0
                    limit = max(1, bucket_bytes // dtype.itemsize)
                run.append(Slot(name, tuple(p.shape), size, n))
                size += n
            if run:
                buckets.append(_bucket(dtype, device, run, size, n_shards, axis, along, replicate))
        if len({k[2:] for k in groups}) > 1:
            buckets.sort(key=lambda b: (max(order[s.name] for s in b.slots), str(b.dtype)))
        return Layout(tuple(buckets), tuple(names or trainable), tuple(frozen))

    @functools.cached_property
    def trainable_names(self) -> tuple[str, ...]:
        """The trainable parameters' names, in the params tree's leaf order (whatever the buckets)."""
        where = self.bucket_of
        return tuple(n for n in self.names if n in where)

    @functools.cached_property
    def bucket_of(self) -> dict[str, int]:
        """name -> the index of the bucket holding that trainable parameter."""
        return {s.name: i for i, b in enumerate(self.buckets) for s in b.slots}

    @property
    def trainable_numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def views(self, flats: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """name -> view of the parameter inside its bucket's flat buffer."""
        out = {}
        for i, flat in enumerate(flats):
            out.update(self.bucket_views(i, flat))
        return out

    def bucket_views(self, i: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> view into ``flat``, bucket ``i``'s buffer, for each of its parameters."""
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.buckets[i].slots}


def _bucket(dtype, device, slots, numel, shards, apart="", cut=("", 1), replicate="") -> Bucket:
    padded = -(-max(numel, 1) // shards) * shards
    return Bucket(dtype, device, tuple(slots), numel, padded, shards, apart, *cut, replicate=replicate)


@dataclass(frozen=True)
class StateSpec:
    """What made a state: the step's chain, the world size and the layout."""

    chain: str
    world_size: int
    layout: Layout
    treedef: Any  # the params tree's structure, to rebuild it for loss_fn
    # The model's state_dict entries: (name, "param" or "buffer", the name the state holds it
    # under), when the params came from zf.functional; checkpoints export by these names.
    model: tuple = ()
    # The step's mesh as this rank sees it: (axis, size, this rank's coordinate) for each axis, outermost
    # first (zerofn.mesh); empty: no mesh (the step's group alone).
    mesh: tuple = ()
    # (name, placements) for each parameter a parallelism cuts, one zerofn.sharding placement per axis of
    # `mesh`: how the parameter this rank holds is cut from the whole one. Absent: whole on every rank.
    placements: tuple = ()
    # The dtype of each params leaf (in ``layout.names``' order) as the model has it: as ``init`` received it,
    # before the precision part cast it (amp holds bf16); what ``full_params`` returns. Empty: as held.
    dtypes: tuple = ()


class DonatedStateError(RuntimeError):
    """A state was used after a step donated its buffers."""


DONATED_HELP = """\
this TrainState was donated to a step: its buffers now hold the new state's
numbers, so reading it would give wrong results. Use the state the step
returned:

    state, metrics = step(state, batch)      # rebind the name

or build the step with donate=False to keep input states intact (at the cost
of one copy of the state per step):

    step = zf.train_step(loss_fn, optimizer, donate=False)
"""


class InFlight:
    """Work still running on a state's values, as handles the state carries (``state.inflight``).

    ``params``: bucket index -> a handle whose ``wait()`` returns once that
    bucket's buffer is whole (a publish's all-gather, a host update writing
    it); ``opt``: handles of updates still writing the optimizer state. Each
    handle is waited for once, by the part that needs it: the next forward
    bucket by bucket (:meth:`wait_bucket`), a read of ``state.params`` or
    ``state.opt_state``, a checkpoint, :func:`zerofn.block_until_ready`.

    It is not part of the state's value: every ``InFlight`` equals every
    other, so two states' tree structures compare equal whatever is in flight.
    """

    __slots__ = ("params", "opt", "fault", "reported")

    def __init__(self, fault: Any = None) -> None:
        self.params: dict[int, Any] = {}
        self.opt: list = []
        # Checks parts reported on the micro-steps of the update under way (zerofn.step.report), not read.
        self.reported: list = []
        # A check the device made and the host has not read: ``(code, explain)``, ``code`` a 0-dim integer
        # tensor (0: nothing wrong), ``explain(code)`` raising what went wrong. Kept from state to state
        # until read by check(), which block_until_ready and checkpoints call.
        self.fault = fault

    def check(self) -> None:
        """Read the device's pending check (a wait for the device) and raise what it found, if anything."""
        if self.fault is not None:
            (code, explain), self.fault = self.fault, None  # raised once: the state then goes on
            value = int(code)
            if value:
                explain(value)

    def buckets(self) -> list[int]:
        """The indices of the buckets still in flight, in order."""
        return sorted(self.params)

    def wait_bucket(self, i: int) -> None:
        """Wait for bucket ``i`` (nothing when it is whole)."""
        handle = self.params.pop(i, None)
        if handle is not None:
            handle.wait()

    def wait_params(self) -> None:
        for i in self.buckets():
            self.wait_bucket(i)

    def wait_opt(self) -> None:
        while self.opt:
            self.opt.pop(0).wait()

    def wait(self) -> None:
        """Wait for everything in flight."""
        self.wait_opt()
        self.wait_params()

    def __bool__(self) -> bool:
        return bool(self.params or self.opt)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InFlight)

    def __hash__(self) -> int:
        return 0

    def __reduce__(self):  # a copy or a pickle holds the values whole: nothing in flight
        self.wait()
        return (InFlight, ())

    def __repr__(self) -> str:
        return f"InFlight(buckets={self.buckets()}, opt={len(self.opt)})"


class RunCache:
    """What a training run derives once from its step and keeps beside its states (``state.run``): the
    model ``loss_fn`` calls, the optimizer bound to the state's buckets (a wrapper may learn from update to
    update), whether the ranks agreed on the batch shapes. Made by ``init``, it goes from state to state.

    Entries are kept by key (:meth:`get`): the step's package decides what the keys are. Like
    :class:`InFlight` it is not part of the state's value: every ``RunCache`` equals every other, and a
    copy or a pickle holds none of its entries (they are derived again when needed).
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict = {}

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        """The entry ``key``, made by ``make()`` the first time it is asked for."""
        try:
            return self.entries[key]
        except KeyError:
            value = self.entries[key] = make()
            return value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunCache)

    def __hash__(self) -> int:
        return 0

    def __reduce__(self):
        return (RunCache, ())

    def __repr__(self) -> str:
        return f"RunCache({len(self.entries)} entries)"


# The in-flight record of the step now running its update (``collecting``): what ``arriving`` marks goes
# there, and so into the state the step returns. Scoped to one update, never process-wide.
_COLLECTING: contextvars.ContextVar = contextvars.ContextVar("zerofn_collecting", default=None)


@contextlib.contextmanager
def collecting(inflight: InFlight, flats: tuple):
    """Within the block, :func:`arriving` records handles into ``inflight``: per bucket for the tensors
    of ``flats`` (or views of them), as optimizer-state writes for any other tensor."""
    token = _COLLECTING.set((inflight, flats))
    try:
        yield inflight
    finally:
        _COLLECTING.reset(token)


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def arriving(t: torch.Tensor, handle: Any) -> None:
    """Record that ``t``'s values are arriving until ``handle.wait()`` returns, in the in-flight record of
    the update now running (see :func:`collecting`); outside one, wait for it here."""
    current = _COLLECTING.get()
    if current is None:
        handle.wait()
        return
    inflight, flats = current
    base = _root(t)
    for i, f in enumerate(flats):
        if isinstance(f, torch.Tensor) and _root(f) is base:
            inflight.wait_bucket(i)  # a second mark on one bucket queues behind the first
            inflight.params[i] = handle
            return
    if not any(h is handle for h in inflight.opt):
        inflight.opt.append(handle)


@T.state_class
class TrainState:
    """Everything a training run holds between steps, as a pytree.

    Fields:
        params: one flat buffer per bucket of trainable parameters (full on
            every rank unless the parameters are sharded).
        frozen: name -> parameter for parameters that get no gradient.
        buffers: name -> the model's buffers (BatchNorm's running
            statistics, any registered buffer), bound into the model for
            every step and kept equal across ranks.
        opt_state: the optimizer's state over its view of ``params`` (this
            rank's slices under ``shard_optimizer``).
        count: number of optimizer updates applied (int64).
        micro: micro-steps accumulated towards the next update (int64).
        grad_accum: per-bucket gradient sums between micro-steps, or None.
        seen: between micro-steps, which trainable parameters (in
            ``layout.trainable_names`` order) got a gradient so far (uint8), or None.
        items: between micro-steps of a ``zf.Mean`` loss, this rank's running sums of ``total`` and
            ``count`` (float64, 2 elements), or None.
        param_steps: the number of updates each trainable parameter received
            (int64, ``layout.trainable_names`` order): torch's per-parameter
            ``state["step"]``, which a parameter that got no gradient on a step
            does not advance.
        loss_scale: the loss scale (``amp``), a pytree with ``scale`` and
            ``adjust(finite)``, or None.
        extra: key -> pytree: entries the step's parts and extensions keep
            between steps (``zerofn.extension``), e.g. the order in which
            ``shard_params`` saw its units run.
        spec: static: the chain, world size and layout that made the state.
    """

    params: tuple
    frozen: dict
    buffers: dict
    opt_state: Any
    count: torch.Tensor
    micro: torch.Tensor
    grad_accum: Any
    seen: Any
    items: Any
    param_steps: torch.Tensor
    loss_scale: Any
    extra: dict
    spec: StateSpec = T.field(static=True)

    # Work still running on params and opt_state (a publish's all-gathers, a host update): not part of
    # the value (every InFlight equals every other); reading params or opt_state waits for it.
    inflight: InFlight = T.field(static=True, default_factory=InFlight)
    # What the run derives once from its step (the bound optimizer, the model, the batch check): not part
    # of the value either; every state of a run shares it.
    run: RunCache = T.field(static=True, default_factory=RunCache)

    def __getattr__(self, name: str) -> Any:  # only for a name not found: a donated state has no fields
        if name != "__dict__" and not name.startswith("__") and self.__dict__.get("_donated", False):
            raise DonatedStateError(DONATED_HELP)
        raise AttributeError(name)

    def arriving_params(self) -> tuple:
        """``params`` without waiting for the work in flight on them (``inflight``): for the step's
        forward, which waits bucket by bucket, and for what reads only shapes."""
        return self._field("params")

    def arriving_opt_state(self) -> Any:
        """``opt_state`` without waiting for an update in flight: for an update that queues behind it."""
        return self._field("opt_state")

    def _field(self, name: str) -> Any:
        try:
            return self.__dict__[name]
        except KeyError:
            raise (DonatedStateError(DONATED_HELP) if self.__dict__.get("_donated") else AttributeError(name)) from None

    def _donate(self) -> None:
        self.__dict__.clear()  # every field now reads as donated (see __getattr__)
        self.__dict__["_donated"] = True

    def __getstate__(self) -> dict:  # pickle and deepcopy read the fields directly: the values whole first
        if not self.__dict__.get("_donated", False):
            self.__dict__["inflight"].wait()
        return self.__dict__

    def replace(self, **changes: Any) -> TrainState:
        fields = {f.name: self._field(f.name) for f in dataclasses.fields(self)}  # no wait for params
        # what was in flight stays with the state that launched it; a check not read yet goes on
        fields["inflight"] = InFlight(self.__dict__["inflight"].fault)
        return type(self)(**{**fields, **changes})

    def __repr__(self) -> str:
        if self.__dict__.get("_donated", False):
            return "TrainState(<donated>)"
        return describe(self)


def block_until_ready(tree: Any) -> Any:
    """Wait for the work still in flight on every :class:`TrainState` in ``tree`` (JAX's name); returns ``tree``.

    A step returns before all of its work is over: the all-gathers of the
    updated shards (stages 1 and 2), a host update on another thread
    (``offload``). The next step waits for each piece where it needs it, and
    so does reading ``state.params`` or ``state.opt_state``; call this to
    time a loop of steps, or before handing the buffers to code that reads
    them some other way. Metrics are device tensors: ``float(m["loss"])``
    waits for its own value only.

    Example:
        >>> import torch, zerofn as zf
        >>> apply = zf.functional(torch.nn.Linear(3, 1))
        >>> step = zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.sgd(0.1))
        >>> state, _ = step(step.init(apply.params), torch.ones(2, 3))
        >>> zf.block_until_ready(state) is state
        True
    """
    devices = set()
    for node in T.tree_leaves(tree, is_leaf=lambda x: isinstance(x, TrainState)):
        if isinstance(node, TrainState):
            inflight = node.__dict__.get("inflight")  # none on a donated state
            if inflight is not None:
                inflight.wait()
                inflight.check()
                params = T.tree_leaves(node.__dict__["params"])  # tensors, or shards in files
                devices.update(t.device for t in params if isinstance(t, torch.Tensor))
        elif isinstance(node, torch.Tensor):
            devices.add(node.device)
    for device in devices:  # the device's queue drained too (what a collective's wait only orders)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return tree


def _waiting(name: str, wait: str, doc: str) -> property:
    def get(self: TrainState) -> Any:
        value = self._field(name)
        getattr(self.__dict__["inflight"], wait)()
        return value

    def put(self: TrainState, value: Any) -> None:  # the dataclass's __init__ only (the state is frozen)
        self.__dict__[name] = value

    return property(get, put, doc=doc)


# Reading params or opt_state waits for the state's own work in flight on them (a documented wait, so that
# code written for a finished step stays right); the step's forward reads arriving_params() and waits per bucket.
TrainState.params = _waiting(
    "params", "wait_params", "One flat buffer per bucket of trainable parameters; waits for a publish in flight."
)
TrainState.opt_state = _waiting(
    "opt_state", "wait_opt", "The optimizer's state; waits for an update still running on another thread."
)


def _params_note(state: TrainState, lay: Layout) -> str:
    note = f"{len(lay.buckets)} buckets, {lay.trainable_numel:,} trainable"
    held = sum(t.numel() for t in state.arriving_params())
    if lay.buckets and held < sum(b.padded for b in lay.buckets):
        note += f", sharded 1/{state.spec.world_size}"
    return note


def _opt_note(opt_state: Any, sharded: bool, world: int) -> str:
    note = f"sharded 1/{world}" if sharded else "replicated"
    placement = placement_of(opt_state)  # declared by a wrapper that keeps the state elsewhere
    if placement is not None:
        note += f", offloaded to {placement} ({type(opt_state).__name__})"
    return note


def describe(state: TrainState) -> str:
    """A readable summary: what is sharded, where it lives, bytes on this rank."""
    spec = state.spec
    lay = spec.layout
    sharded = any(b.shards > 1 for b in lay.buckets)
    rows = [
        ("params", T.tree_leaves(state.arriving_params()), _params_note(state, lay)),
        ("frozen", T.tree_leaves(state.frozen), f"{len(lay.frozen)} tensors"),
        ("buffers", T.tree_leaves(state.buffers), "kept equal across ranks"),
        ("opt_state", T.tree_leaves(state.opt_state), _opt_note(state.opt_state, sharded, spec.world_size)),
        ("grad_accum", T.tree_leaves(state.grad_accum), "between micro-steps"),
    ]
    head = f"TrainState({spec.chain}, world_size={spec.world_size}, count={int(state.count)}, micro={int(state.micro)}"
    if state.loss_scale is not None:
        head += f", loss_scale={float(state.loss_scale.scale):g}"
    lines = [head + ")"]
    for label, leaves, note in rows:
        if leaves or label in ("params", "opt_state"):
            held = held_bytes(leaves)
            where = ",".join(sorted(held)) or "-"
            lines.append(f"  {label:<10} {format_bytes(sum(held.values()), binary=True):>12}  on {where:<8} {note}")
    return "\n".join(lines)
