"""The longest sequence a composition fits (:func:`longest_sequence`): ``python -m zerofn plan --seq-len max``."""

from __future__ import annotations

from typing import Any

from zerofn.plan.context import layout_unit
from zerofn.plan.estimates._compositions import compositions
from zerofn.plan.estimates._record import Estimate
from zerofn.plan.shapes import ModelShape

START = 256  # the first length tried (rounded up to the layout unit), doubled while something fits
LIMIT = 2**40  # lengths past this are not tried: activations that never grow with the sequence


def longest_sequence(
    params: float | ModelShape,
    *,
    gpu_memory: float,
    cpu_memory: float | None = None,
    nvme: float | None = None,
    **kwargs: Any,
) -> tuple[int, Estimate] | None:
    """The longest ``seq`` at which some composition of :func:`compositions` fits (the GPU, and the CPU RAM and
    NVMe per node where given), and the first that does there (the recommendation); None when none fits even
    at the shortest length.

    The lengths tried are multiples of the layout unit (``cp`` for Ulysses, ``2 cp`` for ring, 1 without
    ``cp=``), as ``context_parallel`` cuts them: from 256 tokens (rounded up to a multiple of the unit)
    doubled while something fits, then bisected between the last that fits and the first that does not, so
    about ``2 log2(seq)`` plans in all. Every byte a composition needs grows with the sequence or stays
    (activations, remat's inputs in host memory, the traffic), so the lengths that fit are those below one.
    ``micro_batch`` defaults to 1; every other keyword goes to :func:`compositions`.

    Raises:
        ValueError: without the shapes for activations (``layers`` and ``hidden``, or a :class:`ModelShape`),
            whose bytes alone grow with the sequence; with ``seq=``; anything :func:`compositions` refuses.

    Example:
        >>> from zerofn.plan import longest_sequence, model_shape
        >>> llama2_7b = model_shape({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
        ...     "num_hidden_layers": 32, "intermediate_size": 11008, "num_attention_heads": 32})
        >>> recipe = dict(gpus=8, cp=8, chunked_loss=True, remat_offload=True)  # 8 x 80 GB, 512 GB of RAM
        >>> seq, best = longest_sequence(llama2_7b, gpu_memory=80e9, cpu_memory=512e9, **recipe)
        >>> seq, best.label, round(best.cpu_per_node / 1e9)              # remat's inputs fill the RAM
        (1953120, 'ZeRO-3 + remat (inputs on CPU)', 512)
        >>> longest_sequence(llama2_7b, gpu_memory=80e9, cpu_memory=512e9, **{**recipe, "cp": 1})[0] * 8
        1953120
    """
    if kwargs.get("seq") is not None:
        raise ValueError("longest_sequence: it finds seq; leave seq= out")
    shaped = isinstance(params, ModelShape) or all(kwargs.get(x) for x in ("layers", "hidden"))
    if not shaped:
        raise ValueError(
            "longest_sequence: the sequence changes only the activations, which need the shapes: pass a ModelShape "
            "(zerofn.plan.model_shape(config); python -m zerofn plan --model config.json) or layers= and hidden= "
            "(with heads=, kv_heads=, ffn=, gated=, vocab=)"
        )
    kwargs.setdefault("micro_batch", 1)
    cp = kwargs.get("cp")
    unit = 1 if cp is None else layout_unit(cp, kwargs.get("cp_method", "ulysses"))

    def best(seq: int) -> Estimate | None:
        rows = compositions(params, seq=seq, **kwargs)
        return next((e for e in rows if e.fits(gpu_memory, cpu_memory, nvme)), None)

    lo, hi = 0, -(-START // unit)  # in units: lo fits (0: nothing yet), hi is the next to try
    while hi * unit <= LIMIT and best(hi * unit) is not None:
        lo, hi = hi, 2 * hi
    if hi * unit > LIMIT:
        hi = lo + 1  # still fitting at the limit: report the limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if best(mid * unit) is not None else (lo, mid)
    if lo == 0:
        return None
    return lo * unit, best(lo * unit)
