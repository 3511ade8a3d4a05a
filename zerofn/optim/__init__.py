"""Optax-style gradient transformations over pytrees of torch tensors.

A :class:`GradientTransformation` is a pair of functions, ``init(params) ->
state`` and ``update(updates, state, params=None, **extra) -> (updates,
state)``. Stateful pieces keep their own ``<Name>State`` NamedTuple; named
optimizers (:func:`sgd`, :func:`adam`, :func:`adamw`) only :func:`chain`
primitives. All math is multi-tensor (``torch._foreach_*``), one call per
group of leaves that share a device and dtype.

**update donates updates and state; clone them first to keep them.** Like
buffer donation in JAX, ``update`` works in place: the returned updates may be
the very tensors passed in (overwritten), and the returned state's leaves are
the same tensor objects as the input state's, updated in place. No new
optimizer-state-sized tensors are allocated per step beyond what torch.optim's
foreach implementations allocate (Adam's denominator). :func:`apply_updates`
adds updates to params in place.

Step counts are int64 0-dim tensors on the parameters' device that carry their
value on the host (``zerofn.counters``), so reading one (for bias correction or
a schedule) never waits on the device. An update given ``found_inf=`` (a 0-dim
float tensor on the device, 1: skip) by a step that decided on the device
leaves everything as it was where it is set (``GradientTransformation.masks``):
:func:`adam` and :func:`adamw` skip in torch's fused kernel, :func:`sgd` keeps its
momentum by a select; an optimizer that does not declare ``masks`` (LAMB, Muon)
has the decision read in :func:`update_params`.

Extra keyword arguments to ``update`` are passed by :func:`chain` to every
member; each transform ignores those it does not know.
:func:`clip_by_global_norm` reads ``grad_norm``: the global norm computed by
the caller across ranks, for when ``updates`` is only this rank's shard; an
update that starts before the norm is known gets a :class:`PendingNorm`.

Example:
    >>> import torch
    >>> from zerofn import optim
    >>> params = {"w": torch.ones(3), "b": torch.zeros(())}
    >>> opt = optim.adamw(1e-3, weight_decay=0.0)
    >>> state = opt.init(params)
    >>> grads = {"w": torch.ones(3), "b": torch.ones(())}
    >>> updates, state = opt.update(grads, state, params)  # grads now overwritten
    >>> params = optim.apply_updates(params, updates)
    >>> round(params["w"][0].item(), 6), int(state[0].count)
    (0.999, 1)
"""

from zerofn.optim.alias import adam, adamw, sgd
from zerofn.optim.base import (
    AddDecayedWeightsState,
    ClipByGlobalNormState,
    EmptyState,
    GradientTransformation,
    PendingNorm,
    PendingUpdate,
    ScaleByAdamState,
    ScaleByScheduleState,
    ScaleState,
    Schedule,
    TraceState,
    apply_updates,
    bind,
    chain,
    in_place,
    labels,
    update_params,
)
from zerofn.optim.groups import MaskedState, MultiTransformState, decay_mask, masked, multi_transform
from zerofn.optim.lamb import ScaleByTrustRatioState, lamb, scale_by_trust_ratio
from zerofn.optim.muon import MuonState, muon
from zerofn.optim.probe import StateProbe, probe_state
from zerofn.optim.schedules import (
    constant_schedule,
    cosine_decay_schedule,
    deepspeed_warmup_cosine_lr,
    deepspeed_warmup_decay_lr,
    deepspeed_warmup_lr,
    linear_schedule,
    warmup_cosine_decay_schedule,
)
from zerofn.optim.transforms import (
    add_decayed_weights,
    clip_by_global_norm,
    decay_weights,
    global_norm,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
)
from zerofn.optim.view import LeafView, ParamView, Piece, StepInfo

__all__ = [
    "AddDecayedWeightsState",
    "ClipByGlobalNormState",
    "EmptyState",
    "GradientTransformation",
    "LeafView",
    "MaskedState",
    "MultiTransformState",
    "MuonState",
    "ParamView",
    "Piece",
    "StepInfo",
    "PendingNorm",
    "PendingUpdate",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "ScaleByTrustRatioState",
    "ScaleState",
    "Schedule",
    "StateProbe",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "bind",
    "decay_mask",
    "labels",
    "lamb",
    "masked",
    "multi_transform",
    "muon",
    "in_place",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "decay_weights",
    "deepspeed_warmup_cosine_lr",
    "deepspeed_warmup_decay_lr",
    "deepspeed_warmup_lr",
    "global_norm",
    "linear_schedule",
    "probe_state",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "scale_by_trust_ratio",
    "sgd",
    "trace",
    "update_params",
    "warmup_cosine_decay_schedule",
]
