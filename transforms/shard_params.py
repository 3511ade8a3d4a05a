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
  while backward goes on; when the unit's last gradient is in, its full
  buffer is released.
- ``opt_view`` / ``publish``: the state holds shards, which the optimizer
  updates in place; nothing is gathered after the update.
- ``init``: the state is built shard by shard, one module's parameters at
  a time, also from a model built on the meta device (initialised by
  ``init_fn``, a Hugging Face model's own ``_init_weights``, or the module's
  ``reset_parameters``).
- ``full_params`` and ``forward`` (``step.apply``): gather one unit at a time.
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
when two units share one), and ranks that run different units (every
gather travels with a 16-byte max-reduce of the unit's id, so ranks that
diverge raise together at the first differing unit instead of hanging).

Collectives per step: all-gather of every unit in forward and again in
backward (but the root and the last block, kept from the forward), and a
reduce-scatter of every unit's gradient: at most 3 x parameter bytes
(frozen parameters: 2 x, they have no gradient), plus tiny ones: the
unit-order check with each gather (32 bytes, on a group of its own),
batch-shape agreement, and loss, gradient norm and finiteness.

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
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from zerofn.transforms._units import (
    ROOT,
    Materialiser,
    MinUnitBytes,
    Unit,
    assign_units,
    inside,
    unit_buckets,
    unit_names,
)
from zerofn.transforms.shard_grads import shard_grads

from zerofn import collectives as C
from zerofn import tree as T
from zerofn.functional import ACTIVE_RUN, Functional
from zerofn.reduction import GradSink
from zerofn.state import Bucket, Layout, TrainState, settle
from zerofn.step import Step, reapply, transform
from zerofn.storage import Held, ParamSplit, Storage, to_host, whole_params

__all__ = ["MinUnitBytes", "UnitStorage", "shard_params"]

