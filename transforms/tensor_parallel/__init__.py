"""``tensor_parallel``: Megatron's column- and row-wise Linear layers on a 2-D mesh, data parallel across it.

The world is a mesh of ``size`` consecutive ranks per tensor-parallel group
times ``world // size`` data-parallel ranks: global rank ``r`` is
tensor-parallel rank ``r % size`` of data-parallel rank ``r // size``
(:func:`mesh`). The rewritten step runs on the data-parallel group of its
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
``shard_params``' sharded init reaches each layer (:meth:`_Split.zf_materialise`).

A peft LoRA layer is planned through its wrapper (:func:`_lora_plan`), and
``quantize`` applied around this transform holds each rank's slices
quantized (the split layers' ``zf_around`` runs its dequantized matmul).

Key/value heads fewer than ``size`` (a multiple of them) are shared: each
rank holds the one its query heads read, and the ranks sharing it sum its
gradient (an all-reduce over them, :class:`_SumGrad`).

With ``sequence_parallel=True`` the residual stream between the regions is
split over the sequence (Megatron-SP, :func:`_sequence_parallel`).

Checkpoints save one part per tensor-parallel rank and load on any split
(:mod:`zerofn.checkpoint.partitioned`, from ``state.spec.slices``), and
``step.full_params`` / ``step.state_dict`` gather the slices whole over the
tensor-parallel group (``partition_group``), one parameter at a time;
``local=True`` gives this rank's slices.

Not yet: counting the cross-entropy's own all-reduces (torch's
``loss_parallel``) in ``metrics["comm_bytes"]``, where the layers' are.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from zerofn import collectives as C
from zerofn import tree as T
from zerofn.extension import Extension
from zerofn.functional import Functional
from zerofn.state import cut_slice
from zerofn.step import Step, reapply, report, transform
from zerofn.storage import ParamSplit, split_params

__all__ = ["Mesh", "TensorParallelOptions", "mesh", "tensor_parallel"]

COLWISE, ROWWISE, EMBEDDING, HEAD = "colwise", "rowwise", "embedding", "head"
COLWISE_QKV = "colwise_qkv"  # column-wise over a fused q/k/v output (GPT-2's c_attn): each third split alike
INSIDE = "colwise_inside"  # column-wise whose input is already inside the region (a LoRA B after its A)
SUMMED = "replicated_summed"  # whole on every rank, its input copied into the region, its gradients summed
KINDS = (COLWISE, COLWISE_QKV, ROWWISE, EMBEDDING, HEAD, INSIDE, SUMMED)
_COLUMNS = (COLWISE, COLWISE_QKV, HEAD, INSIDE)


@dataclass(frozen=True)
class Mesh:
    """The 2-D mesh of ``world = tensor * data`` ranks and this rank's groups.

    Attributes:
        tensor: ranks per tensor-parallel group (consecutive global ranks).
        data: data-parallel ranks (``world // tensor``).
        tensor_rank: this rank's place in its tensor-parallel group.
        data_rank: its data-parallel rank (the micro-batch it feeds).
        tensor_group: its tensor-parallel group (None when ``tensor == 1``).
        data_group: its data-parallel group (None when ``data == 1`` and ``tensor == 1``: the world).
    """

    tensor: int
    data: int
    tensor_rank: int
    data_rank: int
    tensor_group: Any
    data_group: Any


_MESHES: dict[tuple, Mesh] = {}  # (tensor size, world, default group) -> its mesh: groups are made once


def mesh(size: int) -> Mesh:
    """The mesh of ``size`` consecutive ranks per tensor-parallel group, made once per process and size.

    Collective the first time (every rank creates every group, as ``torch.distributed.new_group`` needs).

    Raises:
        ValueError: ``size`` is not a positive int dividing the world size.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel: size must be an int >= 1 (ranks per tensor-parallel group), got {size!r}")
    C.init()
    world = C.world_size(group=dist.group.WORLD) if dist.is_initialized() else 1
    if world % size:
        raise ValueError(
            f"tensor_parallel: size {size} does not divide the world size {world}: the mesh is size x (world // "
            f"size) ranks. Run on a multiple of {size} ranks, or pick a size that divides {world}."
        )
    key = (size, world, id(dist.group.WORLD) if dist.is_initialized() else None)
    if key in _MESHES:
        return _MESHES[key]
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = world // size
    tensor_group = data_group = None
    if world > 1:
        for d in range(data):  # every rank makes every group, in the same order
            g = C.new_group(list(range(d * size, (d + 1) * size)))
            if d == rank // size:
                tensor_group = g
        for t in range(size):
            g = C.new_group(list(range(t, world, size)))
            if t == rank % size:
                data_group = g
    m = Mesh(size, data, rank % size, rank // size, tensor_group, data_group)
    _MESHES[key] = m
    return m


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
    m = mesh(size)
    options = TensorParallelOptions(size, None if plan is None else tuple(sorted(plan.items())), sequence_parallel)
    have = step.extension("tensor_parallel")
    if reapply(step, "tensor_parallel", have and have.options, options, "splits the model's layers"):
        return step
    if step.group is not None and step.group is not m.data_group:
        raise ValueError(
            "tensor_parallel: this step already runs on a group of its own (train_step(..., group=)); "
            "tensor_parallel runs it on its data-parallel group. Leave group= out."
        )
    prepared: dict = {}  # "layers": the split layers of the model this step's init prepared last (path -> layer)
    out = step.extend(
        Extension(
            "tensor_parallel",
            options,
            prepare=lambda split, f, where: _prepare(options, m, split, f, where, prepared),
            around=lambda model, state: _Around(m, model),
            partition=(lambda: (m.tensor_rank, m.tensor)) if m.tensor > 1 else None,
            partition_group=(lambda: _whole_group(prepared, m)) if m.tensor > 1 else None,
            groups=(lambda: (m.tensor_group, *_replica_groups(m))) if m.tensor > 1 else None,
            slices=(lambda: _slices(prepared)) if m.tensor > 1 else None,
            prepare_first=True,  # quantize, applied before or after, then holds each rank's slices
            reports=True,  # the batch check below, made on the device
        )
    )
    return out.replace(group=m.data_group) if m.data_group is not None else out


# ---------------------------------------------------------------- the plan


_LLAMA = {
    "self_attn.q_proj": COLWISE,
    "self_attn.k_proj": COLWISE,
    "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE,
    "mlp.gate_proj": COLWISE,
    "mlp.up_proj": COLWISE,
    "mlp.down_proj": ROWWISE,
}

_GPT2 = {"attn.c_attn": COLWISE_QKV, "attn.c_proj": ROWWISE, "mlp.c_fc": COLWISE, "mlp.c_proj": ROWWISE}


def _is_lora(m: nn.Module) -> bool:
    """A peft LoRA layer around a Linear (``base_layer``, ``lora_A``/``lora_B`` per adapter)."""
    return isinstance(getattr(m, "base_layer", None), nn.Linear) and isinstance(
        getattr(m, "lora_A", None), nn.ModuleDict
    )


def _lora_plan(path: str, m: nn.Module, how: str) -> dict[str, str]:
    """A LoRA layer's plan: its base split as the layer would be; beside a column-wise base, each adapter's A
    whole (its input copied into the region, its gradient summed: every rank's B rows contribute) and its B
    split by rows like the base; beside a row-wise base, A split by columns (its output summed) and B whole."""
    out = {f"{path}.base_layer": how}
    for name in m.lora_A:
        a, b = f"{path}.lora_A.{name}", f"{path}.lora_B.{name}"
        if how == COLWISE:
            out[a], out[b] = SUMMED, INSIDE
        else:
            out[a] = ROWWISE
    return out


def _is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's Linear with its weight transposed: ``(in, out)``)."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")


def derive_plan(module: nn.Module, size: int = 1) -> dict[str, str]:
    """The plan for a Hugging Face Llama-style or GPT-2 model, found by the modules' paths ({} if it has
    none): attention's q/k/v column-wise (GPT-2's fused ``c_attn`` by thirds) and its output row-wise, the
    MLP's gate/up (``c_fc``) column-wise and down (``c_proj``) row-wise, and,
    when its vocabulary splits evenly over ``size`` ranks, the
    input embedding vocabulary-parallel and the output head column-wise over the vocabulary (a head tied to
    the embedding keeps holding the embedding's rows: the same slice)."""
    out = {}
    paths = {id(m): path for path, m in module.named_modules()}
    for path, m in module.named_modules():
        for suffix, how in _LLAMA.items():
            if (path == suffix or path.endswith("." + suffix)) and isinstance(m, nn.Linear):
                out[path] = how
            elif (path == suffix or path.endswith("." + suffix)) and _is_lora(m):
                out.update(_lora_plan(path, m, how))
        for suffix, how in _GPT2.items():
            if (path == suffix or path.endswith("." + suffix)) and _is_conv1d(m):
                out[path] = how
    if not out:
        return out
    emb, head = _io_embeddings(module)
    if isinstance(emb, nn.Embedding) and emb.num_embeddings % size == 0 and id(emb) in paths:
        out[paths[id(emb)]] = EMBEDDING
    if isinstance(head, nn.Linear) and head.out_features % size == 0 and id(head) in paths:
        tied = isinstance(emb, nn.Embedding) and emb.weight is head.weight
        if not tied or paths.get(id(emb)) in out:  # a tied head splits with its embedding, or not at all
            out[paths[id(head)]] = HEAD
    return out


def _io_embeddings(module: nn.Module) -> tuple[Any, Any]:
    """A Hugging Face model's input and output embeddings (None where it has none)."""
    found = []
    for name in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(module, name, None)
        try:
            found.append(get() if callable(get) else None)
        except (AttributeError, NotImplementedError):
            found.append(None)
    return found[0], found[1]


def _plan_for(options: TensorParallelOptions, module: nn.Module, where: str) -> dict[str, str]:
    plan = dict(options.plan) if options.plan is not None else derive_plan(module, options.size)
    if not plan:
        linears = [p for p, m in module.named_modules() if isinstance(m, nn.Linear)]
        example = {p: "colwise" for p in linears[:2]}
        raise ValueError(
            f"{where}: tensor_parallel cannot plan {type(module).__name__}: no module path ends in "
            f"{sorted(_LLAMA)}. Its Linear layers: {linears[:12]}{' ...' if len(linears) > 12 else ''}. Pass "
            f"plan={{path: 'colwise' | 'rowwise'}}, a column-wise layer followed by the row-wise one that reads "
            f"its output, e.g. {example}"
        )
    return plan


# ---------------------------------------------------------------- init: the layers become their slices


def _prepare(
    options: TensorParallelOptions,
    m: Mesh,
    split: ParamSplit,
    functional: Functional | None,
    where: str,
    prepared: dict,
) -> ParamSplit:
    if functional is None:
        raise ValueError(
            f"{where}: tensor_parallel splits the model's Linear layers, so it needs the params of "
            "zf.functional(model): step.init(apply.params), apply = zf.functional(model)"
        )
    module = functional.module
    plan = _plan_for(options, module, where)
    layers = {}
    for path, how in plan.items():  # every layer checked before any is split: a refusal changes nothing
        try:
            layer = module.get_submodule(path)
        except AttributeError:
            raise ValueError(f"{where}: tensor_parallel's plan names {path!r}, which the model does not have") from None
        if isinstance(layer, _Split):
            continue
        if hasattr(layer, "_zf_quantized"):
            raise ValueError(
                f"{where}: tensor_parallel's plan names {path!r}, which quantize holds quantized already: apply "
                "quantize around tensor_parallel (quantize(tensor_parallel(step, size))), so that each rank "
                "quantizes its own slice"
            )
        want = nn.Embedding if how == EMBEDDING else nn.Linear
        conv = _is_conv1d(layer) and how in (COLWISE, COLWISE_QKV, ROWWISE)
        if not conv and (not isinstance(layer, want) or type(layer).forward is not want.forward):
            raise ValueError(
                f"{where}: tensor_parallel's plan names {path!r} as {how!r}, a {type(layer).__name__}; {how!r} "
                f"splits an nn.{want.__name__} (whose forward is {want.__name__}'s) or, but for 'embedding' and "
                "'head', a transformers Conv1D. Leave it out of the plan."
            )
        if how == EMBEDDING and (layer.max_norm is not None or layer.scale_grad_by_freq or layer.sparse):
            raise ValueError(
                f"{where}: tensor_parallel: {path!r} uses max_norm, scale_grad_by_freq or sparse, which a "
                "vocabulary-parallel embedding does not support. Leave it out of the plan (replicated)."
            )
        share = _check_heads(module, path, how, m.tensor, where)
        if how == EMBEDDING:
            features = layer.num_embeddings
        elif how == SUMMED:
            features = 0  # not split
        elif how in _COLUMNS:
            features = layer.nf if conv else layer.out_features
        else:
            features = layer.nx if conv else layer.in_features
        parts = 3 if how == COLWISE_QKV else 1
        if features % (parts * (m.tensor // share)):
            raise ValueError(
                f"{where}: tensor_parallel({m.tensor}): {path!r} has {features} "
                f"{'input' if how == ROWWISE else 'output'} features, which {m.tensor} ranks cannot split evenly"
            )
        layers[path] = (layer, how, share)
    names = {}
    # The split layers live with their model (a model prepared again keeps the ones split before); this step's
    # slices() and full_params read those of the model its init prepared last.
    done = module.__dict__.setdefault("_zf_split_layers", {})
    prepared["layers"] = done
    replaced: dict[int, nn.Parameter] = {}  # a weight tied to a split one's: the same slice (an embedding's head)
    order = sorted(layers.items(), key=lambda item: item[1][1] != EMBEDDING)
    for path, (layer, how, share) in order:
        names.update(_split(layer, how, m, path, split.named, share, replaced))
        done[path] = layer
        if how == COLWISE_QKV:  # GPT-2's attention splits the fused output by its (now local) width
            attention = module.get_submodule(path.rpartition(".")[0])
            for attr in ("split_size", "num_heads", "embed_dim"):
                if isinstance(getattr(attention, attr, None), int):
                    setattr(attention, attr, getattr(attention, attr) // m.tensor)
        if share > 1:  # the attention's query heads per key/value head, as this rank holds them
            attention = module.get_submodule(_projection(path).rpartition(".")[0])
            if hasattr(attention, "num_key_value_groups"):
                attention.num_key_value_groups = attention.config.num_attention_heads // m.tensor
    if m.tensor > 1:
        # the modules a column-wise layer's region is (attention, the MLP), past peft's LoRA wrappers
        regions = sorted({_region_of(p) for p, k in plan.items() if k in (COLWISE, COLWISE_QKV)})
        _sum_inside(module, plan, regions, m)
        if options.sequence_parallel:
            _sequence_parallel(module, plan, regions, m, where)
    if not names:
        return split
    functional.refresh()
    named = {k: names.get(k, v) for k, v in split.named.items()}
    out = split_params(named, where)
    return out._replace(trainable={k: out.named[k] for k in split.trainable})


def _check_heads(module: nn.Module, path: str, how: str, size: int, where: str) -> int:
    """Attention's heads split whole: q/o by attention heads, k/v by key/value heads; returns how many
    ranks share each key/value head (1: split; more: fewer key/value heads than ranks, each rank holding
    the one its query heads read, Megatron's grouped-query rule)."""
    if how == SUMMED:
        return 1  # whole on every rank
    path = _projection(path)  # a LoRA layer's base or adapter: its projection's heads
    parent = module.get_submodule(path.rpartition(".")[0]) if "." in path else module
    config = getattr(parent, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    leaf = path.rpartition(".")[2]
    if how == COLWISE_QKV or (leaf == "c_proj" and hasattr(parent, "split_size")):
        leaf = "q_proj"  # GPT-2's attention: its heads split as query heads
    if leaf in ("q_proj", "o_proj") and heads and heads % size:
        raise ValueError(
            f"{where}: tensor_parallel({size}): {path!r} holds {heads} attention heads, which {size} ranks "
            f"cannot split whole. Pick a size that divides {heads}."
        )
    if leaf in ("k_proj", "v_proj") and kv and kv % size:
        if size % kv or (heads and heads % size):
            raise ValueError(
                f"{where}: tensor_parallel({size}): {path!r} holds {kv} key/value heads, which {size} ranks can "
                f"neither split whole nor share (each rank's query heads must read one key/value head: the size "
                f"must divide {kv}, or be a multiple of it that divides the {heads} attention heads)."
            )
        return size // kv
    return 1


def _projection(path: str) -> str:
    """The attention projection a path lies in (``...self_attn.k_proj`` for its peft ``base_layer`` or
    ``lora_B.default``), or the path itself."""
    segs = path.split(".")
    for i in range(len(segs) - 1, -1, -1):
        if segs[i] in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return ".".join(segs[: i + 1])
    return path


_CLASSES: dict[tuple[type, str], type] = {}


def _split(
    layer: nn.Linear, how: str, m: Mesh, path: str, named: dict, share: int = 1, replaced: dict | None = None
) -> dict[str, torch.Tensor]:
    """Make ``layer`` hold this rank's slice of its weight (and bias) and compute as ``how`` says;
    ``share`` ranks hold the same slice (a key/value head shared by that many ranks' query heads)."""
    prefix = f"{path}." if path else ""
    out = {}
    n, r = m.tensor // share, m.tensor_rank // share  # slices, and which one this rank holds
    conv = _is_conv1d(layer)
    source = {}
    for pname in ("weight", "bias"):
        p = layer._parameters.get(pname)
        if p is None:
            continue
        if replaced is not None and id(p) in replaced:  # tied to a weight split already: that very slice
            layer._parameters[pname] = replaced[id(p)]
            continue
        held = named.get(prefix + pname, p)
        local = _slice(held.detach(), how, pname, n, r, conv)
        if held.device.type == "meta":  # built on meta: shard_params' init slices the parameter's init
            source[pname] = p
            local = torch.empty(local.shape, dtype=held.dtype, device="meta")
        else:
            local = local.clone()
        layer._parameters[pname] = nn.Parameter(local, requires_grad=p.requires_grad)
        out[prefix + pname] = layer._parameters[pname]
        if replaced is not None:
            replaced[id(p)] = layer._parameters[pname]
    layer.__dict__["_zf_source"] = source
    layer.__dict__["_zf_whole"] = {
        k: getattr(layer, k)
        for k in ("in_features", "out_features", "num_embeddings", "padding_idx")
        if hasattr(layer, k)
    }
    layer.__dict__["_zf_how"] = how
    layer.__dict__["_zf_slices"] = (n, r, conv)
    layer._zf_replicas = _replica_group(m, share) if share > 1 else None
    cls = type(layer)
    key = (cls, how)
    if key not in _CLASSES:
        if conv:
            base = _RowConv1D if how == ROWWISE else _ColumnConv1D
        else:
            base = {
                COLWISE: _ColumnLinear,
                ROWWISE: _RowLinear,
                EMBEDDING: _VocabEmbedding,
                HEAD: _VocabHead,
                INSIDE: _InsideLinear,
                SUMMED: _SummedLinear,
            }[how]
        _CLASSES[key] = type(f"{base.__name__[1:]}{cls.__name__}", (base, cls), {"__module__": __name__})
    layer.__class__ = _CLASSES[key]
    layer._zf_group, layer._zf_mesh = m.tensor_group, m
    if conv:
        if how == ROWWISE:
            layer.nx //= n
        else:
            layer.nf //= n
    elif how == SUMMED:
        pass
    elif how in _COLUMNS:
        layer.out_features //= n  # n: the slices (fewer than the ranks when they share key/value heads)
    elif how == ROWWISE:
        layer.in_features //= n
    else:
        rows = layer.num_embeddings // n
        layer._zf_rows = (r * rows, (r + 1) * rows)
        pad = layer.padding_idx
        layer.padding_idx = pad - r * rows if pad is not None and r * rows <= pad < (r + 1) * rows else None
        layer.num_embeddings = rows
    return out


def _rule(how: str, pname: str, conv: bool) -> tuple[int, int] | None:
    """How a split layer's parameter ``pname`` is cut: (dimension, chunks cut alike), or None (whole);
    ``conv``: a Conv1D, whose weight is ``(in, out)``."""
    if how == SUMMED or (how == ROWWISE and pname == "bias"):
        return None  # whole on every rank (a row-wise layer's bias is added after the all-reduce)
    if how == ROWWISE:
        return (0 if conv else 1), 1
    dim = 1 if conv and pname == "weight" else 0  # output features, or the vocabulary's rows
    return dim, (3 if how == COLWISE_QKV else 1)  # a fused q/k/v: each third split alike, side by side again


def _slice(t: torch.Tensor, how: str, pname: str, n: int, r: int, conv: bool = False) -> torch.Tensor:
    """Rank ``r``'s slice (of ``n``) of a split layer's parameter ``pname``, as :func:`_rule` says."""
    rule = _rule(how, pname, conv)
    return t if rule is None else cut_slice(t, (*rule, n, r))


class _Split:
    """What a split layer's class adds: its slices' initial values when it was built on the meta device."""

    _zf_seq = False  # sequence parallelism: the residual stream around this layer is split over the sequence

    def zf_materialise(self, path: str, values: Callable[[], dict]) -> dict[str, torch.Tensor]:
        """This layer's slices' initial values by name: ``values()`` gives its whole parameters' (by
        ``init_fn`` or its model's initialisation), which it is for the while (shard_params' sharded init,
        one layer at a time), then each is sliced."""
        d = self.__dict__
        source, whole, how = d["_zf_source"], d["_zf_whole"], d["_zf_how"]
        held = {k: self._parameters[k] for k in source}
        split = {k: getattr(self, k) for k in whole}
        cls = type(self)
        self._parameters.update(source)
        for k, v in whole.items():
            setattr(self, k, v)
        self.__class__ = cls.__bases__[1]  # the layer's own class (the split class is (_Kind, cls))
        try:
            got = values()
        finally:
            self.__class__ = cls
            self._parameters.update(held)
            for k, v in split.items():
                setattr(self, k, v)
        prefix = f"{path}." if path else ""
        n, r, conv = d["_zf_slices"]
        for k in source:
            got[prefix + k] = _slice(got[prefix + k], how, k, n, r, conv)
        return got


class _SplitLinear(_Split, nn.Linear):
    _zf_group: Any


class _ColumnLinear(_SplitLinear):
    """A Linear holding a slice of its output features: input copied in (gradient all-reduced)."""

    _zf_replicas: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self._zf_replicas is not None:  # a key/value head several ranks hold: their gradients summed
            w = _SumGrad.apply(w, self._zf_replicas)
        return self.zf_around(x, lambda x, b: F.linear(x, w, b))

    def zf_around(self, x: torch.Tensor, linear: Callable) -> torch.Tensor:
        """The layer's communication around ``linear(x, bias)``, its local matmul (another transform may
        compute it otherwise: ``quantize`` with its dequantized weight)."""
        b = self.bias
        if b is not None and self._zf_replicas is not None:
            b = _SumGrad.apply(b, self._zf_replicas)
        if not _seq(self):  # under sequence parallelism the region's module (or the final norm, for the
            x = _copy(x, self._zf_group)  # head) gathered the input already
        return linear(x, b)


_COPIES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("zerofn_tp_copies", default=None)


def _seq(layer: Any) -> bool:
    """Whether the sequence is split around ``layer`` now: with sequence parallelism, in training (a
    forward without gradients, ``step.apply`` and generation, runs with the whole sequence: the same math)."""
    return layer._zf_seq and torch.is_grad_enabled()


def _leave(y: torch.Tensor, group: Any, seq: bool) -> torch.Tensor:
    """A row-wise layer's partial output leaving the region: summed over the ranks (all-reduce), or with
    sequence parallelism reduce-scattered over the sequence (dimension 1)."""
    return _ReduceScatterSeq.apply(y, group) if seq else _Reduce.apply(y, group)


def _copy(x: torch.Tensor, group: Any, seq: bool = False) -> torch.Tensor:
    """``x`` entering a tensor-parallel region (with sequence parallelism: all-gathered over the sequence,
    its gradient reduce-scattered): once per tensor while a step runs, so the layers that read
    the same input (attention's q, k and v; the MLP's gate and up) share one copy, whose gradient autograd
    sums over them before the one all-reduce (Megatron's count: one per region in backward, not one per
    layer). The step's copies are kept (with their inputs, which backward keeps anyway) until it ends."""
    enter = _GatherSeq.apply if seq else _Copy.apply
    copies = _COPIES.get()
    if not x.requires_grad and not seq:
        return x
    if copies is None:
        return enter(x, group)
    found = copies.get((id(x), id(group)))
    if found is not None and found[0] is x:
        return found[1]
    copied = enter(x, group)
    copies[(id(x), id(group))] = (x, copied)
    return copied


class _ColumnConv1D(_Split, nn.Module):
    """transformers' Conv1D holding a slice of its output features (the columns of its ``(in, out)``
    weight): input copied in (gradient all-reduced)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _seq(self):  # under sequence parallelism the region's module gathered its input already
            x = _copy(x, self._zf_group)
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return y.view(*x.shape[:-1], self.nf)


class _RowConv1D(_Split, nn.Module):
    """transformers' Conv1D holding a slice of its input features (the rows of its weight): output summed
    over the ranks, then the bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = _seq(self)
        y = _leave(x @ self.weight, self._zf_group, seq)
        return y + (_SumGrad.apply(self.bias, self._zf_group) if seq else self.bias)


class _InsideLinear(_SplitLinear):
    """A Linear holding a slice of its output features whose input is already inside the region (a LoRA
    B after its A, whose output every rank computes whole)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _SummedLinear(_SplitLinear):
    """A Linear every rank holds whole, inside a region (a LoRA A beside a column-wise base): its input
    copied in, its gradients summed over the ranks (each rank's slice of what follows adds its part)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else _SumGrad.apply(self.bias, self._zf_group)
        return F.linear(_copy(x, self._zf_group), _SumGrad.apply(self.weight, self._zf_group), b)


class _RowLinear(_SplitLinear):
    """A Linear holding a slice of its input features: output summed over the ranks, then the bias
    (with sequence parallelism: reduce-scattered over the sequence, and the bias's gradient summed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.zf_around(x, lambda x, b: F.linear(x, self.weight, b))

    def zf_around(self, x: torch.Tensor, linear: Callable) -> torch.Tensor:
        """The layer's communication around ``linear(x, None)``, its local matmul, then the bias."""
        seq = _seq(self)
        y = _leave(linear(x, None), self._zf_group, seq)
        if self.bias is None:
            return y
        return y + (_SumGrad.apply(self.bias, self._zf_group) if seq else self.bias)


class _VocabEmbedding(_Split, nn.Embedding):
    """An Embedding holding a slice of the vocabulary's rows: ids outside it look up zeros, and the ranks'
    lookups are summed (each id's row comes from the one rank that holds it)."""

    _zf_rows: tuple[int, int]
    _zf_group: Any

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lo, hi = self._zf_rows
        outside = (ids < lo) | (ids >= hi)
        local = (ids - lo).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return _Reduce.apply(out, self._zf_group)


class _VocabHead(_ColumnLinear):
    """A column-wise output head over the vocabulary. In training its logits stay split: a ``DTensor``
    sharded on the last dimension, whose ``F.cross_entropy`` (under torch's ``loss_parallel``, which the
    step enters around forward and backward) is computed without gathering them; without gradients (a
    step's ``apply``, generation) the logits are gathered whole."""

    _zf_mesh: Mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        from torch.distributed.tensor import DTensor, Shard

        if self._zf_mesh.tensor == 1:  # the whole vocabulary here: plain logits (and no group to mesh over)
            return local
        if not torch.is_grad_enabled():  # the logits whole, through zerofn's collectives (counted, timed)
            n = dist.get_world_size(self._zf_group)
            rows = local.movedim(-1, 0).contiguous()
            full = rows.new_empty((rows.shape[0] * n, *rows.shape[1:]))
            C.all_gather(full.view(-1), rows.view(-1), group=self._zf_group)
            return full.movedim(0, -1)
        return DTensor.from_local(local, _device_mesh(self._zf_mesh, local.device.type), [Shard(-1)])


_DEVICE_MESHES: dict[tuple, Any] = {}


def _device_mesh(m: Mesh, device_type: str) -> Any:
    """torch's ``DeviceMesh`` over the tensor-parallel group (for the ``DTensor`` logits), made once."""
    key = (id(m.tensor_group), device_type)
    if key not in _DEVICE_MESHES:
        from torch.distributed.device_mesh import DeviceMesh

        _DEVICE_MESHES[key] = DeviceMesh.from_group(m.tensor_group, device_type)
    return _DEVICE_MESHES[key]


_REPLICAS: dict[tuple, Any] = {}  # (tensor size, ranks sharing, world) -> this rank's group of them


def _replica_group(m: Mesh, share: int) -> Any:
    """The group of the ``share`` consecutive ranks of this rank's tensor-parallel group that hold the same
    key/value head. Collective the first time (every rank makes every such group, in the same order)."""
    world = m.tensor * m.data
    key = (m.tensor, share, world, id(dist.group.WORLD))
    if key not in _REPLICAS:
        rank, mine = dist.get_rank(), None
        for start in range(0, world, share):
            g = C.new_group(list(range(start, start + share)))
            if start <= rank < start + share:
                mine = g
        _REPLICAS[key] = mine
    return _REPLICAS[key]


def _slices(prepared: dict) -> tuple:
    """(name, dim, parts, count, index) of every split parameter: how each is cut from the whole one."""
    out = []
    for path, layer in prepared.get("layers", {}).items():
        how, (n, r, conv) = layer.__dict__["_zf_how"], layer.__dict__["_zf_slices"]
        prefix = f"{path}." if path else ""
        for pname in ("weight", "bias"):
            rule = _rule(how, pname, conv)
            if layer._parameters.get(pname) is not None and rule is not None:
                out.append((prefix + pname, *rule, n, r))
    return tuple(out)


def _whole_group(prepared: dict, m: Mesh) -> Any:
    """The tensor-parallel group, over which ``step.full_params`` gathers the split parameters whole; raises
    where a split layer's weight is held quantized (each rank quantized its own slice: their codes and scales
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
    return m.tensor_group


def _replica_groups(m: Mesh) -> tuple:
    """The groups of ranks sharing key/value heads made for this mesh (their gradients' all-reduces)."""
    world = m.tensor * m.data
    return tuple(g for (t, _, w, _), g in _REPLICAS.items() if t == m.tensor and w == world and g is not None)


class _SumGrad(torch.autograd.Function):
    """Identity in forward; the gradient summed over ``group`` in backward (a parameter held alike by the
    ranks of ``group``, each of which computes part of its gradient)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous(), group=ctx.group), None


def _seq_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole sequence (dimension 1) from every rank's consecutive slice of it."""
    n = dist.get_world_size(group)
    local = x.transpose(0, 1).contiguous()
    full = local.new_empty((local.shape[0] * n, *local.shape[1:]))
    C.all_gather(full.view(-1), local.view(-1), group=group)  # flat: the rows lie back to back
    return full.transpose(0, 1).contiguous()  # one copy the layers reading it save, not one each


def _seq_reduce_scatter(x: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's slice of the sequence (dimension 1) of the sum over the ranks."""
    n = _splits_sequence(x, group)
    full = x.transpose(0, 1).contiguous()
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    C.reduce_scatter(out.view(-1), full.view(-1), group=group)
    return out.transpose(0, 1).contiguous()


def _seq_slice(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x.chunk(_splits_sequence(x, group), dim=1)[dist.get_rank(group)].contiguous()


def _splits_sequence(x: torch.Tensor, group: Any) -> int:
    """The ranks of ``group``, which must split ``x``'s sequence (dimension 1) evenly."""
    n = dist.get_world_size(group)
    if x.shape[1] % n:
        raise ValueError(
            f"tensor_parallel(sequence_parallel=True): the sequence has {x.shape[1]} positions, which {n} "
            "ranks cannot split evenly; pad the batch's sequence to a multiple of the tensor-parallel size"
        )
    return n


class _GatherSeq(torch.autograd.Function):
    """All-gather over the sequence in forward; reduce-scatter of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_reduce_scatter(grad, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter over the sequence in forward; all-gather of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_gather(grad.contiguous(), ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """This rank's slice of a sequence every rank holds whole; the gradient all-gathered in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_gather(grad.contiguous(), ctx.group), None


def _sequence_parallel(module: nn.Module, plan: dict, regions: list[str], m: Mesh, where: str) -> None:
    """Megatron's sequence parallelism: the residual stream between the regions is split over the
    sequence. The first block takes its slice of the sequence (the embedding and the masks the model builds
    before it see the whole of it); the column-wise layers all-gather it and the row-wise layers
    reduce-scatter it; the norms between run on the slice, their gradients summed over the ranks; the
    final norm's output is all-gathered, which the vocabulary-parallel head reads as it is."""
    kinds = set(plan.values())
    if HEAD not in kinds:
        raise ValueError(
            f"{where}: tensor_parallel(sequence_parallel=True) needs the output head split over the vocabulary "
            "(plan 'head'), which gathers the sequence back"
        )
    blocks = _blocks(module, plan)
    if blocks is None:
        raise ValueError(
            f"{where}: tensor_parallel(sequence_parallel=True) found no list of blocks holding the split layers "
            "(a ModuleList, as Hugging Face models keep their layers), so it cannot tell where the sequence "
            "splits; leave sequence_parallel False"
        )
    split = {id(module.get_submodule(p)) for p in plan}
    for layer in (module.get_submodule(p) for p in plan):
        if isinstance(layer, _Split) and not isinstance(layer, _VocabEmbedding):
            layer._zf_seq = True
    embedding = [module.get_submodule(p) for p, k in plan.items() if k == EMBEDDING]
    final = _final_norm(module)
    if final is None:
        raise ValueError(
            f"{where}: tensor_parallel(sequence_parallel=True) found no final norm before the head (model.norm or "
            "transformer.ln_f), where the sequence is gathered back; leave sequence_parallel False"
        )
    # modules between the regions that hold parameters of their own (the norms): gradients summed
    for path, sub in module.named_modules():
        inside = any(path.startswith(b + ".") for b in blocks[1]) or sub is final
        own = [n for n, p in sub._parameters.items() if p is not None]
        if inside and own and id(sub) not in split and sub not in embedding and not isinstance(sub, _Split):
            _sum_gradients(sub, m.tensor_group)
    first = module.get_submodule(blocks[1][0])
    hooks = [(first, _on_input(_ScatterSeq.apply, m.tensor_group))]  # installed while a step runs (_Around)
    # the final norm's output gathered whole (its gradient reduce-scattered): the model's own reshapes after it
    # (GPT-2's view by the input's length) and the head see the whole sequence
    hooks.append((final, _on_output(m.tensor_group)))
    # a region's module (attention, the MLP) gathers the sequence as it enters: the model's own reshapes by
    # its input's shape then see the whole sequence, and its column-wise layers read that input as it is
    for path in regions:
        region = module.get_submodule(path)
        hooks.append((region, _on_input(_gather_once, m.tensor_group)))
    module.__dict__["_zf_sequence_hooks"] = hooks


def _on_output(group: Any) -> Callable:
    """A forward hook gathering a module's output over the sequence, in training only."""

    def hook(mod, args, output):
        return _GatherSeq.apply(output, group) if torch.is_grad_enabled() else None

    hook.zf_after = True  # a forward hook, not a pre-hook (see _Around)
    return hook


def _region_of(path: str) -> str:
    """The module a column-wise layer's region is (attention, the MLP): its parent, past a peft LoRA
    wrapper's ``base_layer`` or adapter."""
    segs = path.split(".")
    for i, seg in enumerate(segs):
        if seg in ("base_layer", "lora_A", "lora_B"):
            segs = segs[: i - 1] + [segs[i - 1]]  # the LoRA layer's own path
            break
    return ".".join(segs).rpartition(".")[0]


def _sum_inside(module: nn.Module, plan: dict, regions: list[str], m: Mesh) -> None:
    """Modules inside a region (between its column-wise and row-wise layers) holding parameters of their own
    that are not split (Qwen3's per-head q_norm and k_norm) run on each rank's heads only: their gradients
    are summed over the group."""
    split = {id(module.get_submodule(p)) for p in plan}
    for path in regions:
        region = module.get_submodule(path)
        wrapped = [q for q, sub in region.named_modules() if _is_lora(sub)]  # peft's LoRA layers: planned already
        for sub_path, sub in region.named_modules():
            if sub is region or id(sub) in split or isinstance(sub, _Split) or _is_lora(sub):
                continue
            if any(sub_path.startswith(q + ".") for q in wrapped):  # (a row-wise base's B runs after its sum)
                continue
            if any(id(x) in split for x in sub.modules()):  # a wrapper of split layers
                continue
            if any(p is not None for p in sub._parameters.values()):
                _sum_gradients(sub, m.tensor_group)


def _sum_gradients(sub: nn.Module, group: Any) -> None:
    cls = type(sub)
    if not issubclass(cls, _SumsGradients):
        key = (cls, "seq")
        if key not in _CLASSES:
            _CLASSES[key] = type(f"SummedGradients{cls.__name__}", (_SumsGradients, cls), {"__module__": __name__})
        sub.__class__ = _CLASSES[key]
    sub._zf_group = group


def _gather_once(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _copy(x, group, True)


def _on_input(fn: Callable, group: Any) -> Callable:
    """A forward pre-hook applying ``fn(hidden_states, group)`` to a module's first input (positional, or
    the ``hidden_states`` keyword), in training only (see :func:`_seq`)."""

    def hook(mod, args, kwargs):
        if not torch.is_grad_enabled():
            return None
        if args:
            return (fn(args[0], group), *args[1:]), kwargs
        key = next((k for k in ("hidden_states", "x", "input") if k in kwargs), None)
        if key is None:
            return None
        return args, {**kwargs, key: fn(kwargs[key], group)}

    return hook


def _blocks(module: nn.Module, plan: dict) -> tuple[str, list[str]] | None:
    """The ModuleList holding the split layers, and its children's paths."""
    for path, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub):
            kids = [f"{path}.{k}" if path else k for k, _ in sub.named_children()]
            if any(any(p.startswith(k + ".") for k in kids) for p in plan):
                return path, kids
    return None


def _final_norm(module: nn.Module) -> nn.Module | None:
    """The norm a Hugging Face causal LM applies between its last block and its head."""
    inner = getattr(module, "model", None) or getattr(module, "transformer", None)
    for name in ("norm", "ln_f", "final_layernorm"):
        found = getattr(inner, name, None) if inner is not None else None
        if isinstance(found, nn.Module):
            return found
    return None


class _SumsGradients:
    """A replicated module each rank runs on its own part of the work (a norm between the regions on its
    slice of the sequence; Qwen3's q_norm on its heads): each of its parameters is read through an identity
    whose backward sums the gradient over the tensor-parallel group."""

    _zf_group: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = {n: p for n, p in self._parameters.items() if p is not None and p.requires_grad}
        if not own or not torch.is_grad_enabled():
            return super().__call__(*args, **kwargs)
        for n, p in own.items():
            self._parameters[n] = _SumGrad.apply(p, self._zf_group)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._parameters.update(own)


class _Copy(torch.autograd.Function):
    """Identity in forward; the gradient all-reduced over the tensor-parallel group in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous(), group=ctx.group), None


class _Reduce(torch.autograd.Function):
    """All-reduce over the tensor-parallel group in forward; identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x.contiguous(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ---------------------------------------------------------------- the batch check


class _Around:
    """Around forward and backward: before the model's call, the ranks of a tensor-parallel group compare
    what they feed it (structure, shapes and a checksum of the values; one small all-reduce); with a head
    split over the vocabulary, torch's ``loss_parallel`` (its cross-entropy on the split logits); with
    sequence parallelism, its hooks (the first block's slice, the regions' gathers). All only while the
    step runs."""

    def __init__(self, m: Mesh, model: Callable):
        self.m, self.model, self.hooks, self.loss = m, model, [], None

    def __enter__(self):
        self.copies = _COPIES.set({})
        if self.m.tensor > 1:
            module = self.model().module
            self.hooks.append(module.register_forward_pre_hook(self._check, with_kwargs=True))
            for sub, fn in module.__dict__.get("_zf_sequence_hooks", ()):  # sequence parallelism's, for the step
                if getattr(fn, "zf_after", False):
                    self.hooks.append(sub.register_forward_hook(fn))
                else:
                    self.hooks.append(sub.register_forward_pre_hook(fn, with_kwargs=True))
            if any(isinstance(x, _VocabHead) for x in module.modules()):
                from torch.distributed.tensor.parallel import loss_parallel

                self.loss = loss_parallel()
                self.loss.__enter__()
        return self

    def __exit__(self, *exc):
        if self.loss is not None:
            self.loss.__exit__(*exc)
        for h in self.hooks:
            h.remove()
        self.hooks = []
        _COPIES.reset(self.copies)
        return False

    def _check(self, module, args, kwargs):
        if not torch.is_grad_enabled() and not module.training:
            return None
        tree = (args, kwargs)
        leaves = [t.detach().double() for t in T.tree_leaves(tree) if isinstance(t, torch.Tensor)]
        dev = leaves[0].device if leaves else torch.device("cpu")
        digest = torch.full((), float(T.treespec_digest(tree) & ((1 << 52) - 1)), dtype=torch.float64, device=dev)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        # Three numbers whatever the batch (so that the all-reduce's size never differs between the ranks):
        # the structure and shapes, and a weighted sum and sum of squares of the values; made and compared
        # on the device, read by no one (the step skips the update and raises at the next wait).
        total = sum((t.sum() * (i + 1) for i, t in enumerate(leaves)), zero)
        squares = sum((t.square().sum() for t in leaves), zero)
        key = torch.stack([digest, total, squares])
        both = torch.cat([key, -key])
        C.all_reduce(both, "max", group=self.m.tensor_group)
        differ = (both[:3] != -both[3:]).any()  # the max is the min everywhere when they agree
        report(
            differ,
            "tensor_parallel: the ranks of a tensor-parallel group fed different batches (their structure, shapes "
            "or values differ); that update was skipped and the state kept as it was. Every rank of a group feeds "
            "the micro-batch of its data-parallel rank: batch[zf.collectives.data_rank(step)] (the global rank // "
            "size).",
        )
        return None
