"""What the benchmarks share: the Llama-shaped Hugging Face model they build from their command line, and
this process's memory figures from /proc.

Standard library only at import: the benchmarks parse their command line before torch is imported.
"""

from __future__ import annotations

import argparse


def add_shape_args(
    p: argparse.ArgumentParser, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int
) -> None:
    """The model's shape flags (--hidden ... --vocab), with the benchmark's defaults."""
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--intermediate", type=int, default=intermediate)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=kv_heads)
    p.add_argument("--vocab", type=int, default=vocab)


def build_llama(args: argparse.Namespace, positions: int):
    """The same fp32 Llama (untied head) on every rank from the shape flags and seed 0, with room for
    ``positions`` tokens; a fresh module each call (the transforms rewrite its layers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(positions, 128),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def proc_status(field: str) -> int:
    """This process's /proc/self/status figure ``field`` ("VmRSS", "VmHWM"), in bytes (0 where there is none)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0