ORDER = "shard_params.order"  # state.extra key: unit indices in the order the last step ran them


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
            ``reset_parameters``, which are used without it).

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
    storage = UnitStorage(param_placement=step.storage.param_placement, units=units, prefetch=prefetch, init_fn=init_fn)
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
        shards = Materialiser(functional.module, named, self.init_fn).fill(buckets + frozen_buckets, rank)
        if self.param_placement == "cpu":  # shards at rest in host memory
            shards = [to_host(t, torch.cuda.is_available()) for t in shards]
        flats, frozen = tuple(shards[: len(buckets)]), tuple(shards[len(buckets) :])
        return Held(flats, frozen, layout, {ORDER: torch.zeros(0, dtype=torch.int64)})

    @contextlib.contextmanager
    def bind(self, state: TrainState, sink: GradSink, model: Callable, extra: dict):
        runner = _Runner(state, model(), self.prefetch, sink, self.param_placement == "cpu")
        token = ACTIVE_RUN.set(runner)
        try:
            yield runner.placeholders()
        finally:
            ACTIVE_RUN.reset(token)
            runner.close()
            if runner.forward_order:
                extra[ORDER] = torch.tensor([u.index for u in dict.fromkeys(runner.forward_order)], dtype=torch.int64)

    def adopt(self, functional: Functional, state: TrainState, share: bool, updates_late: bool = False) -> None:
        functional.adopt({})  # the state holds shards: every parameter becomes a placeholder

    def opt_view(self, flat: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
        return flat  # the state holds shards already

    def publish(self, flats: tuple, layout: Layout, rank: int) -> None:
        return None  # updated in place, gathered when used

    def forward(self, state: TrainState, model: Callable, args: tuple, kwargs: dict) -> Any:
        runner = _Runner(state, model(), self.prefetch, None, self.param_placement == "cpu")
        try:
            with torch.no_grad():
                return runner.run(args, kwargs)
        finally:
            runner.close()

    def full_params(self, state: TrainState, model: Callable, masters: tuple | None = None) -> Any:
        layout = state.spec.layout
        dtype = masters[0].dtype if masters else None
        frozen = [f.to(dtype) if dtype is not None and f.is_floating_point() else f for f in state.frozen]
        out = whole_params(masters or state.params, layout.buckets, to_device=True)  # one unit's buffer at a time
        out.update(whole_params(frozen, layout.frozen_buckets, to_device=True))
        return T.tree_unflatten(state.spec.treedef, [out[n] for n in layout.names])


# ---------------------------------------------------------------- the run


class _LiveUnit:
    """One unit's full buffers during a step: empty, being gathered, or ready."""

    def __init__(self, spec: Unit, index: int):
        self.spec, self.index = spec, index
        self.fulls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (full buffer, this rank's shard)
        self.handles: list[C.Handle] = []
        self.ready = False
        self.remaining = 0  # trainable leaves whose gradient has not arrived yet
        self.depth = 0  # module calls of this unit now running
        self.probe: torch.Tensor | None = None  # the order check riding along with a gather


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
        self.flats = state.arriving_params()
        self.by_name = {u.spec.name: u for u in self.units}
        self.leaves: dict[str, torch.Tensor] = {}
        self.hooks: list[Any] = []
        self.forward_order: list[_LiveUnit] = []
        self.last_order = state.extra.get(ORDER)
        self.expected: list[_LiveUnit] | None = None
        self.backward_queue: list[_LiveUnit] | None = None
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
                if not whole:
                    full.untyped_storage().resize_(0)
                    unit.fulls.append((full, shard))
        # Every module call inside a unit (the unit's own module or any of its
        # submodules: a model may call a block's layers without calling the
        # block) opens the unit; modules in no unit belong to the root.
        owner: dict[int, tuple[nn.Module, _LiveUnit]] = {}
        for name, m in self.module.named_modules():
            best = self.by_name[ROOT]
            for unit in self.units:
                if unit.spec.name and inside(name, unit.spec.name):
                    best = unit
            owner[id(m)] = (m, best)
        for m, unit in owner.values():
            top = (unit.spec.name and self.module.get_submodule(unit.spec.name) is m) or (
                not unit.spec.name and m is self.module
            )
            self.hooks.append(m.register_forward_pre_hook(functools.partial(self._before, unit)))
            self.hooks.append(m.register_forward_hook(functools.partial(self._after, unit, bool(top))))
        self.open_block: _LiveUnit | None = None
        self._placeholders = None
        self.calls = 0  # model calls running (forward); none while backward recomputes

    # ---------------------------------------------------------- entry points

    def placeholders(self) -> Any:
        """What loss_fn receives: meta tensors shaped like the parameters, for apply to recognise."""
        if self._placeholders is None:
            metas = [
                torch.empty(self.leaves[n].shape, dtype=self.leaves[n].dtype, device="meta") for n in self.layout.names
            ]
            self._placeholders = T.tree_unflatten(self.treedef, metas)
        return self._placeholders

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
        try:
            return self.functional.call_with(self.leaves, args, kwargs)
        finally:
            self.calls -= 1

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        for unit in self.units:
            self._release(unit)

    # ---------------------------------------------------------- gather and release

    def _gather(self, unit: _LiveUnit) -> None:
        if unit.ready or unit.handles:
            return
        for i in unit.spec.buckets:  # an update still writing a shard finishes first (on every rank alike)
            settle(self.flats, i)
        if not unit.fulls:
            return
        for full, shard in unit.fulls:
            full.untyped_storage().resize_(full.numel() * full.element_size())
            if self.host_shards:  # bring the shard in from host memory (its own buffer, non-blocking)
                shard = torch.empty(shard.shape, dtype=shard.dtype, device=full.device).copy_(shard, non_blocking=True)
            unit.handles.append(C.all_gather(full, shard, async_op=True))
        if C.world_size() > 1:
            # Every rank must gather the same unit here; a tiny max-reduce of (id, -id)
            # tells, so ranks that took different code paths fail together, not hang.
            unit.probe = torch.tensor([unit.index, -unit.index], dtype=torch.int64)
            unit.handles.append(C.all_reduce(unit.probe, "max", async_op=True, control=True))

    def _ensure(self, unit: _LiveUnit) -> None:
        self._gather(unit)
        for h in unit.handles:
            h.wait()
        unit.handles = []
        unit.ready = True
        probe, unit.probe = unit.probe, None
        if probe is not None and int(probe[0]) != -int(probe[1]):
            names = [self.units[int(probe[0])].spec.name, self.units[-int(probe[1])].spec.name]
            raise RuntimeError(
                f"shard_params: ranks gathered different units at the same point of the step: rank "
                f"{C.rank()} gathered {unit.spec.name or '<root>'!r} while others gathered one of "
                f"{[n or '<root>' for n in names]} (world size {C.world_size()}). Every rank must run the same "
                "units in the same order: make control flow that skips or repeats a unit the same on every "
                "rank (for example decide it from a value broadcast from rank 0)."
            )

    def _release(self, unit: _LiveUnit) -> None:
        for h in unit.handles:
            h.wait()
        unit.handles = []
        for full, _ in unit.fulls:
            full.untyped_storage().resize_(0)
        unit.ready = False

    def _prefetch(self, candidates: list[_LiveUnit], current: _LiveUnit) -> None:
        """Have the next ``prefetch`` units (after ``current``) gathered or on their way."""
        for u in [u for u in candidates if u is not current and u.fulls][: self.prefetch]:
            self._gather(u)

    # ---------------------------------------------------------- hooks

    def _expected_forward(self) -> list[_LiveUnit]:
        if self.expected is None:
            if self.last_order is not None and self.last_order.numel():
                self.expected = [self.units[i] for i in self.last_order.tolist()]
            else:  # first step: the root runs first, then the blocks in registration order
                self.expected = [self.by_name[ROOT]] + [u for u in reversed(self.units) if u.spec.name != ROOT]
        return self.expected

    def _before(self, unit: _LiveUnit, module: nn.Module, args: Any) -> None:
        if not self.calls:
            # Outside the model's call: a recompute in backward (activation checkpointing).
            # The unit's backward is under way: have it gathered, and release it only
            # when its last gradient is in (a recompute may stop early, so no depth count).
            self._ensure(unit)
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
        unit.depth += 1

    def _opened(self, unit: _LiveUnit) -> None:
        self.forward_order.append(unit)
        self._ensure(unit)
        expected = self._expected_forward()
        if unit in expected:
            self._prefetch(expected[expected.index(unit) + 1 :], unit)

    def _after(self, unit: _LiveUnit, top: bool, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and self.sink is not None:
            for t in T.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(self._before_backward, unit))
        if not self.calls:  # a recompute in backward: see _before
            return
        unit.depth -= 1
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
        if self.backward_queue is None:
            self.backward_queue = list(dict.fromkeys(reversed(self.forward_order)))
        if unit in self.backward_queue:
            self.backward_queue.remove(unit)
        if unit.remaining or unit.spec.frozen:
            self._ensure(unit)
        self._prefetch([u for u in self.backward_queue if u.remaining or u.spec.frozen], unit)

    def _grad_in(self, unit: _LiveUnit) -> Callable[[torch.Tensor], None]:
        def on_grad(leaf: torch.Tensor) -> None:
            unit.remaining -= 1
            if unit.remaining == 0:  # its backward is over: the full parameters can go
                self._release(unit)

        return on_grad
