"""The ``expert_parallel`` block of a DeepSpeed config (AutoEP): ``"enabled": true`` with ``autoep_size`` N is
``expert_parallel(step, N)`` on the built step; the keys around it, and the arguments of DeepSpeed's own MoE
layer where a config carries them, are read, warned or refused."""

from __future__ import annotations

from typing import Any

from zerofn.deepspeed._keys import (
    EP_ERRORS,
    EP_IGNORED,
    EP_PRESETS,
    EP_QUIET,
    MOE_LAYER_ERRORS,
    MOE_LAYER_IGNORED,
)
from zerofn.deepspeed._reader import Block

__all__ = ["MOE_TOP_LEVEL", "read_expert_parallel"]

# The MoE layer's arguments looked for at the top level of a config ("k" is too short a name to mean it there).
MOE_TOP_LEVEL = tuple(k for k in (*MOE_LAYER_ERRORS, *MOE_LAYER_IGNORED) if k != "k")


def _same(v: Any, quiet: tuple) -> bool:
    """``v`` is one of the ``quiet`` values, of the same type (true is no 1)."""
    return any(v is q or (type(v) is type(q) and v == q) for q in quiet)


def _moe_layer_keys(blk: Block, names: tuple[str, ...], ignored: dict) -> None:
    """Refuse (or warn) the arguments of DeepSpeed's MoE layer among ``names`` in ``blk`` that ask for something:
    ``drop_tokens`` false (zerofn's dropless routing) makes the capacity keys and ``use_rts`` ask for nothing."""
    present = [k for k in names if k in blk]
    drop = blk.raw("drop_tokens") if "drop_tokens" in blk else None
    dropless = drop is False
    for k in present:
        v = blk.raw(k)
        if v is None or v is False or (k == "noisy_gate_policy" and v == "None"):
            continue
        if dropless and k in ("capacity_factor", "eval_capacity_factor", "min_capacity"):
            continue
        if k in MOE_LAYER_IGNORED:
            if not dropless or k != "use_rts":
                ignored[blk.key(k)] = MOE_LAYER_IGNORED[k]
            continue
        raise ValueError(f"from_deepspeed: {blk.key(k)} is {v!r}: {MOE_LAYER_ERRORS[k]}")


def read_expert_parallel(raw: dict, world: int, group: Any, ignored: dict) -> int:
    """The expert-parallel size the config asks for (1: none), checked against the data-parallel ranks before
    anything is built.

    ``raw`` is the whole config; ``world`` the ranks left by tensor and sequence parallelism (``world_size //
    (autotp_size x sequence_parallel_size)``), which ``autoep_size`` must divide. Unlike those two, expert
    parallelism does not divide the data-parallel ranks: every rank of an expert-parallel group feeds its own
    micro-batch, so the batch sizes are resolved over ``world`` as it is (DeepSpeed counts them so too). Keys
    with no equivalent go to ``ignored``.

    DeepSpeed reads the block only with ``"enabled": true`` (``autoep_size`` defaults to 1, every rank holding
    every expert); without it, a block that asks for something is warned, as DeepSpeed ignores it.

    Raises:
        ValueError: an ``autoep_size`` that does not divide ``world``; an ``expert_tensor_parallel_size`` other
            than 1; a ``preset_model`` whose models zerofn does not find itself; a key that would change which
            parameters are experts or how tokens are routed; ``group=`` beside an ``autoep_size`` above 1; an
            argument of DeepSpeed's MoE layer (a capacity factor, token dropping, a noisy gate, ...) that asks
            for what zerofn's dropless routing does not do, at the top level, in ``"moe"`` or in the block.
    """
    top = Block("", raw)
    _moe_layer_keys(top, MOE_TOP_LEVEL, ignored)
    moe = top.block("moe")
    if moe is not None:
        _moe_layer_keys(moe, tuple(MOE_LAYER_ERRORS) + tuple(MOE_LAYER_IGNORED), ignored)
        for k in moe.leftover():
            ignored[moe.key(k)] = "unknown key"
    data = raw.get("expert_parallel")
    if data is None:
        return 1
    blk = Block("expert_parallel", data)
    enabled = blk.get("enabled", False, "bool")
    if not enabled:
        if "enabled" not in data and any(v is not None for v in data.values()):
            ignored["expert_parallel"] = (
                'not enabled: DeepSpeed reads none of its keys without "enabled": true, and neither does zerofn '
                '(write "enabled": true for expert_parallel(step, autoep_size))'
            )
        return 1
    size = blk.get("autoep_size", 1, "int", low=1)
    etp = blk.get("expert_tensor_parallel_size", 1, "int", low=1)
    if etp != 1:
        raise ValueError(
            f"from_deepspeed: expert_parallel.expert_tensor_parallel_size is {etp}: zerofn holds each expert whole "
            "on one rank of its expert-parallel group (no expert tensor parallelism; DeepSpeed accepts only 1 too). "
            "Write 1 or remove it"
        )
    preset = blk.get("preset_model", None, "str")
    if preset is not None and preset not in EP_PRESETS:
        raise ValueError(
            f"from_deepspeed: expert_parallel.preset_model is {preset!r}: zerofn's expert_parallel needs no preset, "
            "it finds the experts of Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and GPT-OSS models "
            f"itself (DeepSpeed's presets {', '.join(repr(p) for p in EP_PRESETS)} pass silently). Remove "
            "preset_model, for one of those models"
        )
    _moe_layer_keys(blk, tuple(MOE_LAYER_ERRORS) + tuple(MOE_LAYER_IGNORED), ignored)
    for k in blk.leftover():
        v = blk.raw(k)
        if k in EP_QUIET and _same(v, EP_QUIET[k]):
            continue
        if k in EP_ERRORS:
            raise ValueError(f"from_deepspeed: expert_parallel.{k} is {v!r}: {EP_ERRORS[k]}")
        ignored[blk.key(k)] = EP_IGNORED.get(k, "unknown key")
    if size == 1:
        return 1
    if world % size:
        raise ValueError(
            f"from_deepspeed: expert_parallel.autoep_size {size} does not divide the {world} data-parallel ranks "
            f"(the world over tensor_parallel.autotp_size and sequence_parallel_size): an expert-parallel group is "
            f"{size} of them. Run on a multiple of {size} ranks per tensor- and sequence-parallel slice, or write an "
            f"autoep_size that divides {world}."
        )
    if group is not None:
        raise ValueError(
            "from_deepspeed: group= and expert_parallel.autoep_size together: expert_parallel runs the step on the "
            "groups of its mesh over the world. Leave group= out."
        )
    return size
