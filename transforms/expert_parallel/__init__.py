"""``expert_parallel``: each rank of an ``ep`` axis holds its experts whole, and tokens travel, not weights.

ZeRO-3 gathers every expert's weights on every rank for every step although each token uses ``k`` of
``E``. Under ``expert_parallel(step, size)`` the ``size`` ranks of an ``ep`` group each hold ``E / size``
experts of every MoE layer whole (the stacked 3-D expert weights cut along the expert dimension), and in
every MoE layer the tokens each rank routed go to the ranks that hold their experts by an all-to-all whose
sizes are exchanged first, and come back by a second one (:mod:`._dispatch`): dropless (no capacity
factor, no token dropped, a rank may receive none), exact (the sums of one process, in another order).

Everything outside the experts (attention, embeddings, routers, norms, shared experts) stays
data-parallel: every rank of the ``ep`` axis feeds a micro-batch of its own, and
``zf.collectives.data_rank(step)`` counts the axis (the claim's ``feeds``). The step runs on the group over
the data-parallel axes and ``ep``; ZeRO's stages shard the non-expert parameters over all of it and the
experts over the ranks that hold the same experts (``zerofn.collectives.without("ep")``, DeepSpeed's
expert-data-parallel group), each group's gradients reduced on its own group.

The experts are found in Hugging Face models without a plan (:mod:`._hf`): the experts modules of
transformers' experts interface, as in Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and GPT-OSS; the
model's own experts implementation computes the local experts.

On a step that already has a mesh (``tensor_parallel`` applied first), ``ep`` joins it outside ``tp``;
``context_parallel`` joins outside ``ep``, so apply it after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofn.transforms.expert_parallel._dispatch import EPLayer, dispatch_forward
from zerofn.transforms.expert_parallel._hf import IMPLEMENTATION, cut_experts

from zerofn.extension import Extension
from zerofn.mesh import Mesh, for_step
from zerofn.moe import experts_modules
from zerofn.sharding import Claim, Shard
from zerofn.step import Step, reapply, transform
from zerofn.storage import ParamSplit, split_params

__all__ = [
    "IMPLEMENTATION",
    "EPLayer",
    "ExpertParallelOptions",
    "dispatch_forward",
    "expert_parallel",
    "experts_modules",
]


@dataclass(frozen=True)
class ExpertParallelOptions:
    """What ``expert_parallel`` was asked for (compared by value when it is applied again)."""

    size: int


@transform
def expert_parallel(step: Step, size: int, /) -> Step:
    """Hold ``1 / size`` of every MoE layer's experts on each rank of an ``ep`` group and send the tokens to
    them (see the module).

    Args:
        step: a Step (ZeRO's stages, ``amp``, ``remat``, ``offload``, ``quantize`` applied before or after;
            ``tensor_parallel`` before, ``context_parallel`` after). Called without it, returns a decorator.
        size: ranks per expert-parallel group; it must divide the world size and every layer's experts.

    Returns:
        The rewritten Step, named ``expert_parallel(...)``, running on the group over the data-parallel
        ranks and the ``ep`` ones.

    Raises:
        ValueError: a ``size`` that is not an int >= 1 or does not divide the world; at ``init``: params not
            from ``zf.functional``, a model with no experts module it can find, experts ``size`` does not
            divide.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"expert_parallel: size must be an int >= 1 (ranks per expert-parallel group), got {size!r}")
    m = for_step(step.mesh, "expert_parallel", "ep", size)
    options = ExpertParallelOptions(size)
    have = step.extension("expert_parallel")
    if reapply(step, "expert_parallel", have and have.options, options, "splits the experts"):
        return step
    # The token exchanges' group: the ep ranks, apart from the mesh's own group over them, which the step's
    # gradient reductions use where ep spans the step's group (see zerofn.mesh.Mesh.own_group).
    exchange = m.own_group("ep", "expert_parallel")
    prepared: dict = {}  # "names": the parameters this step's init cut last
    out = step.extend(
        Extension(
            "expert_parallel",
            options,
            prepare=lambda split, f, where: _prepare(m, exchange, split, f, where, prepared),
            prepare_first=True,  # quantize, applied before or after, then holds each rank's experts
        )
    )
    claim = Claim(
        "ep", "expert_parallel", placements=lambda: _placements(prepared), groups=lambda: (exchange,), feeds=True
    )
    return out.claim(claim, m)


def _prepare(m: Mesh, exchange: Any, split: ParamSplit, functional: Any, where: str, prepared: dict) -> ParamSplit:
    """At ``init``: the model's experts cut to this rank's (dim 0); ``split`` with the cut parameters."""
    if functional is None:
        raise ValueError(
            f"{where}: expert_parallel cuts the model's experts, so it needs the params of zf.functional(model): "
            "step.init(apply.params), apply = zf.functional(model)"
        )
    cut = cut_experts(functional.module, exchange, m.size("ep"), m.coordinate("ep"), where)
    prepared["module"] = functional.module
    functional.refresh()
    named = {k: cut.get(k, v) for k, v in split.named.items()}
    out = split_params(named, where)
    return out._replace(trainable={k: out.named[k] for k in split.trainable})


def _placements(prepared: dict) -> dict[str, Shard]:
    """Each parameter of a cut experts module stacked along its experts, as the model holds it now (the
    weights, their biases, or the parts ``quantize`` holds them as, stacked per expert): ``Shard(0)`` on
    ``ep``."""
    module = prepared.get("module")
    if module is None:
        return {}
    out = {}
    for path, m in experts_modules(module).items():
        if "_zf_ep" not in m.__dict__:
            continue
        for name, p in m.named_parameters(recurse=False):
            if p.dim() >= 1 and p.shape[0] == m.num_experts:
                out[f"{path}.{name}" if path else name] = Shard(0)
    return out
