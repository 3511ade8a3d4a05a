"""The estimate's refusals: the compositions zerofn does not run and the combinations it does not model,
each said with what to do instead (:func:`check`)."""

from __future__ import annotations

from typing import Any

from zerofn.plan.estimates._defaults import DEVICES

QUANTIZE_NEEDS_LORA = (
    "estimate: quantize={quantize!r} without lora_rank: quantize holds the model's frozen Linear weights "
    "quantized (NF4 or int8, dequantized per call), and without LoRA adapters every Linear is trainable, so "
    "nothing would be frozen to quantize. Pass lora_rank= (python -m zerofn plan: --lora-rank R) for QLoRA, or "
    "leave quantize out to plan full training."
)

_WHERE = {"cpu": "in CPU RAM", "nvme": "on NVMe"}


def _param_placement(param_offload: Any, optimizer_offload: str | None) -> str | None:
    """``estimate``'s ``param_offload`` as a placement, as ``offload``'s ``params`` is read: None or False (the
    GPU), "cpu", "nvme", or True (the optimizer state's placement, CPU RAM when it has none)."""
    if param_offload is None or param_offload is False:
        return None
    if param_offload is True:
        return optimizer_offload or "cpu"
    if param_offload in ("cpu", "nvme"):
        return param_offload
    raise ValueError(f'estimate: param_offload must be None, "cpu" or "nvme" (or True, False), got {param_offload!r}')


def check(
    *,
    stage: int,
    optimizer_offload: str | None,
    param_offload: Any,
    remat: bool,
    inference: bool,
    lora_rank: int | None,
    quantize: str | None,
    shaped: bool,
    experts: int,
    tp: int,
    cp: int | None = None,
    remat_offload: bool = False,
    ep: int | None = None,
    pp: int | None = None,
) -> str | None:
    """Raises where :func:`~zerofn.plan.estimate` is asked for what zerofn does not run or the planner does not
    model; returns ``param_offload`` as a placement (:func:`_param_placement`). ``shaped``: the blocks' shapes
    are known (``layers`` and ``hidden``); ``experts``: the MLPs of a block."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"estimate: stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if optimizer_offload not in DEVICES:
        raise ValueError(f'estimate: optimizer_offload must be None, "cpu" or "nvme", got {optimizer_offload!r}')
    param_offload = _param_placement(param_offload, optimizer_offload)
    if inference and (optimizer_offload or remat):
        raise ValueError("estimate: inference holds no optimizer state and saves no activations")
    if inference and param_offload == "nvme":
        raise ValueError(
            'estimate: param_offload="nvme" streams the parameter shards from files beside an optimizer state on '
            'NVMe, which inference does not hold; keep the weights in CPU RAM: stage=3, param_offload="cpu"'
        )
    if param_offload and stage != 3:
        beside = "nvme" if param_offload == "nvme" else optimizer_offload or "cpu"  # what offload takes with it
        raise ValueError(
            f"estimate: parameters rest {_WHERE[param_offload]} only under ZeRO-3, which gathers them unit by unit "
            f'(stage=3): estimate(..., stage=3, optimizer_offload="{beside}", param_offload="{param_offload}")'
        )
    if param_offload == "nvme" and optimizer_offload != "nvme":
        raise ValueError(
            'estimate: param_offload="nvme" streams the parameter shards from files beside an optimizer state that '
            "is on NVMe too (it is six times their size under Adam, so when it fits in RAM the parameters do): "
            'optimizer_offload="nvme", param_offload="nvme" (offload(step, "nvme", path=..., params="nvme")), or '
            'keep both in RAM: optimizer_offload="cpu", param_offload="cpu" (offload(step, "cpu", params="cpu"))'
        )
    if param_offload and not inference and optimizer_offload is None:
        raise ValueError(
            "estimate: parameters on the host come with the optimizer state off the GPU, in CPU RAM or on NVMe "
            '(optimizer_offload="cpu" or "nvme")'
        )
    if quantize is not None and lora_rank is None:
        raise ValueError(QUANTIZE_NEEDS_LORA.format(quantize=quantize))
    if lora_rank is not None and inference:
        raise ValueError(
            f"estimate: lora_rank={lora_rank!r}{f', quantize={quantize!r}' if quantize else ''} plans training "
            "(adapters with gradients and optimizer state); inference=True counts 2-byte weights only. Leave one "
            "of the two out."
        )
    if lora_rank is not None and not shaped:
        raise ValueError(
            "estimate: lora_rank puts adapters on every block's projections, whose shapes it needs: pass a "
            "ModelShape (zerofn.plan.model_shape(config)) or layers= and hidden= (with heads=, kv_heads=, ffn=, "
            "gated= where they differ from GPT's defaults)"
        )
    if lora_rank is not None and experts > 1:
        raise ValueError(
            f"estimate: lora_rank on a mixture-of-experts model ({experts} experts per block) is not "
            "modelled: its experts are not one Linear per projection. Plan its dense counterpart, or without "
            "lora_rank."
        )
    if tp != 1 and (lora_rank is not None or inference):
        what = f"lora_rank={lora_rank!r}" if lora_rank is not None else "inference=True"
        raise ValueError(
            f"estimate: tp={tp!r} with {what} is not modelled: tensor_parallel splits the trainable Linear "
            "layers of a training step (not LoRA's adapters on a frozen base, not weights alone). Leave one of "
            "the two out."
        )
    if cp is not None and inference:
        raise ValueError(
            f"estimate: cp={cp!r} with inference=True is not modelled: context_parallel cuts a training step's "
            "sequence (its forward, backward and loss). Leave one of the two out."
        )
    if ep is not None and inference:
        raise ValueError(
            f"estimate: ep={ep!r} with inference=True is not modelled: expert_parallel cuts a training step's "
            "experts (their parameters, gradients and optimizer state, and the routed tokens of its forward and "
            "backward). Leave one of the two out."
        )
    if pp is not None and pp != 1 and (inference or lora_rank is not None or ep is not None):
        what = "inference=True" if inference else f"lora_rank={lora_rank!r}" if lora_rank is not None else f"ep={ep!r}"
        raise ValueError(
            f"estimate: pp={pp!r} with {what} is not modelled: pipeline_parallel pipelines a training step's "
            "micro-batches through the stages of a dense model's trainable blocks (not weights alone, not LoRA's "
            "adapters on a frozen base, not a mixture-of-experts model's cut experts). Leave one of the two out."
        )
    if remat_offload and not remat:
        raise ValueError(
            "estimate: remat_offload=True holds remat's kept block inputs in host memory (remat(..., "
            'offload="cpu")), and without remat=True nothing is kept: pass remat=True too, or leave remat_offload out'
        )
    return param_offload
