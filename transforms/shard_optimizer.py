"""``shard_optimizer`` (ZeRO stage 1): each rank holds and updates 1/N of the optimizer state.

Phases rewritten (see ``zerofn.step.Phases``):

- ``shards``: every bucket is padded to a multiple of N and split in N
  contiguous shards; rank r owns shard r of every bucket.
- ``opt_view``: the optimizer sees this rank's shard of each bucket, so its
  state (Adam's moments, momentum buffers) is 1/N of the unsharded one.
- ``reduce``: a bucket's gradient is reduce-scattered (not all-reduced) as
  soon as backward has filled it, so each rank receives only the reduced
  gradient of its shard.
- ``publish``: after the update each rank all-gathers the updated shards
  back into the full bucket buffers.

Collectives per step: one reduce-scatter and one all-gather per bucket,
2 x parameter bytes in all, the same as DDP's all-reduce, plus two tiny
ones (batch-shape agreement; loss, gradient norm and finiteness).

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import shard_optimizer
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    >>> step.name
    'shard_optimizer(train_step)'
"""

from __future__ import annotations

import functools

import torch

from zerofn import collectives as C
from zerofn.state import Bucket, Layout
from zerofn.step import Step

__all__ = ["shard_optimizer"]

NAME = "shard_optimizer"


def _opt_view(flat: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
    lo, hi = bucket.shard_range(rank)
    return flat[lo:hi]


def _reduce(grad: torch.Tensor, bucket: Bucket, rank: int, out: torch.Tensor | None) -> C.Handle:
    if out is None:
        out = torch.empty(bucket.shard_numel, dtype=grad.dtype, device=grad.device)
    return C.reduce_scatter(out, grad, "sum", async_op=True)


def _publish(flats: tuple, layout: Layout, rank: int) -> None:
    handles = []
    for flat, bucket in zip(flats, layout.buckets):
        lo, hi = bucket.shard_range(rank)
        # In place: the input is this rank's slice of the output, so no temporary.
        handles.append(C.all_gather(flat, flat[lo:hi], async_op=True))
    for h in handles:
        h.wait()


def _shards(world: int) -> int:
    return world


def shard_optimizer(step: Step | None = None, /) -> Step:
    """Partition the optimizer state over the ranks (ZeRO stage 1).

    Args:
        step: a Step from ``zf.train_step`` (possibly already transformed).
            Called without it, returns a decorator.

    Returns:
        The rewritten Step. Applying it to a step that already shards its
        optimizer (this transform, or ``shard_grads`` / ``shard_params``
        which imply it) returns that step unchanged.

    Raises:
        TypeError: ``step`` is not a Step.
    """
    if step is None:
        return functools.partial(shard_optimizer)
    if not isinstance(step, Step):
        raise TypeError(
            f"shard_optimizer expects a Step from zf.train_step, got {type(step).__name__}. "
            "Build one first: shard_optimizer(zf.train_step(loss_fn, optimizer))."
        )
    if step.phases.shards(2) > 1:  # already sharded by this or an implying transform
        return step
    # Only the phases this transform owns change; others (amp's, say) stay as they are.
    phases = step.phases._replace(
        shards=_shards, opt_view=_opt_view, reduce=_reduce, grads_replicated=False, publish=_publish
    )
    return step.replace(transforms=step.transforms + (NAME,), phases=phases)
