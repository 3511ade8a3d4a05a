"""The plan: which of a model's layers ``tensor_parallel`` splits, and how.

A plan is ``{module path: kind}``. The kinds a user writes are ``"colwise"``, ``"rowwise"``,
``"embedding"`` and ``"head"``; the others the derived plans use for layers that need a variant:
GPT-2's fused q/k/v (``"colwise_qkv"``) and a peft LoRA layer's adapters (``"colwise_inside"``,
``"replicated_summed"``). :func:`derive_plan` finds Megatron's pairing in Hugging Face Llama-style and
GPT-2 models by their modules' paths (a LoRA layer through its wrapper, :func:`lora_plan`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

COLWISE, ROWWISE, EMBEDDING, HEAD = "colwise", "rowwise", "embedding", "head"
COLWISE_QKV = "colwise_qkv"  # column-wise over a fused q/k/v output (GPT-2's c_attn): each third split alike
INSIDE = "colwise_inside"  # column-wise whose input is already inside the region (a LoRA B after its A)
SUMMED = "replicated_summed"  # whole on every rank, its input copied into the region, its gradients summed
KINDS = (COLWISE, COLWISE_QKV, ROWWISE, EMBEDDING, HEAD, INSIDE, SUMMED)
COLUMNS = (COLWISE, COLWISE_QKV, HEAD, INSIDE)


# Llama-style models' layers by their paths' ends (Qwen2/3, Mistral too; without a gate, its up and down)
LLAMA = {
    "self_attn.q_proj": COLWISE,
    "self_attn.k_proj": COLWISE,
    "self_attn.v_proj": COLWISE,
    "self_attn.o_proj": ROWWISE,
    "mlp.gate_proj": COLWISE,
    "mlp.up_proj": COLWISE,
    "mlp.down_proj": ROWWISE,
}

_GPT2 = {"attn.c_attn": COLWISE_QKV, "attn.c_proj": ROWWISE, "mlp.c_fc": COLWISE, "mlp.c_proj": ROWWISE}


def kv_share(heads: int | None, kv_heads: int, size: int) -> int | None:
    """How many consecutive ranks of ``size`` hold each key/value head (Megatron's grouped-query rule): 1 where
    ``size`` divides the ``kv_heads`` (each rank holds ``kv_heads / size`` of them); ``size / kv_heads`` where
    ``size`` is a multiple of them that divides the attention ``heads`` (fewer key/value heads than ranks:
    each rank holds the one its query heads read); None where it is neither."""
    if kv_heads % size == 0:
        return 1
    if size % kv_heads or (heads and heads % size):
        return None
    return size // kv_heads


def is_lora(m: nn.Module) -> bool:
    """A peft LoRA layer around a Linear (``base_layer``, ``lora_A``/``lora_B`` per adapter)."""
    return isinstance(getattr(m, "base_layer", None), nn.Linear) and isinstance(
        getattr(m, "lora_A", None), nn.ModuleDict
    )


def lora_plan(path: str, m: nn.Module, how: str) -> dict[str, str]:
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


def is_conv1d(m: nn.Module) -> bool:
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
        for suffix, how in LLAMA.items():
            if (path == suffix or path.endswith("." + suffix)) and isinstance(m, nn.Linear):
                out[path] = how
            elif (path == suffix or path.endswith("." + suffix)) and is_lora(m):
                out.update(lora_plan(path, m, how))
        for suffix, how in _GPT2.items():
            if (path == suffix or path.endswith("." + suffix)) and is_conv1d(m):
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


def plan_for(given: tuple | None, size: int, module: nn.Module, where: str) -> dict[str, str]:
    """The plan ``tensor_parallel`` was given (its ``(path, kind)`` pairs), else the one derived for ``module``
    over ``size`` ranks; raises, listing the model's Linear layers, where there is neither."""
    plan = dict(given) if given is not None else derive_plan(module, size)
    if not plan:
        linears = [p for p, m in module.named_modules() if isinstance(m, nn.Linear)]
        example = {p: "colwise" for p in linears[:2]}
        raise ValueError(
            f"{where}: tensor_parallel cannot plan {type(module).__name__}: no module path ends in "
            f"{sorted(LLAMA)}. Its Linear layers: {linears[:12]}{' ...' if len(linears) > 12 else ''}. Pass "
            f"plan={{path: 'colwise' | 'rowwise'}}, a column-wise layer followed by the row-wise one that reads "
            f"its output, e.g. {example}"
        )
    return plan
