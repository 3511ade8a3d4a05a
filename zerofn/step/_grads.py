"""Averaging over the ranks: the gradients (phase 4 of a step, "unscale") and the model's float buffers.

The reduction sums (or averages, ``predivide``) each bucket's gradient over the ranks; what is left to
divide, with the micro-steps and the loss scale, is one factor per bucket, applied in one fused
multiply (:func:`unscale`). A ``zf.Mean`` divides by its global count instead (:func:`mean_factor`).
The model's float buffers (BatchNorm's running statistics) are averaged too: what each rank's forward
changed, one all-reduce per dtype (:func:`average_buffers`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerofn import collectives as C
from zerofn.optim.base import foreach_groups  # the device/dtype grouping foreach kernels need
from zerofn.precision import Precision

__all__ = ["average_buffers", "divide", "float_buffers", "mean_factor", "unscale"]


def unscale(precision: Precision, grads: dict, factors: list | None, norm_scales: list | None = None):
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
    elif any(f != 1.0 for f in factors):  # one rank, one micro-step, no loss scale: x * 1.0 is x, bit for bit
        torch._foreach_mul_(list(grads.values()), factors)
    return grads, torch._foreach_norm(list(grads.values()))


def divide(predivide: float, n: int, scale: float | torch.Tensor) -> float | torch.Tensor:
    """``predivide / (n * scale)``, in float64 as the host computes it (a 0-dim tensor for a scale on the
    device)."""
    return predivide / (n * (scale.double() if isinstance(scale, torch.Tensor) else scale))


def mean_factor(predivide: float, count: Any, scale: float) -> Any:
    """What turns a reduced sum of a zf.Mean's totals (divided by ``predivide`` before the reduction, times
    the loss scale) into the gradient of the mean over every item: nan when no rank counted any (the
    step is then skipped, as for any non-finite loss). ``count``: a float, or a tensor on the device."""
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, predivide / (count * scale), math.nan)
    return predivide / (count * scale) if count > 0 else math.nan


def float_buffers(buffers: dict, copy: bool = False) -> list[torch.Tensor]:
    """The float buffers (copies of them, before a forward), when there are ranks to agree with."""
    if C.world_size() == 1:
        return []
    return [b.clone() if copy else b for b in buffers.values() if b.is_floating_point()]


def average_buffers(after: list[torch.Tensor], before: list[torch.Tensor]) -> None:
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
