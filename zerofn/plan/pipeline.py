"""Pipeline parallelism in the planner: what one GPU of each stage holds, keeps in flight and sends under
``pipeline_parallel(step, stages, microbatches=m, schedule=..., virtual_stages=v)``
(:class:`PipelineParallelPlan`, :func:`pipeline_parallel_plan`), for :func:`estimate`'s ``pp=``.

The mesh is ``pp x dp x cp x tp``, ``pp`` outermost: stage ``s`` runs on the ``world / pp`` consecutive ranks
``s world / pp ...``, and the ZeRO stages shard each stage's state over its ``dp x cp = world / (pp x tp)`` GPUs
(the data-parallel ranks, ``world / (pp x tp x cp)``, and the context-parallel ones, over which the state is
sharded as without ``pp``: :mod:`zerofn.plan.context`).

**The cut.** The blocks are cut into ``pp x v`` chunks, as even as they divide, the first chunks taking one more
(as ``pipeline_parallel`` cuts them); GPU rank ``i`` of the pipeline holds chunks ``i, i + pp, ..., i + (v - 1)
pp`` (``v`` = 1 but for the interleaved schedules). The first stage holds the input embedding (and learned
positions), the last the final norm and an untied head; a head tied to the embedding is held by the first stage,
which owns the shared weight, and read by the last (as the transform's ``assign`` holds it). The planner reports
the stage whose bytes per GPU are the largest: it is what must fit.

**Activations in flight** (micro-batches of ``micro_batch`` sequences each; the step takes ``micro_batch x m`` a
data-parallel rank), as torch's schedules run them, counted in micro-batches of one chunk (``L / (pp v)``
blocks):

- ``"1f1b"`` (``Schedule1F1B``): stage ``i`` (0-based) runs ``min(pp - i, m)`` forwards before its first backward
  and then one backward for each forward, so it holds ``min(pp - i, m)`` micro-batches of its own blocks: the
  first stage the most, ``min(pp, m)``.
- ``"interleaved"`` (``ScheduleInterleaved1F1B``, Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", section 2.2): ``min((v - 1) r + 2 (pp - 1 - i) + 1, v m)`` chunk
  micro-batches, ``r`` torch's micro-batches per round (``pp`` when it divides ``m``). For the first stage with
  ``r = pp``: ``pp v + pp - 1`` chunk micro-batches, ``(1 + (pp - 1) / (pp v)) x pp`` micro-batches of a stage's
  blocks: the ``(1 + (p - 1) / (p v))`` factor over 1F1B's ``p`` with which Korthikanti et al. (2022, "Reducing
  Activation Recomputation in Large Transformer Models") count the interleaved schedule's activations.
- ``"zero_bubble"`` (``ScheduleInterleavedZeroBubble``, Qi et al. 2023, "Zero Bubble Pipeline Parallelism", its
  ZB-H1 schedule): ``min((v - 1) r + (pp - 1 - i) + 1, v m)``, with ``v = 1`` the same as 1F1B's; and, since the
  weight gradients (W) of stage ``i`` run ``i`` micro-batches after their input gradients (B), the inputs W
  needs (each Linear's input and its output's gradient) of up to ``i`` micro-batches
  (:func:`zerofn.plan.activations.weight_grad_bytes`).

**The bubble**, the fraction of a step the pipeline's GPUs sit idle (:func:`bubble_fraction`): 1F1B
``(p - 1) / (m + p - 1)``; interleaved ``(p - 1) / (v m + p - 1)`` (Narayanan et al.: the bubble shrinks by
``v``); zero bubble ``(p - 1) / (3 v m + p - 1)``, an approximation of ZB-H1's bubble, which Qi et al. put at
``(p - 1) (T_F + T_B - T_W)`` where 1F1B's is ``(p - 1) (T_F + T_B + T_W)``: with forward, input gradient and
weight gradient taking a third of a micro-batch's time each, a third of 1F1B's.

**Traffic between stages**: each micro-batch's output (``micro_batch x seq / cp x hidden x`` the activations'
bytes, each GPU of a tensor-parallel group sending its whole copy) goes forward to the next stage's GPU and its
gradient back, per chunk boundary: a GPU sends at most two a micro-batch and chunk (forward to the next, backward
to the one before) and receives as many.

Example:
    >>> from zerofn.plan import pipeline_parallel_plan
    >>> p = pipeline_parallel_plan(size=4, microbatches=8, world=16, layers=32, block=200_000_000,
    ...     first=500_000_000, last=500_000_000, micro_batch=1, seq=4096, hidden=4096)
    >>> p.stage_blocks, p.in_flight, p.data                        # blocks and micro-batches a stage; dp ranks
    ((8, 8, 8, 8), (4, 3, 2, 1), 4)
    >>> round(p.bubble, 4), p.bubble_formula                       # 3 / 11
    (0.2727, '(p - 1) / (m + p - 1)')
    >>> round(p.send / 2**20), p.sends, round(p.traffic(1) / 2**20)  # MiB: one output; sends; stage 1's a step
    (32, (1, 2, 2, 1), 512)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "PipelineParallelPlan",
    "bubble_fraction",
    "bubble_formula",
    "chunk_blocks",
    "in_flight",
    "pipeline_parallel_plan",
]

SCHEDULES = ("1f1b", "interleaved", "zero_bubble")  # zerofn.transforms.pipeline_parallel's schedule=
_NAMES = {"1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zero_bubble": "zero bubble (ZB-H1)"}


def bubble_formula(schedule: str) -> str:
    """The bubble fraction's formula for ``schedule``, as the planner prints it (p stages, m micro-batches, v
    virtual stages)."""
    return {
        "1f1b": "(p - 1) / (m + p - 1)",
        "interleaved": "(p - 1) / (v m + p - 1)",
        "zero_bubble": "(p - 1) / (3 v m + p - 1)",
    }[schedule]


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The fraction of a step a pipeline's GPUs sit idle, filling and draining it (see the module docs).

    Example:
        >>> from zerofn.plan import bubble_fraction
        >>> bubble_fraction("1f1b", 4, 8), bubble_fraction("interleaved", 4, 8, 2), bubble_fraction("zero_bubble", 4, 8)
        (0.2727272727272727, 0.15789473684210525, 0.1111111111111111)
    """
    p, m, v = stages, microbatches, virtual
    scale = {"1f1b": 1, "interleaved": v, "zero_bubble": 3 * v}[schedule]
    return (p - 1) / (scale * m + p - 1)


