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
from zerofn import mesh
from zerofn.reduction import Reduction, bucket_group
from zerofn.sharding import Claim
from zerofn.state import Bucket
from zerofn.step import Step, transform

__all__ = ["ShardedReduction", "int8", "quantized_reduction", "replicated", "shard_optimizer"]


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
    replicas: int = 1
    reduce_dtype: str | None = None  # "int8": qgZ, floating buckets reduce-scattered as int8 blocks

    @property
    def shards_optimizer(self) -> bool:
        return True

    @property
    def shards_grads(self) -> bool:
        return self.grads

    def shards(self, world: int) -> int:
        return world // self.replicas

    @property
    def replicate(self) -> str:
        return "dp_replicate" if self.replicas > 1 else ""

    @property
    def replicated(self) -> bool:
        return False

    @property
    def every_micro(self) -> bool:
        return self.grads

    def quantizes(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s gradient is reduce-scattered block-quantized (qgZ): a floating bucket of more
        than one shard under ``reduce_dtype="int8"`` (fp32, bf16 or fp16; others travel as they are)."""
        return self.reduce_dtype == "int8" and bucket.shards > 1 and bucket.dtype in C.QUANTIZED_DTYPES

    def folds(self, bucket: Bucket) -> bool:
        # a quantized reduction would quantize the running sum too: it lands a new partition, added after
        return not self.quantizes(bucket)

    def reduce(self, grad: torch.Tensor, bucket: Bucket, rank: int, out: torch.Tensor | None) -> C.Handle:
        if out is None and bucket.shards == 1:
            # One shard (world size 1, or one rank a replica): the bucket is its own partition; no copy, as a
            # single process does; summed over every rank that holds it (across the replicas too).
            return C.all_reduce(grad, "sum", async_op=True, group=C.without(bucket.apart) if bucket.apart else None)
        total = None
        if self.quantizes(bucket):  # qgZ: into a new partition, added to a running one last (see folds)
            total, out = out, torch.empty(bucket.shard_numel, dtype=grad.dtype, device=grad.device)
            handle = _int8_reduce_scatter(out, grad, bucket)
        else:
            if out is None:
                out = torch.empty(bucket.shard_numel, dtype=grad.dtype, device=grad.device)
            handle = C.reduce_scatter(out, grad, "sum", async_op=True, group=bucket_group(bucket))
        if bucket.replicate:  # hybrid sharding: the replica's reduced shard, summed across the replicas
            handle = _Then(handle, lambda r: C.all_reduce(r, "sum", async_op=True, group=C.along(bucket.replicate)))
        if total is not None:
            handle = _Then(handle, lambda r: total.add_(r))
        return handle


def _nodes(bucket: Bucket) -> tuple | None:
    """``(node, across)``: the groups of a two-hop reduction of ``bucket`` (the ranks of this rank's node, and
    the line of ranks across the nodes that hold the same place in theirs), where the step's group spans
    nodes (a mesh whose ``dp_replicate`` is above 1: ``hpz=``) and the bucket is sharded over all of it;
    None otherwise."""
    if bucket.apart or bucket.replicate:
        return None
    try:
        across = C.along("dp_replicate")
    except ValueError:  # the step's group spans no nodes
        return None
    return (C.without("dp_replicate"), across) if across is not None else None


def _int8_reduce_scatter(out: torch.Tensor, grad: torch.Tensor, bucket: Bucket):
    """qgZ's reduce-scatter of ``grad`` into ``out`` as int8 blocks: one all-to-all over the bucket's group, or,
    where the step knows its nodes, ZeRO++'s two hops: within the node (each rank receives, summed over the
    node, the shards of its place in every node), then across the nodes (its own shard, summed over them).
    The second hop sends ``1 / (ranks a node)`` of what one flat exchange sends across nodes."""
    nodes = _nodes(bucket)
    if nodes is None:
        return C.reduce_scatter_quantized(out, grad, async_op=True, group=bucket_group(bucket))
    node, across = nodes
    n, s, k = C.world_size(across), C.world_size(node), bucket.shard_numel
    # ranks are numbered node-major (shard r = node r // s, place r % s): place j gathers shard j of every node
    mixed = grad.view(n, s, k).transpose(0, 1).reshape(-1)
    mid = torch.empty(n * k, dtype=grad.dtype, device=grad.device)
    first = C.reduce_scatter_quantized(mid, mixed, async_op=True, group=node)
    return _Then(first, lambda m: C.reduce_scatter_quantized(out, m, async_op=True, group=across))


class _Then:
    """What follows a collective when it lands (a second collective, waited for in turn, or a tensor
    operation): ``wait()`` gives the follower's result. ``progress()`` waits for the first collective only
    and starts the follower, so that the gradient sink can have the second in flight while it launches the
    next bucket's first (hybrid sharding's all-reduce across nodes beside the next reduce-scatter)."""

    __slots__ = ("first", "then", "started")

    def __init__(self, first, then):
        self.first, self.then, self.started = first, then, None

    def progress(self) -> None:
        if self.started is not None:
            return
        if isinstance(self.first, _Then):  # a chain: advance its own first step; this one's follows at wait()
            self.first.progress()
            return
        self.started = (self.then(self.first.wait()),)

    def wait(self):
        if self.started is None:
            self.started = (self.then(self.first.wait()),)
        out = self.started[0]
        return out.wait() if isinstance(out, (C.Handle, _Then)) else out


@transform
def shard_optimizer(step: Step, /, *, replicate: int | None = None) -> Step:
    """Partition the optimizer state over the ranks (ZeRO stage 1).

    Args:
        step: a Step from ``zf.train_step`` (possibly already transformed).
            Called without it, returns a decorator.
        replicate: hybrid sharding (FSDP2's HSDP): ``replicate`` replicas, each a group of ``world //
            replicate`` consecutive ranks (a node) that shards the optimizer state among its ranks; a
            bucket's gradient is reduce-scattered within the group and each shard all-reduced across the
            replicas (the mesh's ``dp_replicate`` x ``dp_shard``). Default: one group of every rank.

    Returns:
        The rewritten Step. Applied to a step that already shards its
        optimizer state (this transform, or ``shard_grads`` /
        ``shard_params``, which imply it) it returns that step unchanged
        (with ``replicate`` set, it keeps or sets it).

    Raises:
        TypeError: ``step`` is not a Step.
        ValueError: ``replicate`` is not an int >= 1, does not divide the world size, or differs from the
            step's.
    """
    if not step.reduction.shards_optimizer:
        # the three ZeRO stages shard over the data-parallel axis, the step's group: one claim for all three
        step = step.claim(Claim("dp_shard", "zero")).replace(reduction=ShardedReduction())
    return replicated(step, replicate, "shard_optimizer")


def int8(value, what: str, by: str) -> str | None:
    """``value`` (None, ``"int8"`` or ``torch.int8``) as a quantization setting; ``what`` names the
    argument in the error."""
    if value is None:
        return None
    if value == "int8" or value is torch.int8:
        return "int8"
    raise ValueError(
        f"{by}: {what} must be None (the gradients' or parameters' own dtype) or \"int8\" (block-quantized, "
        f"ZeRO++'s qgZ/qwZ), got {value!r}"
    )


def quantized_reduction(step: Step, reduce_dtype, by: str) -> Step:
    """``step`` (which shards its optimizer state) with its gradients reduce-scattered as int8 blocks
    (qgZ) when ``reduce_dtype`` says so; ``by``: the transform asking, for errors."""
    want = int8(reduce_dtype, "reduce_dtype", by)
    if want is None or step.reduction.reduce_dtype == want:
        return step
    return step.replace(reduction=step.reduction.replace(reduce_dtype=want))


def replicated(step: Step, replicate: int | None, by: str) -> Step:
    """``step`` (which shards its optimizer state) with ``replicate`` replicas of its shards (hybrid
    sharding: see :func:`shard_optimizer`); ``by``: the transform asking, for errors."""
    if replicate is None:
        return step
    if not isinstance(replicate, int) or isinstance(replicate, bool) or replicate < 1:
        raise ValueError(
            f"{by}: replicate must be an int >= 1 (replicas of the shards, one per node), got {replicate!r}"
        )
    have = step.reduction.replicas
    if have not in (1, replicate):
        raise ValueError(
            f"{by}: replicate={replicate}, but the step already holds {have} replicas of its shards; give one "
            f"replicate= (or leave it out of {by}: it keeps the step's)"
        )
    if replicate == have:
        return step
    m = mesh.for_step(step.mesh, by, "dp_replicate", replicate)
    return step.claim(Claim("dp_shard", "zero"), m).replace(reduction=step.reduction.replace(replicas=replicate))
