"""``shard_params`` (ZeRO stage 3): parameters sharded at rest, gathered per unit just in time.

Implies ``shard_grads`` and ``shard_optimizer``. Between steps a rank holds
only its shard of every parameter (frozen ones too), of the gradient
partition while accumulating, and of the optimizer state.

The model is cut into *units*: by default its natural blocks, the children
of every outermost ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``
at any depth (a block holding most of the parameters is cut into its own
children), plus the root (every parameter in no block: embeddings, final
norm, head; and any parameter two units share). Each unit's parameters form
one flat buffer per dtype, padded to a multiple of N and sharded like a
``shard_optimizer`` bucket.

It replaces two parts of the step (see ``zerofn.step``): the ``reduction``,
with a stage-3 ``ShardedReduction`` (unit buckets reduce-scattered as
their gradients land, as in ``shard_grads``), and the ``storage``, with a
:class:`UnitStorage`:

- ``bind``: ``loss_fn`` receives meta placeholders; ``apply`` (from
  ``zf.functional``) sees that a sharded step is running and calls the
  module with leaves that view per-unit full buffers whose storage is
  empty. A forward pre-hook all-gathers a unit's buffer just before the unit
  runs, and starts the gathers of the next ``prefetch`` units (in the order
  the previous step ran them, which the state carries under
  ``state.extra["shard_params.order"]``) so they overlap compute; a forward
  hook releases it (``storage.resize_(0)``: autograd keeps its saved views,
  whose memory is gone; the root and the forward's last block, which
  backward needs first, stay gathered into backward, as FSDP2 keeps its
  root) and hooks the unit's outputs, whose gradient marks
  the start of the unit's backward: there the buffer is gathered again
  (with the next units in backward order prefetched). As backward hands
  over a unit's gradients they go into its bucket, which is reduce-scattered
  while backward goes on; when the unit's last gradient is in and backward
  has computed the gradients of its inputs (through its frozen weights too:
  a LoRA block's adapters' gradients are in before the frozen layers under
  them have run backward), its full buffer is released. A unit whose
  outputs needed no gradient (a frozen embedding) is not gathered in
  backward at all. A module compiled with ``module.compile()`` gets no
  hooks: its unit opens and closes around its compiled call, in eager code
  (:class:`~zerofn.transforms._units.Intercept`), and the modules inside it
  run in the open unit, so dynamo never traces zerofn's work (docs/compile.md).
  Nothing stays on the modules after the step. Under ``pipeline_parallel``
  a step runs several micro-batches, each stage's forwards and backwards
  interleaved by the schedule (``Runner.run_microbatches``, which the
  pipeline sets): each forward and each backward gathers the units it
  runs (FSDP2 under torchtitan's pipeline), the gradients accumulate over
  the micro-batches and each unit's is reduce-scattered once, after its
  last; the pipeline's ``reshard_between_microbatches=False`` keeps each
  unit gathered from its first gather to its last backward instead.
- ``opt_view`` / ``publish``: the state holds shards, which the optimizer
  updates in place; nothing is gathered after the update.
- ``init``: the state is built shard by shard, one module's parameters at
  a time, also from a model built on the meta device (initialised by
  ``init_fn``, a Hugging Face model's own ``_init_weights``, or the module's
  ``reset_parameters``).
- ``full_params`` and ``forward`` (``step.apply``): gather one unit at a time;
  inside :func:`gathered` (``zf.generate(..., gather_once=True)``) every
  unit is gathered once on entering the block, each ``step.apply`` of that
  state runs on the whole parameters with no collective of its own, and
  they are released on leaving it.
- ``param_placement="cpu"`` (``offload(params=True)``): shards rest in host memory and each
  is copied in just before its unit's all-gather.

Why module hooks and not autograd-aware gathers under selective
recomputation (the "JAX road" in docs/design.md): ``torch.func`` refuses the
saved-tensor hooks that checkpointing needs, the recomputed collective
needs ``wait_tensor`` bookkeeping, and the hook road gives the same
traffic with any ``nn.Module`` and lets a unit's gradients flow straight
into the bucket machinery that ``shard_grads`` already has. Its known traps
are handled: a unit used twice (gathered again if released, released only
when its last gradient is in), tied parameters (moved to the root unit
when two units share one), parameters read outside their unit (in
``loss_fn``, or by another unit's code: the model shows placeholders but
in the unit whose modules run, and computing with one gathers its unit for
the read and hands over a copy whose gradient flows into the unit's
bucket), and ranks that run different units (they agree on each unit the
forward runs, each outside read and each backward gather, and on the
forward's end, so ranks that diverge raise together at the first differing
point instead of hanging; while the forward follows the order the last step
recorded, every rank issues the gathers that order predicts at each unit,
and backward issues the gathers of a plan agreed on at the forward's end,
so those agreements stay in flight and are checked when a gather is waited
for instead of costing a round trip per unit; after a step that ran one
model call, each unit once, the forward agrees only at its end, and a rank
that leaves the order issues its remaining gathers into scratch buffers
before it agrees, so every rank raises, see ``Runner._left``), and a
``loss_fn`` that differentiates inside itself (a gradient penalty's
``torch.autograd.grad(..., create_graph=True)``: each unit that inner grad
gathers stays gathered until its backward is over, or the step's end if it
holds frozen parameters, since the graph it builds reads the unit's
parameters in the step's backward; a placeholder among its inputs is the
parameter's leaf; see ``Runner._inner`` in ``_runner.py``).

Collectives per step: all-gather of every unit in forward and again in
backward (but the root and the last block, kept from the forward), and a
reduce-scatter of every unit's gradient: at most 3 x parameter bytes
(frozen parameters: 2 x, they have no gradient), plus tiny ones: the
unit-order agreement with each backward gather and at the forward's end (32
bytes each, on a group of its own; the first step, and a step after one
whose order changed, also agree on each unit the forward opens),
batch-shape agreement, and loss, gradient norm and finiteness; a read
outside a released unit adds its gather.

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import shard_params
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    >>> state = step.init(apply.params)
    >>> state, metrics = step(state, torch.ones(2, 4))
    >>> step.full_params(state)["weight"].shape
    torch.Size([1, 4])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from zerofn.transforms._units import MinUnitBytes
from zerofn.transforms.shard_grads import shard_grads
from zerofn.transforms.shard_optimizer import int8, quantized_reduction, replicated
from zerofn.transforms.shard_params._gathered import gathered
from zerofn.transforms.shard_params._runner import ORDER as ORDER  # the state.extra key of the recorded unit order
from zerofn.transforms.shard_params._storage import UnitStorage

from zerofn import mesh
from zerofn.sharding import Claim
from zerofn.step import Step, reapply, transform

__all__ = ["MinUnitBytes", "UnitStorage", "gathered", "shard_params"]


@transform
def shard_params(
    step: Step,
    /,
    *,
    units: Callable[[str, nn.Module], bool] | list[str] | None = None,
    prefetch: int = 1,
    init_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    replicate: int | None = None,
    hpz: int | None = None,
    gather_dtype: str | None = None,
    reduce_dtype: str | None = None,
) -> Step:
    """Shard parameters at rest and gather them per unit just in time (ZeRO stage 3).

    Args:
        step: a Step from ``zf.train_step`` (possibly already transformed).
            Called without it, returns a decorator.
        units: which modules are gathered as one: a list of module paths, a
            predicate ``(path, module) -> bool``, or a size policy
            ``MinUnitBytes(n)`` (each unit the smallest module holding at
            least n parameter bytes); default: the model's natural blocks
            (children of ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict``
            containers). Parameters in no unit form the root unit. A policy
            that leaves the model one unit warns.
        prefetch: how many units ahead to gather while the current one
            computes (forward and backward), >= 0.
        init_fn: ``init_fn(name, meta_tensor) -> tensor`` to materialise
            every parameter given on the meta device (it takes precedence over
            a Hugging Face model's ``_init_weights`` and over
            ``reset_parameters``, which are used without it, and for each
            parameter it returns None for); ``zf.checkpoint.pretrained_init(
            directory)`` reads a Hugging Face checkpoint's tensors one at a time.
        replicate: hybrid sharding (FSDP2's HSDP): ``replicate`` replicas, each a group of ``world //
            replicate`` consecutive ranks (a node) that shards the parameters, gradients and optimizer
            state among its ranks; the gathers and reduce-scatters stay within the group, and each
            reduced shard is all-reduced across the replicas (the mesh's ``dp_replicate`` x ``dp_shard``).
            Default: one group of every rank.
        hpz: ZeRO++'s hierarchical partitioning (hpZ; FSDP2's ``reshard_after_forward=int``), ``hpz``
            ranks a node: the parameters, gradients and optimizer state stay sharded over every rank, a
            unit's forward gather (over every rank) keeps this rank's 1/``hpz`` of it, and backward
            gathers the unit within the node from those pieces, so that only the forward's gather and
            the gradients' reduce-scatter cross nodes. It holds 1/``hpz`` of each unit's parameters
            more during the step. Not with ``replicate``.
        gather_dtype: ``"int8"``: ZeRO++'s qwZ. Each floating unit buffer is all-gathered as int8 blocks
            (one fp32 scale per 2048 elements: 0.25 x the bytes of fp32, 0.5 x of bf16) and the forward
            and backward compute with the dequantized values, each within absmax(its block) / 254 of the
            parameter; the shards (and amp's fp32 masters) the optimizer updates are untouched, and
            ``full_params`` and checkpoints gather them exactly. Default None: their own dtype.
        reduce_dtype: ``"int8"``: ZeRO++'s qgZ, as ``shard_grads(..., reduce_dtype="int8")``.

    Returns:
        The rewritten Step, named ``shard_params(...)`` whatever shard
        transforms it was combined with. Applied to a step that already
        shards parameters with the same options it returns that step unchanged.

    Raises:
        TypeError: ``step`` is not a Step.
        ValueError: a negative ``prefetch``, a step that already shards
            parameters with other options, or a ``replicate`` that does not
            divide the world size or differs from the step's.
    """
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"shard_params: prefetch must be an int >= 0, got {prefetch!r}")
    gather_dtype = int8(gather_dtype, "gather_dtype", "shard_params")
    if hpz is not None and (not isinstance(hpz, int) or isinstance(hpz, bool) or hpz < 1):
        raise ValueError(f"shard_params: hpz must be an int >= 1 (ranks a node), got {hpz!r}")
    if hpz is not None and (replicate or 1) > 1:
        raise ValueError(
            "shard_params: hpz and replicate both say how a node's ranks hold the parameters; give one: "
            "replicate=N shards everything within each of N nodes (HSDP), hpz=k shards over every rank and "
            "gathers backward's units within nodes of k ranks (ZeRO++'s hpZ)"
        )
    units = tuple(units) if isinstance(units, (list, tuple)) else units  # hashable, like the rest of a Step
    storage = UnitStorage(
        param_placement=step.storage.param_placement,
        param_path=step.storage.param_path,
        units=units,
        prefetch=prefetch,
        init_fn=init_fn,
        gather_dtype=gather_dtype,
        hpz=hpz if hpz is not None and hpz > 1 else None,
    )
    have = step.storage if step.storage.gathers_units else None
    if reapply(step, "shard_params", have, storage, "shards parameters"):
        return quantized_reduction(replicated(step, replicate, "shard_params"), reduce_dtype, "shard_params")
    sharded = replicated(shard_grads(step, reduce_dtype=reduce_dtype), replicate, "shard_params")
    if storage.hpz is not None:
        sharded = _nodes(sharded, storage.hpz)
    return sharded.replace(reduction=sharded.reduction.replace(name="shard_params"), storage=storage)


def _nodes(step: Step, hpz: int) -> Step:
    """``step`` on a mesh of nodes of ``hpz`` ranks (``dp_replicate`` x ``dp_shard = hpz``), its shards over
    every rank: hpZ's secondary pieces are gathered within ``dp_shard``."""
    if step.reduction.replicas > 1:
        raise ValueError("shard_params: hpz on a step that replicates its shards (replicate=): give one of the two")
    world = mesh.world_size()
    if world % hpz:
        raise ValueError(
            f"shard_params: hpz={hpz} does not divide the world size {world}: a node is hpz ranks. Run on a "
            f"multiple of {hpz} ranks, or give the ranks a node has."
        )
    if world == hpz:
        return step  # one node: backward's gather is within it already
    m = mesh.for_step(step.mesh, "shard_params", "dp_replicate", world // hpz)
    return step.claim(Claim("dp_shard", "zero"), m)
