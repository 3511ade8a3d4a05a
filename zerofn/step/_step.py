"""The :class:`Step` value: what it is made of (composition), building it (:func:`train_step`), writing
transforms of it (:func:`transform`, :func:`reapply`), and its views of a state (``full_params``,
``state_dict``, ``apply``, ``check_state``).

A Step holds no cache: what a run derives once from it (the bound optimizer, the model ``loss_fn``
calls, the batch check) lives in the run's states (``zerofn.step._derived``). ``init`` and the call
live in ``zerofn.step._init`` and ``zerofn.step._call``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerofn import alloc, counters, sharding
from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn.closure import find_functional
from zerofn.extension import Extension
from zerofn.functional import Functional
from zerofn.mesh import AXES, DATA_AXES
from zerofn.optim.bucket_view import param_view
from zerofn.precision import Precision
from zerofn.reduction import Reduction
from zerofn.state import Layout, StateSpec, TrainState
from zerofn.step._call import call
from zerofn.step._derived import run_model
from zerofn.step._init import device_of, init_state, opt_params
from zerofn.storage import Storage

__all__ = ["DEFAULT_BUCKET_BYTES", "Step", "StepTransform", "reapply", "train_step", "transform"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb


def in_group(method: Callable) -> Callable:
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
    """A training step ``step(state, batch) -> (state, metrics)``; see :mod:`zerofn.step`.

    Build one with :func:`train_step` and rewrite it with the transforms in
    ``zerofn.transforms``. A value: its fields say everything it does, and it
    keeps nothing from one call to the next (a run's states do).
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
    mesh: Any = None  # a zerofn.mesh.Mesh once a parallelism lays the ranks out on axes; ``group`` its data axes
    claims: tuple[sharding.Claim, ...] = ()  # the axes of ``mesh`` the transforms work on, in order

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

    def claim(self, claim: sharding.Claim, mesh: Any = None) -> Step:
        """A copy whose transforms include ``claim`` on one of the mesh's axes (replacing the claimant's
        earlier claim). With ``mesh`` (a :class:`zerofn.mesh.Mesh`), the copy runs on it, on its
        data-parallel group; without, on the step's mesh and group as they are (the ZeRO stages claim the
        data-parallel ``dp_shard`` axis, which is the step's group).

        Raises:
            ValueError: another transform claimed the axis already, or the step runs on another mesh.
        """
        other = next((c for c in self.claims if c.axis == claim.axis and c.by != claim.by), None)
        if other is not None:
            raise ValueError(
                f"{claim.by}: the mesh axis {claim.axis!r} is {other.by}'s already; each axis is one parallelism's. "
                "Apply one of them, or give each its own axis."
            )
        if mesh is not None and self.mesh is not None and mesh is not self.mesh:
            _check_join(self, claim, mesh)
        if (
            mesh is not None
            and self.group is not None
            and self.mesh is None
            and self.group is not step_group(mesh, (claim,))
        ):
            raise ValueError(
                f"{claim.by}: this step already runs on a group of its own (train_step(..., group=)); {claim.by} "
                "runs it on its mesh's data-parallel group. Leave group= out."
            )
        claims = tuple(c for c in self.claims if c.by != claim.by) + (claim,)
        if mesh is None:
            return self.replace(claims=claims)
        return self.replace(mesh=mesh, claims=claims, group=step_group(mesh, claims))

    def groups(self) -> tuple:
        """The groups beside the step's own that its collectives run on: its claimed axes' and those the
        claims name (their traffic counts in ``metrics["comm_bytes"]``)."""
        found: list = []
        for c in self.claims:
            more = c.groups() if c.groups is not None else ()
            if c.feeds and self.mesh is not None and c.axis in self.mesh.axes:
                more = (*more, C.without(c.axis, group=self.group))  # the group its cut parameters reduce on
            axis = self.mesh.group(c.axis) if self.mesh is not None and c.axis in self.mesh.axes else None
            found += [axis, *more]
        if self.mesh is not None and self.mesh.size("dp_replicate") > 1:
            # nodes: hybrid sharding's shards within a replica summed across the replicas, hpZ's gathers
            # within a node, qgZ's two hops
            found += [C.without("dp_replicate", group=self.group), self.mesh.group("dp_replicate")]
        out: dict[int, Any] = {}
        for g in found:
            if g is not None and g is not self.group:
                out.setdefault(id(g), g)
        return tuple(out.values())

    @property
    def effective_optimizer(self) -> O.GradientTransformation:
        """The user's optimizer inside the precision's wrapper, then the extensions' in order.

        The precision wraps first whatever order the transforms were applied
        in: amp's fp32 master weights are optimizer state, so a wrapper that
        places the optimizer state (offload) must see them. Built anew on each
        access (a step holds no cache; the one a run updates with is bound to
        its buckets, see :meth:`bound_optimizer`).
        """
        return self._wrapped(self.optimizer)

    def _wrapped(self, opt: O.GradientTransformation) -> O.GradientTransformation:
        opt = self.precision.wrap_optimizer(opt)
        for e in self.extensions:
            if e.wrap_optimizer is not None:
                opt = e.wrap_optimizer(opt)
        return opt

    def model(self) -> Functional:
        """The ``zf.functional`` apply that ``loss_fn`` calls (found in its closure)."""
        return find_functional(self.loss_fn)

    # ------------------------------------------------------------ init and views

    @in_group
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
            return init_state(self, params, keep_module, structure_only)

    def bound_optimizer(self, layout: Layout, rank: int, treedef: Any) -> O.GradientTransformation:
        """The effective optimizer bound to what each bucket this rank updates holds (its
        :class:`~zerofn.optim.ParamView`; ``treedef``: the params tree's structure), built anew: a run
        builds it once, at ``init``, and keeps it in its states."""
        view = param_view(layout, rank, treedef)
        # The user's optimizer is bound before any wrapper sees it, so that a wrapper which does not
        # forward bind (one of a user's own) still wraps the per-parameter optimizer; the wrappers that
        # do (amp's masters, offload) are bound again, which rebinds their inner one to the same view.
        return O.bind(self._wrapped(O.bind(self.optimizer, view)), view)

    def _opt_params(self, flats: tuple, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
        return opt_params(self, flats, layout, rank)

    @in_group
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
        they compute beside fp32 inputs as the model did. Under
        ``pipeline_parallel``, whose ranks hold their stages' parameters only
        (placed ``zerofn.sharding.Stage`` on ``pp``), each stage's parameters
        are sent from the ranks that hold them: every rank gets the whole
        model, a dict of every parameter in the model's order.

        ``master=True`` gives the weights the optimizer updates, in their
        own dtype (amp's fp32 masters; with ``amp(..., master_dtype=bf16)``
        the held bf16 parameters; frozen parameters, which have none, as
        held, in the masters' dtype). ``local=True`` gives the parameters
        this rank's model computes with, as the step holds them: under
        ``tensor_parallel`` its own slices of the split parameters (cut as
        ``state.spec.placements`` say), not gathered over the tensor-parallel
        group; under ``amp`` in its dtype (bf16; the norms it keeps in fp32
        in fp32); sharded parameters still gathered whole over the
        data-parallel ranks; a pipeline's rank, its own stages' parameters only.
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
        split = not local and bool(spec.placements)
        if split:  # asked first: a claim raises where its pieces cannot be made whole
            for c in self.claims:
                if c.whole is not None:
                    c.whole()
        dtypes = dict(zip(spec.layout.names, spec.dtypes)) if spec.dtypes and not (master or local) else {}
        # The masters are the most precise values: read where the held parameters are not in the model's dtype.
        cast = any(dtypes.get(s.name, b.dtype) != b.dtype for b in spec.layout.buckets for s in b.slots)
        masters = self.precision.masters(state.opt_state) if master or cast else None
        leaves, treedef = T.tree_flatten(
            self.storage.full_params(state, functools.partial(run_model, self, state.run), masters)
        )
        # ``leaves`` holds the only reference to each tensor: one replaced (cast, joined) is freed at once;
        # so are the masters read from files
        del masters
        for i, (name, t) in enumerate(zip(spec.layout.names, leaves)):
            want = dtypes.get(name, t.dtype)
            if t.is_floating_point() and want != t.dtype:
                leaves[i] = t.to(want)
        if split:
            _join_pieces(self.mesh, spec, leaves)
        trainable = {s.name for b in spec.layout.buckets for s in b.slots}
        staged = _staged_axes(spec) if split else []
        if staged:  # parameters other ranks hold whole (a pipeline's other stages): sent from there
            named = _from_stages(self.mesh, staged, dict(zip(spec.layout.names, leaves)), trainable)
            del leaves
            if requires_grad:
                for name in trainable:
                    named[name].requires_grad_(True)
            return {n: named[n] for n in _model_order(spec, named)}
        if requires_grad:  # trainable as they were, for init, which reads trainability from requires_grad
            for name, t in zip(spec.layout.names, leaves):
                if name in trainable:
                    t.requires_grad_(True)
        return T.tree_unflatten(treedef, leaves)

    @in_group
    def state_dict(self, state: TrainState, *, master: bool = False, local: bool = False) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` from the state: every parameter name (tied ones under each of
        their names) and every persistent buffer, for ``model.load_state_dict(..., strict=True)``.

        Collective, like :meth:`full_params`; ``master`` and ``local`` as there (whole parameters in the
        model's dtypes by default, which a freshly built model loads, every stage's under a pipeline;
        ``local=True``: this rank's slices under ``tensor_parallel``, which its split model loads, and a
        pipeline's rank the entries of its own stages' parameters, with every buffer).
        """
        full = self.full_params(state, master=master, local=local)
        model = run_model(self, state.run)
        absent = {held for _, kind, held in model.state_dict_names() if kind == "param" and held not in full}
        if not absent:
            return model.state_dict_of(full, state.buffers)
        # local=True on a rank that holds some parameters only (a pipeline's stage): its entries alone
        out = model.state_dict_of(dict.fromkeys(absent) | dict(full), state.buffers)
        return {n: out[n] for n, kind, held in model.state_dict_names() if kind != "param" or held not in absent}

    @in_group
    def apply(self, state: TrainState, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on the current parameters, without gradients (evaluation, generation).

        Runs the model that ``loss_fn`` calls (through ``zf.functional``) on
        the state's parameters as the storage holds them: under
        ``shard_params`` it gathers one unit at a time, so it runs models
        larger than one rank. Under ``pipeline_parallel`` every rank gathers
        the whole model (``full_params``) and runs it. Collective: call it on
        every rank, in the same order as the other collective calls.
        """
        self.check_state(state)
        model = functools.partial(run_model, self, state.run)
        with contextlib.ExitStack() as stack:
            if state.buffers:
                stack.callback(model().bind_buffers(state.buffers))
            stack.enter_context(self.precision.autocast(device_of(state.spec.layout)))
            if self.mesh is not None and self.mesh.size("pp") > 1:
                # a pipeline's stages each hold a part of the model: the whole model, gathered on every rank
                # (full_params, collective), runs the forward there
                whole = self.full_params(state)
                with torch.no_grad():
                    return model()(whole, *args, **kwargs)
            return self.storage.forward(state, model, args, kwargs)

    @in_group
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

    @in_group
    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One micro-step: ``(new_state, metrics)``; the input state is donated (see ``train_step``).

        Collective: every rank calls it once per micro-batch, in the same
        order, with micro-batches of the same shapes. A rank that does not
        call it makes the others fail with
        ``zerofn.collectives.CollectiveTimeoutError`` after
        ``ZEROFN_TIMEOUT_S`` (default 600 s).
        """
        self.check_state(state)
        groups = (C.current_group(), *self.groups())
        with contextlib.ExitStack() as stack:
            counted = [stack.enter_context(C.counting(g)) if g is not None else C.Counter() for g in groups]
            if not self.donate:  # the copy reads state.params, which waits for a publish in flight
                kept = state.inflight.fault  # a check not read yet goes on with the copy
                state = T.tree_map(lambda t: counters.clone(t) if isinstance(t, torch.Tensor) else t, state)
                state.inflight.fault = kept
            new_state, metrics = call(self, state, batch)
        metrics["comm_bytes"] = sum(c.bytes for c in counted)
        by_axis: dict[str, int] = {}
        for g, c in zip(groups, counted):
            label = (self.mesh.axes_of(g) if self.mesh is not None else None) or "dp_shard"
            by_axis[label] = by_axis.get(label, 0) + c.bytes
        metrics["comm_bytes_by_axis"] = by_axis
        if self.donate:
            state._donate()
        return new_state, metrics


# ---------------------------------------------------------------- a split model's parameters made whole


def step_group(mesh: Any, claims: tuple) -> Any:
    """The group a step on ``mesh`` runs on: the data-parallel axes', with the axes of claims that reduce
    over theirs (:attr:`zerofn.sharding.Claim.reduces`: context parallelism's ``cp``) or feed micro-batches
    of their own (:attr:`zerofn.sharding.Claim.feeds`: expert parallelism's ``ep``). For each axis of the
    latter, the group's ranks that share this rank's coordinate on it are made too, and recorded as
    ``zerofn.collectives.without(axis)`` of the group; on a mesh whose ``dp_replicate`` is above 1 (hybrid
    sharding's replicas), so are the ranks of one replica (``without("dp_replicate")``, and with each
    feeding axis, ``without((axis, "dp_replicate"))``) and the line across the replicas
    (``zerofn.collectives.along("dp_replicate")``)."""
    reducing = [c.axis for c in claims if (c.reduces or c.feeds) and c.axis in mesh.axes]
    axes = [a for a in (*DATA_AXES, *reducing) if a in mesh.axes]
    group = mesh.group_over(*axes) if reducing else mesh.data_group
    if group is None:
        return group
    feeding = [c.axis for c in claims if c.feeds and c.axis in mesh.axes]
    for axis in feeding:
        C.set_without(group, axis, mesh.group_over(*(a for a in axes if a != axis)))
    if mesh.size("dp_replicate") > 1:
        rest = [a for a in axes if a != "dp_replicate"]
        C.set_without(group, "dp_replicate", mesh.group_over(*rest))
        C.set_along(group, "dp_replicate", mesh.group("dp_replicate"))
        for axis in feeding:
            C.set_without(group, (axis, "dp_replicate"), mesh.group_over(*(a for a in rest if a != axis)))
    return group


def _check_join(step: Step, claim: sharding.Claim, mesh: Any) -> None:
    """Raises unless ``mesh`` keeps each axis the step's other parallelisms claimed on the ranks it had (they
    hold its groups): an axis joins from the inside out, each new one outside those already laid out."""
    for c in step.claims:
        if c.by == claim.by or c.axis in DATA_AXES:
            continue
        was, now = step.mesh.ranks(c.axis), (mesh.ranks(c.axis) if c.axis in mesh.axes else None)
        if was != now:
            raise ValueError(
                f"{claim.by}: the step's mesh {step.mesh!r} would become {mesh!r}, which lays {c.by}'s axis "
                f"{c.axis!r} over other ranks (this rank's group {was} -> {now}); {c.by} holds the groups it "
                f"was applied with. Apply {claim.by} before {c.by}: axes join from the innermost out "
                f"({', '.join(reversed(AXES))})."
            )


def _join_pieces(mesh: Any, spec: StateSpec, leaves: list) -> None:
    """Replace, in place in ``leaves`` (``layout.names``' order), each parameter a parallelism cuts
    (``spec.placements``) by the whole one: gathered over each cutting axis's group, the innermost first
    (the inverse of the cuts, outermost first), one parameter at a time."""
    cut = dict(spec.placements)
    sizes = tuple(size for _, size, _ in spec.mesh)
    # Every gather lands in one buffer, the size of the largest whole parameter: gloo may hold a finished
    # gather's output for a while after wait() returned, so a buffer per parameter could outlive its join and
    # stack up beside the next ones (seen: 2.25 of the largest parameter above the model, where one is the bound)
    scratch: torch.Tensor | None = None
    wholes = [
        math.prod(sharding.whole_shape(t.shape, cut[n], sizes)) * t.element_size()
        for n, t in zip(spec.layout.names, leaves)
        if n in cut
    ]
    # in the layout's order: a bucket's parameters are views of one flat tensor, freed once all are replaced
    for i, name in enumerate(spec.layout.names):
        if name not in cut:
            continue
        placements = cut[name]
        t = leaves[i].detach()
        for (axis, size, _), p in reversed(list(zip(spec.mesh, placements))):
            n = sharding.piece(p, size, 0)[1]
            if n == 1:
                continue
            if scratch is None or scratch.device != t.device:
                scratch = torch.empty(max(wholes), dtype=torch.uint8, device=t.device)
            out = scratch[: size * t.numel() * t.element_size()].view(t.dtype).view(size, t.numel())
            C.all_gather(out.view(-1), t.contiguous().view(-1), group=mesh.group(axis))
            held = {(c,): out[c].view(t.shape) for c in range(size)}  # by coordinate on the axis
            t = sharding.join(held, (p,), (size,))
            if t.untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr():
                t = t.clone()  # the next gather writes over the buffer
            del out, held
        leaves[i] = t


def _staged_axes(spec: StateSpec) -> list[tuple[int, str, int]]:
    """(index, axis, size) of each axis of more than one rank on which some parameter is whole at one coordinate
    only (:class:`zerofn.sharding.Stage`: a pipeline's stages), innermost first."""
    found = []
    for k, (axis, size, _) in enumerate(spec.mesh):
        if size > 1 and any(isinstance(ps[k], sharding.Stage) for _, ps in spec.placements):
            found.append((k, axis, size))
    return found[::-1]


def _from_stages(mesh: Any, staged: list, named: dict, trainable: set) -> dict:
    """``named`` (this rank's whole parameters, by name) with every parameter the ranks at another coordinate
    of a staged axis hold, sent by the first rank of the axis's group that holds it to those that do not (what
    each rank holds told first: names, shapes, dtypes, trainability); ``trainable`` grows by the received
    trainable ones. Collective over each staged axis's group."""
    device = next((t.device for t in named.values()), torch.device("cpu"))
    for _, axis, size in staged:
        group, me = mesh.group(axis), mesh.coordinate(axis)
        mine = [(n, tuple(t.shape), t.dtype, n in trainable) for n, t in named.items()]
        every = C.gather_objects(mine, group=group)
        holders: dict[str, list[int]] = {}
        meta: dict[str, tuple] = {}
        for r, held in enumerate(every):
            for n, shape, dtype, trains in held:
                holders.setdefault(n, []).append(r)
                meta.setdefault(n, (shape, dtype, trains))
        handles, sent = [], []  # the tensors sent are kept until every send is done
        for n in sorted(holders):  # one order on every rank: each send meets its receive
            have = holders[n]
            if len(have) == size:
                continue
            if me == have[0]:
                sent.append(named[n].detach().contiguous())
                handles += [C.send(sent[-1], to, async_op=True, group=group) for to in range(size) if to not in have]
            elif me not in have:
                shape, dtype, trains = meta[n]
                named[n] = torch.empty(shape, dtype=dtype, device=device)
                handles.append(C.recv(named[n], have[0], async_op=True, group=group))
                if trains:
                    trainable.add(n)
        for h in handles:
            h.wait()
        del sent
    return named


def _model_order(spec: StateSpec, named: dict) -> list[str]:
    """The names of ``named`` in the model's order (its ``state_dict``'s, each parameter at its first name),
    those the model does not list after them, sorted."""
    first = [held for _, kind, held in spec.model if kind == "param" and held in named]
    order = list(dict.fromkeys(first))
    return order + sorted(set(named) - set(order))


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
        ``comm_bytes`` (this rank's collective traffic), ``comm_bytes_by_axis``
        (the same by the mesh axes each group spans: ``{"dp_shard": ...,
        "dp_replicate": ...}``, ``"dp_replicate x dp_shard"`` for a group
        over both; a step on no mesh: ``"dp_shard"``), ``skipped`` (a
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
