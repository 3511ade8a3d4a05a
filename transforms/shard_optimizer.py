"""``shard_optimizer`` (ZeRO stage 1): each rank holds and updates 1/N of the optimizer state.

Replaces the step's ``reduction`` part (see ``zerofn.step``) with a
:class:`ShardedReduction` (``shards_optimizer``):

- every bucket is padded to a multiple of N and split in N contiguous
  shards; rank r owns shard r of every bucket, and the storage gives the
  optimizer that shard, so its state (Adam's moments, momentum buffers) is
  1/N of the unsharded one;
- a bucket's gradient is reduce-scattered (not all-reduced) as soon as
  backward has filled it, so each rank receives only the reduced gradient
  of its shard;
- after the update the storage all-gathers the updated shards back into
  the full bucket buffers (its ``publish``).

Collectives per step: one reduce-scatter and one all-gather per bucket,
2 x parameter bytes in all, the same as DDP's all-reduce, plus two tiny
ones (batch-shape agreement; loss, gradient norm and finiteness).

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import shard_optimizer
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    >>> step.name, step.reduction.shards_optimizer, step.reduction.shards_grads
    ('shard_optimizer(train_step)', True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofn import collectives as C
from zerofn.reduction import Reduction, bucket_group
from zerofn.sharding import Claim
from zerofn.state import Bucket
from zerofn.step import Step, transform

__all__ = ["ShardedReduction", "shard_optimizer"]


@dataclass(frozen=True)
class ShardedReduction(Reduction):
    """Buckets reduce-scattered over N shards: rank r receives the summed gradient of shard r.

    Without ``grads`` (ZeRO-1) it reduces once per update; with ``grads``
    (ZeRO-2, set by ``shard_grads``) gradients are sharded for the whole
    step: every micro-step reduce-scatters and the state carries only this
    rank's reduced partition between micro-steps.
    """

    name: str | None = "shard_optimizer"
    grads: bool = False

    @property
    def shards_optimizer(self) -> bool:
        return True

    @property
    def shards_grads(self) -> bool:
        return self.grads

    def shards(self, world: int) -> int:
        return world

    @property
    def replicated(self) -> bool:
        return False

    @property
    def every_micro(self) -> bool:
        return self.grads

    def reduce(self, grad: torch.Tensor, bucket: Bucket, rank: int, out: torch.Tensor | None) -> C.Handle:
        if out is None and bucket.shards == 1:
            # One shard (world size 1): the bucket is its own partition; no copy, as a single process does.
            return C.all_reduce(grad, "sum", async_op=True, group=bucket_group(bucket))
        if out is None:
            out = torch.empty(bucket.shard_numel, dtype=grad.dtype, device=grad.device)
        return C.reduce_scatter(out, grad, "sum", async_op=True, group=bucket_group(bucket))


@transform
def shard_optimizer(step: Step, /) -> Step:
    """Partition the optimizer state over the ranks (ZeRO stage 1).

    Args:
        step: a Step from ``zf.train_step`` (possibly already transformed).
            Called without it, returns a decorator.

    Returns:
        The rewritten Step. Applied to a step that already shards its
        optimizer state (this transform, or ``shard_grads`` /
        ``shard_params``, which imply it) it returns that step unchanged.

    Raises:
        TypeError: ``step`` is not a Step.
    """
    if step.reduction.shards_optimizer:
        return step
    # the three ZeRO stages shard over the data-parallel axis, the step's group: one claim for all three
    return step.claim(Claim("dp_shard", "zero")).replace(reduction=ShardedReduction())
