"""Finding a Hugging Face model's experts and cutting them to this rank's.

transformers holds the experts of a MoE layer as one module of stacked 3-D parameters (``gate_up_proj``
``[E, ...]``, ``down_proj`` ``[E, ...]``, and their biases where the model has them: GPT-OSS), whose class
``@use_experts_implementation`` makes dispatch its forward through transformers' experts interface by
``config._experts_implementation``: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and GPT-OSS among others.
:func:`cut_experts` finds every such module, keeps this rank's ``E / size`` experts of each parameter
(dim 0), registers :func:`~._dispatch.dispatch_forward` as the implementation ``"zerofn_expert_parallel"``
and makes it the model's, the implementation it had kept for the local experts. The routers, shared
experts, attention and everything else stay as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from zerofn.transforms.expert_parallel._dispatch import EPLayer, dispatch_forward

from zerofn.moe import experts_modules

__all__ = ["IMPLEMENTATION", "cut_experts"]

IMPLEMENTATION = "zerofn_expert_parallel"


def cut_experts(module: nn.Module, group: Any, size: int, rank: int, where: str) -> dict[str, torch.Tensor]:
    """Cut every experts module of ``module`` to this rank's experts (rank ``rank`` of ``size``: experts
    ``rank E / size`` onward) and run it through the expert-parallel forward. Returns the cut parameters by
    their names in ``module`` (stacked along dim 0: the parameters the ``ep`` axis cuts).

    Raises:
        ValueError: no experts module found, or experts that ``size`` does not divide; nothing is changed
            then.
    """
    found = experts_modules(module)
    if not found:
        raise ValueError(
            f"{where}: expert_parallel found no experts module in {type(module).__name__}: it looks for modules "
            "of transformers' experts interface (a class decorated with @use_experts_implementation, as "
            "Mixtral's, Qwen2-MoE's, Qwen3-MoE's, DeepSeek-V3's and GPT-OSS's experts are) holding stacked 3-D "
            "weights (gate_up_proj / up_proj, down_proj) of num_experts along dim 0. A model whose experts are "
            "a list of modules has none: decorate its experts class with "
            "transformers.integrations.moe.use_experts_implementation over stacked weights, or train it "
            "without expert_parallel (shard_params gathers every expert)."
        )
    for path, m in found.items():
        if m.num_experts % size:
            raise ValueError(
                f"{where}: expert_parallel({size}) cannot split {path!r}'s {m.num_experts} experts over {size} "
                f"ranks: each rank holds num_experts / size whole experts. Pick a size that divides "
                f"{m.num_experts}."
            )
    _register()
    cut: dict[str, torch.Tensor] = {}
    for path, m in found.items():
        done = m.__dict__.get("_zf_ep")
        if done is not None:  # cut by an earlier init of this step: as it is
            if (done.size, done.rank) != (size, rank):
                raise ValueError(
                    f"{where}: {path!r} holds the experts of rank {done.rank} of {done.size} already (an init of "
                    f"another expert_parallel step); this step needs rank {rank} of {size}. Build the model afresh."
                )
            cut.update(
                {
                    f"{path}.{n}" if path else n: p
                    for n, p in m.named_parameters(recurse=False)
                    if p.dim() >= 1 and p.shape[0] == m.num_experts
                }
            )
            continue
        experts = m.num_experts
        local = experts // size
        lo = rank * local
        for name, p in list(m.named_parameters(recurse=False)):
            if p.dim() >= 1 and p.shape[0] == experts:
                piece = nn.Parameter(p.detach()[lo : lo + local].clone(), requires_grad=p.requires_grad)
                setattr(m, name, piece)
                cut[f"{path}.{name}" if path else name] = piece
        config = m.config
        inner = config._experts_implementation
        m._zf_ep = EPLayer(group, size, rank, experts, None if inner == IMPLEMENTATION else inner)
        m.num_experts = local
        config._experts_implementation = IMPLEMENTATION
    return cut


def _register() -> None:
    """``"zerofn_expert_parallel"`` in transformers' experts interface (once per process)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, dispatch_forward)
