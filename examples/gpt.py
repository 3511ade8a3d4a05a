"""The examples' GPT, its synthetic corpus, and two training helpers.

The model (``GPT``, ``GPTConfig``, ``Block``), the corpus (``MarkovCorpus``)
and the loss (``loss_fn_for``) live in ``zerofn/bench/gpt.py``, so that
``python -m zerofn.bench`` trains the same model from an installed zerofn;
this file re-exports them for the examples and adds what only training
scripts need: ``unigram_entropy`` and ``lr_schedule``.

The corpus is drawn from a random Markov chain: each token allows only a
few next tokens, with skewed probabilities. Its unigram entropy is close to
log(vocab), while the entropy of the next token given the one before is far
lower; a model that learns the chain drives its loss well below the unigram
entropy, towards that floor.
"""

from __future__ import annotations

import math

import torch

from zerofn.bench.gpt import GPT, Block, GPTConfig, MarkovCorpus, loss_fn_for

__all__ = ["Block", "GPT", "GPTConfig", "MarkovCorpus", "loss_fn_for", "lr_schedule", "unigram_entropy"]


def unigram_entropy(tokens: torch.Tensor, vocab: int) -> float:
    """Entropy (nats) of the token frequencies: what a model without context can reach."""
    counts = torch.bincount(tokens.reshape(-1), minlength=vocab).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def lr_schedule(peak: float, warmup: int, total: int):
    def lr(count: int) -> float:
        if count < warmup:
            return peak * (count + 1) / warmup
        progress = min(1.0, (count - warmup) / max(1, total - warmup))
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    return lr
