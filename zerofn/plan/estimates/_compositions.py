"""Every composition ``python -m zerofn plan`` tabulates (:func:`compositions`)."""

from __future__ import annotations

from typing import Any

from zerofn.plan.estimates._defaults import DEVICES
from zerofn.plan.estimates._estimate import estimate
from zerofn.plan.estimates._record import Estimate
from zerofn.plan.shapes import ModelShape


def compositions(
    params: float | ModelShape, *, inference: bool = False, remat: bool | None = None, **kwargs: Any
) -> list[Estimate]:
    """Every composition :func:`main` tabulates, in preference order (see ``Estimate.order``).

    Training: DDP and ZeRO-1, 2, 3, each with the optimizer state on the
    GPU, in CPU RAM or on NVMe, ZeRO-3 with its parameters in CPU RAM too
    (beside an optimizer state in RAM or on NVMe), and ZeRO-3 with its
    parameters and optimizer state on NVMe; each with and without remat
    when ``remat`` is None and the shapes for activations are given. Inference: replicated, ZeRO-3, ZeRO-3 with
    parameters in CPU RAM.

    Every other keyword goes to :func:`estimate` for each row: ``lora_rank=`` (LoRA adapters of that rank
    on every block's projections, the rest frozen) and ``quantize=`` (``"nf4"`` or ``"int8"``: the frozen
    projections held quantized, QLoRA) among them, with :func:`estimate`'s meaning; there the parameters'
    placement moves the frozen base too (ZeRO-3 with its parameters in CPU RAM or on NVMe); and ``tp=``
    (tensor parallelism: every row one GPU's share of the split model, sharded over the data-parallel
    ranks); ``cp=``, ``cp_method=``, ``chunked_loss=`` (context parallelism and its long-context recipe) and
    ``remat_offload=`` (the remat rows' kept inputs in host memory; the rows without remat keep theirs); and
    ``pp=``, ``microbatches=``, ``schedule=``, ``virtual_stages=`` (pipeline parallelism: every row the largest
    stage's).

    Example:
        >>> from zerofn.plan import compositions
        >>> [e.label for e in compositions(1e9, gpus=2)][:4]
        ['DDP', 'ZeRO-1', 'ZeRO-2', 'DDP + optimizer on CPU']
    """
    if inference:
        rows = [
            estimate(params, inference=True, stage=s, param_offload=p, **kwargs)
            for s, p in ((0, None), (3, None), (3, "cpu"))
        ]
        return sorted(rows, key=Estimate.order)
    shaped = isinstance(params, ModelShape) or all(kwargs.get(x) for x in ("layers", "hidden"))
    has_acts = shaped and bool(kwargs.get("seq")) and bool(kwargs.get("micro_batch"))
    remats = (False, True) if (remat is None and has_acts) else (bool(remat),)
    offload = bool(kwargs.pop("remat_offload", False))
    rows = []
    for r in remats:
        kw = dict(kwargs, remat=r, remat_offload=offload and r)
        for stage in (0, 1, 2, 3):
            for dev in DEVICES:
                rows.append(estimate(params, stage=stage, optimizer_offload=dev, **kw))
        # ZeRO-3's parameter shards in CPU RAM beside the optimizer state in RAM or on NVMe, or on NVMe beside it
        for dev, p in (("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme")):
            rows.append(estimate(params, stage=3, optimizer_offload=dev, param_offload=p, **kw))
    return sorted(rows, key=Estimate.order)
