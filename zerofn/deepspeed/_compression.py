"""``compression_training``: DeepSpeed's compression library (quantization, pruning, layer reduction while
training), which zerofn does not have; any technique it enables is an error, since ignoring it changes what is
trained."""

from __future__ import annotations

from zerofn.deepspeed._keys import COMPRESSION_TECHNIQUES
from zerofn.deepspeed._reader import Block

__all__ = ["read_compression"]


def read_compression(r: Block) -> None:
    """Raise when the config's top level ``r`` enables a compression technique; pass when it enables none.

    A technique is enabled by ``"shared_parameters": {"enabled": true}`` (``layer_reduction``: its own
    ``"enabled": true``), as DeepSpeed reads it.
    """
    blk = r.block("compression_training")
    if blk is None:
        return
    on = []
    for name in blk.data:
        tech = blk.raw(name)
        if not isinstance(tech, dict):
            raise ValueError(
                f"from_deepspeed: {blk.key(name)} must be a JSON object (a technique of DeepSpeed's compression "
                f"library: {', '.join(COMPRESSION_TECHNIQUES)}), got {tech!r}"
            )
        shared = tech.get("shared_parameters")
        enabled = tech.get("enabled") is True or (isinstance(shared, dict) and shared.get("enabled") is True)
        if name not in COMPRESSION_TECHNIQUES and enabled is False and "shared_parameters" not in tech:
            raise ValueError(
                f"from_deepspeed: {blk.key(name)}: not a technique of DeepSpeed's compression library "
                f"({', '.join(COMPRESSION_TECHNIQUES)}): check its spelling, or remove it"
            )
        if enabled:
            on.append(name)
    if on:
        what = "; ".join(f"{n} {COMPRESSION_TECHNIQUES.get(n, 'compresses the model while training')}" for n in on)
        raise ValueError(
            f"from_deepspeed: compression_training enables {', '.join(on)}: {what}, which changes the numbers, and "
            "zerofn has no compression library. Remove compression_training (or set each technique's "
            '"shared_parameters": {"enabled": false}) to train the model as it is'
        )