def chunk_blocks(layers: int, stages: int, virtual: int = 1) -> tuple[int, ...]:
    """The blocks of each of the ``stages x virtual`` chunks, as even as they divide, the first chunks taking one
    more (as ``pipeline_parallel`` cuts them); chunk ``c`` runs on pipeline rank ``c mod stages``."""
    count = stages * virtual
    base, more = divmod(layers, count)
    return tuple(base + (1 if c < more else 0) for c in range(count))


def _per_round(stages: int, microbatches: int) -> int:
    """torch's interleaved schedules' micro-batches per round: ``m // max(1, m // pp)``."""
    return microbatches // max(1, microbatches // stages)


def in_flight(schedule: str, stages: int, microbatches: int, virtual: int, rank: int) -> tuple[int, int]:
    """``(held, waiting)`` for pipeline rank ``rank``: the chunk micro-batches whose activations it holds at its
    peak, and (zero bubble) those whose input gradient has run but whose weight gradient waits, holding W's
    inputs. See the module docs for each schedule's count."""
    p, m, v = stages, microbatches, virtual
    if schedule == "1f1b":
        return min(p - rank, m), 0
    factor = 2 if schedule == "interleaved" else 1  # torch's warmup: 2 ops a hop (interleaved), 1 (zero bubble)
    warmup = (v - 1) * _per_round(p, m) + factor * (p - 1 - rank)
    held = min(warmup + 1, m * v)
    waiting = min(rank, max(0, m * v - held)) if schedule == "zero_bubble" else 0
    return held, waiting


