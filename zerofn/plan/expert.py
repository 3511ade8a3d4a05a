"""Expert parallelism in the planner: what one GPU holds and sends under ``expert_parallel(step, ep)``
(:class:`ExpertParallelPlan`, :func:`expert_parallel_plan`), for :func:`estimate`'s ``ep=``.

``expert_parallel`` cuts a mixture-of-experts model's routed experts over the ``ep`` GPUs of a group (an
axis of the mesh inside ``cp``, outside ``tp``: ``dp x cp x ep x tp``): each GPU holds ``experts / ep`` of
the experts of every mixture-of-experts block whole (the stacked expert weights, and biases, cut along the
expert dimension), and everything else whole: attention, the routers, the shared experts, the dense
blocks, the embeddings and the norms. The ``ep`` axis is data-parallel for all but the experts: every GPU
feeds its own micro-batch, so the micro-batches in flight are ``world / (tp x cp)``, as without it.

The ZeRO stages shard the two kinds of parameters over two groups, each reducing its own gradients:

- the rest (not the experts) over every GPU the step runs on, ``dp x cp x ep = world / tp``, as without
  expert parallelism;
- each GPU's experts over the GPUs holding the same experts (the expert-data-parallel group),
  ``world / (tp x ep)``.

So the ZeRO table of :mod:`zerofn.plan` applies to each part with its own N, and what one GPU holds is
``params - expert_params + expert_params / ep`` before ZeRO.

Traffic on the expert-parallel group: the tokens a GPU routes go to the GPUs holding their experts by an
all-to-all (the row counts exchanged first: no capacity factor, no token dropped) and come back by a second
one, in forward and again in backward: four all-to-alls per mixture-of-experts block and micro-batch, six
under remat (its recomputed forward dispatches and combines again). Each sends this GPU's routed rows, its
own block included: ``micro_batch x seq / cp x top_k x hidden x`` the activations' bytes. The counts
exchanged before each (a few integers per expert) are not counted. Per step, multiply by the micro-batches
a step accumulates.

Example:
    >>> from zerofn.plan import expert_parallel_plan
    >>> x = expert_parallel_plan(size=8, world=16, tp=1, cp=1, experts=8, top_k=2, moe_layers=32,
    ...     params=46_702_792_704, expert_params=45_097_156_608, hidden=4096, seq=4096, micro_batch=1)
    >>> x.local_experts, x.data, x.group, x.expert_group              # Mixtral 8x7B over 16 GPUs, ep 8
    (1, 16, 16, 2)
    >>> round(x.local / 1e9, 2), round(x.exchange / 2**20, 1), round(x.traffic(remat=False) / 1e9, 2)
    (7.24, 64.0, 8.59)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ExpertParallelPlan", "expert_parallel_plan"]


@dataclass(frozen=True)
class ExpertParallelPlan:
    """What ``expert_parallel(step, size)`` cuts, holds and sends (:func:`expert_parallel_plan`).

    Attributes:
        size: GPUs per expert-parallel group (``ep``).
        experts: routed experts per mixture-of-experts block.
        local_experts: the experts one GPU holds of each block, ``experts / size``.
        top_k: the experts each token goes to.
        moe_layers: the mixture-of-experts blocks (one dispatch and one combine each).
        data: micro-batches in flight, ``world / (tp x cp)``: every GPU of a group feeds its own.
        group: the GPUs the ZeRO stages shard all but the experts over, ``world / tp``.
        expert_group: the GPUs holding the same experts, over which the ZeRO stages shard them,
            ``world / (tp x size)``.
        params: the model's parameters, all of them.
        expert_params: the routed experts' parameters over every block, whole.
        local: parameters on one GPU: ``params - expert_params + expert_params / size``.
        tokens: tokens of a micro-batch one GPU routes, ``micro_batch x seq / cp`` (0 without ``seq`` and
            ``micro_batch``).
        exchange: bytes one GPU sends in one all-to-all of one block: ``tokens x top_k x hidden x`` the
            activations' bytes (its own rows included).
    """

    size: int
    experts: int
    local_experts: int
    top_k: int
    moe_layers: int
    data: int
    group: int
    expert_group: int
    params: int
    expert_params: int
    local: int
    tokens: int
    exchange: int

    @property
    def local_expert_params(self) -> int:
        """The experts' parameters on one GPU, ``expert_params / size``."""
        return self.expert_params // self.size

    @property
    def replicated(self) -> int:
        """Parameters whole on every GPU of an expert-parallel group: all but the routed experts."""
        return self.params - self.expert_params

    def traffic(self, *, remat: bool) -> int:
        """Bytes one GPU sends on its expert-parallel group per micro-batch: 4 all-to-alls a block (dispatch and
        combine, in forward and in backward), 6 under remat (its recomputed forward runs its 2 again)."""
        return (6 if remat else 4) * self.moe_layers * self.exchange


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_parallel_plan(
    *,
    size: int,
    world: int,
    tp: int,
    cp: int,
    experts: int,
    top_k: int,
    moe_layers: int,
    params: int,
    expert_params: int,
    hidden: int | None,
    seq: int | None,
    micro_batch: int | None,
    activation_bytes: int = 2,
    shaped: bool = True,
) -> ExpertParallelPlan:
    """The cut of a mixture-of-experts model's experts over ``size`` GPUs per group, as :func:`estimate` counts
    it. ``experts``, ``top_k``, ``moe_layers`` and ``expert_params`` are the model's
    (:class:`~zerofn.plan.ModelShape`); ``shaped`` False: none are known (a bare parameter count).

    Raises:
        ValueError: ``size`` not an int >= 1; no model shape, or a dense model; ``size`` not dividing the
            experts of a block, or the data-parallel ranks ``world / (tp x cp)``.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"estimate: ep must be an int >= 1 (GPUs per expert-parallel group), got {size!r}")
    if not shaped:
        raise ValueError(
            f"estimate: ep={size} cuts a mixture-of-experts model's experts, which a parameter count does not "
            "say: pass a ModelShape of a mixture-of-experts config (zerofn.plan.model_shape(config); python -m "
            "zerofn plan --model config.json), Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 or GPT-OSS"
        )
    if experts <= 1 or not moe_layers:
        raise ValueError(
            f"estimate: ep={size} cuts a mixture-of-experts model's experts over the GPUs of a group, and this "
            "model is dense (one MLP a block: no num_local_experts, num_experts or n_routed_experts above 1 in its config). "
            "Plan it without ep (python -m zerofn plan: leave --ep out), with tp or cp for a dense model's "
            "parallelism, or pass a mixture-of-experts config."
        )
    data = world // (tp * cp)
    if experts % size:
        fit = [d for d in _divisors(experts) if data % d == 0]
        raise ValueError(
            f"estimate: ep={size} does not divide the model's {experts} experts per block: each GPU of an "
            f"expert-parallel group holds experts / ep of them whole. Pick ep from {fit} (the divisors of "
            f"{experts} that divide the {data} data-parallel ranks)."
        )
    if data % size:
        fit = [d for d in _divisors(data) if experts % d == 0]
        raise ValueError(
            f"estimate: ep={size} does not divide the {data} data-parallel ranks (world {world} / (tp {tp} x "
            f"cp {cp})) the expert-parallel groups are cut from (the mesh is dp x cp x ep x tp). Pick ep from "
            f"{fit}, or plan a multiple of {size * tp * cp} GPUs."
        )
    tokens = int(micro_batch or 0) * int(seq or 0) // cp
    exchange = tokens * int(top_k) * int(hidden or 0) * int(activation_bytes)
    return ExpertParallelPlan(
        size=size,
        experts=experts,
        local_experts=experts // size,
        top_k=int(top_k),
        moe_layers=int(moe_layers),
        data=data,
        group=world // tp,
        expert_group=world // (tp * size),
        params=params,
        expert_params=expert_params,
        local=params - expert_params + expert_params // size,
        tokens=tokens,
        exchange=exchange,
    )
