"""``zf.train_step`` and the Step protocol that transforms rewrite.

A Step is a pure function from the outside, ``step(state, batch) -> (state,
metrics)``, with ``step.init(params) -> state``. It is made of three parts,
each owning one concern and its piece of the step's name, and one chain:

- ``reduction`` (:class:`zerofn.reduction.Reduction`): how gradients are
  reduced across ranks, and the ZeRO ``stage`` that transforms compare;
- ``storage`` (:class:`zerofn.storage.Storage`): how parameters are held,
  bound for a forward, updated and gathered;
- ``precision`` (:class:`zerofn.precision.Precision`): dtypes, autocast,
  the optimizer's master weights and the loss scale;
- ``extensions`` (:class:`zerofn.extension.Extension`): what further
  transforms add (optimizer wrappers, contexts around forward and backward,
  entries of the state), in the order they were applied.

A transform ``Step -> Step`` replaces a part or extends the chain; the core
names no transform. One call runs six phases (the sink; forward and
backward; carry; unscale; update; publish), described once in the design
page of the docs ("The phases of a step"); the comments in ``Step._run``
number them alike.

Example:
    >>> import torch, zerofn as zf
    >>> model = torch.nn.Linear(4, 1)
    >>> apply = zf.functional(model)
    >>> def loss_fn(params, batch):
    ...     return ((apply(params, batch["x"]) - batch["y"]) ** 2).mean()
    >>> step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    >>> state = step.init(apply.params)
    >>> batch = {"x": torch.ones(8, 4), "y": torch.zeros(8, 1)}
    >>> state, metrics = step(state, batch)
    >>> sorted(metrics)
    ['comm_bytes', 'grad_norm', 'loss', 'skipped']
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerofn import alloc, counters, keys
from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn.closure import find_functional
from zerofn.extension import Extension
from zerofn.functional import ADOPTED_HELP, BINDING, Functional, owner_of
from zerofn.losses import MEAN_HELP, Mean
from zerofn.optim.base import foreach_groups  # the device/dtype grouping foreach kernels need
from zerofn.precision import Precision
from zerofn.reduction import GradSink, Reduction
from zerofn.state import InFlight, Layout, StateSpec, TrainState, collecting, join_slices
from zerofn.storage import Storage, split_params

__all__ = ["DEFAULT_BUCKET_BYTES", "Step", "StepTransform", "reapply", "train_step", "transform"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb

IGNORED_PARAMS_HELP = """\
{name}(state, batch): no gradient reached the parameters the step passed to
loss_fn: the loss does not depend on them. loss_fn must compute the loss
from its params argument, for example

    def loss_fn(params, batch):
        return criterion(apply(params, batch["x"]), batch["y"])   # not apply.params, not model(...)