@dataclass(frozen=True)
class PipelineParallelPlan:
    """What ``pipeline_parallel(step, size, microbatches=m, schedule=..., virtual_stages=v)`` cuts, holds and sends
    (:func:`pipeline_parallel_plan`).

    Attributes:
        size: pipeline stages (``pp``): GPUs along the pipeline axis.
        schedule: ``"1f1b"``, ``"interleaved"`` or ``"zero_bubble"``.
        microbatches: the micro-batches a step pipelines (``m``).
        virtual: model chunks per GPU (``v``; 1 but for the interleaved schedules).
        data: data-parallel ranks, ``world / (pp x tp x cp)``: pipelines side by side.
        group: the GPUs each stage's ZeRO stages shard over, ``dp x cp = world / (pp x tp)``.
        layers: the model's blocks.
        chunks: the blocks of each of the ``pp x v`` chunks (chunk ``c`` on rank ``c mod pp``).
        stage_blocks: the blocks each pipeline rank holds (its chunks').
        stage_params: the parameters one GPU of each pipeline rank holds (its blocks, the first the embeddings,
            the last the final norm and an untied head; one GPU's share under tensor parallelism).
        in_flight: per rank, the chunk micro-batches whose activations it holds at its peak.
        waiting: per rank, the chunk micro-batches whose weight gradient waits (zero bubble; else 0).
        sends: per rank, the activations or gradients one GPU sends a micro-batch (one per chunk boundary and
            direction: 1 on the first and last stage of 1F1B, 2 between).
        send: bytes of one send: ``micro_batch x seq / cp x hidden x`` the activations' bytes (0 without
            ``seq`` and ``micro_batch``).
        stage: the rank an :class:`~zerofn.plan.Estimate` reports (the largest: what must fit).
        micro_batch: the sequences of one micro-batch (0 when not given).
        tied: bytes of a head tied to the input embedding, which the first stage holds and lends the last each
            step (it sends the weight, the last sends its gradient back); 0 untied.
    """

    size: int
    schedule: str
    microbatches: int
    virtual: int
    data: int
    group: int
    layers: int
    chunks: tuple[int, ...]
    stage_blocks: tuple[int, ...]
    stage_params: tuple[int, ...]
    in_flight: tuple[int, ...]
    waiting: tuple[int, ...]
    sends: tuple[int, ...]
    send: int
    stage: int = 0
    micro_batch: int = 0
    tied: int = 0

    @property
    def bubble(self) -> float:
        """The fraction of a step the GPUs sit idle (:func:`bubble_fraction`)."""
        return bubble_fraction(self.schedule, self.size, self.microbatches, self.virtual)

    @property
    def bubble_formula(self) -> str:
        return bubble_formula(self.schedule)

    @property
    def name(self) -> str:
        """The schedule as the output names it: ``1F1B``, ``interleaved 1F1B``, ``zero bubble (ZB-H1)``."""
        return _NAMES[self.schedule]

    @property
    def per_round(self) -> int:
        """torch's interleaved schedules' micro-batches a round, ``m // max(1, m // pp)`` (``pp`` when it divides
        ``m``)."""
        return _per_round(self.size, self.microbatches)

    @property
    def hops(self) -> int:
        """Chunk boundaries a micro-batch crosses each way, ``pp x v - 1``: the fill's and the drain's."""
        return self.size * self.virtual - 1

    def traffic(self, stage: int | None = None) -> int:
        """Bytes one GPU of ``stage`` (default the reported one) sends over the pipeline in a step: its sends a
        micro-batch, ``m`` micro-batches, and a tied head's weight (the first stage) or gradient (the last)."""
        i = self.stage if stage is None else stage
        return self.sends[i] * self.microbatches * self.send + (self.tied if i in (0, self.size - 1) else 0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_parallel_plan(
    *,
    size: int,
    microbatches: int | None,
    world: int,
    layers: int | None,
    block: int,
    first: int,
    last: int,
    schedule: str = "1f1b",
    virtual: int = 1,
    tp: int = 1,
    cp: int = 1,
    micro_batch: int | None = None,
    seq: int | None = None,
    hidden: int | None = None,
    activation_bytes: int = 2,
    stage: int = 0,
    tied: int = 0,
) -> PipelineParallelPlan:
    """The cut of a model into ``size`` stages (``virtual`` chunks a GPU), as :func:`estimate` counts it.

    ``block`` is one block's parameters on one GPU, ``first`` those outside the blocks on the first stage (the
    input embedding, learned positions) and ``last`` on the last (the final norm, an untied head); ``micro_batch``
    the sequences of one micro-batch, ``seq`` the whole sequence (``seq / cp`` of it a GPU); ``tied`` the bytes of
    a head tied to the embedding (the first stage lends it to the last each step).

    Raises:
        ValueError: ``size``, ``microbatches`` or ``virtual`` not an int >= 1; no ``microbatches``; an unknown
            ``schedule``; ``virtual`` > 1 under 1F1B, or < 2 interleaved; fewer micro-batches than stages under
            1F1B, or not a multiple of torch's rounds under the interleaved schedules; no ``layers``; more chunks
            than blocks; ``size`` not dividing ``world / (tp x cp)``.
    """
    for value, what in ((size, "pp"), (virtual, "virtual_stages")):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            kind = "pipeline stages" if what == "pp" else "model chunks a GPU holds"
            raise ValueError(f"estimate: {what} must be an int >= 1 ({kind}), got {value!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"estimate: schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if schedule == "1f1b" and virtual != 1:
        raise ValueError(
            f"estimate: schedule='1f1b' runs one model chunk a GPU, got virtual_stages={virtual}: pass "
            f"schedule='interleaved' (python -m zerofn plan: --schedule interleaved --virtual-stages {virtual}) or "
            "'zero_bubble' for several chunks a GPU, or leave virtual_stages out"
        )
    if schedule == "interleaved" and virtual < 2:
        raise ValueError(
            "estimate: schedule='interleaved' interleaves several model chunks a GPU and needs virtual_stages >= 2 "
            "(python -m zerofn plan: --virtual-stages 2); with one chunk a GPU it is schedule='1f1b'"
        )
    if microbatches is None:
        raise ValueError(
            f"estimate: pp={size} pipelines each step's batch in micro-batches: pass microbatches= (python -m "
            f"zerofn plan: --microbatches M), at least {size} for 1F1B; the bubble (p - 1) / (m + p - 1) shrinks "
            f"as m grows, e.g. microbatches={4 * size}"
        )
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"estimate: microbatches must be an int >= 1 (micro-batches a step), got {microbatches!r}")
    p, m, v = size, microbatches, virtual
    if schedule == "1f1b" and m < p:
        raise ValueError(
            f"estimate: microbatches={m} is fewer than the pp={p} stages, and 1F1B needs at least one micro-batch "
            f"a stage (torch's Schedule1F1B refuses fewer): pass microbatches >= {p}, such as {4 * p} (a bubble "
            f"of {bubble_fraction('1f1b', p, 4 * p):.0%}), or fewer stages"
        )
    rounds = max(1, m // p)
    if schedule != "1f1b" and m % rounds:
        raise ValueError(
            f"estimate: microbatches={m} with schedule={schedule!r}: torch's interleaved schedules run the "
            f"micro-batches in max(1, m // pp) = {rounds} rounds, and {m} is not a multiple of {rounds}. Pass a "
            f"multiple of pp={p} (such as {rounds * p} or {(rounds + 1) * p}), or fewer than {p}."
        )
    if not layers:
        raise ValueError(
            f"estimate: pp={p} cuts the model's blocks into stages, whose count it needs: pass a ModelShape "
            "(zerofn.plan.model_shape(config); python -m zerofn plan --model config.json) or layers= (--layers)"
        )
    if p * v > layers:
        fit = [d for d in _divisors(world // (tp * cp)) if d * v <= layers]
        raise ValueError(
            f"estimate: pp={p} x virtual_stages={v} = {p * v} model chunks for {layers} blocks: each chunk needs a "
            f"block at least (pipeline_parallel refuses fewer). Pick pp from {fit}"
            + (f", or fewer virtual stages (at most {layers // p})" if v > 1 and layers >= p else "")
            + "."
        )
    inner = tp * cp
    if world % (p * inner):
        fit = [d for d in _divisors(world // inner) if d * v <= layers] if world % inner == 0 else []
        raise ValueError(
            f"estimate: pp={p} does not divide world / (tp x cp) = {world // inner} ({world} GPUs / (tp {tp} x cp "
            f"{cp})): the mesh is pp x dp x cp x tp, each stage on world / pp GPUs. Pick pp from {fit}, or plan a "
            f"multiple of {p * inner} GPUs."
        )
    chunks = chunk_blocks(layers, p, v)
    blocks = tuple(sum(chunks[r + k * p] for k in range(v)) for r in range(p))
    params = tuple(b * block + (first if r == 0 else 0) + (last if r == p - 1 else 0) for r, b in enumerate(blocks))
    held, waiting = zip(*(in_flight(schedule, p, m, v, r) for r in range(p)))
    # per chunk micro-batch: its output forward (but the model's last chunk) and its gradient back (but the first)
    sends = tuple(sum((c < p * v - 1) + (c > 0) for c in range(r, p * v, p)) for r in range(p))
    send = int(micro_batch or 0) * int(seq or 0) // cp * int(hidden or 0) * int(activation_bytes)
    return PipelineParallelPlan(
        size=p,
        schedule=schedule,
        microbatches=m,
        virtual=v,
        data=world // (p * inner),
        group=world // (p * tp),
        layers=int(layers),
        chunks=chunks,
        stage_blocks=blocks,
        stage_params=params,
        in_flight=tuple(held),
        waiting=tuple(waiting),
        sends=sends,
        send=send,
        stage=stage,
        micro_batch=int(micro_batch or 0),
        tied=int(tied) if p > 1 else 0,
    )
