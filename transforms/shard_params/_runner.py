"""The runner (:class:`Runner`): one step's gathers and releases of the units around the model's forward
and backward. Module hooks open a unit (all-gather its buffers, with the next ``prefetch`` units'
gathers in flight) and close it (release them, but for the units backward needs first); gradient hooks
gather a unit again for backward and release it when its backward is over. :class:`Phase` says where in
the step the runner is."""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from zerofn.transforms._units import ROOT, Intercept, compiled, compiles_children, inside
from zerofn.transforms.shard_params._agreement import Agreement, Point
from zerofn.transforms.shard_params._placeholders import StandIns
from zerofn.transforms.shard_params._read_ahead import ReadAhead
from zerofn.transforms.shard_params._unit import LiveUnit, last_block

from zerofn import alloc, counters
from zerofn import collectives as C
from zerofn import tree as T
from zerofn._io import FileTensor
from zerofn.functional import Functional
from zerofn.reduction import bucket_group
from zerofn.state import TrainState
from zerofn.storage import Closers

ORDER = "shard_params.order"  # state.extra key: unit indices in the order the last step ran them
# Ends a recorded order that the next step's forward follows without agreeing on each unit (see Runner._left):
# the step that recorded it ran one model call, opened each unit with parameters once and read none from
# outside its unit before the call ended (see Runner.record).
FOLLOW = -1
# Full buffers of gathers that a failing step left in flight, posted after an agreement the ranks failed: kept
# allocated, since the collective may still write into them (see Runner._release).
_ABANDONED: list[torch.Tensor] = []


class Phase(enum.Enum):
    """Where a runner is in its step."""

    BUILT = enum.auto()  # made, the model not called yet: the model's places hold what they held
    FORWARD = enum.auto()  # a model call is running: module calls open and close units
    # After a model call: loss_fn's own code, or backward, whose recomputes (activation checkpointing) call
    # modules outside any model call. The model's places show placeholders but in the unit whose modules run.
    BETWEEN = enum.auto()
    CLOSED = enum.auto()  # the step is over: every unit released, the model's own parameters back


def _grad_node(t: torch.Tensor) -> Any:
    """The autograd node that receives ``t``'s gradient: its ``grad_fn``, or a leaf's gradient accumulator."""
    return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]


class _Task:
    """One backward (autograd's graph task) of a step of several micro-batch backwards: the units it gathered,
    released when it ends, and the units still to come in it (the forwards of the model calls it reached,
    reversed)."""

    def __init__(self) -> None:
        self.units: dict[LiveUnit, None] = {}
        self.queue: list[LiveUnit] = []
        self.runs: set[int] = set()


