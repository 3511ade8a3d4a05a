"""How fast: a step's time per composition, from the model's FLOPs and its collectives on each link
(:func:`speeds`, :func:`step_speed`; the result :class:`Speed`, its collectives :class:`Comm`).

The model, kept simple so that each part shows in ``python -m zerofn plan --hardware`` (docs/planning.md,
"Speed"):

- **Compute.** Model FLOPs per token ``6 N + 12 L w s`` (PaLM's appendix B, the MFU formula torchtitan and
  Megatron report against): N the parameters less the input embedding (a tied one is the head's matmul and
  counts), L the blocks, w the attention width (heads x head dim), s the sequence. Forward is a third of
  them, backward two thirds; ``remat`` recomputes the forward (``8 N + 16 L w s`` of hardware FLOPs, forward a
  quarter). Seconds: hardware FLOPs / (peak x ``efficiency``, default 0.6).
- **Collectives.** A ring all-gather or reduce-scatter of a full tensor of B bytes over n ranks moves
  ``B (n - 1) / n`` bytes through each rank's link, an all-reduce ``2 B (n - 1) / n``, an all-to-all
  ``B (n - 1) / n`` (:func:`ring_bytes`). A group of s ranks a node over R nodes runs hierarchically
  (:func:`link_bytes`): within each node over NVLink, ``B (s - 1) / s``, then across nodes on each GPU's
  own NIC for its ``1 / s`` of the tensor, ``(B / s) (R - 1) / R``; the two add up to the ring's
  ``B (n - 1) / n``. An all-to-all (qgZ's) is one flat exchange: ``B (s - 1) / n`` to the node's GPUs
  and ``B (n - s) / n`` across nodes; under hpZ (the step knows its nodes) qgZ goes in two hops, an
  all-to-all within the node (``B (s - 1) / s``) and one across nodes on this GPU's ``1 / s`` of it
  (``(B / s) (R - 1) / R``), as ZeRO++'s hierarchical all-to-all does. Each link's bytes take ``latency + bytes / bandwidth`` on it
  (:class:`~zerofn.plan.hardware.LinkCost`), and the two stages run one after the other.
- **Overlap.** ZeRO-3 (and HSDP, hpZ, qwZ, qgZ): the forward's gathers overlap forward compute and the
  backward's gathers and reduce-scatters overlap backward compute, but the first gather (the root unit:
  embeddings, head, final norm, gathered before anything computes) and the last reduce-scatter (the root
  unit's, after everything computed) do not. DDP, ZeRO-1 and 2: the gradient buckets' reductions overlap
  backward but the last bucket's; ZeRO-1 and 2's all-gather of the updated parameters (the publish) does
  not overlap. What overlaps is hidden up to the compute of its pass; the rest shows. The optimizer's
  update (memory-bound: 36 bytes read and written per parameter under mixed precision, 28 in fp32, at the
  HBM bandwidth) never overlaps, nor do qwZ's and qgZ's int8 codecs (a pass over each tensor they encode
  or decode, ``p + 1`` bytes an element at the HBM bandwidth). Tensor-parallel all-reduces and
  context-parallel exchanges sit on the critical path (not overlapped).
- **Pipeline** (``pp`` stages, ``m`` micro-batches; :mod:`zerofn.plan.pipeline`). The compute is the slowest
  stage's (the most blocks; the last adds the head's FLOPs) for its ``m`` micro-batches; the bubble idles the GPUs
  ``compute x bubble / (1 - bubble)`` more (1F1B's ``(p - 1) / (m + p - 1)``: a step of ``m + p - 1``
  micro-batches' time). Each micro-batch's output goes to the next stage and its gradient back (per GPU at most
  two sends a micro-batch and chunk), on the link between neighbour stages: ``pp`` is the outermost axis, so they
  are on different nodes when there are several and a stage spans a node or more. Each send overlaps the next
  micro-batch's compute, but those on the fill's and the drain's critical path, ``2 (p v - 1)`` sends of one
  micro-batch's output, which are exposed. The ZeRO stages' collectives run over the stage's own parameters
  and its ``world / (pp x tp)`` GPUs: DDP/ZeRO-1/2 reduce the gradients accumulated over the micro-batches once a
  step, ZeRO-3 gathers and reduce-scatters its blocks once a micro-batch (the root unit once a step).
- **Step** = compute + bubble + exposed communication + update + codec; tokens/s = tokens of a step / step;
  MFU = model FLOPs / (step x peak).

Traffic, per step (one micro-batch), Psi the parameters the ZeRO group shards, p the bytes of a gathered
parameter (2 under mixed precision, 4 in fp32; qwZ: int8 codes and an fp32 scale per 2048, ``1 + 4 / 2048``),
g of a reduced gradient (the same; qgZ: int8 as an all-to-all):

- DDP: all-reduce of ``g Psi``; ZeRO-1, 2: reduce-scatter of ``g Psi`` and all-gather of ``p Psi``; each in
  buckets (1 MiB first, then 25 MiB, as zerofn's ``bucket_bytes``).
- ZeRO-3: the forward gathers every unit (``p Psi``); backward gathers the blocks again but the last one
  (it starts with the block forward ended with, and the root unit stays gathered from forward's start to
  backward's end: ``p (Psi - root - block)``); every unit's gradient is reduce-scattered (``g Psi``). The
  ZeRO paper's 3 Psi counts the root and the last block twice.
- HSDP (``shard_params(step, replicate=nodes)``): ZeRO-3 within each node (its s GPUs), then the
  gradient shards all-reduced across the R nodes, ``2 (g Psi / s) (R - 1) / R`` per GPU.
- hpZ (``shard_params(step, hpz=gpus_per_node)``): the forward gathers over every rank, the backward within
  the node from the node's secondary copy (``p Psi / s`` more per GPU), the reduce-scatter over every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerofn.plan.estimates import BUCKET_BYTES, estimate
from zerofn.plan.hardware import Hardware
from zerofn.plan.pipeline import PipelineParallelPlan
from zerofn.plan.shapes import ModelShape

__all__ = [
    "EFFICIENCY",
    "FIRST_BUCKET_BYTES",
    "INT8_BYTES",
    "Comm",
    "Composition",
    "Speed",
    "flops_per_token",
    "link_bytes",
    "ring_bytes",
    "speed_compositions",
    "speeds",
    "step_speed",
]

EFFICIENCY = 0.6  # the fraction of the dense peak a step's compute achieves, by default
FIRST_BUCKET_BYTES = 2**20  # zerofn.storage.FIRST_BUCKET_BYTES: the first gradient bucket (torch DDP's)
TWO_HOP = "all_to_all_two_hops"  # qgZ within the node, then across the nodes on 1 / (GPUs a node) of it
INT8_BLOCK = 2048  # qwZ / qgZ: one scale per block of this many elements
INT8_BYTES = 1 + 4 / INT8_BLOCK  # an int8 code and an fp32 scale per block: bytes per element
UPDATE_BYTES = {True: 36, False: 28}  # bytes the optimizer's update reads and writes per parameter
FORWARD = "forward"
BACKWARD = "backward"
PIPELINE = "pipeline"  # a pipeline's sends: each overlaps the next micro-batch's compute, but on the fill and drain
NONE = "none"  # does not overlap
SEND = "send_recv"  # a pipeline's point-to-point sends between neighbour stages (the link's own cost)


def ring_bytes(kind: str, full_bytes: float, ranks: int) -> float:
    """Bytes one rank moves in a ring collective over ``ranks`` ranks of a full tensor of ``full_bytes``:
    ``B (n - 1) / n`` for an all-gather, reduce-scatter or all-to-all, twice that for an all-reduce.

    Example:
        >>> from zerofn.plan import ring_bytes
        >>> ring_bytes("all_gather", 8e9, 8), ring_bytes("all_reduce", 8e9, 8)
        (7000000000.0, 14000000000.0)
    """
    if ranks <= 1 or full_bytes <= 0:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * full_bytes * (ranks - 1) / ranks


def link_bytes(kind: str, full_bytes: float, ranks: int, per_node: int) -> tuple[float, float]:
    """``(intra, inter)``: the bytes one rank moves within its node and across nodes in a collective over
    ``ranks`` ranks, ``per_node`` of them on each node.

    An all-gather, reduce-scatter or all-reduce runs hierarchically: the ring within the node over the whole
    tensor, then the ring across the ``ranks / per_node`` nodes over this GPU's ``1 / per_node`` of it (each
    GPU on its own NIC); the two add up to :func:`ring_bytes` over all the ranks. An all-to-all is one flat
    exchange (zerofn's, qgZ's): each rank sends every other rank its ``1 / ranks`` of the tensor directly,
    ``per_node - 1`` of them on its node and the rest, ``(ranks - per_node) / ranks`` of it, across nodes.

    Example:
        >>> from zerofn.plan import link_bytes
        >>> link_bytes("all_gather", 8e9, 16, 8)          # 2 nodes of 8: 7/8 of it on NVLink, 1/16 on the NIC
        (7000000000.0, 500000000.0)
        >>> link_bytes("all_to_all", 8e9, 16, 8)          # 7/16 to the node's GPUs, 8/16 to the other node's
        (3500000000.0, 4000000000.0)
    """
    s = max(1, min(per_node, ranks))
    nodes = max(1, ranks // s)
    if kind == TWO_HOP:  # ZeRO++'s qgZ where the step knows its nodes: within the node, then across on 1/s
        return ring_bytes("reduce_scatter", full_bytes, s), ring_bytes("reduce_scatter", full_bytes / s, nodes)
    if kind == "all_to_all":
        if ranks <= 1 or full_bytes <= 0:
            return 0.0, 0.0
        return full_bytes * (s - 1) / ranks, full_bytes * (ranks - s) / ranks
    return ring_bytes(kind, full_bytes, s), ring_bytes(kind, full_bytes / s, nodes)


@dataclass(frozen=True)
class Composition:
    """A composition the speed table ranks: the ZeRO ``stage`` (0: DDP) and ZeRO-3's variants: ``replicate``
    (HSDP: shard within a node, replicate across nodes), ``hpz`` (a secondary copy of the parameters in
    each node that backward gathers from), ``int8_gather`` (qwZ) and ``int8_reduce`` (qgZ)."""

    label: str
    stage: int
    replicate: bool = False
    hpz: bool = False
    int8_gather: bool = False
    int8_reduce: bool = False

    def code(self, *, nodes: int, gpus_per_node: int) -> str:
        """The zerofn call that builds it (around ``step``, an ``amp``'d ``zf.train_step``)."""
        if self.stage == 0:
            return "zf.train_step(...)"
        if self.stage < 3:
            return f"{('shard_optimizer', 'shard_grads')[self.stage - 1]}(step)"
        kw = []
        if self.replicate:
            kw.append(f"replicate={nodes}")
        if self.hpz:
            kw.append(f"hpz={gpus_per_node}")
        if self.int8_gather:
            kw.append('gather_dtype="int8"')
        if self.int8_reduce:
            kw.append('reduce_dtype="int8"')
        return f"shard_params(step{''.join(', ' + k for k in kw)})"


def speed_compositions(nodes: int = 1) -> list[Composition]:
    """The compositions :func:`speeds` predicts: DDP, ZeRO-1, 2, 3, ZeRO-3 with qwZ, qgZ and both, and, on
    more than one node, HSDP, hpZ and ZeRO++ (hpZ with qwZ and qgZ)."""
    rows = [
        Composition("DDP", 0),
        Composition("ZeRO-1", 1),
        Composition("ZeRO-2", 2),
        Composition("ZeRO-3", 3),
        Composition("ZeRO-3 + qwZ", 3, int8_gather=True),
        Composition("ZeRO-3 + qgZ", 3, int8_reduce=True),
        Composition("ZeRO-3 + qwZ + qgZ", 3, int8_gather=True, int8_reduce=True),
    ]
    if nodes > 1:
        rows += [
            Composition("HSDP", 3, replicate=True),
            Composition("hpZ", 3, hpz=True),
            Composition("ZeRO++ (hpZ + qwZ + qgZ)", 3, hpz=True, int8_gather=True, int8_reduce=True),
        ]
    return rows


@dataclass(frozen=True)
class Comm:
    """One kind of collective a step issues, over the step: ``full_bytes`` of full tensors in ``count``
    collectives over ``ranks`` ranks (``per_node`` a node); the bytes one rank moves within its node and
    across nodes, and their seconds; ``window``: the pass whose compute it overlaps (``"forward"``,
    ``"backward"``) or ``"none"``."""

    what: str
    kind: str
    full_bytes: float
    ranks: int
    per_node: int
    count: int
    intra_bytes: float
    inter_bytes: float
    intra_s: float
    inter_s: float
    window: str

    @property
    def seconds(self) -> float:
        return self.intra_s + self.inter_s


def _comm(hw: Hardware, what: str, kind: str, full: float, ranks: int, per_node: int, count: int, window: str) -> Comm:
    intra, inter = link_bytes(kind, full, ranks, per_node)
    cost = "all_to_all" if kind == TWO_HOP else kind
    return Comm(
        what=what,
        kind=kind,
        full_bytes=full,
        ranks=ranks,
        per_node=min(per_node, ranks),
        count=count,
        intra_bytes=intra,
        inter_bytes=inter,
        intra_s=hw.intra(cost).seconds(intra, 2 * count if kind == TWO_HOP else count),
        inter_s=hw.inter(cost).seconds(inter, count),
        window=window,
    )


@dataclass(frozen=True)
class Speed:
    """The predicted step of one composition (:func:`step_speed`), per GPU.

    Attributes:
        composition: what it is; ``code`` the zerofn call.
        compute_s, forward_s, backward_s: the compute's seconds, all and per pass (backward's holds remat's
            recomputed forward).
        update_s: the optimizer's update (never overlapped).
        comms: the collectives, each with its bytes and seconds on each link and its window.
        exposed_s: communication seconds not hidden behind compute.
        codec_s: qwZ's and qgZ's int8 encoding and decoding, memory-bound passes over the tensors (not
            overlapped; 0 without them).
        step_s: compute + bubble + exposed + update + codec.
        tokens: tokens a step trains on (every GPU's).
        model_flops: model FLOPs one GPU computes in a step (``6 N + 12 L w s`` per token, no recompute).
        peak_flops: one GPU's dense peak, FLOP/s.
        remat: whether the step recomputes activations (chosen when it is what fits).
        memory: bytes per GPU at the step's peak (the memory estimate), None if not estimated.
        fits: whether ``memory`` fits the GPU.
        bubble_s: a pipeline's idle time, filling and draining it: ``compute x bubble / (1 - bubble)`` (0
            without ``pp``).
        fill_s: a pipeline's sends on the fill's and the drain's critical path, ``2 (p v - 1)`` of one
            micro-batch's output, counted exposed (0 without ``pp``).
    """

    composition: Composition
    code: str
    compute_s: float
    forward_s: float
    backward_s: float
    update_s: float
    comms: tuple[Comm, ...]
    exposed_s: float
    codec_s: float
    step_s: float
    tokens: float
    model_flops: float
    peak_flops: float
    remat: bool = False
    memory: int | None = None
    fits: bool = True
    short: tuple[str, ...] = field(default=())
    bubble_s: float = 0.0
    fill_s: float = 0.0

    @property
    def label(self) -> str:
        return self.composition.label

    @property
    def comm_s(self) -> float:
        """Every collective's seconds, overlapped or not."""
        return sum(c.seconds for c in self.comms)

    @property
    def overlapped_s(self) -> float:
        return self.comm_s - self.exposed_s

    @property
    def intra_bytes(self) -> float:
        return sum(c.intra_bytes for c in self.comms)

    @property
    def inter_bytes(self) -> float:
        return sum(c.inter_bytes for c in self.comms)

    @property
    def intra_s(self) -> float:
        return sum(c.intra_s for c in self.comms)

    @property
    def inter_s(self) -> float:
        return sum(c.inter_s for c in self.comms)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second over the peak."""
        return self.model_flops / (self.step_s * self.peak_flops)


def flops_per_token(*, params: float, layers: int, width: int, seq: int) -> float:
    """Model FLOPs per token of a training step (forward and backward, no recompute), PaLM's
    ``6 N + 12 L w s``: ``params`` is N (the parameters less the input embedding), ``width`` the attention's
    width (heads x head dim), ``seq`` the sequence.

    Example:
        >>> from zerofn.plan import flops_per_token
        >>> flops_per_token(params=7.5e9, layers=32, width=4096, seq=8192) / 1e9   # Llama-3-8B at 8192 tokens
        57.884901888
    """
    return 6.0 * params + 12.0 * layers * width * seq


def _buckets(nbytes: float) -> tuple[int, float]:
    """zerofn's gradient buckets of ``nbytes``: how many, and the last one's bytes (the 1 MiB first bucket,
    then 25 MiB each; the last, the remainder, holds the first parameters, reduced last)."""
    if nbytes <= FIRST_BUCKET_BYTES:
        return 1, nbytes
    rest = nbytes - FIRST_BUCKET_BYTES
    n = 1 + math.ceil(rest / BUCKET_BYTES)
    return n, rest - (n - 2) * BUCKET_BYTES


def step_speed(
    composition: Composition,
    *,
    hardware: Hardware,
    params: float,
    root: float,
    block: float,
    layers: int,
    nodes: int,
    gpus_per_node: int,
    model_flops: float,
    tokens: float,
    mixed_precision: bool = True,
    remat: bool = False,
    efficiency: float = EFFICIENCY,
    tp: int = 1,
    tp_bytes: float = 0.0,
    cp_bytes: float = 0.0,
    cp_count: int = 0,
    cp_size: int = 1,
    memory: int | None = None,
    short: tuple[str, ...] = (),
    pipeline: PipelineParallelPlan | None = None,
    compute_flops: float | None = None,
) -> Speed:
    """One composition's predicted step (see the module docs for the model).

    Args:
        composition: what to predict (:func:`speed_compositions`).
        hardware: the GPU and its links.
        params: Psi, the parameters the ZeRO stages shard (one GPU's slice under tensor parallelism);
            ``root`` and ``block`` its root unit's (embeddings, head, final norm) and one block's, ``layers``
            the blocks.
        nodes, gpus_per_node: the machines; the ZeRO group is ``nodes x gpus_per_node / tp`` ranks,
            ``gpus_per_node / tp`` a node.
        model_flops: model FLOPs one GPU computes in a step; ``tokens`` the tokens a step trains on.
        mixed_precision: 2-byte parameters and gradients on the wire (else 4).
        remat: the forward recomputed in backward (a third more compute; MFU does not count it).
        efficiency: the fraction of the peak the compute achieves.
        tp, tp_bytes: tensor parallelism: the bytes all-reduced on its group per step (within a node).
        cp_bytes, cp_count, cp_size: context parallelism: the bytes a rank sends on its group per step, in
            how many exchanges, over how many GPUs (spaced ``tp`` apart).
        memory, short: the memory estimate's bytes per GPU and what does not fit (empty: it fits).
        pipeline, compute_flops: pipeline parallelism (:class:`~zerofn.plan.PipelineParallelPlan`): ``params``,
            ``root``, ``block`` and ``layers`` are then one stage's, the ZeRO group ``nodes x gpus_per_node /
            (pp x tp)``; ``compute_flops`` the model FLOPs of the slowest stage's GPU in a step (its
            ``microbatches`` micro-batches; default ``model_flops``), which sets the pace; the bubble idles the
            GPUs ``bubble / (1 - bubble)`` of it; ``tp_bytes`` and ``cp_bytes`` are per micro-batch; and the
            stages' sends go on the link between neighbour stages' GPUs.
    """
    hw = hardware
    if not 0 < efficiency <= 1:
        raise ValueError(
            f"step_speed: efficiency must be in (0, 1], the fraction of the peak achieved, got {efficiency}"
        )
    pb = 2 if mixed_precision else 4
    gather_b = INT8_BYTES if composition.int8_gather else pb
    reduce_b = INT8_BYTES if composition.int8_reduce else pb
    pp = pipeline.size if pipeline is not None else 1
    mb = pipeline.microbatches if pipeline is not None else 1  # micro-batches a step
    n = nodes * gpus_per_node // (tp * pp)  # the ZeRO (data-parallel) group: one stage's
    s = max(1, min(gpus_per_node, nodes * gpus_per_node // pp) // tp)  # of it on one node
    peak = hw.tflops * 1e12
    hw_flops = (model_flops if compute_flops is None else compute_flops) * (4 / 3 if remat else 1)
    compute = hw_flops / (peak * efficiency)
    forward = compute * (0.25 if remat else 1 / 3)
    backward = compute - forward
    comms: list[Comm] = []

    def add(what: str, kind: str, full: float, ranks: int, per: int, count: int, window: str) -> None:
        comms.append(_comm(hw, what, kind, full, ranks, per, count, window))

    codec_elems = 0.0
    stage = composition.stage
    if stage in (0, 1, 2):
        grads = params * pb
        count, last = _buckets(grads)
        red, word = ("all_reduce", "all-reduce") if stage == 0 else ("reduce_scatter", "reduce-scatter")
        if count > 1:
            add(f"gradient {word}, buckets but the last", red, grads - last, n, s, count - 1, BACKWARD)
        add(f"gradient {word}, the last bucket", red, last, n, s, 1, NONE)
        if stage > 0:
            add("parameter all-gather after the update (publish)", "all_gather", params * pb, n, s, count, NONE)
        shard = params if stage == 0 else params / n
    else:
        blocks = max(0.0, params - root)
        # HSDP: ZeRO-3 within the node, the shards' gradients all-reduced across nodes
        group = s if composition.replicate else n
        back = s if composition.hpz else group  # hpZ: backward gathers within the node
        again = max(0.0, blocks - block)  # the last block and the root unit stay gathered into backward
        add(
            "parameter all-gather, root unit (before forward computes)",
            "all_gather",
            root * gather_b,
            group,
            s,
            1,
            NONE,
        )
        # a pipeline's stage runs its forward and backward once a micro-batch, each gathering the blocks
        each = f", each of {mb} micro-batches" if mb > 1 else ""
        add(
            f"parameter all-gather, blocks in forward{each}",
            "all_gather",
            mb * blocks * gather_b,
            group,
            s,
            mb * layers,
            FORWARD,
        )
        what = "parameter all-gather, blocks in backward" + (" (within the node)" if composition.hpz else "") + each
        add(what, "all_gather", mb * again * gather_b, back, s, mb * max(0, layers - 1), BACKWARD)
        red, word = ("reduce_scatter", "reduce-scatter")
        if composition.int8_reduce:  # two hops where the step knows its nodes (hpz=), one flat exchange otherwise
            red, word = (
                (TWO_HOP, "int8 all-to-all in two hops") if composition.hpz else ("all_to_all", "int8 all-to-all")
            )
        add(f"gradient {word}, blocks{each}", red, mb * blocks * reduce_b, group, s, mb * layers, BACKWARD)
        add(f"gradient {word}, root unit (after backward computes)", red, root * reduce_b, group, s, 1, NONE)
        if composition.replicate and nodes > 1:
            add(
                "gradient shards all-reduced across nodes, blocks",
                "all_reduce",
                blocks * pb / s,
                nodes,
                1,
                layers,
                BACKWARD,
            )
            add("gradient shards all-reduced across nodes, root unit", "all_reduce", root * pb / s, nodes, 1, 1, NONE)
        shard = params / group
        # the int8 codec's passes over the tensors, memory-bound: every gathered element decoded (qwZ), every
        # gradient element encoded before its all-to-all (qgZ); 1 byte of code beside the element's own bytes
        if composition.int8_gather:
            codec_elems += root + blocks + again if mb == 1 else root + mb * (blocks + again)
        if composition.int8_reduce:
            codec_elems += params if mb == 1 else root + mb * blocks
    if tp > 1 and tp_bytes:
        what = f"tensor-parallel all-reduces (tp {tp})"
        add(what, "all_reduce", mb * tp_bytes, tp, tp, mb * max(1, 4 * layers), NONE)
    cp_bytes, cp_count = mb * cp_bytes, mb * cp_count
    if cp_size > 1 and cp_bytes:
        # the group's cp GPUs, tp apart: those on one node exchange over NVLink, the rest across nodes
        on_node = max(1, min(cp_size, gpus_per_node // tp))
        inter = cp_bytes * (cp_size - on_node) / cp_size
        intra = cp_bytes - inter
        comms.append(
            Comm(
                what=f"context-parallel exchanges (cp {cp_size})",
                kind="all_to_all",
                full_bytes=cp_bytes,
                ranks=cp_size,
                per_node=on_node,
                count=max(1, cp_count),
                intra_bytes=intra,
                inter_bytes=inter,
                intra_s=hw.intra("all_to_all").seconds(intra, max(1, cp_count)),
                inter_s=hw.inter("all_to_all").seconds(inter, max(1, cp_count)),
                window=NONE,
            )
        )
    fill = 0.0
    if pipeline is not None and pipeline.send:
        fill = _pipeline_sends(comms, hw, pipeline, nodes, gpus_per_node)
    exposed = sum(c.seconds for c in comms if c.window == NONE)
    exposed += max(0.0, sum(c.seconds for c in comms if c.window == FORWARD) - forward)
    exposed += max(0.0, sum(c.seconds for c in comms if c.window == BACKWARD) - backward)
    sends = sum(c.seconds for c in comms if c.window == PIPELINE)
    exposed += min(sends, fill + max(0.0, sends - compute))  # the fill and drain, and what compute cannot hide
    bubble = compute * pipeline.bubble / (1 - pipeline.bubble) if pipeline is not None else 0.0
    update = shard * UPDATE_BYTES[mixed_precision] / (hw.hbm_gbps * 1e9)
    codec = codec_elems * (pb + 1) / (hw.hbm_gbps * 1e9)
    return Speed(
        composition=composition,
        code=composition.code(nodes=nodes, gpus_per_node=gpus_per_node),
        compute_s=compute,
        forward_s=forward,
        backward_s=backward,
        update_s=update,
        comms=tuple(comms),
        exposed_s=exposed,
        codec_s=codec,
        step_s=compute + bubble + exposed + update + codec,
        tokens=tokens,
        model_flops=model_flops,
        peak_flops=peak,
        remat=remat,
        memory=memory,
        fits=not short,
        short=tuple(short),
        bubble_s=bubble,
        fill_s=min(sends, fill),
    )


def _pipeline_sends(comms: list, hw: Hardware, pipeline: PipelineParallelPlan, nodes: int, gpus_per_node: int) -> float:
    """Add the sends of one GPU of a pipeline's busiest stage to ``comms`` (window ``"pipeline"``) and return the
    seconds of the fill's and drain's sends, on the critical path.

    ``pp`` is the outermost axis of the mesh, so neighbour stages are ``world / pp`` ranks apart: on different
    nodes when there are several and a stage spans a node or more (``gpus_per_node <= world / pp``); on one node
    when there is one; otherwise a node holds several stages and its edge stage sends one way across nodes and
    the other within (half the bytes on each link)."""
    world = nodes * gpus_per_node
    stage_gpus = world // pipeline.size
    across = 0.0 if nodes == 1 else 1.0 if gpus_per_node <= stage_gpus else 0.5
    most = max(pipeline.sends)
    count = most * pipeline.microbatches
    total = count * pipeline.send
    inter, intra = total * across, total * (1 - across)
    n_inter = round(count * across)
    comms.append(
        Comm(
            what=f"pipeline sends to the neighbour stages (pp {pipeline.size}: activations forward, gradients back)",
            kind=SEND,
            full_bytes=total,
            ranks=2,
            per_node=1 if across == 1 else 2,
            count=count,
            intra_bytes=intra,
            inter_bytes=inter,
            intra_s=hw.intra(SEND).seconds(intra, count - n_inter),
            inter_s=hw.inter(SEND).seconds(inter, n_inter),
            window=PIPELINE,
        )
    )
    hop = (hw.inter(SEND) if across else hw.intra(SEND)).seconds(pipeline.send, 1)
    return 2 * pipeline.hops * hop


def _block_params(source: float | ModelShape, layers: int, hidden: int, ffn: int | None, gated: bool) -> int:
    """One block's parameters, as the memory estimate counts them."""
    psi = source.params if isinstance(source, ModelShape) else int(round(source))
    if isinstance(source, ModelShape) and source.layer_params:
        per = source.layer_params
    else:
        f = ffn or 4 * hidden
        per = 4 * hidden * hidden + (3 if gated else 2) * hidden * f
    return min(per, psi // layers)


def speeds(
    source: float | ModelShape,
    *,
    hardware: Hardware,
    nodes: int = 1,
    gpus_per_node: int | None = None,
    seq: int,
    micro_batch: int,
    mixed_precision: bool = True,
    efficiency: float = EFFICIENCY,
    gpu_memory: float | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int | None = None,
    gated: bool | None = None,
    tp: int = 1,
    cp: int | None = None,
    cp_method: str = "ulysses",
    pp: int | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    compositions: list[Composition] | None = None,
    **memory_kw,
) -> list[Speed]:
    """Every composition's predicted step (:func:`speed_compositions`), fastest first among those that fit
    ``gpu_memory`` (default the hardware's), then those that do not.

    Each is planned without ``remat`` when that fits, else with it (a third more compute). The shapes
    (``layers``, ``hidden``) are needed: the attention's FLOPs and ZeRO-3's units come from them. Other
    keywords go to the memory estimate (:func:`~zerofn.plan.estimate`).

    With ``pp`` (and ``microbatches``, ``schedule``, ``virtual_stages``, as :func:`~zerofn.plan.estimate` takes
    them) a step pipelines ``microbatches`` micro-batches of ``micro_batch`` sequences through the stages: its
    compute is the slowest stage's (the most blocks, the last with the head's FLOPs) times the micro-batches, plus
    the bubble; the ZeRO stages' collectives are those of the stage the memory estimate reports (its own
    parameters, over its ``world / (pp x tp)`` GPUs; ZeRO-3 gathering and reducing its blocks a micro-batch), and
    its sends to the neighbour stages are counted (:mod:`zerofn.plan.pipeline`). HSDP and hpZ are left out.

    Example:
        >>> from zerofn.plan import load_hardware, model_shape, speeds
        >>> llama3_8b = model_shape({"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        ...     "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
        ...     "num_key_value_heads": 8, "tie_word_embeddings": False})
        >>> rows = speeds(llama3_8b, hardware=load_hardware("h100"), nodes=16, seq=8192, micro_batch=1)
        >>> [(s.label, round(s.step_s, 3), round(s.mfu, 3)) for s in rows[:2]]   # fastest first
        [('ZeRO-3', 0.818, 0.586), ('hpZ', 0.818, 0.586)]
        >>> round(rows[0].inter_bytes / 1e9, 2), round(rows[1].inter_bytes / 1e9, 2)  # bytes across nodes a GPU
        (5.35, 3.76)
    """
    shape = source if isinstance(source, ModelShape) else None
    if shape is not None:
        layers, hidden, heads, kv_heads, ffn, vocab, gated = shape.given(
            layers, hidden, heads, kv_heads, ffn, vocab, gated
        )
        if shape.experts > 1:
            raise ValueError(
                f"speeds: a mixture-of-experts model ({shape.experts} experts per block) is not modelled: its "
                "FLOPs per token are its active experts', and its all-to-alls are not in the speed model; plan "
                "its memory without --hardware"
            )
    if not (layers and hidden):
        raise ValueError(
            "speeds: the step's time needs the model's shapes (the attention's FLOPs and ZeRO-3's units): pass a "
            "ModelShape (--model config.json), or layers= and hidden= (--layers, --hidden, with --vocab)"
        )
    if not (seq and micro_batch):
        raise ValueError("speeds: the step's FLOPs are its tokens': pass seq= and micro_batch= (--seq, --micro-batch)")
    gpus = gpus_per_node or hardware.gpus_per_node
    psi = shape.params if shape is not None else int(round(float(source)))
    heads = heads or max(1, hidden // 64)
    head_dim = shape.head_dim if (shape is not None and shape.head_dim) else hidden // heads
    width = heads * head_dim
    untied = shape is not None and not shape.tied and vocab
    n_flops = psi - (vocab * hidden if untied else 0)
    per_token = flops_per_token(params=n_flops, layers=layers, width=width, seq=seq)
    world = gpus * nodes
    cp_size = cp or 1
    staged = pp is not None and pp != 1
    pp_size = pp if staged else 1
    m = microbatches if staged else 1  # micro-batches a step
    data = world // (tp * cp_size * pp_size)  # micro-batches in flight (pipelines side by side)
    tokens = data * micro_batch * m * seq
    model_flops = m * micro_batch * seq * per_token / (tp * cp_size * pp_size)
    dims = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, gated=gated)
    dims = {k: v for k, v in dims.items() if v is not None}
    kw = dict(dims, seq=seq, micro_batch=micro_batch, mixed_precision=mixed_precision, **memory_kw)
    if tp != 1:
        kw["tp"] = tp
    if cp is not None:
        kw["cp"], kw["cp_method"] = cp, cp_method
    if staged:
        kw.update(pp=pp, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages)
    offload = bool(kw.pop("remat_offload", False))  # remat's kept inputs in host memory: the remat rows only
    limit = hardware.hbm_bytes if gpu_memory is None else gpu_memory
    block = _block_params(source, layers, hidden, ffn, bool(gated))
    out = []
    for comp in compositions or speed_compositions(nodes):
        if (comp.replicate or comp.hpz) and (nodes == 1 or staged):
            continue
        chosen = None
        for r in (False, True):
            try:
                if comp.replicate:  # the state as ZeRO-3's over one node's GPUs
                    e = estimate(source, stage=3, gpus=gpus, nodes=1, remat=r, remat_offload=offload and r, **kw)
                else:
                    e = estimate(
                        source, stage=comp.stage, gpus=gpus, nodes=nodes, remat=r, remat_offload=offload and r, **kw
                    )
            except ValueError:
                if not comp.replicate:
                    raise
                break  # HSDP's replica of one node cannot hold this layout (a cp group across nodes): left out
            total = e.total
            if comp.hpz:  # the node's secondary copy of the parameters, 1 / s of them on each GPU
                local = e.tensor_parallel.local if e.tensor_parallel else psi
                total += math.ceil(local / max(1, gpus // tp)) * (2 if mixed_precision else 4)
            chosen = (e, r, total)
            if total <= limit:
                break
        if chosen is None:
            continue
        e, r, total = chosen
        short = () if total <= limit else ("GPU",)
        local, blk, units = psi, block, layers
        if e.tensor_parallel is not None:
            local, blk = e.tensor_parallel.local, e.tensor_parallel.block
        pipe, compute_flops = e.pipeline_parallel, None
        if pipe is not None:  # the reported stage's parameters and blocks; the pace the slowest stage's
            local, units = pipe.stage_params[pipe.stage], pipe.stage_blocks[pipe.stage]
            head = max(0, n_flops - layers * block)  # outside the blocks: the head's matmul (and the norms)
            last = pipe.size - 1
            stage_tokens = [
                flops_per_token(params=b * block + (head if i == last else 0), layers=b, width=width, seq=seq)
                for i, b in enumerate(pipe.stage_blocks)
            ]
            compute_flops = m * micro_batch * seq * max(stage_tokens) / (tp * cp_size)
        cp_plan = e.context_parallel
        cp_count = 0
        if cp_plan is not None and cp_plan.size > 1:
            passes = 3 if r else 2
            per_layer = 4 if cp_plan.method == "ulysses" else 2 * (cp_plan.size - 1)
            cp_count = per_layer * passes * units
        out.append(
            step_speed(
                comp,
                hardware=hardware,
                params=local,
                root=max(0, local - units * blk),
                block=blk,
                layers=units,
                nodes=nodes,
                gpus_per_node=gpus,
                model_flops=model_flops,
                tokens=tokens,
                mixed_precision=mixed_precision,
                remat=r,
                efficiency=efficiency,
                tp=tp,
                tp_bytes=e.tp_traffic,
                cp_bytes=e.cp_traffic,
                cp_count=cp_count,
                cp_size=cp_size,
                memory=total,
                short=short,
                pipeline=pipe,
                compute_flops=compute_flops,
            )
        )
    return sorted(out, key=lambda x: (not x.fits, x.step_s))
