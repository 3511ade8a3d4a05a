"""``tensor_parallel``: Megatron's column- and row-wise Linear layers on a 2-D mesh, data parallel across it.

The world is a mesh (:mod:`zerofn.mesh`, ``make(tp=size)``: its ``tp``
axis innermost, ``dp_shard`` taking the rest) of ``size`` consecutive ranks
per tensor-parallel group times ``world // size`` data-parallel ranks:
global rank ``r`` is tensor-parallel rank ``r % size`` of data-parallel
rank ``r // size`` (:func:`mesh`). The rewritten step runs on the data-parallel group of its
rank (``step.group``): everything the step and the other transforms
communicate (the gradients' reduction, ``shard_params``' gathers, the
checks) goes over that axis, so every shard transform, ``amp``, ``remat``
and ``offload`` work over the data-parallel ranks as they do without it.
Inside the model, on the tensor-parallel group:

- a **column-wise** ``Linear`` (attention's q, k and v, the MLP's gate and
  up) holds the rows of its weight (and bias) for its slice of the output
  features; its input enters through ``copy``, which is the identity in
  forward and all-reduces the input's gradient in backward;
- a **row-wise** ``Linear`` (attention's output, the MLP's down) holds the
  columns of its weight for its slice of the input features, which the
  column-wise layer before it produced; its output leaves through
  ``reduce``, an all-reduce in forward and the identity in backward, and
  the (whole) bias is added after it.

So a block runs two all-reduces of its activations in forward and two in
backward (Megatron's pairing), attention's heads split over the ranks
(``num_heads / size`` each, grouped-query key/value heads too, or shared
when there are fewer of them than ranks), and every
parameter outside the split layers is replicated: each tensor-parallel
rank computes the same values for it and the same gradient. The layers
keep their place and names in the model: their parameters are the local
slices (each rank of a tensor-parallel group holds other values), which
the state holds as any parameters.

The plan is ``{module path: "colwise" | "rowwise" | "embedding" |
"head"}``; ``plan=None`` derives it from the module structure for Hugging
Face Llama, Qwen2/3 and Mistral (``self_attn.{q,k,v,o}_proj``,
``mlp.{gate,up,down}_proj``, the input embedding and the untied output
head), and a model it cannot plan gets an error that lists its Linear
layers and shows a plan to write.

Each rank feeds the micro-batch of its data-parallel rank
(``zf.collectives.data_rank(step)``): the ranks of one tensor-parallel
group feed the same batch, which the step checks before each forward (one
small all-reduce on the tensor-parallel group).

With the vocabulary split (``"embedding"``, ``"head"``), the embedding's
lookups are summed over the group and the head's logits stay split in
training (a ``DTensor`` sharded on the vocabulary, whose cross-entropy the
step computes under torch's ``loss_parallel``); without gradients the head
gathers them whole. A model built on the meta device is split as
``shard_params``' sharded init reaches each layer (``zf_materialise``).

A peft LoRA layer is planned through its wrapper (``_plan.lora_plan``), and
``quantize`` applied around this transform holds each rank's slices
quantized (the split layers' ``zf_around`` runs its dequantized matmul).

Key/value heads fewer than ``size`` (a multiple of them) are shared: each
rank holds the one its query heads read, and the ranks sharing it sum its
gradient (an all-reduce over them, on a sub-split of the mesh's ``tp`` axis:
``mesh.subgroup("tp", ranks sharing)``).

With ``sequence_parallel=True`` the residual stream between the regions is
split over the sequence (Megatron-SP, ``_sequence``).

The transform claims the mesh's ``tp`` axis (a
:class:`zerofn.sharding.Claim`): the step then runs on the mesh's
data-parallel group, and each split parameter's placement on ``tp``
(``Shard(dim)``; a fused q/k/v ``Shard(dim, parts=3)``; shared key/value
heads ``Shard(dim, share=k)``) is recorded in ``state.spec.placements``.
From the placements alone, checkpoints save one part per tensor-parallel
rank and load on any split (:mod:`zerofn.checkpoint.partitioned`), and
``step.full_params`` / ``step.state_dict`` gather the slices whole over the
``tp`` axis, one parameter at a time; ``local=True`` gives this rank's
slices. On a step that already has a mesh (another parallelism applied
first), ``tp`` joins it (``step.mesh.with_axes(tp=size)``), innermost; a
parallelism applied earlier whose axis that would move is named in the
error, with the order that works (the innermost axis's transform first).

The package, one job a module: ``_plan`` (the kinds, :func:`derive_plan`
and the Llama, LoRA and GPT-2 ``Conv1D`` plans, :func:`kv_share`: how many
ranks share a key/value head), ``_layers`` (the split layer classes and how
a parameter is cut: ``split_layer``, ``rule``, :func:`placement`,
``slice_param``), ``_autograd`` (every autograd collective: ``SumGrad``,
``Copy``, ``Reduce``, ``GatherSeq``, ``ReduceScatterSeq``, ``ScatterSeq``),
``_sequence`` (sequence parallelism), ``_check`` (the batch check and the
rest of what a step enters around forward and backward), ``_prepare``
(``init``: the plan checked, the layers split) and this module (the
transform, its extension and its claim). The groups are the mesh's; the
package keeps none of its own. The planner (:mod:`zerofn.plan.tensor`)
states a model's placements from its shapes by the same rules
(:data:`LLAMA`, :func:`kv_share`, :func:`placement`).

Not yet: counting the cross-entropy's own all-reduces (torch's
``loss_parallel``) in ``metrics["comm_bytes"]``, where the layers' are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofn.transforms.tensor_parallel._check import Around
from zerofn.transforms.tensor_parallel._layers import placement
from zerofn.transforms.tensor_parallel._plan import (
    COLWISE,
    COLWISE_QKV,
    EMBEDDING,
    HEAD,
    INSIDE,
    KINDS,
    LLAMA,
    ROWWISE,
    SUMMED,
    derive_plan,
    kv_share,
)
from zerofn.transforms.tensor_parallel._prepare import prepare

from zerofn.extension import Extension
from zerofn.mesh import Mesh, for_step
from zerofn.sharding import Claim, Shard
from zerofn.step import Step, reapply, transform

__all__ = [
    "COLWISE",
    "COLWISE_QKV",
    "EMBEDDING",
    "HEAD",
    "INSIDE",
    "KINDS",
    "LLAMA",
    "ROWWISE",
    "SUMMED",
    "Mesh",
    "TensorParallelOptions",
    "derive_plan",
    "kv_share",
    "mesh",
    "placement",
    "tensor_parallel",
]


def mesh(size: int) -> Mesh:
    """The mesh ``tensor_parallel(step, size)`` runs on: :func:`zerofn.mesh.make` with ``tp=size``, its
    ``tp`` axis ``size`` consecutive ranks and ``dp_shard`` the rest (``mesh(size).group("tp")`` is this
    rank's tensor-parallel group, ``.data_group`` its data-parallel one). Made once per process and size:
    collective the first time (every rank creates every group).

    Raises:
        ValueError: ``size`` is not a positive int dividing the world size.
    """
    _check_size(size)
    return for_step(None, "tensor_parallel", "tp", size)


def _check_size(size: Any) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel: size must be an int >= 1 (ranks per tensor-parallel group), got {size!r}")


@dataclass(frozen=True)
class TensorParallelOptions:
    """What ``tensor_parallel`` was asked for (compared by value when it is applied again)."""

    size: int
    plan: Any
    sequence_parallel: bool


@transform
def tensor_parallel(step: Step, size: int, /, *, plan: dict | None = None, sequence_parallel: bool = False) -> Step:
    """Split the model's Linear layers over ``size`` ranks (Megatron's pairing); data parallel across.

    Args:
        step: a Step (any transforms applied before or after). Called without it, returns a decorator.
        size: ranks per tensor-parallel group; it must divide the world size.
        plan: ``{module path: "colwise" | "rowwise" | "embedding" | "head"}``; None: derived for
            Hugging Face Llama, Qwen2/3 and Mistral models.
        sequence_parallel: split the residual stream between the regions over the sequence (all-gather
            and reduce-scatter in place of the all-reduces; the norms run on the slice); needs the head
            split over the vocabulary and a sequence that is a multiple of ``size``.

    Returns:
        The rewritten Step, named ``tensor_parallel(...)``, running on this rank's data-parallel group.

    Raises:
        ValueError: a ``size`` that does not divide the world; a plan naming what is not a Linear, or a
            split that does not divide its features (or its attention heads); at ``init``: params not
            from ``zf.functional``, a model it cannot plan.
    """
    if plan is not None and (
        not isinstance(plan, dict) or any(v not in KINDS or not isinstance(k, str) for k, v in plan.items())
    ):
        raise ValueError(f"tensor_parallel: plan must be a dict of module path -> one of {list(KINDS)}, got {plan!r}")
    _check_size(size)
    m = for_step(step.mesh, "tensor_parallel", "tp", size)  # on a step's mesh: tp joins beside its other axes
    tp = m.size("tp")
    options = TensorParallelOptions(size, None if plan is None else tuple(sorted(plan.items())), sequence_parallel)
    have = step.extension("tensor_parallel")
    if reapply(step, "tensor_parallel", have and have.options, options, "splits the model's layers"):
        return step
    prepared: dict = {}  # "layers": the split layers of the model this step's init prepared last (path -> layer)
    out = step.extend(
        Extension(
            "tensor_parallel",
            options,
            prepare=lambda split, f, where: prepare(options.plan, sequence_parallel, m, split, f, where, prepared),
            around=lambda model, state: Around(m, model),
            prepare_first=True,  # quantize, applied before or after, then holds each rank's slices
            reports=True,  # the batch check (_check), made on the device
        )
    )
    claim = Claim(
        "tp",
        "tensor_parallel",
        placements=lambda: _placements(prepared, tp),
        whole=lambda: _check_whole(prepared),
        groups=lambda: _replica_groups(prepared),
    )
    return out.claim(claim, m)


def _placements(prepared: dict, tp: int) -> dict[str, Shard]:
    """Each split parameter's placement on the ``tp`` axis: how it is cut from the whole one (a fused q/k/v
    in blocks; key/value heads fewer than the ranks shared by consecutive ranks)."""
    out = {}
    for path, layer in prepared.get("layers", {}).items():
        how, (n, _, conv) = layer.__dict__["_zf_how"], layer.__dict__["_zf_slices"]
        prefix = f"{path}." if path else ""
        for pname in ("weight", "bias"):
            p = placement(how, pname, conv, tp // n)
            if layer._parameters.get(pname) is not None and p is not None:
                out[prefix + pname] = p
    return out


def _check_whole(prepared: dict) -> None:
    """Raises where a split layer's weight is held quantized, before ``step.full_params`` gathers the split
    parameters whole (each rank quantized its own slice: their codes and scales
    do not join into those of the whole weight)."""
    quantized = [p for p, layer in prepared.get("layers", {}).items() if hasattr(layer, "_zf_quantized")]
    if quantized:
        raise ValueError(
            f"full_params: {quantized[0]!r}{' and others' if len(quantized) > 1 else ''} hold their weights "
            "quantized per tensor-parallel slice (quantize around tensor_parallel): each rank quantized its own "
            "slice, so the parts do not join into the whole weight's. Read this rank's slices with "
            "step.full_params(state, local=True) (or step.state_dict(state, local=True)) and dequantize them "
            "there: zerofn.transforms.quantize.dequantized(params, apply.module)."
        )


def _replica_groups(prepared: dict) -> tuple:
    """The groups of ranks sharing a key/value head that the split layers sum gradients over (their
    all-reduces, counted in ``comm_bytes``): sub-splits of the mesh's ``tp`` axis, each once."""
    out: dict[int, Any] = {}
    for layer in prepared.get("layers", {}).values():
        g = getattr(layer, "_zf_replicas", None)
        if g is not None:
            out.setdefault(id(g), g)
    return tuple(out.values())
