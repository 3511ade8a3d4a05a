"""A mixture of experts' frozen stacked expert weights held quantized (QLoRA on the experts).

transformers holds a MoE layer's experts as stacked 3-D weights of one module (``zerofn.moe.experts_modules``).
:func:`quantize_experts` encodes each frozen stacked weight expert by expert with the layer codec and holds
the parts stacked along the experts (``gate_up_proj_codes`` ``[E, ...]``, ...) as frozen parameters of the
module in place of the weight, so that a cut along the experts (``expert_parallel``) cuts the parts alike.
Its forward then runs through the experts implementation ``"zerofn_quantized_experts"``, which decodes the
weights into temporaries, runs the implementation the module had on them, and drops them; the whole is
checkpointed (``torch.utils.checkpoint``, non-reentrant), so backward decodes them again rather than keeping
them: between forward and backward a layer holds its parts only. Under ``expert_parallel`` it runs inside the
token exchange, on the rank's own experts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from zerofn.transforms.quantize._codecs import Codec

__all__ = ["IMPLEMENTATION", "decode_stacked", "quantize_experts", "quantized_experts"]


def quantized_experts(module: nn.Module) -> dict[str, _Held]:
    """path -> how its stacked weights are held, for every experts module of ``module`` held quantized."""
    return {
        path: m._zf_quantized_experts for path, m in module.named_modules() if "_zf_quantized_experts" in m.__dict__
    }


def decode_stacked(fmt: Codec, parts: dict[str, torch.Tensor], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A stacked weight ``[E, *shape]`` from its parts stacked along the experts (``E`` their first dim)."""
    n = next(iter(parts.values())).shape[0]
    with torch.no_grad():
        return torch.stack([fmt.decode({k: t[e] for k, t in parts.items()}, shape, dtype) for e in range(n)])


IMPLEMENTATION = "zerofn_quantized_experts"


class _Held:
    """How one experts module holds its stacked weights quantized: name -> (codec, one expert's shape, dtype,
    the parts' names), and the implementation its forward had."""

    def __init__(self, inner: str | None) -> None:
        # name -> (codec, one expert's shape, the dtype it was quantized from, the dtype it computes in, the
        # parts' names by part)
        self.weights: dict[str, tuple[Codec, torch.Size, torch.dtype, torch.dtype, dict[str, str]]] = {}
        self.inner = inner


def quantize_experts(
    module: nn.Module, named: dict, fmt: Codec, compute: torch.dtype | None, where: str, found: dict
) -> dict:
    """Hold every frozen stacked weight of the experts modules ``found`` (path -> module, of ``module``)
    quantized (see the module); returns
    ``named`` (name -> tensor, the params ``init`` holds) with each such weight replaced by its parts.

    Raises:
        ValueError: a stacked weight on the meta device (its values are needed to encode it).
    """
    out = dict(named)
    for path, m in found.items():
        if "_zf_quantized_experts" in m.__dict__:
            continue
        frozen = [
            (n, p)
            for n, p in m.named_parameters(recurse=False)
            if p.dim() == 3 and p.shape[0] == m.num_experts and not p.requires_grad
        ]
        if not frozen:
            continue
        held = _Held(None)
        for name, p in frozen:
            full = f"{path}.{name}" if path else name
            if p.device.type == "meta":
                raise ValueError(
                    f"{where}: quantize holds {full!r} (a stacked experts weight) quantized expert by expert from "
                    "its values, and it is on the meta device. Build the model with its weights (or load them) "
                    "before step.init; its Linear layers may stay on meta under shard_params."
                )
            with torch.no_grad():
                encoded = [fmt.encode(p.detach()[e]) for e in range(p.shape[0])]
            names = {}
            del m._parameters[name]
            for k in encoded[0]:
                part = nn.Parameter(torch.stack([enc[k] for enc in encoded]), requires_grad=False)
                m.register_parameter(f"{name}_{k}", part)
                names[k] = f"{name}_{k}"
                out[f"{full}_{k}"] = part
            out.pop(full, None)
            held.weights[name] = (fmt, p.shape[1:], p.dtype, compute or p.dtype, names)
        _register()
        ep = m.__dict__.get("_zf_ep")
        if ep is not None:  # inside expert parallelism's exchange: on this rank's experts
            held.inner, ep.inner = ep.inner, IMPLEMENTATION
        else:  # the config is the model's, shared by its layers: what it named before the first was held so
            held.inner = m.config._experts_implementation
            if held.inner == IMPLEMENTATION:
                held.inner = next(
                    o._zf_quantized_experts.inner
                    for o in found.values()
                    if "_zf_quantized_experts" in o.__dict__ and o.config is m.config
                )
            m.config._experts_implementation = IMPLEMENTATION
        m._zf_quantized_experts = held
    return out


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, quantized_experts_forward)


def quantized_experts_forward(module: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights):
    """The experts' forward on weights decoded from their parts, checkpointed (see the module)."""
    held: _Held = module._zf_quantized_experts
    if not torch.is_grad_enabled():
        return _run(module, held, hidden, top_k_index, top_k_weights)
    return checkpoint(_run, module, held, hidden, top_k_index, top_k_weights, use_reentrant=False)


def _run(module: Any, held: _Held, hidden, top_k_index, top_k_weights):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for name, (fmt, shape, _, dtype, names) in held.weights.items():
        parts = [{k: getattr(module, n)[e] for k, n in names.items()} for e in range(module.num_experts)]
        with torch.no_grad():
            weight = torch.stack([fmt.decode(p, shape, dtype) for p in parts])
        object.__setattr__(module, name, weight)  # a plain attribute for this call, not a parameter
    try:
        inner = ALL_EXPERTS_FUNCTIONS.get_interface(held.inner, type(module).forward.__wrapped__)
        return inner(module, hidden, top_k_index, top_k_weights)
    finally:
        for name in held.weights:
            module.__dict__.pop(name, None)
