"""``init``'s part: the planned layers checked against the model, then split to this rank's slices.

:func:`prepare` checks every planned layer before it splits any (a refusal changes nothing): that it is
there and of a kind the plan can split, that its features and attention heads split evenly over the
tensor-parallel axis (key/value heads fewer than the ranks are shared, Megatron's grouped-query rule),
then splits them (``_layers``), makes the modules inside a region that hold parameters of their own
sum their gradients, and sets up sequence parallelism when asked.
"""

from __future__ import annotations

from torch import nn
from zerofn.transforms.tensor_parallel._layers import Split, split_layer, sum_gradients
from zerofn.transforms.tensor_parallel._plan import (
    COLUMNS,
    COLWISE,
    COLWISE_QKV,
    EMBEDDING,
    ROWWISE,
    SUMMED,
    is_conv1d,
    is_lora,
    kv_share,
    plan_for,
)
from zerofn.transforms.tensor_parallel._sequence import sequence_parallel

from zerofn.functional import Functional
from zerofn.mesh import Mesh
from zerofn.storage import ParamSplit, split_params


def prepare(
    plan: tuple | None,
    sequence: bool,
    m: Mesh,
    split: ParamSplit,
    functional: Functional | None,
    where: str,
    prepared: dict,
) -> ParamSplit:
    """The extension's ``prepare`` at ``init``: the planned layers of ``functional``'s model checked, then
    split to this rank's slices on ``m``'s tensor-parallel axis (with ``sequence``, sequence parallelism
    set up too); returns ``split`` with the sliced parameters in place of the whole ones. ``prepared``
    records the model's split layers for the step's other hooks."""
    if functional is None:
        raise ValueError(
            f"{where}: tensor_parallel splits the model's Linear layers, so it needs the params of "
            "zf.functional(model): step.init(apply.params), apply = zf.functional(model)"
        )
    module = functional.module
    size = m.size("tp")
    plan = plan_for(plan, size, module, where)
    layers = {}
    for path, how in plan.items():  # every layer checked before any is split: a refusal changes nothing
        try:
            layer = module.get_submodule(path)
        except AttributeError:
            raise ValueError(f"{where}: tensor_parallel's plan names {path!r}, which the model does not have") from None
        if isinstance(layer, Split):
            continue
        if hasattr(layer, "_zf_quantized"):
            raise ValueError(
                f"{where}: tensor_parallel's plan names {path!r}, which quantize holds quantized already: apply "
                "quantize around tensor_parallel (quantize(tensor_parallel(step, size))), so that each rank "
                "quantizes its own slice"
            )
        want = nn.Embedding if how == EMBEDDING else nn.Linear
        conv = is_conv1d(layer) and how in (COLWISE, COLWISE_QKV, ROWWISE)
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
        share = _check_heads(module, path, how, size, where)
        if how == EMBEDDING:
            features = layer.num_embeddings
        elif how == SUMMED:
            features = 0  # not split
        elif how in COLUMNS:
            features = layer.nf if conv else layer.out_features
        else:
            features = layer.nx if conv else layer.in_features
        parts = 3 if how == COLWISE_QKV else 1
        if features % (parts * (size // share)):
            raise ValueError(
                f"{where}: tensor_parallel({size}): {path!r} has {features} "
                f"{'input' if how == ROWWISE else 'output'} features, which {size} ranks cannot split evenly"
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
        names.update(split_layer(layer, how, m, path, split.named, share, replaced))
        done[path] = layer
        if how == COLWISE_QKV:  # GPT-2's attention splits the fused output by its (now local) width
            attention = module.get_submodule(path.rpartition(".")[0])
            for attr in ("split_size", "num_heads", "embed_dim"):
                if isinstance(getattr(attention, attr, None), int):
                    setattr(attention, attr, getattr(attention, attr) // size)
        if share > 1:  # the attention's query heads per key/value head, as this rank holds them
            attention = module.get_submodule(_projection(path).rpartition(".")[0])
            if hasattr(attention, "num_key_value_groups"):
                attention.num_key_value_groups = attention.config.num_attention_heads // size
    if size > 1:
        # the modules a column-wise layer's region is (attention, the MLP), past peft's LoRA wrappers
        regions = sorted({_region_of(p) for p, k in plan.items() if k in (COLWISE, COLWISE_QKV)})
        _sum_inside(module, plan, regions, m)
        if sequence:
            sequence_parallel(module, plan, regions, m, where)
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
    share = kv_share(heads, kv, size) if leaf in ("k_proj", "v_proj") and kv else 1
    if share is None:
        raise ValueError(
            f"{where}: tensor_parallel({size}): {path!r} holds {kv} key/value heads, which {size} ranks can "
            f"neither split whole nor share (each rank's query heads must read one key/value head: the size "
            f"must divide {kv}, or be a multiple of it that divides the {heads} attention heads)."
        )
    return share


def _projection(path: str) -> str:
    """The attention projection a path lies in (``...self_attn.k_proj`` for its peft ``base_layer`` or
    ``lora_B.default``), or the path itself."""
    segs = path.split(".")
    for i in range(len(segs) - 1, -1, -1):
        if segs[i] in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return ".".join(segs[: i + 1])
    return path


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
        wrapped = [q for q, sub in region.named_modules() if is_lora(sub)]  # peft's LoRA layers: planned already
        for sub_path, sub in region.named_modules():
            if sub is region or id(sub) in split or isinstance(sub, Split) or is_lora(sub):
                continue
            if any(sub_path.startswith(q + ".") for q in wrapped):  # (a row-wise base's B runs after its sum)
                continue
            if any(id(x) in split for x in sub.modules()):  # a wrapper of split layers
                continue
            if any(p is not None for p in sub._parameters.values()):
                sum_gradients(sub, m.group("tp"))