Nothing was updated and the state is as it was.
"""


def _in_group(method: Callable) -> Callable:
    """Run a Step method inside ``C.group_scope(self.group)`` (None: the caller's current group); ``init``
    first joins the default process group under torchrun when nothing joined yet (``C.init``)."""
    joins = method.__name__ == "init"

    @functools.wraps(method)
    def run(self: Step, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # error messages name the method, not this wrapper
        if joins:
            C.init()
        with C.group_scope(self.group):
            return method(self, *args, **kwargs)

    return run


@dataclass(frozen=True)
class Step:
    """A training step ``step(state, batch) -> (state, metrics)``; see module docs.

    Build one with :func:`train_step` and rewrite it with the transforms in
    ``zerofn.transforms``.
    """

    loss_fn: Callable
    optimizer: O.GradientTransformation
    accumulate_steps: int = 1
    donate: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    group: Any = None  # the torch ProcessGroup it runs on; None: the current group (zf.collectives.group_scope)
    reduction: Reduction = Reduction()
    storage: Storage = Storage()
    precision: Precision = Precision()
    extensions: tuple[Extension, ...] = ()
    # The model loss_fn calls and the effective optimizer, found on first use (a cache: not compared, not
    # copied by replace).
    _found: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    # ------------------------------------------------------------ composition

    @property
    def name(self) -> str:
        """The chain: the parts' pieces (reduction, storage, precision), then the extensions' in order.

        A name depends on the parts a step has, not on the order the
        transforms that made them were applied in.
        """
        out = "train_step"
        parts = (self.reduction, self.storage, self.precision, *self.extensions)
        for piece in dict.fromkeys(p.name for p in parts if p.name):
            out = f"{piece}({out})"
        return out

    def __repr__(self) -> str:
        return f"<Step {self.name}, accumulate_steps={self.accumulate_steps}, donate={self.donate}>"

    def replace(self, **changes: Any) -> Step:
        """A copy with some fields (parts, settings) replaced."""
        return dataclasses.replace(self, **changes)

    def extend(self, extension: Extension) -> Step:
        """A copy with ``extension`` added at the end of the chain."""
        return self.replace(extensions=self.extensions + (extension,))

    def extension(self, name: str) -> Extension | None:
        """The extension named ``name``, if the step has it."""
        return next((e for e in self.extensions if e.name == name), None)

    @property
    def effective_optimizer(self) -> O.GradientTransformation:
        """The user's optimizer inside the precision's wrapper, then the extensions' in order.

        The precision wraps first whatever order the transforms were applied
        in: amp's fp32 master weights are optimizer state, so a wrapper that
        places the optimizer state (offload) must see them.
        """
        if "optimizer" not in self._found:  # built once per step: a wrapper may learn from step to step
            opt = self.precision.wrap_optimizer(self.optimizer)
            for e in self.extensions:
                if e.wrap_optimizer is not None:
                    opt = e.wrap_optimizer(opt)
            self._found["optimizer"] = opt
        return self._found["optimizer"]

    def model(self) -> Functional:
        """The ``zf.functional`` apply that ``loss_fn`` calls (found in its closure on first use)."""
        if "model" not in self._found:
            self._found["model"] = find_functional(self.loss_fn)
        return self._found["model"]

    # ------------------------------------------------------------ init and views

    @_in_group
    def init(self, params: Any, *, keep_module: bool = False, structure_only: bool = False) -> TrainState:
        """Build the state for ``params`` (a tree of tensors, e.g. ``apply.params``).

        Tensors with ``requires_grad=False`` (or a non-float dtype) are frozen:
        no gradient, no optimizer state.

        When ``params`` is ``apply.params`` of a ``zf.functional`` module, the
        state takes the module's parameters over, so that it holds the only
        copy: a parameter the state holds whole in the same dtype and device
        (no sharding of parameters, no amp, a donating step) stays in the
        module as a view of the state's buffer, and reads the state's current
        values; every other one becomes a meta placeholder, and calling the
        module outside a step raises, pointing to ``step.apply`` and
        ``step.full_params``. ``keep_module=True`` leaves the module as it
        was (a second copy of the parameters beside the state).

        ``structure_only=True`` builds the state only to be overwritten, as
        ``zf.checkpoint.load`` does: the ranks' params are not compared, and
        the parameter buckets, the optimizer's moments and the copies
        wrappers keep of the parameters (amp's masters, offload's host
        copies) are allocated without being written (see
        :mod:`zerofn.alloc`); counts and scratch are made as always. Its
        values are undefined until a load fills every one of them.

        Collective: call it on every rank, with the same params (under
        torchrun it joins the process group, and the ranks' states must match).
        """
        with alloc.unfilled() if structure_only else contextlib.nullcontext():
            return self._init(params, keep_module, structure_only)

    def _init(self, params: Any, keep_module: bool, structure_only: bool) -> TrainState:
        for e in self.extensions:
            if e.check is not None:
                e.check(self)
        split = split_params(params, f"{self.name}.init")
        functional = owner_of(params)
        if functional is not None and functional.adopted:
            # Its parameters are placeholders now: materialising them afresh would silently
            # start from other numbers than the state that holds them.
            raise ValueError(ADOPTED_HELP.format(what=f"{self.name}.init(apply.params)"))
        owner = functional.owner if functional is not None else (lambda name: None)
        given = {k: v.dtype for k, v in split.named.items()}  # the model's dtypes, before the precision's cast
        named = {k: self.precision.cast(v, owner(k)) for k, v in split.named.items()}  # held (and run) so
        split = split._replace(named=named, trainable={k: named[k] for k in split.trainable})
        # the extensions that change what the model's layers are (their shapes) first, whatever the order of
        # application, so that the others' prepares see the layers as they will run
        for e in sorted(self.extensions, key=lambda e: not e.prepare_first):
            if e.prepare is not None:
                split = e.prepare(split, functional, f"{self.name}.init")
        names = _names_view(split.treedef, split.named, split.trainable)
        groups = O.labels(self.optimizer, names)  # its masks and groups, if any
        split = split._replace(labels={k: groups[k] for k in split.trainable} if groups else {})
        world, rank = C.world_size(), C.rank()
        if world > 1 and not structure_only:
            _check_same_params(split.named, self.name)
        held = self.storage.init(
            split,
            shards=self.reduction.shards(world),
            bucket_bytes=self.bucket_bytes,
            model=lambda: functional or self.model(),
        )
        opt_state = self.bound_optimizer(held.layout, rank, split.treedef).init(
            self._opt_params(held.params, held.layout, rank)
        )
        extra = dict(held.extra)
        for e in self.extensions:
            extra.update((key, init()) for key, init in e.entries)
        # The model's buffers are state too; the module keeps the same tensors (or, with
        # keep_module, its own), and every step binds the state's into the module.
        buffers = functional.buffers() if functional is not None else {}
        if keep_module:
            buffers = {k: v.clone() for k, v in buffers.items()}
        # The counts an update advances live where the update runs, so that the device can decide on it.
        counts_on = None if _device(held.layout) in ("cpu", "meta") else _device(held.layout)
        state = TrainState(
            params=held.params,
            frozen=held.frozen,
            buffers=buffers,
            opt_state=opt_state,
            count=counters.new(0, device=counts_on),
            micro=counters.new(0),
            grad_accum=None,
            seen=None,
            items=None,
            param_steps=counters.new_like([0] * len(held.layout.trainable_names), device=counts_on),
            loss_scale=self.precision.new_loss_scale(counts_on),
            extra=extra,
            spec=StateSpec(
                self.name,
                world,
                held.layout,
                split.treedef,
                functional.state_dict_names() if functional else (),
                next((e.partition() for e in self.extensions if e.partition is not None), (0, 1)),
                tuple(x for e in self.extensions if e.slices is not None for x in e.slices()),
                tuple(given.get(k, v.dtype) for k, v in split.named.items()),  # what prepare made: as held
            ),
        )
        if functional is not None and not keep_module:
            device = torch.device(_device(held.layout)).type
            late = any(e.updates_late(device) for e in self.extensions if e.updates_late is not None)
            self.storage.adopt(functional, state, share=self.donate, updates_late=late)
        return state

    def bound_optimizer(self, layout: Layout, rank: int, treedef: Any) -> O.GradientTransformation:
        """The effective optimizer bound to what each bucket this rank updates holds (its
        :class:`~zerofn.optim.ParamView`; ``treedef``: the params tree's structure): once per layout."""
        cache = self._found.setdefault("bound", {})
        key = (layout, rank, treedef)
        if key not in cache:
            view = param_view(layout, rank, treedef)
            # The user's optimizer is bound before any wrapper sees it, so that a wrapper which does not
            # forward bind (one of a user's own) still wraps the per-parameter optimizer; the wrappers that
            # do (amp's masters, offload) are bound again, which rebinds their inner one to the same view.
            opt = self.precision.wrap_optimizer(O.bind(self.optimizer, view))
            for e in self.extensions:
                if e.wrap_optimizer is not None:
                    opt = e.wrap_optimizer(opt)
            cache[key] = O.bind(opt, view)
        return cache[key]

    def _opt_params(self, flats: tuple, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
        return {
            keys.bucket(i): self.storage.opt_view(f, b, rank) for i, (f, b) in enumerate(zip(flats, layout.buckets))
        }

    @_in_group
    def full_params(
        self, state: TrainState, *, master: bool = False, requires_grad: bool = False, local: bool = False
    ) -> Any:
        """The full parameters (a new tree shaped like the ``init`` input) on every rank.

        Whole tensors in the model's own dtypes, whatever the composition: the
        parameters one process would hold after the same training. Sharded
        parameters are gathered one bucket at a time; under
        ``tensor_parallel`` each split parameter is gathered from its slices
        over the tensor-parallel group, one parameter at a time (a rank holds
        the model once, plus one parameter's slices). Under ``amp`` they are
        the fp32 master weights cast to the dtype each parameter had when
        ``init`` received it (the model's: fp32 for a model built in fp32;
        frozen parameters, which have no master, the held values cast), so
        they compute beside fp32 inputs as the model did.

        ``master=True`` gives the weights the optimizer updates, in their
        own dtype (amp's fp32 masters; with ``amp(..., master_dtype=bf16)``
        the held bf16 parameters; frozen parameters, which have none, as
        held, in the masters' dtype). ``local=True`` gives the parameters
        this rank's model computes with, as the step holds them: under
        ``tensor_parallel`` its own slices of the split parameters (cut as
        ``state.spec.slices`` says), not gathered over the tensor-parallel
        group; under ``amp`` in its dtype (bf16; the norms it keeps in fp32
        in fp32); sharded parameters still gathered whole over the
        data-parallel ranks.
        ``requires_grad=True`` marks the trainable parameters (not the
        frozen ones), so that ``other_step.init(step.full_params(state,
        requires_grad=True))`` builds a state that trains the same ones.

        Collective: every rank must call it, in the same order as its other
        collective calls; called on some ranks only, it fails after
        ``ZEROFN_TIMEOUT_S`` with ``zerofn.collectives.CollectiveTimeoutError``
        (to save on one rank, call it on every rank and write on rank 0 only).
        """
        self.check_state(state)
        spec = state.spec
        split = not local and spec.partition[1] > 1 and bool(spec.slices)
        # the group the slices are gathered over, asked first: it raises where they cannot be made whole
        group = next(e.partition_group() for e in self.extensions if e.partition_group is not None) if split else None
        dtypes = dict(zip(spec.layout.names, spec.dtypes)) if spec.dtypes and not (master or local) else {}
        # The masters are the most precise values: read where the held parameters are not in the model's dtype.
        cast = any(dtypes.get(s.name, b.dtype) != b.dtype for b in spec.layout.buckets for s in b.slots)
        masters = self.precision.masters(state.opt_state) if master or cast else None
        leaves, treedef = T.tree_flatten(self.storage.full_params(state, self.model, masters))
        # ``leaves`` holds the only reference to each tensor: one replaced (cast, joined) is freed at once;
        # so are the masters read from files
        del masters
        for i, (name, t) in enumerate(zip(spec.layout.names, leaves)):
            want = dtypes.get(name, t.dtype)
            if t.is_floating_point() and want != t.dtype:
                leaves[i] = t.to(want)
        if split:
            _join_slices(spec, leaves, group)
        if requires_grad:  # trainable as they were, for init, which reads trainability from requires_grad
            trainable = {s.name for b in spec.layout.buckets for s in b.slots}
            for name, t in zip(spec.layout.names, leaves):
                if name in trainable:
                    t.requires_grad_(True)
        return T.tree_unflatten(treedef, leaves)

    @_in_group
    def state_dict(self, state: TrainState, *, master: bool = False, local: bool = False) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` from the state: every parameter name (tied ones under each of
        their names) and every persistent buffer, for ``model.load_state_dict(..., strict=True)``.

        Collective, like :meth:`full_params`; ``master`` and ``local`` as there (whole parameters in the
        model's dtypes by default, which a freshly built model loads; ``local=True``: this rank's slices
        under ``tensor_parallel``, which its split model loads).
        """
        full = self.full_params(state, master=master, local=local)
        return self.model().state_dict_of(full, state.buffers)

    @_in_group
    def apply(self, state: TrainState, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on the current parameters, without gradients (evaluation, generation).

        Runs the model that ``loss_fn`` calls (through ``zf.functional``) on
        the state's parameters as the storage holds them: under
        ``shard_params`` it gathers one unit at a time, so it runs models
        larger than one rank. Collective: call it on every rank, in the same
        order as the other collective calls.
        """
        self.check_state(state)
        with contextlib.ExitStack() as stack:
            if state.buffers:
                stack.callback(self.model().bind_buffers(state.buffers))
            stack.enter_context(self.precision.autocast(_device(state.spec.layout)))
            return self.storage.forward(state, self.model, args, kwargs)

    @_in_group
    def check_state(self, state: Any) -> None:
        """Raise, saying what to do, unless ``state`` is a live state this step made (its chain, this world size)."""
        if not isinstance(state, TrainState):
            raise TypeError(
                f"{self.name}(state, batch): state is a {type(state).__name__}, expected the TrainState made by "
                f"this step's init: state = step.init(apply.params)"
            )
        spec = state.spec  # raises DonatedStateError on a donated state
        world = C.world_size()
        if spec.chain != self.name or spec.world_size != world:
            raise ValueError(
                f"{self.name}(state, batch): state was made by {spec.chain} on world size {spec.world_size}, "
                f"but this step is {self.name} on world size {world}. Build the state with this step's init: "
                f"state = step.init(params), or carry the parameters over: "
                f"state = step.init(other_step.full_params(old_state, requires_grad=True)), or save and load a "
                f"checkpoint (zf.checkpoint), which carries the optimizer state too."
            )

    # ------------------------------------------------------------ the step

    @_in_group
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One micro-step: ``(new_state, metrics)``; the input state is donated (see ``train_step``).

        Collective: every rank calls it once per micro-batch, in the same
        order, with micro-batches of the same shapes. A rank that does not
        call it makes the others fail with
        ``zerofn.collectives.CollectiveTimeoutError`` after
        ``ZEROFN_TIMEOUT_S`` (default 600 s).
        """
        self.check_state(state)
        also = tuple(g for e in self.extensions if e.groups is not None for g in e.groups())
        with C.counting(also=also) as counter:
            if not self.donate:  # the copy reads state.params, which waits for a publish in flight
                kept = state.inflight.fault  # a check not read yet goes on with the copy
                state = T.tree_map(lambda t: counters.clone(t) if isinstance(t, torch.Tensor) else t, state)
                state.inflight.fault = kept
            new_state, metrics = self._run(state, batch)
        metrics["comm_bytes"] = counter.bytes
        if self.donate:
            state._donate()
        return new_state, metrics

    def _run(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        layout, world, rank = state.spec.layout, state.spec.world_size, C.rank()
        k = self.accumulate_steps
        micro = counters.value(state.micro)  # host counters: no device read (zerofn.counters)
        last = micro + 1 == k
        precision, ls = self.precision, state.loss_scale
        digest = self._batch_digest(batch)

        # 1. The sink. Between micro-steps a state carries either full local gradient
        # sums (reduced once, on the last micro-step) or, when gradients are sharded,
        # this rank's reduced partition (reduced on every micro-step).
        every_micro = self.reduction.every_micro
        reduce_now = last or every_micro
        carried = state.grad_accum
        scale = precision.loss_scale_factor(ls)
        optimizer = self.bound_optimizer(layout, rank, state.spec.treedef)
        # An optimizer that can start before backward ends gets each bucket's gradient as it is final.
        pending = None
        if last and optimizer.start_update is not None:
            pending = optimizer.start_update(
                state.arriving_opt_state(),
                self._opt_params(state.arriving_params(), layout, rank),
                state.inflight.wait_opt,
            )

        norms: list = []  # of each bucket's final gradient, as it lands (the gradient then goes)
        early: dict = {}  # a zf.Mean's global count, for an update that starts as buckets land (see below)

        def final(i: int, r: torch.Tensor) -> None:  # phase 4 below, for one bucket, as it lands
            key = keys.bucket(i)
            if "handle" in early:  # the count's all-reduce, under way since the forward ended (a host read:
                early["n"] = float(early.pop("handle").wait()[1])  # this update runs on the host anyway)
            f = factors[i] if "n" not in early else _mean_factor(sink.predivide[i], early["n"], scale)
            g, norm = _unscale(precision, {key: r}, [f])
            norms.extend(norm)
            pending.grad(key, g[key])

        sink = GradSink(
            layout,
            self.reduction,
            precision.grad_dtype,
            rank,
            reduce_now,
            carried=None if every_micro else carried,
            reduced_sums=carried if every_micro else None,
            on_result=final if pending is not None else None,
        )
        factors = [_divide(d, world * k, scale) for d in sink.predivide]  # phase 4's, per bucket
        stats = functools.partial(_stats, world=world, rank=rank, replicated=self.reduction.replicated, digest=digest)

        try:
            # 2. Forward and backward; each bucket is reduced as backward completes it.
            # A zf.Mean's running sums reach the other ranks in the statistics below; an update that starts
            # as buckets land needs the count sooner: its all-reduce overlaps backward.
            counts = early if pending is not None else None
            token = _REPORTS.set([])
            try:
                loss, aux, extra, items = self._forward_backward(state, batch, sink, scale, counts)
            finally:
                reported = state.inflight.reported + _REPORTS.get()  # this update's micro-steps' checks
                _REPORTS.reset(token)
            after = {"micro": counters.new(micro + 1), "extra": extra, "items": items}

            seen = sink.seen(state.seen)  # None: every parameter got a gradient here so far
            after["seen"] = seen

            # 3. Carry the gradient to the next micro-step. The statistics stay on the device: nothing
            # here waits for it (the metrics are read when the user reads them).
            if not reduce_now:
                done = stats(loss, aux, None, items=items)
                new = state.replace(grad_accum=sink.full_buffers(), **after)
                new.inflight.reported = reported
                return new, _metrics(precision, ls, done, aux)
            reduced = sink.finish()
            if "handle" in early:  # no bucket landed to wait for it
                early.pop("handle").wait()
            if not last:
                done = stats(loss, aux, None, items=items)
                new = state.replace(grad_accum=tuple(reduced.values()), **after)
                new.inflight.reported = reported
                return new, _metrics(precision, ls, done, aux)

            # 4. Average over ranks and micro-steps and undo the loss scale: one fused multiply. A zf.Mean
            # divides by its global count instead, which the statistics bring: the norms are taken first
            # (of the gradient before that division, which scales them alike) and the multiply follows.
            divide_later = pending is None and items is not None
            if divide_later:
                reduced, norms = _unscale(precision, reduced, None, [_divide(d, 1, scale) for d in sink.predivide])
            elif pending is None:
                reduced, norms = _unscale(precision, reduced, factors)
            checks = _any(reported, loss.device) if any(e.reports for e in self.extensions) else None
            done = stats(
                loss,
                aux,
                norms,
                unseen=seen is not None,
                items=items,
                seen=(seen, len(layout.trainable_names)),
                reported=checks,
            )
            if divide_later:
                n = done["count"]
                for g, d in zip(reduced.values(), sink.predivide):
                    g.mul_(_mean_factor(d, n, scale))
                done["sumsq"] = done["sumsq"] / n.square()
            # Whether the update applies (a finite loss and gradient, batches the ranks agree on) is decided on
            # the device, read by no one, when the optimizer can skip there (GradientTransformation.masks), and
            # so are which parameters no rank gave a gradient; otherwise the host reads both (one read).
            ok, fault = _verdict(done, digest)
            on_device = (
                optimizer.masks
                and not _check_each_update()
                and all(t.device == ok.device for t in T.tree_leaves((state.count, ls)) if isinstance(t, torch.Tensor))
            )
            if on_device:  # what the optimizer needs to know of the parameters, on the device too
                names = layout.trainable_names
                maybe = (
                    frozenset(n for n, b in zip(names, counters.values(seen)) if not b) if seen is not None else None
                )
                absent = _absent(*done["seen"], done["world"]) if maybe else None
                # a copy: an update on the host's worker may read it after the counts below advance
                counts = None if counters.uniform(state.param_steps) else state.param_steps.clone()
                info = O.StepInfo(frozenset(), None, None, maybe or frozenset(), absent, counts, names)
                decided: Any = ok
            else:
                finite, missing = _decide(self.name, ok, fault, done, batch, layout, reported)
                info = _step_info(state, missing)
                decided = finite
        except BaseException:
            if pending is not None:  # nothing it started may stay: the state is as it was
                pending.cancel()
            raise
        grad_norm = done["sumsq"].sqrt().float()  # nan when negative (no gradient reached it)
        after.update(
            micro=counters.new(0),
            grad_accum=None,
            seen=None,
            items=None,
            loss_scale=precision.adjust(ls, decided),
        )
        skipped = ~ok if on_device else torch.full((), not finite, device=ok.device)
        if not on_device and not finite:
            if pending is not None:
                pending.cancel()
            return state.replace(**after), _metrics(precision, after["loss_scale"], done, aux, skipped, grad_norm)

        # 5. Update in place, then 6. publish. What is left running (a host update on another thread, the
        # publish's all-gathers) is recorded in the new state's in-flight handles, which its readers wait on.
        flats = state.arriving_params()
        inflight = InFlight(
            _carry_fault(state.inflight.fault, fault, self.name, reported) if on_device else state.inflight.fault
        )
        found = {"found_inf": skipped.float()} if on_device else {}
        with torch.no_grad(), collecting(inflight, flats):
            if pending is not None:
                opt_state = pending.commit(grad_norm=grad_norm, info=info, **found)
            else:
                opt_params = self._opt_params(flats, layout, rank)
                opt_state = O.update_params(
                    optimizer, reduced, state.opt_state, opt_params, grad_norm=grad_norm, info=info, **found
                )
            del reduced
            self.storage.publish(flats, layout, rank, inflight)
        if on_device:  # in place: the input state is donated (or a copy)
            count = counters.advance_(state.count, ok)
            steps = counters.advance_(state.param_steps, ok if info.absent is None else ok & ~info.absent)
        else:
            steps = _advance_steps(state.param_steps, layout, info)
            count = counters.new(counters.value(state.count) + 1, device=state.count.device)
        new = state.replace(opt_state=opt_state, count=count, param_steps=steps, inflight=inflight, **after)
        return new, _metrics(precision, after["loss_scale"], done, aux, skipped, grad_norm)

    def _batch_digest(self, batch: Any) -> int | None:
        """The batch's structure, shapes and dtypes as a number (a host computation), when ranks must agree
        on it: the first call agrees at once (a small all-reduce); every update compares it in its
        statistics (see :func:`_decide`), so no call waits on a read for it."""
        if C.world_size() == 1:
            return None
        digest = T.treespec_digest(batch) & ((1 << _DIGEST_BITS) - 1)
        if "batch" not in self._found:
            _check_batch(self.name, batch, digest)
            self._found["batch"] = digest
        return digest

    def _forward_backward(self, state: TrainState, batch: Any, sink: GradSink, scale: float, counts: dict | None):
        """Phase 2: returns the loss (detached), the aux dict, the state entries for the next state and, for a
        ``zf.Mean``, this rank's running sums of total and count (else None). ``counts``: where to put the
        all-reduce of those sums, launched before backward, for an update that starts as buckets land."""
        extra = dict(state.extra)
        before = _float_buffers(state.buffers, copy=True)
        with contextlib.ExitStack() as stack:
            if state.buffers:
                stack.callback(self.model().bind_buffers(state.buffers))
            params = stack.enter_context(self.storage.bind(state, sink, self.model, extra))
            for e in self.extensions:
                if e.around is not None:
                    stack.enter_context(e.around(self.model, state))
            # Parameters a zf.functional call swaps in stay until backward is over,
            # so a recompute in backward (checkpointing in the model) sees them too.
            token = BINDING.set(stack)
            stack.callback(BINDING.reset, token)
            with self.precision.autocast(_device(state.spec.layout)):
                out = self.loss_fn(params, batch)
            loss, aux, mean = _split_loss(self.name, out)
            loss = loss.float()
            items = None
            if mean is not None:
                now = torch.stack([loss.detach().double(), mean.counted(loss.device)])
                items = now if state.items is None else state.items + now
                if counts is not None and counters.value(state.micro) + 1 == self.accumulate_steps:
                    counts["handle"] = C.all_reduce(items.clone(), "sum", async_op=True, control=True)
            if loss.requires_grad:
                sink.backward_started = True  # a backward before this one was a torch.autograd.grad in loss_fn
                (loss * scale if isinstance(scale, torch.Tensor) or scale != 1.0 else loss).backward()
            del params, out
        if sink.received == 0 and state.spec.layout.buckets:
            raise ValueError(IGNORED_PARAMS_HELP.format(name=self.name))
        _average_buffers(_float_buffers(state.buffers), before)
        return loss.detach(), aux, extra, items


# ---------------------------------------------------------------- a split model's parameters made whole


def _join_slices(spec: StateSpec, leaves: list, group: Any) -> None:
    """Replace, in place in ``leaves`` (``layout.names``' order), each parameter that is a slice of a whole one
    (``spec.slices``) by the whole one, gathered over ``group`` (the ranks holding the model's parts), one
    parameter at a time."""
    where = {name: i for i, name in enumerate(spec.layout.names)}
    rules = [(name, int(d), int(p), int(n), int(i)) for name, d, p, n, i in spec.slices if name in where]
    if not rules:
        return
    count = C.world_size(group=group)
    device = leaves[where[rules[0][0]]].device
    mine = torch.tensor([rule[4] for rule in rules], dtype=torch.int64, device=device)
    every = torch.empty(count * len(rules), dtype=torch.int64, device=device)
    C.all_gather(every, mine, group=group)
    indices = every.view(count, len(rules)).tolist()  # which slice of each parameter each rank holds
    for k, (name, dim, parts, n, _) in enumerate(rules):
        t = leaves[where[name]]
        out = torch.empty((count, t.numel()), dtype=t.dtype, device=t.device)
        C.all_gather(out.view(-1), t.detach().contiguous().view(-1), group=group)
        pieces: dict[int, torch.Tensor] = {}
        for g in range(count):  # ranks sharing a slice (shared key/value heads) gave the same one
            pieces.setdefault(indices[g][k], out[g].view(t.shape))
        leaves[where[name]] = join_slices(pieces, dim, parts, n)
        del out, pieces


# ---------------------------------------------------------------- what a step computes besides the update


def _unscale(precision: Precision, grads: dict, factors: list | None, norm_scales: list | None = None):
    """Phase 4 on ``grads`` (bucket key -> reduced gradient, ``factors`` one per bucket): the optimizer's
    dtype, then the average over ranks and micro-steps and the loss scale undone in one fused multiply;
    returns the gradients and their norms. ``factors=None`` leaves the multiply to the caller and gives
    the norms times ``norm_scales``."""
    grads = precision.optimizer_grads(grads)
    if not grads:
        return grads, []
    if factors is None:
        return grads, [n * c for n, c in zip(torch._foreach_norm(list(grads.values())), norm_scales)]
    if any(isinstance(f, torch.Tensor) for f in factors):  # a loss scale on the device
        for g, f in zip(grads.values(), factors):
            g.mul_(f)
    else:
        torch._foreach_mul_(list(grads.values()), factors)
    return grads, torch._foreach_norm(list(grads.values()))


def _divide(predivide: float, n: int, scale: float | torch.Tensor) -> float | torch.Tensor:
    """``predivide / (n * scale)``, in float64 as the host computes it (a 0-dim tensor for a scale on the
    device)."""
    return predivide / (n * (scale.double() if isinstance(scale, torch.Tensor) else scale))


def _mean_factor(predivide: float, count: Any, scale: float) -> Any:
    """What turns a reduced sum of a zf.Mean's totals (divided by ``predivide`` before the reduction, times
    the loss scale) into the gradient of the mean over every item: nan when no rank counted any (the
    step is then skipped, as for any non-finite loss). ``count``: a float, or a tensor on the device."""
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, predivide / (count * scale), math.nan)
    return predivide / (count * scale) if count > 0 else math.nan


def _float_buffers(buffers: dict, copy: bool = False) -> list[torch.Tensor]:
    """The float buffers (copies of them, before a forward), when there are ranks to agree with."""
    if C.world_size() == 1:
        return []
    return [b.clone() if copy else b for b in buffers.values() if b.is_floating_point()]


def _average_buffers(after: list[torch.Tensor], before: list[torch.Tensor]) -> None:
    """Make float buffers equal on every rank: add the mean over ranks of what each rank's forward changed.

    DDP instead broadcasts rank 0's buffers before each forward, which drops
    the other ranks' updates. Averaging the changes keeps them: a running
    mean updated by equal-sized local batches then equals the one updated by
    their concatenation (a running variance misses the spread between the
    ranks' means), and a buffer no forward changes stays exactly as it was.
    Integer buffers (counters) advance alike on every rank. One all-reduce
    per dtype, of every float buffer, so that all ranks issue the same one.
    """
    if not after:
        return
    for group, old in foreach_groups(after, before):
        delta = torch.cat([(b - o).reshape(-1) for b, o in zip(group, old)])
        C.all_reduce(delta, "mean")
        pieces = delta.split([b.numel() for b in group])
        torch._foreach_copy_(group, [o + d.view_as(o) for o, d in zip(old, pieces)])


def _check_same_params(named: dict, where: str) -> None:
    """Every rank must start from the same parameters: the max and min over ranks of each tensor's sum and
    sum of squares (one small all-reduce) tell, before a state is built from numbers that differ between ranks."""
    names = [k for k, t in named.items() if t.device.type != "meta" and t.is_floating_point()]
    if not names:
        return
    sums = torch.stack(
        [
            torch.stack([named[k].detach().double().sum(), named[k].detach().double().square().sum()]).cpu()
            for k in names
        ]
    ).nan_to_num(0.0)
    hi, lo = C.max_min(sums)
    differ = [k for k, a, b in zip(names, hi, lo) if not torch.equal(a, b)]
    if differ:
        raise ValueError(
            f"{where}.init: the ranks passed different values for {len(differ)} parameter(s) ({differ[:3]}"
            f"{' ...' if len(differ) > 3 else ''}). Every rank must start from the same parameters: seed the "
            "random generator the same way on every rank before building the model (torch.manual_seed(0)), "
            "load the same weights on every rank, or load a checkpoint (zf.checkpoint.load)."
        )


def _device(layout: Layout) -> str:
    return layout.buckets[0].device if layout.buckets else "cpu"


_DIGEST_BITS = 20  # small enough that the statistics' sum of squares of it stays exact in float64


def _check_batch(where: str, batch: Any, digest: int) -> None:
    """All ranks must feed batches of one structure, shapes and dtypes: agreed at once (the first call)."""
    hi, lo = C.max_min(torch.tensor([digest], dtype=torch.int64))
    if not torch.equal(hi, lo):
        _batches_differ(where, batch)


def _batches_differ(where: str, batch: Any) -> None:
    shapes = T.tree_map(T.describe_leaf, batch)
    everyone = C.gather_objects(shapes)
    lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(everyone))
    raise ValueError(
        f"{where}(state, batch): ranks fed batches of different shapes or structure "
        f"(world size {C.world_size()}); every rank must feed a micro-batch of the same shapes:\n{lines}\n"
        "Drop or pad the last partial batch (for example DataLoader(..., drop_last=True))."
    )


def _local(t: Any) -> Any:
    """A loss computed on a distributed tensor (a vocabulary-parallel cross-entropy over a ``DTensor`` of
    logits sharded by vocabulary) as the plain tensor every rank holds (differentiably)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) and hasattr(t, "placements") else t


def _split_loss(where: str, out: Any) -> tuple[torch.Tensor, dict, Mean | None]:
    """The loss to run backward on, the aux dict and, for a ``zf.Mean``, the Mean."""
    aux: dict = {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise TypeError(
                f"{where}: loss_fn returned a tuple of {len(out)} items; expected a scalar loss, a zf.Mean(total, "
                "count), or (loss, aux_dict)"
            )
        out, aux = out
    if isinstance(out, Mean):
        return _local(out.total), aux, out
    out = _local(out)
    if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
        got = (
            f"a tensor of shape {list(out.shape)} and dtype {out.dtype}"
            if isinstance(out, torch.Tensor)
            else f"a {type(out).__name__}"
        )
        raise ValueError(
            f"{where}: loss_fn must return a scalar (0-dim) floating-point tensor, got {got}. "
            "Reduce it first, for example return loss.mean(), or return zf.Mean(losses.sum(), count) for a mean "
            "over items whose number differs between ranks or micro-steps (tokens)."
        )
    return out, aux, None


def _stats(
    loss,
    aux,
    norms,
    *,
    world: int,
    rank: int,
    replicated: bool,
    digest,
    unseen: bool = False,
    items=None,
    seen=None,
    reported=None,
):
    """One small all-reduce, on the loss's device, read by no one here: the loss (mean over ranks), the
    gradient sum of squares (from each bucket's norm; None: no gradient), how many ranks gave some
    parameter no gradient (``unseen`` here), the batch digest and its square (equal on every rank when
    n * sum(d^2) == sum(d)^2), a ``zf.Mean``'s running sums of total and count (``items``; the loss is then
    their quotient) and how many ranks counted a negative number, the scalar aux values and, on an update
    across ranks (``seen``: this rank's bits or None, and how many trainable parameters), how many ranks gave
    each parameter a gradient. Returns device tensors; :func:`_verdict` decides on the device, or
    :func:`_decide` reads what the host must know, once per update."""
    scalars = {k: v for k, v in sorted(aux.items()) if _is_scalar(v)}
    dev = loss.device

    def const(v: float) -> torch.Tensor:  # made on the device: no copy from the host
        return torch.full((), float(v), dtype=torch.float64, device=dev)

    if not norms or (replicated and rank != 0):  # None: no gradient; replicated: rank 0's norm is everyone's
        sumsq = const(0.0)
    else:
        sumsq = torch.stack([n.double().square() for n in norms]).sum().to(dev)
    d = digest or 0
    parts = [loss.double(), sumsq, const(1.0 if unseen else 0.0), const(d), const(d * d)]
    if items is not None:
        parts += [items[0].to(dev), items[1].to(dev), (items[1] < 0).double().to(dev)]
    parts += [
        v.detach().double().reshape(()).to(dev) if isinstance(v, torch.Tensor) else const(v) for v in scalars.values()
    ]
    if reported is not None:  # parts' checks on the device (see report): after the aux values
        parts.append(reported)
    bits = None
    if seen is not None and world > 1:
        mine, n = seen
        bits = _pack_seen(torch.ones(n, device=dev) if mine is None else mine.to(dev), world)
    vec = torch.stack(parts) if bits is None else torch.cat([torch.stack(parts), bits])
    C.all_reduce(vec, "sum")
    base = 8 if items is not None else 5
    out = {"vec": vec, "loss": vec[0] / world, "sumsq": vec[1], "world": world}
    if items is not None:
        total, n = vec[5], vec[6]
        out.update(loss=total / n, count=n)  # nan when no rank counted any: the step is then skipped
    out["aux"] = {k: vec[base + j] / world for j, k in enumerate(scalars)}
    end = base + len(scalars)
    if reported is not None:
        out["reported"], end = vec[end], end + 1
    if bits is not None:
        out["seen"] = (vec[end:], seen[1])
    elif seen is not None and seen[0] is not None:  # one rank: its own bits, one per field
        out["seen"] = (_pack_seen(seen[0].to(dev), 1), seen[1])
    return out


def _any(reported: list, device: Any) -> torch.Tensor:
    """Whether any of the reported checks failed, as a float64 on ``device`` (0 or 1)."""
    flag = torch.zeros((), dtype=torch.float64, device=device)
    for failed, _ in reported:
        flag = torch.maximum(flag, failed.to(device, torch.float64))
    return flag


def _field_bits(world: int) -> int:
    """Bits per parameter in the packed count of ranks that gave it a gradient: room for 0..world."""
    return max(1, world.bit_length())


def _pack_seen(bits: torch.Tensor, world: int) -> torch.Tensor:
    """This rank's bit per trainable parameter (gave it a gradient or not), packed into float64s of 52 bits
    each, ``_field_bits(world)`` bits per parameter: the all-reduce's sum of them is, field by field, how
    many ranks gave each parameter a gradient (no field overflows, every sum stays exact)."""
    b = _field_bits(world)
    per = 52 // b
    n = bits.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.float64, device=bits.device)
    padded[:n] = bits.to(torch.float64)
    exponents = torch.arange(0, b * per, b, device=bits.device)  # made on the device: no copy from the host
    weights = torch.ldexp(torch.ones(per, dtype=torch.float64, device=bits.device), exponents)
    return (padded.view(-1, per) * weights).sum(1)


def _absent(packed: torch.Tensor, n: int, world: int) -> torch.Tensor:
    """Which of the ``n`` parameters no rank gave a gradient, on the device (a bool each), from the packed
    sums (see :func:`_pack_seen`): each field shifted down by a power of two and cut, exact in float64."""
    b = _field_bits(world)
    per = 52 // b
    exponents = -torch.arange(0, b * per, b, device=packed.device)
    scales = torch.ldexp(torch.ones(per, dtype=torch.float64, device=packed.device), exponents)  # 2^-(b j)
    shifted = (packed.reshape(-1, 1) * scales.reshape(1, -1)).floor()
    return (torch.remainder(shifted, float(1 << b)).reshape(-1)[:n]) == 0


_REPORTS: contextvars.ContextVar[list | None] = contextvars.ContextVar("zerofn_reports", default=None)


def report(failed: torch.Tensor, explain: str) -> None:
    """Report a check a part of the step made on the device during forward (a rank's batch against its
    peers'): ``failed``, a 0-dim bool tensor the host does not read. The step's update is then skipped on
    every rank of its group and the next wait (``zf.block_until_ready``, a checkpoint) raises
    ``ValueError(explain)``. Outside a step it is read at once and raises there."""
    reports = _REPORTS.get()
    if reports is not None:
        reports.append((failed, explain))
    elif bool(failed):
        raise ValueError(explain)


def _verdict(stats: dict, digest: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether the update applies, on the device (a 0-dim bool): the loss and the gradient are finite, the
    ranks' batches agreed and no ``zf.Mean`` counted a negative number; and what went wrong that the user
    must hear of (0: nothing, else a fault code, see :func:`_explain_fault`)."""
    vec = stats["vec"]
    ok = torch.isfinite(stats["loss"]) & torch.isfinite(stats["sumsq"])
    fault = torch.zeros((), dtype=torch.int64, device=vec.device)
    if digest is not None:
        differ = stats["world"] * vec[4] != vec[3] * vec[3]
        fault = torch.where(differ, _BATCHES_DIFFER, fault)
    if "count" in stats:
        fault = torch.where(vec[7] > 0, _NEGATIVE_COUNT, fault)
    if "reported" in stats:
        fault = torch.where(stats["reported"] > 0, _REPORTED, fault)
    return ok & (fault == 0), fault


_BATCHES_DIFFER, _NEGATIVE_COUNT, _REPORTED = 1, 2, 3


def _check_each_update() -> bool:
    """``ZEROFN_CHECK_EACH_UPDATE=1``: read every update's decision on the host, raising at the call that fed
    a bad batch (a debugging aid: each read waits for the device)."""
    return os.environ.get("ZEROFN_CHECK_EACH_UPDATE", "") not in ("", "0")


def _carry_fault(previous: Any, fault: torch.Tensor, where: str, reported: list) -> tuple:
    """The device's check still to be read: this update's fault, or an earlier one not read yet."""
    if previous is not None:
        fault = torch.maximum(previous[0], fault)
    return fault, functools.partial(_explain_fault, where, _messages(reported))


def _messages(reported: list) -> tuple:
    """What the parts' reported checks say when they fail, each once."""
    return tuple(dict.fromkeys(m for _, m in reported))


def _explain_fault(where: str, messages: tuple, code: int) -> None:
    if code == _REPORTED:
        raise ValueError(
            " ".join(messages)
            if messages
            else f"{where}: a check of the batch failed on another rank of this step's group on an update (that "
            "update was skipped on the device and the state kept as it was); that rank raises what was wrong."
        )
    if code == _NEGATIVE_COUNT:
        raise ValueError(f"zf.Mean: count must be >= 0 (how many items total sums), got a negative count. {MEAN_HELP}")
    raise ValueError(
        f"{where}(state, batch): ranks fed batches of different shapes or structure (world size "
        f"{C.world_size()}) on an update after the first; that update was skipped on the device and the state "
        "kept as it was (metrics['skipped']). Every rank must feed a micro-batch of the same shapes: drop or pad "
        "the last partial batch (for example DataLoader(..., drop_last=True)). Set ZEROFN_CHECK_EACH_UPDATE=1 to "
        "raise at the call that fed it, with each rank's shapes."
    )


def _decide(
    where: str, ok: torch.Tensor, fault: torch.Tensor, stats: dict, batch: Any, layout: Layout, reported: list
) -> tuple[bool, frozenset]:
    """The device's decision (:func:`_verdict`) read on the host, with which parameters no rank gave a gradient
    (one read): whether the update applies, and those parameters; raises what the fault says (the ranks'
    batches differ, with every rank's shapes; a negative zf.Mean count; a part's check), before anything is
    updated."""
    absent = _absent(*stats["seen"], stats["world"]) if "seen" in stats else None
    head = torch.stack([ok.double(), fault.double()])
    applies, code, *gone = (head if absent is None else torch.cat([head, absent.double()])).tolist()
    if code == _BATCHES_DIFFER:
        _batches_differ(where, batch)
    elif code:
        _explain_fault(where, _messages(reported), int(code))
    return bool(applies), frozenset(n for n, a in zip(layout.trainable_names, gone) if a)


def _names_view(treedef: Any, named: dict, trainable: Any) -> O.ParamView:
    """The parameters as the optimizer's labels see them: names, full shapes and dtypes (no leaves yet), and
    which of them it updates."""
    shapes = tuple(tuple(t.shape) for t in named.values())
    dtypes = tuple(t.dtype for t in named.values())
    return O.ParamView({}, treedef, tuple(named), shapes, dtypes, frozenset(trainable))


def param_view(layout: Layout, rank: int, treedef: Any) -> O.ParamView:
    """What each bucket this rank's optimizer updates holds: the whole bucket, or its shard."""
    leaves = {}
    for i, b in enumerate(layout.buckets):
        lo, hi = b.shard_range(rank) if b.shards > 1 else (0, b.padded)
        pieces = []
        for s in b.slots:
            a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < z:
                pieces.append(O.Piece(s.name, s.shape, a - s.offset, a - lo, z - a))
        leaves[keys.bucket(i)] = O.LeafView(tuple(pieces), hi - lo, b.shards > 1)
    shapes = {s.name: s.shape for b in layout.buckets for s in b.slots}
    dtypes = {s.name: b.dtype for b in layout.buckets for s in b.slots}
    for b in layout.frozen_buckets:
        for s in b.slots:
            shapes.setdefault(s.name, s.shape)
            dtypes.setdefault(s.name, b.dtype)
    names = layout.names
    return O.ParamView(
        leaves,
        treedef,
        names,
        tuple(shapes.get(n, ()) for n in names),
        tuple(dtypes.get(n, torch.float32) for n in names),
        frozenset(layout.trainable_names),
    )


def _step_info(state: TrainState, missing: frozenset) -> O.StepInfo:
    """What the optimizer is told about the parameters on this update: which got no gradient on any rank,
    and how many updates each received (host counters: no read, unless an update decided on the device
    since)."""
    count = counters.value(state.count)
    steps = counters.values(state.param_steps)
    lo, hi = (min(steps), max(steps)) if steps else (count, count)
    per = None if lo == hi else dict(zip(state.spec.layout.trainable_names, steps))
    return O.StepInfo(missing, per, lo if lo == hi else count)


def _advance_steps(steps: torch.Tensor, layout: Layout, info: O.StepInfo) -> torch.Tensor:
    """Each updated parameter's count plus one (not those that got no gradient)."""
    old, dev = counters.values(steps), steps.device
    if not info.missing:
        return counters.new_like((v + 1 for v in old), device=dev)
    return counters.new_like((v + (n not in info.missing) for v, n in zip(old, layout.trainable_names)), device=dev)


def _metrics(precision: Precision, loss_scale: Any, stats, aux, skipped=None, grad_norm=None) -> dict:
    """The metrics, device tensors (read one to wait for it: ``float(metrics["loss"])``): none of them
    waits here. ``skipped``: a 0-dim bool tensor (None: no update on this call, so False)."""
    dev = stats["loss"].device
    m: dict[str, Any] = {
        "loss": stats["loss"].float(),
        "grad_norm": grad_norm if grad_norm is not None else torch.full((), math.nan, device=dev),
        "skipped": skipped if skipped is not None else torch.zeros((), dtype=torch.bool, device=dev),
    }
    if "count" in stats:
        m["count"] = stats["count"]
    m.update(precision.metrics(loss_scale))
    for k, v in aux.items():
        m[k] = stats["aux"][k].float() if k in stats["aux"] else v
    return m


def _is_scalar(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---------------------------------------------------------------- building and transforming steps


def train_step(
    loss_fn: Callable,
    optimizer: O.GradientTransformation,
    accumulate_steps: int = 1,
    *,
    donate: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group: Any = None,
) -> Step:
    """Build a Step from a loss function and an optimizer.

    Args:
        loss_fn: ``loss_fn(params, batch)`` returning a scalar loss tensor,
            a ``zf.Mean(total, count)`` (a mean over items whose number differs
            between ranks or micro-steps: the step divides by the global count,
            see ``zerofn.losses``), or either as ``(loss, aux_dict)``; scalar aux
            values are averaged over ranks into the metrics.
        optimizer: a ``zf.optim`` GradientTransformation, e.g. ``zf.optim.adamw(3e-4)``.
        accumulate_steps: apply the update on every K-th call; the result
            equals one step on the K micro-batches concatenated.
        donate: reuse the input state's buffers for the new state (default);
            the input state then raises if used again. ``False`` copies it
            first and leaves it untouched.
        bucket_bytes: gradient bucket size for the reduction during backward.
        group: the torch ``ProcessGroup`` the step runs on (its ranks are the
            step's world: gradients are averaged over them, states are
            sharded over them); None (default): the current group when a
            method is called, the one ``zf.collectives.group_scope`` made
            current, else the default group. Every method that communicates
            (``init``, the call, ``full_params``, ``state_dict``, ``apply``)
            runs in it; ``zf.checkpoint.load`` too.

    Returns:
        A :class:`Step`: ``state = step.init(params)``, ``state, metrics =
        step(state, batch)``, ``step.full_params(state)``. ``metrics`` has
        ``loss`` (mean over ranks), ``grad_norm`` (global, before clipping),
        ``comm_bytes`` (this rank's collective traffic), ``skipped`` (a
        non-finite loss or gradient: no update), ``count`` (a ``zf.Mean``'s
        count over the ranks and the update's micro-steps so far; its
        ``loss`` is their mean) and the aux values. Under N
        ranks gradients are averaged across ranks (DDP semantics).

    Raises:
        TypeError / ValueError: a non-callable loss_fn, a bad optimizer, or
            ``accumulate_steps`` < 1.
    """
    if not callable(loss_fn):
        raise TypeError(f"train_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"train_step: optimizer must be a zf.optim GradientTransformation (init, update), got "
            f"{type(optimizer).__name__}. For example zf.optim.adamw(lr=3e-4)."
        )
    if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise ValueError(f"train_step: accumulate_steps must be an int >= 1, got {accumulate_steps!r}")
    return Step(loss_fn, optimizer, accumulate_steps, donate, bucket_bytes, group)


StepTransform = Callable[..., Step]


def transform(fn: Callable[..., Step]) -> StepTransform:
    """Make ``fn(step, /, *args, **options)`` a transform in zerofn's calling convention.

    The result takes the step positionally and options after it; called
    without a step it returns a decorator; a step that is not a
    :class:`Step` raises a TypeError naming the transform.

    Example:
        >>> import torch, zerofn as zf
        >>> from zerofn.step import transform
        >>> @transform
        ... def slower(step, /, *, factor=2):
        ...     return step.replace(accumulate_steps=step.accumulate_steps * factor)
        >>> base = zf.train_step(lambda p, b: p["w"].sum(), zf.optim.sgd(0.1))
        >>> slower(base).accumulate_steps, slower(factor=3)(base).accumulate_steps
        (2, 3)
    """
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(step: Step | None = None, /, *args: Any, **options: Any) -> Any:
        if step is None:
            return lambda s: wrapper(s, *args, **options)
        if not isinstance(step, Step):
            raise TypeError(
                f"{name} expects a Step from zf.train_step, got {type(step).__name__}. "
                f"Build one first: {name}(zf.train_step(loss_fn, optimizer))."
            )
        return fn(step, *args, **options)

    return wrapper


def reapply(step: Step, name: str, have: Any, want: Any, what: str) -> bool:
    """Whether applying transform ``name`` again is a no-op; raises when it would change the step.

    A transform whose effect ``step`` already has (``have``, its settings as
    the step holds them; None when it has none) is applied again with
    ``want``: the same settings return True (the caller returns the step
    unchanged), different ones raise a ValueError naming both.
    """
    if have is None:
        return False
    if have == want:
        return True
    raise ValueError(
        f"{name}: {step.name} already {what}: {have!r}; applying {name} again with {want!r} would change it. "
        f"Apply {name} once (to change its settings, rebuild the step from zf.train_step)."
    )
