"""Sequence parallelism (Megatron-SP): the residual stream between the regions split over the sequence.

:func:`sequence_parallel` marks the split layers (their communication then goes over the sequence:
all-gather in, reduce-scatter out), makes the modules between the regions that hold parameters (the
norms) sum their gradients over the group, and records the hooks a step installs while it runs (the
batch check's context does): the first block takes its slice of the sequence, each region's module
gathers it as it enters, and the final norm's output is gathered back whole for the head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from zerofn.transforms.tensor_parallel._autograd import GatherSeq, ScatterSeq, copy_in
from zerofn.transforms.tensor_parallel._layers import Split, VocabEmbedding, sum_gradients
from zerofn.transforms.tensor_parallel._plan import EMBEDDING, HEAD

from zerofn.mesh import Mesh


def sequence_parallel(module: nn.Module, plan: dict, regions: list[str], m: Mesh, where: str) -> None:
    """Megatron's sequence parallelism: the residual stream between the regions is split over the
    sequence. The first block takes its slice of the sequence (the embedding and the masks the model builds
    before it see the whole of it); the column-wise layers all-gather it and the row-wise layers
    reduce-scatter it; the norms between run on the slice, their gradients summed over the ranks; the
    final norm's output is all-gathered, which the vocabulary-parallel head reads as it is."""
    kinds, group = set(plan.values()), m.group("tp")
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
        if isinstance(layer, Split) and not isinstance(layer, VocabEmbedding):
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
        if inside and own and id(sub) not in split and sub not in embedding and not isinstance(sub, Split):
            sum_gradients(sub, group)
    first = module.get_submodule(blocks[1][0])
    hooks = [(first, _on_input(ScatterSeq.apply, group))]  # installed while a step runs (Around)
    # the final norm's output gathered whole (its gradient reduce-scattered): the model's own reshapes after it
    # (GPT-2's view by the input's length) and the head see the whole sequence
    hooks.append((final, _on_output(group)))
    # a region's module (attention, the MLP) gathers the sequence as it enters: the model's own reshapes by
    # its input's shape then see the whole sequence, and its column-wise layers read that input as it is
    for path in regions:
        region = module.get_submodule(path)
        hooks.append((region, _on_input(_gather_once, group)))
    module.__dict__["_zf_sequence_hooks"] = hooks


def _on_output(group: Any) -> Callable:
    """A forward hook gathering a module's output over the sequence, in training only."""

    def hook(mod, args, output):
        return GatherSeq.apply(output, group) if torch.is_grad_enabled() else None

    hook.zf_after = True  # a forward hook, not a pre-hook (see Around)
    return hook


def _gather_once(x: torch.Tensor, group: Any) -> torch.Tensor:
    return copy_in(x, group, True)


def _on_input(fn: Callable, group: Any) -> Callable:
    """A forward pre-hook applying ``fn(hidden_states, group)`` to a module's first input (positional, or
    the ``hidden_states`` keyword), in training only (a forward without gradients runs with the whole sequence)."""

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
