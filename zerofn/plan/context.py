"""Context parallelism in the planner: what one GPU holds and sends under ``context_parallel(step, cp)``
(:class:`ContextParallelPlan`, :func:`context_parallel_plan`), for :func:`estimate`'s ``cp=``.

``context_parallel`` cuts every micro-batch's sequence over the ``cp`` ranks of a group, from the embedding
to the loss: each GPU computes ``seq / cp`` of its tokens, so every activation that is per token (the
blocks' saved tensors, remat's kept inputs, the loss's gradient of the hidden states) is ``1 / cp`` of what
one GPU would hold for the whole sequence. Parameters are whole along ``cp``, and the step (with the ZeRO
stages' buckets) runs on the group over the data-parallel ranks and the ``cp`` ones together, so the state
is sharded over ``dp x cp = world / tp`` ranks, as without context parallelism: what ``cp`` buys is the
sequence, not the state. The micro-batches in flight are ``world / (tp x cp)``.

Attention is where the tokens meet, two ways:

- ``"ulysses"``: q, k and v each go through one all-to-all, from this rank's tokens for all heads to the
  whole sequence for ``heads / cp`` heads, and the output through one back. Each exchange moves this rank's
  tokens' share of the tensor (its own block included): per layer and direction ``bytes(q) + bytes(k) +
  bytes(v) + bytes(out)``, key/value heads fewer than ``cp`` repeated to ``cp`` before the exchange. Forward
  and backward each, and remat's recompute once more. The query heads (on a GPU, after ``tensor_parallel``)
  must be a multiple of ``cp``, and the key/value heads a multiple or a divisor of it.
- ``"ring"``: the key/value blocks travel around the ring. With ``n = micro_batch x kv_heads x (seq / cp) x
  head_dim`` elements of k (and of v) and ``E`` bytes each, a rank sends ``(cp - 1) 2 n E`` in forward and
  ``(cp - 1) 2 n E + cp 2 n 4`` in backward (the blocks again, and ``cp`` trips of the float32 dk/dv
  accumulator), remat's recompute the forward's again. Any number of heads.

The sequence must cut into the layout's equal chunks (:func:`layout_unit`): ``cp`` slices for Ulysses,
``2 cp`` chunks for ring (each rank holds two from opposite ends, which balances causal attention's work).

Example:
    >>> from zerofn.plan import context_parallel_plan
    >>> c = context_parallel_plan(size=8, method="ulysses", world=8, tp=1, layers=32, heads=32, kv_heads=8,
    ...     head_dim=128, seq=65536, micro_batch=1, activation_bytes=2)
    >>> c.data, c.group, c.unit, c.tokens                          # micro-batches in flight, ZeRO's ranks
    (1, 8, 8, 8192)
    >>> round(c.exchange / 2**20, 1), round(c.traffic(remat=True) / 1e9, 2)  # one layer and direction; a step
    (160.0, 16.11)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METHODS", "ContextParallelPlan", "context_parallel_plan", "layout_unit", "ulysses_heads_ok"]

METHODS = ("ulysses", "ring")  # zerofn.transforms.context_parallel.METHODS


def layout_unit(cp: int, method: str) -> int:
    """The sequence lengths a ``cp`` group runs are multiples of this: ``cp`` (Ulysses' slices) or ``2 cp``
    (ring's chunks, two a rank), as ``context_parallel`` cuts them."""
    return 2 * cp if method == "ring" else cp


def ulysses_heads_ok(q_heads: int, kv_heads: int, cp: int) -> bool:
    """Whether Ulysses can split ``q_heads`` query heads over ``cp`` ranks and split or share ``kv_heads`` key/value
    heads (the heads on one GPU, after tensor parallelism), as the transform checks them."""
    return q_heads % cp == 0 and (kv_heads % cp == 0 or cp % kv_heads == 0)


@dataclass(frozen=True)
class ContextParallelPlan:
    """What ``context_parallel(step, size, method=method)`` cuts and sends (:func:`context_parallel_plan`).

    Attributes:
        size: GPUs per context-parallel group (``cp``).
        method: ``"ulysses"`` or ``"ring"``.
        data: data-parallel ranks, micro-batches in flight: ``world / (tp x cp)``.
        group: the ranks the step and the ZeRO stages run on, ``dp x cp = world / tp``.
        unit: the layout unit (:func:`layout_unit`); the sequence is a multiple of it.
        layers: attention layers (one exchange set each).
        tokens: tokens of a micro-batch one GPU computes, ``micro_batch x seq / cp`` (0 without ``seq`` and
            ``micro_batch``).
        exchange: bytes one rank sends per attention layer and direction: Ulysses' q, k, v and output (the
            four all-to-alls), ring's k and v blocks ``cp - 1`` times (0 without the shapes).
        accumulator: ring only: bytes of the float32 dk/dv accumulator a rank sends in one layer's backward,
            ``cp`` trips of ``2 n 4`` (0 for Ulysses).
    """

    size: int
    method: str
    data: int
    group: int
    unit: int
    layers: int
    tokens: int
    exchange: int
    accumulator: int = 0

    def traffic(self, *, remat: bool) -> int:
        """Bytes one rank sends on its context-parallel group per micro-batch: each layer's exchanges in forward
        and in backward (with ring's accumulator), and under remat once more for the recomputed forward."""
        return self.layers * ((3 if remat else 2) * self.exchange + self.accumulator)


def context_parallel_plan(
    *,
    size: int,
    method: str,
    world: int,
    tp: int,
    layers: int | None,
    heads: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    seq: int | None,
    micro_batch: int | None,
    activation_bytes: int = 2,
    hidden: int | None = None,
) -> ContextParallelPlan:
    """The cut of every micro-batch's sequence over ``size`` GPUs per group, as :func:`estimate` counts it.

    ``heads`` and ``kv_heads`` are the model's; on one GPU there are ``heads / tp`` query heads and
    ``max(1, kv_heads / tp)`` key/value heads (tensor parallelism's share). ``head_dim`` defaults to
    ``hidden / heads``.

    Raises:
        ValueError: ``size`` not an int >= 1, not dividing ``world / tp``; an unknown ``method``; under Ulysses,
            query heads on a GPU that ``size`` does not divide, or key/value heads it neither divides nor is a
            multiple of (use ring); a ``seq`` that is not a multiple of the layout unit.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"estimate: cp must be an int >= 1 (GPUs per context-parallel group), got {size!r}")
    if method not in METHODS:
        raise ValueError(f"estimate: cp_method must be one of {list(METHODS)}, got {method!r}")
    group = world // tp
    if group % size:
        fit = [d for d in range(1, group + 1) if group % d == 0]
        raise ValueError(
            f"estimate: cp={size} does not divide world / tp = {group} ({world} GPUs / tp {tp}), the GPUs the "
            f"context-parallel groups are cut from (the mesh is dp x cp x tp). Pick cp from {fit}, or plan a "
            f"multiple of {size * tp} GPUs."
        )
    q = kv = None
    if heads:
        q = max(1, int(heads) // tp)
        kv = max(1, int(kv_heads or heads) // tp)
        if method == "ulysses" and not ulysses_heads_ok(q, kv, size):
            fit = [d for d in range(1, group + 1) if group % d == 0 and ulysses_heads_ok(q, kv, d)]
            raise ValueError(
                f"estimate: cp={size} with cp_method='ulysses' splits attention's heads over the group, but a GPU "
                f"holds {q} query and {kv} key/value heads (the model's {heads} and {kv_heads or heads}"
                f"{f' over tp {tp}' if tp > 1 else ''}): the query heads must be a multiple of cp and the key/value "
                f"heads a multiple or a divisor of it. Use cp_method='ring' (python -m zerofn plan: --cp-method "
                f"ring), which keeps every head, or pick cp from {fit}."
            )
    unit = layout_unit(size, method)
    if seq and int(seq) % unit:
        up = -(-int(seq) // unit) * unit
        raise ValueError(
            f"estimate: seq={seq} does not cut into the {unit} equal chunks cp={size} with cp_method={method!r} "
            f"makes ({'two a rank, ring' if method == 'ring' else 'one a rank'}): plan a multiple of {unit}, such as "
            f"{up} (the sequence padded to it)."
        )
    tokens = int(micro_batch or 0) * int(seq or 0) // size
    exchange = accumulator = 0
    if tokens and q and layers:
        d = int(head_dim or (int(hidden or 0) // int(heads)))
        a = int(activation_bytes)
        if method == "ulysses":
            # q and the output for this GPU's query heads; k and v for its key/value heads, repeated to cp
            exchange = tokens * d * a * (2 * q + 2 * max(kv, size))
        else:
            n = tokens * kv * d  # elements of this rank's k block (and of its v block)
            exchange = (size - 1) * 2 * n * a
            accumulator = size * 2 * n * 4
    return ContextParallelPlan(
        size=size,
        method=method,
        data=group // size,
        group=group,
        unit=unit,
        layers=int(layers or 0),
        tokens=tokens,
        exchange=exchange,
        accumulator=accumulator,
    )
