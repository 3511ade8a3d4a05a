"""A small GPT and a synthetic corpus with structure a model can learn.

This is the model that ``python -m zerofn.bench`` trains and that the
examples use (``examples/gpt.py`` imports it from here), so the benchmark
runs from an installed zerofn as well as from a checkout.

The corpus is drawn from a random Markov chain: each token allows only a
few next tokens, with skewed probabilities. Its unigram entropy is close to
log(vocab), while the entropy of the next token given the one before is far
lower; a model that learns the chain drives its loss well below the unigram
entropy, towards that floor.

Example:
    >>> import torch
    >>> model = GPT(GPTConfig(vocab=16, seq_len=8, dim=32, heads=4, layers=1))
    >>> batch = MarkovCorpus(vocab=16).sample(2, 9, seed=0)
    >>> model(batch[:, :-1]).shape
    torch.Size([2, 8, 16])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

__all__ = ["Block", "GPT", "GPTConfig", "MarkovCorpus", "loss_fn_for"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq_len: int = 64
    dim: int = 128
    heads: int = 4
    layers: int = 4
    tie_embeddings: bool = True


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        # No bias on q, k, v: a key bias gets an exactly-zero gradient under
        # softmax, where Adam amplifies reduction-order noise into steps.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(self.ln1(x)), "b t (three h d) -> three b h t d", three=3, h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(rearrange(y, "b h t d -> b t (h d)"))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)  # small logits at the start (the head shares it)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class MarkovCorpus:
    """Token sequences from a random Markov chain with ``branching`` choices after each token."""

    def __init__(self, vocab: int = 64, branching: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.next_tokens = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
        weights = torch.rand(vocab, branching, generator=g) ** 2 + 0.05
        self.probs = weights / weights.sum(-1, keepdim=True)

    def conditional_entropy(self) -> float:
        """Entropy (nats) of the next token given the one before, averaged over tokens: the loss floor."""
        p = self.probs
        return float(-(p * p.log()).sum(-1).mean())

    def sample(self, n: int, length: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(n, length, dtype=torch.long)
        out[:, 0] = torch.randint(self.vocab, (n,), generator=g)
        for t in range(1, length):
            prev = out[:, t - 1]
            choice = torch.multinomial(self.probs[prev], 1, generator=g).squeeze(1)
            out[:, t] = self.next_tokens[prev, choice]
        return out


def loss_fn_for(apply):
    """The next-token cross-entropy of ``apply`` (from zf.functional(GPT(...)))."""

    def loss_fn(params, batch):
        logits = apply(params, batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return loss_fn
