"""The ``tensor_parallel`` block of a DeepSpeed config (AutoTP training): ``autotp_size`` N is
``tensor_parallel(step, N)`` on the built step; the keys around it are read, warned or refused."""

from __future__ import annotations

from typing import Any

from zerofn.deepspeed._keys import TP_ERRORS, TP_IGNORED, TP_PRESETS
from zerofn.deepspeed._reader import Block, asks_nothing

__all__ = ["read_tensor_parallel"]


def read_tensor_parallel(raw: dict, world: int, group: Any, ignored: dict) -> int:
    """The tensor-parallel size the config asks for (1: none), checked against the world before anything is built.

    ``raw`` is the whole config; keys with no equivalent go to ``ignored``.

    Raises:
        ValueError: an ``autotp_size`` that does not divide the world, a ``tp.tp_size`` that disagrees with
            it, a key that would change the layers' split (a custom partition, an injection policy, a preset
            zerofn does not derive, a process group object), or ``group=`` beside a tensor-parallel size.
    """
    data = raw.get("tensor_parallel")
    if data is None:
        return 1
    blk = Block("tensor_parallel", data)
    size = blk.get("autotp_size", 0, "int", low=0)
    size = max(size, 1)  # 0 (DeepSpeed's default) disables it; 1 splits nothing
    inner = blk.block("tp") or blk.block("tensor_parallel")
    if inner is not None:
        tp_size = inner.get("tp_size", 1, "int", low=1)
        if tp_size not in (1, size):
            raise ValueError(
                f"from_deepspeed: tensor_parallel.tp.tp_size is {tp_size} but tensor_parallel.autotp_size is "
                f"{size}: AutoTP training splits over autotp_size ranks. Write the size once, as "
                f'"tensor_parallel": {{"autotp_size": {tp_size}}}'
            )
        for k in ("mpu", "tp_group"):
            if inner.raw(k) is not None:
                raise ValueError(
                    f"from_deepspeed: {inner.key(k)} is set: zerofn lays out its own groups (tensor_parallel's "
                    "mesh: autotp_size consecutive ranks per tensor-parallel group, data parallel across them); "
                    "remove it"
                )
        if inner.get("tp_grain_size", 1, "int", low=1) != 1:
            ignored[inner.key("tp_grain_size")] = TP_IGNORED["tp_grain_size"]
        for k in inner.leftover():
            ignored[inner.key(k)] = "unknown key"
    preset = blk.get("preset_model", None, "str")
    if preset is not None and preset not in TP_PRESETS:
        raise ValueError(
            f"from_deepspeed: tensor_parallel.preset_model is {preset!r}: zerofn derives the split of Hugging Face "
            f"Llama, Qwen2/3 and Mistral models only ({', '.join(repr(p) for p in TP_PRESETS)}). Remove it for "
            "those, or build the step by hand with tensor_parallel(step, N, plan={module path: 'colwise' | "
            "'rowwise'})"
        )
    for k in blk.leftover():
        v = blk.raw(k)
        if k in TP_ERRORS:
            if not asks_nothing(v) and v != {}:
                raise ValueError(f"from_deepspeed: tensor_parallel.{k} is set: {TP_ERRORS[k]}")
        elif k in TP_IGNORED:
            if k == "tp_overlap_comm" and v is False:
                continue
            if k in ("replace_with_kernel_inject", "kernel_inject", "keep_module_on_host") and v is False:
                continue
            ignored[blk.key(k)] = TP_IGNORED[k]
        else:
            ignored[blk.key(k)] = "unknown key"
    if size == 1:
        return 1
    if world % size:
        raise ValueError(
            f"from_deepspeed: tensor_parallel.autotp_size {size} does not divide the world size {world}: the ranks "
            f"are {size} per tensor-parallel group times world // {size} data-parallel ranks. Run on a multiple of "
            f"{size} ranks, or write an autotp_size that divides {world}."
        )
    if group is not None:
        raise ValueError(
            "from_deepspeed: group= and tensor_parallel.autotp_size together: tensor_parallel runs the step on "
            "the data-parallel group of its mesh over the world. Leave group= out."
        )
    return size
