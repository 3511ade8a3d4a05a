"""``step.init(params)``: the state a run starts from.

The parameters are split into trainable and frozen ones, cast by the precision part, prepared by the
extensions (those that change the model's layers first), labelled by the optimizer, compared across
ranks and handed to the storage part, which lays them out in buckets; the optimizer, bound to what this
rank updates, builds its state. The run's cache
(:class:`~zerofn.state.RunCache`) starts here, with the bound optimizer in it. See ``Step.init``.
"""

from __future__ import annotations

from typing import Any

import torch

from zerofn import collectives as C
from zerofn import counters, keys, sharding
from zerofn import optim as O
from zerofn.functional import ADOPTED_HELP, owner_of
from zerofn.optim.bucket_view import names_view
from zerofn.state import Layout, RunCache, StateSpec, TrainState
from zerofn.step._checks import check_same_params
from zerofn.step._derived import run_model, run_optimizer
from zerofn.storage import split_params

__all__ = ["device_of", "init_state", "opt_params"]


def init_state(step: Any, params: Any, keep_module: bool, structure_only: bool) -> TrainState:
    """The body of ``step.init`` (see there), in the step's group."""
    for e in step.extensions:
        if e.check is not None:
            e.check(step)
    split = split_params(params, f"{step.name}.init")
    functional = owner_of(params)
    if functional is not None and functional.adopted:
        # Its parameters are placeholders now: materialising them afresh would silently
        # start from other numbers than the state that holds them.
        raise ValueError(ADOPTED_HELP.format(what=f"{step.name}.init(apply.params)"))
    owner = functional.owner if functional is not None else (lambda name: None)
    given = {k: v.dtype for k, v in split.named.items()}  # the model's dtypes, before the precision's cast
    named = {k: step.precision.cast(v, owner(k)) for k, v in split.named.items()}  # held (and run) so
    split = split._replace(named=named, trainable={k: named[k] for k in split.trainable})
    # the extensions that change what the model's layers are (their shapes) first, whatever the order of
    # application, so that the others' prepares see the layers as they will run
    for e in sorted(step.extensions, key=lambda e: not e.prepare_first):
        if e.prepare is not None:
            split = e.prepare(split, functional, f"{step.name}.init")
    apart = {}  # the parameters cut along an axis of the step's group (zerofn.sharding.Claim.feeds)
    for c in step.claims:
        if c.feeds and c.placements is not None and step.mesh is not None and c.axis in step.mesh.axes:
            n = step.reduction.shards(C.world_size(C.without(c.axis)))
            apart.update({name: (c.axis, n) for name in c.placements() if name in split.named})
    cut = {}  # the parameters a model-parallel axis outside the step's group cuts (tensor parallelism's)
    for c in step.claims:
        if c.placements is not None and not (c.feeds or c.reduces) and step.mesh is not None:
            if c.axis in step.mesh.axes and step.mesh.size(c.axis) > 1:
                for name, p in c.placements().items():
                    # consecutive ranks that hold the same piece (shared heads); a stage's parameters are whole
                    # where held (their gradient norm is summed over the pipeline's axis as a whole)
                    if name in split.named and not isinstance(p, sharding.Stage):
                        cut[name] = (c.axis, getattr(p, "share", step.mesh.size(c.axis)))
    split = split._replace(apart=apart, cut=cut, replicate=step.reduction.replicate)
    names = names_view(split.treedef, split.named, split.trainable)
    groups = O.labels(step.optimizer, names)  # its masks and groups, if any
    split = split._replace(labels={k: groups[k] for k in split.trainable} if groups else {})
    world, rank = C.world_size(), C.rank()
    if world > 1 and not structure_only:
        check_same_params({k: v for k, v in split.named.items() if k not in apart}, step.name)
        for axis in sorted({a for a, _ in apart.values()}):  # pieces that differ along the axis: alike across it
            with C.group_scope(C.without(axis)):
                check_same_params({k: v for k, v in split.named.items() if apart.get(k, ("",))[0] == axis}, step.name)
    run = RunCache()
    held = step.storage.init(
        split,
        shards=step.reduction.shards(world),
        bucket_bytes=step.bucket_bytes,
        model=lambda: functional or run_model(step, run),
    )
    opt_state = run_optimizer(step, run, held.layout, rank, split.treedef).init(
        opt_params(step, held.params, held.layout, rank)
    )
    extra = dict(held.extra)
    # The model's buffers are state too; the module keeps the same tensors (or, with
    # keep_module, its own), and every step binds the state's into the module.
    buffers = functional.buffers() if functional is not None else {}
    if keep_module:
        buffers = {k: v.clone() for k, v in buffers.items()}
    # The counts an update advances live where the update runs, so that the device can decide on it.
    counts_on = None if device_of(held.layout) in ("cpu", "meta") else device_of(held.layout)
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
        loss_scale=step.precision.new_loss_scale(counts_on),
        extra=extra,
        spec=StateSpec(
            step.name,
            world,
            held.layout,
            split.treedef,
            functional.state_dict_names() if functional else (),
            *_placements(step),
            tuple(given.get(k, v.dtype) for k, v in split.named.items()),  # what prepare made: as held
        ),
        run=run,
    )
    if functional is not None and not keep_module:
        device = torch.device(device_of(held.layout)).type
        late = any(e.updates_late(device) for e in step.extensions if e.updates_late is not None)
        step.storage.adopt(functional, state, share=step.donate, updates_late=late)
    return state


def opt_params(step: Any, flats: tuple, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """What the optimizer updates: one tensor per bucket, as the storage part gives it (the whole bucket,
    or this rank's shard)."""
    return {keys.bucket(i): step.storage.opt_view(f, b, rank) for i, (f, b) in enumerate(zip(flats, layout.buckets))}


def device_of(layout: Layout) -> str:
    """The device the layout's trainable buckets live on ("cpu" without any)."""
    return layout.buckets[0].device if layout.buckets else "cpu"


def _placements(step: Any) -> tuple[tuple, tuple]:
    """(the step's mesh as this rank sees it, each cut parameter's placements on its axes), for the spec. A
    claim that places parameters whole on some coordinates of its axis (``zerofn.sharding.Stage``: a
    pipeline's stages) names every parameter of the model, so the spec lists those this rank does not hold
    too, alike on every rank of the axis."""
    mesh = step.mesh
    if mesh is None:
        return (), ()
    axes = tuple(mesh.sizes)
    cuts: dict[str, list] = {}
    for c in step.claims:
        for name, p in (c.placements() if c.placements is not None else {}).items():
            cuts.setdefault(name, [sharding.Replicate()] * len(axes))[axes.index(c.axis)] = p
    return (
        tuple((a, mesh.size(a), mesh.coordinate(a)) for a in axes),
        tuple((name, tuple(ps)) for name, ps in sorted(cuts.items())),
    )
