"""The optimizer's view of a step's buckets (:class:`~zerofn.optim.view.ParamView` made from a layout),
and what each update tells it (:class:`~zerofn.optim.view.StepInfo`).

A step holds trainable parameters in flat buckets (``zerofn.state.Layout``) and hands its optimizer one
tensor per bucket, whole or this rank's shard: :func:`param_view` says which parameters each holds, for
``bind``; :func:`names_view` is the view before any bucket exists, for the optimizer's labels. Each
update then tells the optimizer which parameters got no gradient and how many updates each received
(:func:`step_info`), and advances those counts (:func:`advance_steps`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from zerofn import counters, keys
from zerofn.optim.view import LeafView, ParamView, Piece, StepInfo
from zerofn.reduction import bucket_rank

if TYPE_CHECKING:
    from zerofn.state import Layout

__all__ = ["advance_steps", "names_view", "param_view", "step_info"]


def names_view(treedef: Any, named: dict, trainable: Any) -> ParamView:
    """The parameters as the optimizer's labels see them: names, full shapes and dtypes (no leaves yet), and
    which of them it updates."""
    shapes = tuple(tuple(t.shape) for t in named.values())
    dtypes = tuple(t.dtype for t in named.values())
    return ParamView({}, treedef, tuple(named), shapes, dtypes, frozenset(trainable))


def param_view(layout: Layout, rank: int, treedef: Any) -> ParamView:
    """What each bucket this rank's optimizer updates holds: the whole bucket, or its shard."""
    leaves = {}
    for i, b in enumerate(layout.buckets):
        lo, hi = b.shard_range(bucket_rank(b, rank)) if b.shards > 1 else (0, b.padded)
        pieces = []
        for s in b.slots:
            a, z = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < z:
                pieces.append(Piece(s.name, s.shape, a - s.offset, a - lo, z - a))
        leaves[keys.bucket(i)] = LeafView(tuple(pieces), hi - lo, b.shards > 1)
    shapes = {s.name: s.shape for b in layout.buckets for s in b.slots}
    dtypes = {s.name: b.dtype for b in layout.buckets for s in b.slots}
    for b in layout.frozen_buckets:
        for s in b.slots:
            shapes.setdefault(s.name, s.shape)
            dtypes.setdefault(s.name, b.dtype)
    names = layout.names
    return ParamView(
        leaves,
        treedef,
        names,
        tuple(shapes.get(n, ()) for n in names),
        tuple(dtypes.get(n, torch.float32) for n in names),
        frozenset(layout.trainable_names),
    )


def step_info(count: torch.Tensor, param_steps: torch.Tensor, names: tuple, missing: frozenset) -> StepInfo:
    """What the optimizer is told about the parameters (``names``, in ``param_steps``' order) on this update:
    which got no gradient on any rank, and how many updates each received (host counters: no read, unless
    an update decided on the device since)."""
    total = counters.value(count)
    steps = counters.values(param_steps)
    lo, hi = (min(steps), max(steps)) if steps else (total, total)
    per = None if lo == hi else dict(zip(names, steps))
    return StepInfo(missing, per, lo if lo == hi else total)


def advance_steps(steps: torch.Tensor, names: tuple, info: StepInfo) -> torch.Tensor:
    """Each updated parameter's count (``names``, in ``steps``' order) plus one (not those that got no
    gradient)."""
    old, dev = counters.values(steps), steps.device
    if not info.missing:
        return counters.new_like((v + 1 for v in old), device=dev)
    return counters.new_like((v + (n not in info.missing) for v, n in zip(old, names)), device=dev)
