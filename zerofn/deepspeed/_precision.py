"""The mixed precision a DeepSpeed config asks for (``fp16``, ``bf16``, the dtype gradients are reduced in), as ``amp``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from zerofn.deepspeed._keys import PRECISION_IGNORED, TOP_IGNORED
from zerofn.deepspeed._reader import Block

__all__ = ["AmpSpec", "bf16_masters", "read_precision"]


class AmpSpec(NamedTuple):
    """The arguments of ``amp(step, dtype, **options)``: the compute dtype and the loss-scale and reduction options."""

    dtype: torch.dtype
    options: dict


def bf16_masters(r: Block) -> tuple[bool, bool]:
    """``(bf16_master_weights_and_grads, bf16_optimizer_states)`` as the config's enabled ``bf16`` block
    asks for them (both False when it is off), read without marking any key read: the optimizer's
    moments follow them (fp32 moments of bf16 parameters unless ``bf16_optimizer_states``), and
    :func:`read_precision` checks the values."""
    blk = r.data.get("bf16", r.data.get("bfloat16"))
    if not isinstance(blk, dict) or blk.get("enabled") is not True:
        return False, False
    return blk.get("bf16_master_weights_and_grads") is True, blk.get("bf16_optimizer_states") is True


def read_precision(r: Block, ignored: dict) -> AmpSpec | None:
    """What the ``fp16`` / ``bf16`` blocks (and the reduction dtype) of the config's top level ``r`` ask for.

    None when neither is enabled; keys with no equivalent are added to ``ignored``.
    """
    fp16 = r.block("fp16")
    bf16 = r.block("bf16")
    if bf16 is None:
        bf16 = r.block("bfloat16")  # DeepSpeed's older name
    on16 = fp16 is not None and fp16.get("enabled", False, "bool")
    onbf = bf16 is not None and bf16.get("enabled", False, "bool")
    if on16 and onbf:
        raise ValueError(
            "from_deepspeed: fp16.enabled and bf16.enabled are both true (DeepSpeed refuses it too): enable one"
        )
    out = None
    if on16:
        if fp16.get("consecutive_hysteresis", False, "bool"):
            raise ValueError(
                "from_deepspeed: fp16.consecutive_hysteresis true: zerofn's loss scale follows DeepSpeed's default "
                "(hysteresis refilled when the scale grows, not after every good step); remove it or set it false"
            )
        if fp16.get("fp16_master_weights_and_grads", False, "bool"):
            raise ValueError(
                "from_deepspeed: fp16.fp16_master_weights_and_grads true: zerofn's amp keeps fp32 master weights; "
                "remove it or set it false"
            )
        fp16.raw("auto_cast")  # zerofn's amp runs the forward under torch.autocast either way
        scale = fp16.get("loss_scale", 0.0, "float", low=0.0)
        if scale == 0:
            kw = {
                "loss_scale": "dynamic",
                "init_scale": 2.0 ** fp16.get("initial_scale_power", 16, "int", low=0),
                "growth_interval": fp16.get("loss_scale_window", 1000, "int", low=1),
                "hysteresis": fp16.get("hysteresis", 2, "int", low=1),
                "min_scale": fp16.get("min_loss_scale", 1.0, "float"),
            }
        else:
            kw = {"loss_scale": scale}
            for k in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
                fp16.raw(k)  # they tune the dynamic scale only
        out = AmpSpec(torch.float16, kw)
    elif onbf:
        masters = bf16.get("bf16_master_weights_and_grads", False, "bool")
        if bf16.get("bf16_optimizer_states", False, "bool") and not masters:
            raise ValueError(
                f"from_deepspeed: {bf16.key('bf16_optimizer_states')} true needs bf16_master_weights_and_grads "
                "true (DeepSpeed refuses it too): set both, or remove bf16_optimizer_states"
            )
        # bf16 masters: no fp32 copy, the optimizer updates the bf16 parameters with bf16 gradients (its
        # moments in fp32, or in bf16 with bf16_optimizer_states: the optimizer's mu_dtype / nu_dtype).
        out = AmpSpec(torch.bfloat16, {"master_dtype": torch.bfloat16} if masters else {})
    for blk, on in ((fp16, on16), (bf16, onbf)):
        if blk is not None and on:
            for k in blk.leftover():
                if k not in PRECISION_IGNORED:
                    raise ValueError(
                        f"from_deepspeed: {blk.key(k)}: not a key of DeepSpeed's {blk.path} block that zerofn knows "
                        "(ignoring it could change the numbers): check its spelling, or remove it. Known: enabled, "
                        + (
                            "loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale, "
                            "consecutive_hysteresis, fp16_master_weights_and_grads, auto_cast, "
                            if blk is fp16
                            else "bf16_master_weights_and_grads, bf16_optimizer_states, "
                        )
                        + ", ".join(sorted(PRECISION_IGNORED))
                    )
                ignored[blk.key(k)] = PRECISION_IGNORED[k]
    # The dtype gradients travel in: communication_data_type, else fp32_allreduce.
    comm = r.raw("communication_data_type")
    fp32_reduce = r.raw("fp32_allreduce", False)
    if comm is not None and comm not in ("fp32", "fp16", "bf16"):
        raise ValueError(f'from_deepspeed: communication_data_type must be "fp32", "fp16" or "bf16", got {comm!r}')
    if out is None:
        if comm in ("fp16", "bf16"):
            ignored["communication_data_type"] = TOP_IGNORED["communication_data_type"]
        return None
    want = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(comm)
    if want is None and fp32_reduce is True:
        want = torch.float32
    if want is not None and want != out.dtype:
        out.options["reduce_dtype"] = want
    return out