class Runner:
    """Gathers and releases units around the module's forward and backward."""

    def __init__(
        self,
        state: TrainState,
        functional: Functional,
        prefetch: int,
        sink: Any,
        host_shards: bool,
        gather_dtype: str | None = None,
        hpz: bool = False,
    ):
        spec = state.spec
        # qwZ: floating buckets gathered as int8 blocks (the shards themselves untouched)
        self.quantized = gather_dtype == "int8"
        # hpZ: a unit gathered over every rank keeps this rank's piece of it within its node (the ranks of its
        # replica, without("dp_replicate")), and gathers from those pieces within the node again
        self.node = C.without("dp_replicate") if hpz else None
        self.node_rank, self.node_size = (C.rank(self.node), C.world_size(self.node)) if hpz else (0, 1)
        self.functional = functional
        self.module = functional.module
        self.layout = spec.layout
        self.treedef = spec.treedef
        self.prefetch = prefetch
        self.sink = sink
        self.host_shards = host_shards
        self.phase = Phase.BUILT
        self.units = [LiveUnit(u, i) for i, u in enumerate(self.layout.units)]
        # The shards without waiting for an update still writing them (offload's, on its worker thread):
        # each unit waits for its own buckets before it is gathered.
        self.flats, self.inflight = state.arriving_params(), state.inflight
        self.by_name = {u.spec.name: u for u in self.units}
        self.hooks: list[Any] = []
        self.forward_order: list[LiveUnit] = []
        last_order = state.extra.get(ORDER)
        carried = counters.values(last_order) if last_order is not None else ()  # carried: no read
        # Until the first model call ends, follow the carried order without agreeing on each unit (see _left): a
        # training step's. A forward alone (an evaluation, a generated token) may run part of the model each call,
        # which would leave the order every time.
        follow = bool(carried) and carried[-1] == FOLLOW
        self.carried = carried[:-1] if follow else carried
        self.blind = follow and sink is not None
        self.regular = True  # this step's forward may be followed that way in the next step (see record)
        self.ends = 0  # model calls ended (each agreed on at its end)
        self.issued = 0  # the carried order's units whose forward gathers are issued, in order (see _left)
        self.expected: list[LiveUnit] | None = None
        self.backward_queue: list[LiveUnit] | None = None
        self.queue_inner = False  # the queue is an inner torch.autograd.grad's (see _inner)
        self.agreement = Agreement(self.units)
        self.next_open = 0  # where the forward is in the recorded order (among units with parameters)
        self.recorded: list[LiveUnit] | None = None  # that order, units with parameters only
        # Backward's plan (see _advance): the units it gathers, in order, agreed on at the forward's end
        self.plan: list[LiveUnit] | None = None
        self.plan_at: dict[LiveUnit, int] = {}
        self.planned = False  # the step's backward is under way and follows the plan
        self.cursor = 0  # the plan's gathers issued
        self.reached = 0  # the plan's units backward has reached (one past the furthest)
        self.inner_seen = False  # an inner torch.autograd.grad ran (see _inner): backward agrees per gather
        self.kept = _kept(state, self.flats, host_shards, sink is not None and torch.is_grad_enabled())
        self.kept.bind(sink, self._grad_in)
        for unit, fulls, groups, count in zip(self.units, self.kept.fulls, self.kept.groups, self.kept.counts):
            unit.fulls, unit.groups, unit.remaining = list(fulls), groups, count
        self.leaves = self.kept.leaves
        self.unit_of = {name: self.units[i] for name, i in self.kept.unit_of.items()}
        self.read_ahead = ReadAhead(self.units, prefetch, owner=self.layout)
        self.intercepts: list[Intercept] = []
        self.watched: dict[int, tuple[LiveUnit, bool]] = {}  # see _watch_globally
        try:
            self._watch_calls()
        except BaseException:
            self.unwatch()
            self.kept.unbind(keep=True)
            raise
        self.open_block: LiveUnit | None = None
        self.input_hooks: list = []  # see _watch_inputs
        self.backward_hooks: dict[LiveUnit, Callable] = {}  # see _after
        self.stand_ins = self.kept.stand_ins(functional)
        self.stand_ins.bind(self)
        self.copies: dict[str, torch.Tensor] = {}  # parameters read outside their unit: gathered copies
        # Several micro-batch forwards and backwards in the step (a pipeline's schedule): see run_microbatches.
        self.micro: int | None = None
        self.reshard = True
        self.runs: list[list[LiveUnit]] = []  # the units each model call opened
        self.tasks: dict[int, _Task] = {}  # graph task id -> the backward's units

    def _watch_calls(self) -> None:
        """Make every module call inside a unit open the unit (the unit's own module or any of its submodules:
        a model may call a block's layers without calling the block); modules in no unit belong to the root.

        An eager module gets a forward pre-hook and hook. A module compiled with ``module.compile()`` gets an
        :class:`Intercept` instead, so that the unit opens and closes in eager code around the compiled call
        (its hooks would run inside the compiled region, where dynamo would trace them); its submodules in the
        same unit get nothing (they run inside that call, with the unit open). A module in a compiled region
        whose unit differs from its parent's (a block of a model compiled whole) can only be reached by hooks,
        which dynamo traces: the graph breaks there (docs/compile.md).

        A model with no compiled module is watched through two global module hooks for the step instead
        (:meth:`_watch_globally`): a step then registers and removes two hooks, not two per module."""
        modules = list(self.module.modules())
        if not any(compiled(m) or compiles_children(m) for m in modules):
            self._watch_globally(modules)
            return
        seen: set[int] = set()
        befores: dict[LiveUnit, Callable] = {}
        afters: dict[tuple[LiveUnit, bool], Callable] = {}

        def walk(m: nn.Module, parent: LiveUnit | None, in_region: bool) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            index, top = self.kept.owner(self.module, m)
            unit = self.units[index]
            if not in_region and compiled(m):
                self.intercepts.append(Intercept(m, C.with_current_group(functools.partial(self._call, unit, top, m))))
            elif not in_region or unit is not parent:
                # In the step's group also where autograd recomputes on a thread of its own (CUDA).
                before = befores.get(unit)
                if before is None:
                    before = befores[unit] = C.with_current_group(functools.partial(self._before, unit))
                after = afters.get((unit, top))
                if after is None:
                    after = afters[unit, top] = C.with_current_group(functools.partial(self._after, unit, top))
                if in_region:  # dynamo would trace them: it calls them outside the graph instead (a break)
                    before, after = torch.compiler.disable(before), torch.compiler.disable(after)
                self.hooks.append(m.register_forward_pre_hook(before))
                self.hooks.append(m.register_forward_hook(after))
            region = in_region or compiled(m) or compiles_children(m)
            for child in m.children():
                walk(child, unit, region)

        walk(self.module, None, False)

    def _watch_globally(self, modules: list[nn.Module]) -> None:
        """Watch the calls of ``modules`` (the model's, none compiled) through torch's global module hooks,
        registered until :meth:`unwatch`: each call of one of them runs the pre-hook and hook its unit's would
        (a call of any other module, the loss's or another model's, finds no unit and passes). They run before
        the module's own hooks: its pre-hooks see its unit gathered, as its forward does."""
        self.watched = {
            id(m): (self.units[index], top) for m in modules for index, top in [self.kept.owner(self.module, m)]
        }
        self.watched_modules = modules  # alive while watched: no other module takes one of their ids
        # In the step's group also where autograd recomputes on a thread of its own (CUDA).
        self.hooks.append(nn.modules.module.register_module_forward_pre_hook(C.with_current_group(self._global_before)))
        self.hooks.append(nn.modules.module.register_module_forward_hook(C.with_current_group(self._global_after)))

    def _global_before(self, module: nn.Module, args: Any) -> None:
        entry = self.watched.get(id(module))
        if entry is not None:
            self._before(entry[0], module, args)

    def _global_after(self, module: nn.Module, args: Any, output: Any) -> None:
        entry = self.watched.get(id(module))
        if entry is not None:
            self._after(entry[0], entry[1], module, args, output)

    def _call(self, unit: LiveUnit, top: bool, module: nn.Module, call: Callable, args: tuple, kwargs: dict) -> Any:
        """A compiled module's call (see :meth:`_watch_calls`): the unit's hooks around it, in eager code."""
        self._before(unit, module, args)
        out = call(*args, **kwargs)
        self._after(unit, top, module, args, out)
        return out

    def unwatch(self) -> None:
        """Take the hooks off the model's modules: its calls no longer open or close units."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.watched, self.watched_modules = {}, []
        for i in reversed(self.intercepts):
            i.remove()
        self.intercepts = []

    # ---------------------------------------------------------- entry points

    def run_microbatches(self, m: int, *, reshard: bool = True) -> None:
        """This step runs ``m`` micro-batches (a pipeline's schedule): model calls (a stage's forward of a
        micro-batch each) and, later, in any order, backwards (a micro-batch's, through one or more of those
        calls), each handing every trainable parameter one gradient, which accumulates in its leaf: the sink
        (the caller's) reduces it once all ``m`` are in, so each unit's gradient is reduced once a step. Call
        before the first model call. ``torch.autograd.grad`` calls that accumulate nothing (a stage's input
        gradient alone, the shapes' inference) are backwards too, handing no gradient.

        Each model call gathers its units as a step's forward does (the root and the call's last block stay
        gathered for its backward, the blocks before are released); each backward gathers them again as it
        reaches them (prefetching the next ones of its calls' forwards, reversed) and, with ``reshard``,
        releases each unit once its gradients of that backward are in (a unit with frozen parameters, whose
        weights may compute its inputs' gradients after that, and whatever else the backward gathered, when the
        backward ends). Without ``reshard`` a unit stays gathered from its first gather to its last micro-batch's
        backward (FSDP2 under a pipeline with ``reshard_after_forward=False``): one gather a step, this rank's
        stages' parameters whole meanwhile.

        The ranks agree on the units as in any step; the order recorded for the next step is every unit each
        call opened, in turn (the schedule repeats it), not each unit once.
        """
        self.micro, self.reshard = m, reshard
        self.blind = self.regular = False  # every model call agrees on each unit
        for unit in self.units:
            unit.per_round = unit.remaining
            unit.rounds_left = m if unit.remaining else 0

    def lend(self, tensors: dict[str, torch.Tensor]) -> None:
        """Tensors that the model's calls read for parameters this state does not hold (a pipeline's weight
        tied across stages, lent for the step by the stage that holds it); before the first model call."""
        if tensors:
            self.stand_ins.swapped = {**self.stand_ins.swapped, **tensors}

    def whole(self, name: str) -> torch.Tensor:
        """A detached copy of parameter ``name``, gathered (its unit gathered for it if it is not, agreed on
        by the ranks first, and released again after, as for a read from outside the unit)."""
        unit = self.unit_of[name]
        idle = unit.idle
        if idle:
            self._agree_outside(unit)
        self.ensure(unit)
        copy = self.leaves[name].detach().clone()
        if idle and unit.depth == 0 and unit is not self.open_block:
            self._release(unit)
        return copy

    def _agree_outside(self, unit: LiveUnit) -> None:
        """Every rank must gather ``unit`` for a read from outside it at this point."""
        if self.ends == 0:
            self.regular = False
        if self.blind:
            self._left(Point.OUTSIDE, unit)
        else:
            self.agreement.agree(Point.OUTSIDE, unit)

    def record(self, failed: bool) -> list[int]:
        """What to carry to the next step under :data:`ORDER`: the order (:meth:`order`), and :data:`FOLLOW`
        where the next step's forward may follow it without agreeing on each unit. It may where this step ran
        one model call, which opened each unit with parameters once and followed the order it predicted (or
        agreed on each unit: the first step), and read no parameter from outside its unit before the call ended:
        the ranks then issue the order's gathers, and those alone, in the order's order."""
        out = [u.index for u in self.order()]
        opened = [u for u in self.forward_order if u.fulls]
        if self.regular and not failed and self.ends == 1 and len(set(opened)) == len(opened):
            out.append(FOLLOW)
        return out

    def order(self) -> list[LiveUnit]:
        """The order to record for the next step: each unit as the forward first opened it, or, under several
        micro-batches, every unit each model call opened."""
        return list(self.forward_order) if self.micro is not None else list(dict.fromkeys(self.forward_order))

    def placeholders(self) -> Any:
        """What loss_fn receives: placeholders shaped like the parameters (meta tensors), for apply to
        recognise; a placeholder that loss_fn computes with gathers its parameter (see :meth:`outside`)."""
        return self.stand_ins.tree(self.treedef, self.layout.names)

    def outside(self, name: str) -> torch.Tensor:
        """Parameter ``name``, read outside its unit's modules (in loss_fn, or by another unit): a gathered
        copy whose gradient flows into the parameter's, so into the unit's bucket before its reduction.

        The unit is gathered for the read if it is not (one all-gather, agreed on by every rank first) and
        released again unless it was gathered or on its way; the copy lives as long as what uses it (autograd
        keeps it until backward passes it). One copy per parameter and step.
        """
        copy = self.copies.get(name)
        if copy is not None:
            return copy
        unit = self.unit_of[name]
        idle = unit.idle
        if idle:
            self._agree_outside(unit)
        self.ensure(unit)
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

    def _show(self, unit: LiveUnit, inside: bool) -> None:
        """Put the unit's leaves (while its own modules run) or placeholders (otherwise) in its places in the
        model, from the first model call to the step's end: a read from anywhere else then goes through
        :meth:`outside`, never to a released buffer."""
        if self.phase in (Phase.FORWARD, Phase.BETWEEN):
            self.stand_ins.show(unit, inside)

    def __call__(self, functional: Functional, params: Any, args: tuple, kwargs: dict) -> Any:
        if params is not self.stand_ins.params:
            raise ValueError(
                "under shard_params, call apply with the params the step passed to loss_fn: they are "
                "placeholders for parameters that live sharded across the ranks and are gathered unit by "
                "unit inside apply. To read full parameters, use step.full_params(state)."
            )
        return self.run(args, kwargs)

    def run(self, args: tuple, kwargs: dict) -> Any:
        outer, self.phase = self.phase, Phase.FORWARD
        micro = self.micro is not None and outer is not Phase.FORWARD
        if micro:
            self.runs.append([])
        try:
            # The model shows placeholders but in the unit whose modules run, so a parameter read from outside
            # its unit is gathered for the read (outside), wherever the read is.
            out = self.functional.call_with(self.stand_ins.swapped, args, kwargs)
        except BaseException:
            if micro:  # a pipeline's stage before the last stops inside the model (at its final norm)
                self._unwind()
            raise
        finally:
            self.phase = Phase.FORWARD if outer is Phase.FORWARD else Phase.BETWEEN  # a model call in a model call
        # Every rank's forward ends here, having run the same units, with the same units for backward to gather.
        self.plan = self._plan() if self.sink is not None and torch.is_grad_enabled() and not micro else None
        if self.blind and self.next_open < len(self._recorded()):
            self._left(Point.END, None)  # ended before the order did
        self.blind = False
        self.ends += 1
        self.agreement.agree(Point.END, None, plan=self.plan)
        return out

    def _plan(self) -> list[LiveUnit]:
        """The units backward gathers, in order (see :meth:`_advance`): the forward's units reversed, each
        once, that hold parameters backward needs (trainable ones, or frozen ones its outputs' gradients run
        through) and that the forward released (the root and the last block stay gathered)."""
        return [u for u in dict.fromkeys(reversed(self.forward_order)) if u.fulls and u.idle and u.needed_in_backward]

    def _unwind(self) -> None:
        """A micro-batch's model call ended by an exception (a pipeline stage's end before the last stage's):
        the calls it left open are over; the root and the call's last block stay gathered for its backward, as
        when the call returns."""
        for unit in self.units:
            if unit.depth:
                unit.depth = 0
                self._show(unit, False)
        self.open_block = None

    def close(self, failed: bool = False) -> None:
        """End the step: release every unit and settle the agreements in flight. ``failed``: the step is
        ending by an exception; a divergence found now is not raised over it, and a gather posted after an
        agreement the ranks failed is not waited for (another rank may never issue it)."""
        if not failed:
            self.kept.closers.end()  # gradients whose bucket's hook did not run (see Closers)
        self.phase = Phase.CLOSED  # the model has its own parameters back
        self.unwatch()
        for h in self.input_hooks:
            h.remove()
        self.input_hooks = []
        if self.planned and not failed:
            # The plan's gathers that this rank's backward did not reach (a unit that needed no gradient here):
            # issued all the same, so that every rank has issued the same gathers.
            self._advance(len(self.plan))
        for unit in self.units:
            self._release(unit, final=True)
        if self.planned and not failed:
            self.agreement.settled()  # ranks that diverged in backward raise here together, before the update
        else:  # a forward or backward that raised left agreements in flight: end them alike
            with contextlib.suppress(RuntimeError):
                self.agreement.settled()
        self.copies = {}
        self.tasks = {}
        self.read_ahead.close()
        self.stand_ins.unbind()
        self.kept.unbind(keep=not failed)

    # ---------------------------------------------------------- gather and release

    def gather(self, unit: LiveUnit) -> None:
        """Start gathering ``unit``'s full buffers, unless they are gathered or on their way."""
        if unit.ready or unit.handles:
            return
        for i in unit.spec.buckets:  # an update still writing a shard finishes first (on every rank alike)
            self.inflight.wait_bucket(i)
        if not unit.fulls:
            return
        lease = self.read_ahead.take(unit)
        unit.lease = lease  # given back once the gather is done (or the unit released, however it ends)
        read = iter(lease.tensors if lease is not None else ())
        copied = None
        for k, ((full, shard), group) in enumerate(zip(unit.fulls, unit.groups)):
            full.untyped_storage().resize_(full.numel() * full.element_size())
            if isinstance(shard, FileTensor):  # read from its file (ahead, on the I/O thread), into a host buffer
                shard = next(read)
            if self.host_shards and shard.device != full.device:  # brought in from host memory
                shard = self.read_ahead.to_device(shard, full.device)
                copied = full.device
            second = unit.secondaries[k] if unit.secondaries else None
            if second is not None:  # hpZ: from the pieces kept within the node
                unit.handles.append(self._all_gather(full, second, self.node))
            else:
                unit.handles.append(self._all_gather(full, shard, group))
        if lease is not None and copied is not None and copied.type == "cuda":
            # Copied to the device: the buffer is free for another read once the copies are done (otherwise
            # the gather reads the buffer itself).
            self.read_ahead.release_after_copies(lease)
            unit.lease = None
        self._read_ahead(unit)

    def _all_gather(self, full: torch.Tensor, shard: torch.Tensor, group: Any) -> C.Handle:
        if self.quantized and full.dtype in C.QUANTIZED_DTYPES:
            return C.all_gather_quantized(full, shard, async_op=True, group=group)
        return C.all_gather(full, shard, async_op=True, group=group)

    def _read_ahead(self, unit: LiveUnit) -> None:
        """Start reading the shards of the units expected after ``unit`` (``prefetch + 1`` of them): the
        forward's recorded order, then backward's (the forward's reversed), or what backward has left."""
        if not self.read_ahead.reading:
            return
        if self.backward_queue is not None:
            order = [u for u in self.backward_queue if u.needed_in_backward]
        else:
            forward = self.recorded if self.recorded is not None else self._expected_forward()
            order = forward[forward.index(unit) + 1 :] if unit in forward else forward
            if self.sink is not None and torch.is_grad_enabled():  # a backward follows
                order = order + list(reversed(forward))
        self.read_ahead.ahead(unit, order)

    def ensure(self, unit: LiveUnit) -> None:
        """Have ``unit``'s full buffers gathered: start the gather if it is not under way, and wait for it."""
        if unit.ready:  # gathered and waited for already (each of a unit's module calls and outputs ensures it)
            return
        self.gather(unit)
        self._wait(unit)
        unit.give_back()
        unit.ready = True
        if self.node is not None and not unit.secondaries:  # hpZ: gathered over every rank; keep the node's piece
            unit.secondaries = [full.chunk(self.node_size)[self.node_rank].clone() for full, _ in unit.fulls]

    def _wait(self, unit: LiveUnit) -> None:
        """Wait for ``unit``'s gather in flight, if any: first for the agreements posted with and before it
        (see :meth:`_advance`), so that a rank that diverged raises here rather than leaving this one waiting for
        a gather it never issued."""
        if unit.agreed:
            self.agreement.settled(unit.agreed)
            unit.agreed = 0
        for h in unit.handles:
            h.wait()
        unit.handles = []

    def _release(self, unit: LiveUnit, final: bool = False, over: bool = False) -> None:
        """Free the unit's full buffers. A pinned unit's only at the step's end (``final``) or, if it has no
        frozen parameters, when its backward is over (``over``: its last gradient is in; see :meth:`_inner`)."""
        if unit.pinned and not (final or (over and not unit.spec.frozen)):
            self._show(unit, False)
            return
        if self.micro is not None and not self.reshard and not final and not unit.finished:
            self._show(unit, False)  # kept gathered until its last micro-batch's backward (run_microbatches)
            return
        if self.agreement.failed is not None and unit.agreed >= self.agreement.failed:
            # Posted after an agreement the ranks failed: another rank may never issue it, and the buffer it
            # writes into stays allocated (the step is failing; the process group is out of step).
            _ABANDONED.extend(full for full, _ in unit.fulls)
            unit.handles, unit.agreed = [], 0
            return
        self._wait(unit)
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

    def _prefetch(self, candidates: list[LiveUnit], current: LiveUnit, agree: bool = False) -> None:
        """Have the next ``prefetch`` units (after ``current``) gathered or on their way; ``agree``: each
        gather this issues is agreed on first (in backward, whose order autograd decides)."""
        for u in [u for u in candidates if u is not current and u.fulls][: self.prefetch]:
            if agree and u.idle:
                self.agreement.agree(Point.BACKWARD, u)
            self.gather(u)

    def _ensure_backward(self, unit: LiveUnit) -> None:
        if unit.idle and unit.fulls:
            at = self.plan_at.get(unit, -1) if self.planned else -1
            if at >= self.cursor:
                self._advance(at + 1)
            else:  # off the plan (gathered again after its release): agreed on before its gather
                self.agreement.agree(Point.BACKWARD, unit)
        self.ensure(unit)
        if self._inner():
            unit.pinned = True
        if self.micro is not None and torch._C._current_graph_task_id() != -1:
            self._task().units[unit] = None  # released when this backward ends (if not before)

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

    def _expected_forward(self) -> list[LiveUnit]:
        if self.expected is None:
            if self.carried:
                self.expected = [self.units[i] for i in self.carried]
            else:  # first step: the root runs first, then the blocks in registration order
                self.expected = [self.by_name[ROOT]] + [u for u in reversed(self.units) if u.spec.name != ROOT]
        return self.expected

    def _before(self, unit: LiveUnit, module: nn.Module, args: Any) -> None:
        if self.phase is not Phase.FORWARD:
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
            if torch.is_grad_enabled() and self.sink is not None and self.micro is None:
                self._watch_inputs(unit, args)
        unit.depth += 1

    def _watch_inputs(self, unit: LiveUnit, args: Any) -> None:
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
            if self._inner() or self.phase is Phase.CLOSED:
                return
            if not left:
                left.append(sum(map(torch._C._will_engine_execute_node, nodes)))
            left[0] -= 1
            if left[0] == 0:
                unit.inputs -= 1
                if unit.inputs == 0 and unit.remaining == 0:
                    self._release(unit, over=True)

        self.input_hooks += [t.register_hook(C.with_current_group(arrived)) for t in inputs]

    def _opened(self, unit: LiveUnit) -> None:
        self.forward_order.append(unit)
        if self.runs:
            self.runs[-1].append(unit)
        expected = self._expected_forward()
        if not unit.fulls:  # a unit without parameters issues no collective to disagree on
            self.ensure(unit)
            return
        if self.carried:
            # The order the last step recorded (every rank's, agreed on then): every rank issues the gathers
            # it predicts at this point, the next unit in it and `prefetch` after that, whichever unit it opened,
            # so the agreement on the unit can stay in flight (or, following it blind, is not needed: see _left);
            # a rank that opened another unit waits for it.
            order = self._recorded()
            if not self.blind:
                self.agreement.agree(Point.OPEN, unit, wait=False)
            for u in order[self.next_open : self.next_open + 1 + self.prefetch]:
                self.gather(u)
            self.issued = max(self.issued, min(len(order), self.next_open + 1 + self.prefetch))
            if self.next_open < len(order) and unit is order[self.next_open]:
                self.next_open += 1
                self.ensure(unit)
                return
            self.regular = False
            if self.blind:
                self._left(Point.OPEN, unit)
            else:
                self.agreement.settled()  # ranks that opened different units raise here together
            if unit in order[self.next_open :]:
                self.next_open = order.index(unit, self.next_open) + 1
        else:  # the first step: no order agreed on yet, each point waits for its agreement
            self.agreement.agree(Point.OPEN, unit)
        self.ensure(unit)
        if unit in expected:
            self._prefetch(expected[expected.index(unit) + 1 :], unit)

    def _recorded(self) -> list[LiveUnit]:
        """The carried order's units with parameters: the ones whose forward gathers the ranks predict."""
        if self.recorded is None:
            self.recorded = [u for u in self._expected_forward() if u.fulls]
        return self.recorded

    def _left(self, action: Point, unit: LiveUnit | None) -> None:
        """This rank's forward left the carried order while following it blind (see :data:`FOLLOW`): it did
        ``action`` (opened ``unit``, read from outside it, or ended) where the order has another unit next.

        Following it blind, no rank agrees on each unit: every rank issues the order's gathers, each unit's
        once, in the order's order, each before the unit opens. A rank that leaves it issues the order's
        gathers it has not issued yet, as the others will, into buffers of its own, each waited for, then
        agrees on what it did, waiting, where the others agree on the forward's end: so no rank waits for a
        gather another never issues, the codes differ, and every rank raises, with the process groups in step.
        Ranks that all left it alike agree and go on, each unit agreed on from there as when the order is
        not followed blind (the gathers issued so far being the same on every rank)."""
        order = self._recorded()
        expected = order[self.next_open] if self.next_open < len(order) else None
        self.blind = self.regular = False
        if C.world_size() == 1:
            return
        for u in order[self.issued :]:
            self._drain(u)
        self.issued = len(order)
        self.agreement.left(action, unit, expected)

    def _drain(self, unit: LiveUnit) -> None:
        """Issue the collectives :meth:`gather` issues for ``unit``'s first gather of the step (over its groups,
        not hpZ's node: a unit the forward has not gathered yet has no piece kept within it), into buffers of
        its own (what this rank sends is zeros), and wait for them; the unit itself is left as it is."""
        for (full, _), group in zip(unit.fulls, unit.groups):
            out = torch.empty(full.shape, dtype=full.dtype, device=full.device)
            piece = torch.zeros(full.numel() // C.world_size(group), dtype=full.dtype, device=full.device)
            self._all_gather(out, piece, group).wait()

    def _after(self, unit: LiveUnit, top: bool, module: nn.Module, args: Any, output: Any) -> None:
        if torch.is_grad_enabled() and self.sink is not None:
            if self.micro is not None:  # the backward of this model call (a recompute's: of the one under way)
                run = len(self.runs) - 1 if self.phase is Phase.FORWARD else None
                hook = C.with_current_group(functools.partial(self._backward_of, run, unit))
            else:  # one per unit and step, for every output of its modules' calls
                hook = self.backward_hooks.get(unit)
                if hook is None:
                    hook = self.backward_hooks[unit] = C.with_current_group(
                        functools.partial(self._before_backward, unit)
                    )
            for t in (output,) if isinstance(output, torch.Tensor) else T.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    unit.backward = True
                    t.register_hook(hook)
        if self.phase is not Phase.FORWARD:  # a recompute in backward: see _before
            return
        unit.depth -= 1
        if unit.depth == 0:
            self._show(unit, False)
        if top and unit.depth == 0 and self.micro is not None:
            # Several micro-batches: a block stays open until the next one opens (which releases it) or the
            # model call ends, whose last block stays gathered for the call's backward, as the root does.
            if unit.spec.name == ROOT:
                self.open_block = None
            elif unit is not self.open_block:  # a block that another opened inside it
                self._release(unit)
        elif top and unit.depth == 0:
            # The root and the forward's last block are the first backward needs: they stay gathered
            # (as FSDP2 keeps its root), saving their gathers at backward's start and the wait for them.
            backward = torch.is_grad_enabled() and self.sink is not None
            expected = self._expected_forward()
            backward_next = backward and (unit.spec.name == ROOT or unit is last_block(expected))
            if not backward_next:
                self._release(unit)
            if unit is self.open_block:
                self.open_block = None
            if unit.spec.name == ROOT and self.open_block is not None:
                if not backward_next:
                    self._release(self.open_block)  # the model's forward is over
                self.open_block = None

    def _before_backward(self, unit: LiveUnit, grad: torch.Tensor) -> None:
        inner = self._inner()
        self.inner_seen |= inner
        if self.backward_queue is None or self.queue_inner != inner:  # the step's backward after an inner grad
            self.backward_queue = list(dict.fromkeys(reversed(self.forward_order)))
            self.queue_inner = inner
            if not inner and not self.inner_seen and self.plan is not None:
                self.planned = True
                self.plan_at = {u: i for i, u in enumerate(self.plan)}
        if unit in self.backward_queue:
            self.backward_queue.remove(unit)
        if self.planned:
            self.reached = max(self.reached, self.plan_at.get(unit, -1) + 1)
            self._advance(self.reached + self.prefetch)
            if unit.remaining or unit.spec.frozen:
                self._ensure_backward(unit)
            return
        if unit.remaining or unit.spec.frozen:
            self._ensure_backward(unit)
        self._prefetch([u for u in self.backward_queue if u.needed_in_backward], unit, agree=True)

    def _advance(self, upto: int) -> None:
        """Issue the plan's gathers up to position ``upto``, in order, each with its agreement left in flight.

        The plan (:meth:`_plan`) is agreed on at the forward's end, so every rank issues the same gathers in the
        same order whichever units its backward reaches, and when: reaching the plan's i-th unit issues the
        gathers through the ``i + prefetch``-th. Each gather's agreement is settled only before a gather posted
        with or after it is waited for (:meth:`_wait`), when the other ranks have posted it anyway: no round
        trip per unit. A unit gathered again after its release (off the plan) agrees before its gather, as
        every point did before."""
        upto = min(upto, len(self.plan))
        while self.cursor < upto:
            u = self.plan[self.cursor]
            self.cursor += 1
            if u.idle:
                u.agreed = self.agreement.post(Point.BACKWARD, u)
                self.gather(u)
            else:  # gathered already (off the plan): no gather; a rank that issues one sees the codes differ
                self.agreement.post(Point.HELD, u)

    def _grad_in(self, index: int, n: int = 1) -> None:
        """``n`` of unit ``index``'s gradients are in (its leaves' hook, after the sink took them)."""
        unit = self.units[index]
        if self.micro is not None:
            for _ in range(n):
                self._micro_grad_in(unit)
            return
        unit.remaining -= n
        if unit.remaining == 0 and unit.inputs == 0:  # its backward is over: the full parameters can go
            self._release(unit, over=True)

    # ---------------------------------------------------------- several micro-batches (run_microbatches)

    def _task(self) -> _Task:
        """The backward now running (autograd's graph task): made at its first hook, its end queued."""
        tid = torch._C._current_graph_task_id()
        task = self.tasks.get(tid)
        if task is None:
            task = self.tasks[tid] = _Task()
            end = C.with_current_group(functools.partial(self._task_over, tid))
            torch.autograd.Variable._execution_engine.queue_callback(end)
        return task

    def _round(self, unit: LiveUnit) -> None:
        """A backward that reaches ``unit`` for the first time counts its gradients afresh."""
        tid = torch._C._current_graph_task_id()
        if unit.task != tid:
            unit.task = tid
            unit.remaining = unit.per_round if unit.rounds_left else 0

    def _needed(self, unit: LiveUnit) -> bool:
        """Whether the backward now running still needs ``unit`` (as ``needed_in_backward``, a unit it has not
        reached yet counting all its trainable parameters as to come)."""
        fresh = unit.task != torch._C._current_graph_task_id()
        return bool(unit.fulls) and (
            bool(unit.rounds_left if fresh else unit.remaining) or (bool(unit.spec.frozen) and unit.backward)
        )

    def _backward_of(self, run: int | None, unit: LiveUnit, grad: torch.Tensor) -> None:
        """``_before_backward`` for the backward of model call ``run`` (one backward may run through several:
        the stages one rank runs in turn): gather the unit, prefetch the next units of the call's forward,
        reversed."""
        task = self._task()
        if run is not None and run not in task.runs:
            task.runs.add(run)
            task.queue += [u for u in dict.fromkeys(reversed(self.runs[run])) if u not in task.queue]
        if unit in task.queue:
            task.queue.remove(unit)
        self._round(unit)
        if unit.remaining or unit.spec.frozen:
            self._ensure_backward(unit)
        ahead = [u for u in task.queue if self._needed(u)][: self.prefetch]
        self._prefetch(ahead, unit, agree=True)
        for u in ahead:
            task.units[u] = None

    def _micro_grad_in(self, unit: LiveUnit) -> None:
        """One of ``unit``'s gradients in this micro-batch's backward; the last of them ends the unit's part of
        it: it is released (with ``reshard``, or after its last micro-batch). A unit with frozen parameters
        waits for the backward's end (they may compute its inputs' gradients after the trainable ones')."""
        self._round(unit)
        if unit.remaining == 0:
            return
        unit.remaining -= 1
        if unit.remaining == 0:
            unit.rounds_left -= 1
            if not unit.spec.frozen and (self.reshard or unit.finished):
                self._release(unit, over=True)

    def _task_over(self, tid: int) -> None:
        """A micro-batch's backward ended: release what it gathered and still holds (with ``reshard``; else the
        units whose last micro-batch it was)."""
        task = self.tasks.pop(tid, None)
        if task is None or self.phase is Phase.CLOSED:
            return
        for unit in task.units:
            if not unit.idle and unit.depth == 0 and (self.reshard or unit.finished):
                self._release(unit, over=True)


class _Kept:
    """A run's full buffers and parameter leaves over its shards, made once (see :func:`_kept`): per unit its
    full buffers (their storage empty but while gathered), the groups they are gathered over and its trainable
    leaves; each trainable leaf hands its gradient to the running step's sink, then to its runner
    (:meth:`bind`), through hooks registered once."""

    def __init__(self, state: TrainState, flats: tuple, host_shards: bool, trainable: bool):
        layout = state.spec.layout
        self.over: tuple | None = (flats, state.frozen, host_shards)  # what it was made over (None: made anew)
        self.sink: Any = None
        self.then: Callable[..., None] | None = None
        self.busy = False  # a runner uses it
        self.fulls: list[list[tuple[torch.Tensor, Any]]] = []
        self.groups: list[list] = []
        self.counts: list[int] = []
        self.leaves: dict[str, torch.Tensor] = {}
        self.unit_of: dict[str, int] = {}  # parameter name -> its unit's index
        self._stand_ins: StandIns | None = None  # see stand_ins
        self.layout_units = layout.units
        self._owners: tuple | None = None  # see owners
        members: list[list] = [[] for _ in layout.buckets]  # each bucket's trainable leaves, for the closers
        for index, unit in enumerate(layout.units):
            fulls, groups, count = [], [], 0
            pairs = [(flats[i], layout.buckets[i], i) for i in unit.buckets]
            pairs += [(state.frozen[i], layout.frozen_buckets[i], None) for i in unit.frozen]
            for shard, bucket, trained in pairs:
                # A bucket of one shard on the device (every bucket of one rank; the experts where each rank
                # holds its own: Bucket.apart) is whole: the leaves view it where it lies, nothing to gather.
                whole = bucket.shards == 1 and not host_shards
                full = shard if whole else torch.empty(bucket.padded, dtype=bucket.dtype, device=bucket.device)
                raw = full.data  # leaves view this alias: refilling `full` bumps no version they saved
                for s in bucket.slots:
                    leaf = raw[s.offset : s.offset + s.numel].view(s.shape)
                    if trained is not None and trainable:
                        leaf = leaf.detach().requires_grad_(True)
                        members[trained].append((s.name, leaf))
                        count += 1
                    self.leaves[s.name] = leaf
                    self.unit_of[s.name] = index
                if not whole:
                    full.untyped_storage().resize_(0)
                    fulls.append((full, shard))
                    groups.append(bucket_group(bucket))
            self.fulls.append(fulls)
            self.groups.append(groups)
            self.counts.append(count)
        # Each trainable leaf hands its gradient to the step's sink, then to its runner (bind): one hook call per
        # bucket where the gradients arrive as they did in the last step (see Closers).
        self.closers = Closers(members, self._take, self._take_bucket)

    def owner(self, module: nn.Module, m: nn.Module) -> tuple[int, bool]:
        """For ``m``, a module in ``module``: the index of the unit it belongs to (the innermost unit whose name
        is a prefix of its own; the root's otherwise) and whether it is that unit's own module (or the model
        itself). Found for every module once per model, again when it meets a module it has not seen."""
        found = self._owners
        entry = found[1].get(id(m)) if found is not None and found[0] is module else None
        if entry is None or entry[0] is not m:
            entry = self._find_owners(module)[id(m)]
        return entry[1], entry[2]

    def _find_owners(self, module: nn.Module) -> dict[int, tuple[nn.Module, int, bool]]:
        units = self.layout_units
        root = next(i for i, u in enumerate(units) if u.name == ROOT)
        own = {i: module.get_submodule(u.name) for i, u in enumerate(units) if u.name}  # each unit's own module
        table = {}
        for name, m in module.named_modules():
            index = root
            for i, unit in enumerate(units):
                if unit.name and inside(name, unit.name):
                    index = i
            table[id(m)] = (m, index, own.get(index) is m or m is module)
        self._owners = (module, table)
        return table

    def _take(self, name: str, leaf: torch.Tensor) -> None:
        if self.sink is not None:
            self.sink.take(name, leaf)
        if self.then is not None:
            self.then(self.unit_of[name])

    def _take_bucket(self, i: int, leaves: list[tuple[str, torch.Tensor]]) -> None:
        self.sink.take_bucket(i, leaves)
        if self.then is not None:
            self.then(self.unit_of[leaves[0][0]], len(leaves))  # a bucket lies in one unit

    def stand_ins(self, functional: Functional) -> StandIns:
        """The placeholders over these leaves for ``functional``'s model, made once (a step no longer makes one
        per parameter)."""
        if self._stand_ins is None or self._stand_ins.functional is not functional:
            self._stand_ins = StandIns(functional, self.leaves, self.unit_of, len(self.layout_units))
        return self._stand_ins

    def bind(self, sink: Any, then: Callable[..., None]) -> None:
        """For a runner's step: gradients go to ``sink`` (``take(name, leaf)``, or ``take_bucket`` where it is a
        ``GradSink``), then ``then(unit index, how many)``."""
        self.sink, self.then, self.busy = sink, then, True
        for leaf in self.leaves.values():
            leaf.grad = None  # a step that raised in backward may have left some
        self.closers.start(sink)

    def unbind(self, keep: bool) -> None:
        """The runner's step is over: a backward after it (a graph kept past it) reaches no sink. ``keep``:
        the step ended well, its buffers are free for the next (else gathers it left in flight may still write
        into them: the next step makes its own)."""
        self.closers.stop()
        self.sink, self.then, self.busy = None, None, False
        if not keep:
            self.over = None


_KEPT = "shard_params.kept"  # the state.run entry of the kept buffers and leaves


def _kept(state: TrainState, flats: tuple, host_shards: bool, trainable: bool) -> _Kept:
    """The full buffers and leaves for a step over ``flats``: made when the run's shards are new (the first
    step, a state copied, loaded or moved) or the last step over them failed, else the ones its last step used.
    Leaves and hooks made once per layout, not per step: a step no longer detaches a view and registers two hooks
    for every parameter. A runner that starts while another holds them (a model call inside ``gathered``) makes
    its own."""
    kept = state.run.entries.get((_KEPT, trainable))
    if kept is None or not _same(kept.over, (flats, state.frozen, host_shards)):
        kept = state.run.entries[(_KEPT, trainable)] = _Kept(state, flats, host_shards, trainable)
    elif kept.busy:
        return _Kept(state, flats, host_shards, trainable)
    return kept


def _same(over: tuple | None, now: tuple) -> bool:
    """Whether kept buffers made over ``over`` serve a step over ``now``: the very same shards."""
    if over is None or over[2] != now[2] or len(over[0]) != len(now[0]) or len(over[1]) != len(now[1]):
        return False
    return all(a is b for a, b in zip(over[0] + over[1], now[0] + now[1]))
