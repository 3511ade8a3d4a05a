"""``shard_grads`` (ZeRO stage 2): no rank ever holds the whole gradient.

Implies ``shard_optimizer``: applying both, in either order, is the same
step. It replaces the step's ``reduction`` part with a stage-2
:class:`~zerofn.transforms.shard_optimizer.ShardedReduction`: with
``accumulate_steps=K`` every micro-step reduce-scatters its buckets during
backward and adds the result into this rank's gradient partition, which
the state carries between micro-steps (1/N of the gradient instead of stage
1's full local sums).

During backward a parameter's gradient is copied into its bucket and freed
as soon as autograd hands it over; a completed bucket is reduce-scattered
asynchronously while backward goes on, and its full buffer is dropped when
the reduction lands. Full-size gradient memory is bounded by two buckets
(one in flight, one filling) plus the largest single parameter's gradient;
a parameter larger than ``bucket_bytes`` is a bucket of its own.

Collectives per step: one reduce-scatter per bucket per micro-step and one
all-gather per bucket per update: 2 x parameter bytes per step without
accumulation, as DDP's all-reduce; plus two tiny ones (batch-shape
agreement; loss, gradient norm and finiteness).

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import shard_grads, shard_optimizer
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = shard_grads(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    >>> step.name, shard_optimizer(step) is step
    ('shard_grads(train_step)', True)
"""

from __future__ import annotations

from zerofn.transforms.shard_optimizer import quantized_reduction, replicated, shard_optimizer

from zerofn.step import Step, reapply, transform

__all__ = ["shard_grads"]


@transform
def shard_grads(
    step: Step, /, *, bucket_bytes: int | None = None, replicate: int | None = None, reduce_dtype: str | None = None
) -> Step:
    """Shard gradients as backward produces them (ZeRO stage 2).

    Args:
        step: a Step from ``zf.train_step`` (possibly already transformed).
            Called without it, returns a decorator.
        bucket_bytes: gradient bucket size; default: the step's
            (``zf.train_step(..., bucket_bytes=...)``, 25 MiB).
        replicate: hybrid sharding, as ``shard_optimizer(..., replicate=)``: gradients and optimizer state
            sharded within each of ``replicate`` groups of consecutive ranks, each shard's gradient summed
            across the groups.
        reduce_dtype: ``"int8"``: ZeRO++'s qgZ. Each floating bucket's gradient is block-quantized
            (int8, one fp32 scale per 2048 elements) and reduce-scattered by an all-to-all, each rank
            summing the pieces it receives in fp32: 0.25 x the bytes of an fp32 reduce-scatter (0.5 x
            bf16). Each element of the reduced gradient is within the sum over ranks of absmax(that
            rank's block) / 254 of the exact sum; the running partition carried between micro-steps is
            added after, unquantized. Default None: the gradients' own dtype.

    Returns:
        The rewritten Step, named ``shard_grads(...)`` whether or not
        ``shard_optimizer`` was applied before or after it. Applied to a
        step that already shards gradients it returns that step unchanged
        (with another ``bucket_bytes`` it raises).

    Raises:
        TypeError: ``step`` is not a Step.
        ValueError: ``bucket_bytes`` is not a positive int, or differs from
            the bucket size of a step that already shards gradients.
    """
    if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
        raise ValueError(f"shard_grads: bucket_bytes must be a positive int, got {bucket_bytes!r}")
    want = step.bucket_bytes if bucket_bytes is None else bucket_bytes
    have = step.bucket_bytes if step.reduction.shards_grads else None
    if reapply(step, "shard_grads", have, want, "shards gradients with bucket_bytes"):
        return quantized_reduction(replicated(step, replicate, "shard_grads"), reduce_dtype, "shard_grads")
    sharded = quantized_reduction(
        replicated(shard_optimizer(step), replicate, "shard_grads"), reduce_dtype, "shard_grads"
    )
    return sharded.replace(reduction=sharded.reduction.replace(grads=True, name="shard_grads"), bucket_bytes=want)
