"""Models and references the tests share (imported by rank processes too)."""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zerofn as zf


class MLP(nn.Module):
    def __init__(self, sizes=(7, 13, 11, 3)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


class TinyTransformer(nn.Module):
    """Tied embeddings, odd sizes, a frozen parameter, a float64 parameter and a scalar."""

    def __init__(self, vocab=23, dim=10, heads=2, layers=2, seq=9, extras=True):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            b = nn.Module()
            b.ln = nn.LayerNorm(dim)
            b.qkv = nn.Linear(dim, 3 * dim, bias=False)
            b.proj = nn.Linear(dim, dim)
            b.fc = nn.Linear(dim, 2 * dim + 1)
            b.out = nn.Linear(2 * dim + 1, dim)
            self.blocks.append(b)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.extras = extras
        if extras:
            self.temperature = nn.Parameter(torch.tensor(1.3))  # a scalar parameter
            self.frozen_proj = nn.Parameter(torch.randn(dim, dim) * 0.1, requires_grad=False)
            self.gate64 = nn.Parameter(torch.randn(dim, dtype=torch.float64) * 0.1 + 1.0)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        if self.extras:
            x = x + x @ self.frozen_proj
            x = (x.double() * self.gate64).float()
        for b in self.blocks:
            h = b.ln(x)
            q, k, v = b.qkv(h).chunk(3, dim=-1)
            B, T, D = q.shape
            q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
            x = x + b.proj(y)
            x = x + b.out(torch.tanh(b.fc(x)))
        logits = self.head(x)
        if self.extras:
            logits = logits * self.temperature
        return logits


def make_mlp(seed=0):
    torch.manual_seed(seed)
    model = MLP()
    apply = zf.functional(model)

    def loss_fn(params, batch):
        return ((apply(params, batch["x"]) - batch["y"]) ** 2).mean()

    return model, apply, loss_fn


def mlp_batch(step, n, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x = torch.randn(n, 7, generator=g)
    return {"x": x, "y": torch.sin(x[:, :3] * 2)}


def make_transformer(seed=0, extras=True):
    torch.manual_seed(seed)
    model = TinyTransformer(extras=extras)
    apply = zf.functional(model)

    def loss_fn(params, batch):
        logits = apply(params, batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    return model, apply, loss_fn


def transformer_batch(step, n, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(23, (n, 9), generator=g)


MODELS = {
    "mlp": (make_mlp, mlp_batch),
    "transformer": (make_transformer, transformer_batch),
}


# The shape of the small Hugging Face decoders the tests build (grouped-query attention: 2 key/value heads).
TINY_DECODER = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tiny_llama_config(**changes):
    """A small Llama's config: ``TINY_DECODER`` with ``changes`` (transformers' warnings quieted)."""
    import transformers
    from transformers import LlamaConfig

    transformers.logging.set_verbosity_error()
    return LlamaConfig(**{**TINY_DECODER, **changes})


def tiny_llama(seed: int = 0, **changes) -> nn.Module:
    """A small fp32 Llama from :func:`tiny_llama_config`, its weights drawn after ``torch.manual_seed(seed)``."""
    from transformers import LlamaForCausalLM

    cfg = tiny_llama_config(**changes)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def tiny_lora_llama(**changes) -> nn.Module:
    """A peft LoRA over :func:`tiny_llama` (``changes`` its config's) on q, v and gate, its adapters' B drawn
    non-zero so that every adapter trains from the first step."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        tiny_llama(**changes),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0),
    )
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    return model


def stats_bytes(trainable: int, world: int, update: bool = True) -> int:
    """What a step's statistics all-reduce adds to comm_bytes on ``world`` ranks (counted twice, as every
    all-reduce): the loss, the gradient's sum of squares, how many ranks lacked a gradient, the batch digest
    and its square (5 float64), and on an update how many ranks gave each of the ``trainable`` parameters a
    gradient, packed ``world.bit_length()`` bits a parameter into 52-bit float64s."""
    floats = 5 + (math.ceil(trainable / (52 // world.bit_length())) if update else 0)
    return 2 * 8 * floats


def rank_slice(batch, rank, world):
    """This rank's share of a global batch (the first dim split in equal parts)."""
    if isinstance(batch, dict):
        return {k: rank_slice(v, rank, world) for k, v in batch.items()}
    n = batch.shape[0] // world
    return batch[rank * n : (rank + 1) * n]


def refusals(calls: dict, errors: tuple = (ValueError,)) -> dict:
    """``{key: the message of the error calls[key]() raised}`` (None where it raised none), for checking that
    each bad call is refused with what to do; an error of another type propagates."""
    out = {}
    for key, fn in calls.items():
        try:
            fn()
            out[key] = None
        except errors as e:
            out[key] = str(e)
    return out


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest |a - b| over every key, each pair compared on the host (offload's masters live there, the
    step's parameters on the GPU); nan when any difference is nan (a nan parameter on either side), so that
    every comparison with it fails (Python's max() would drop a nan that is not first)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert a[k].shape == b[k].shape, (k, tuple(a[k].shape), tuple(b[k].shape))  # no broadcasting
    diffs = [(a[k].double().cpu() - b[k].double().cpu()).abs().max().item() for k in a]  # wherever each lives
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)


def train(step, state, batch_fn, steps, global_batch, world, rank):
    """``steps`` updates of ``step``, each rank feeding its slice of the global batch in
    ``step.accumulate_steps`` micro-batches; returns the final state and metrics."""
    k = step.accumulate_steps
    metrics = None
    for i in range(steps):
        local = rank_slice(batch_fn(i, global_batch), rank, world)
        for m in range(k):
            state, metrics = step(state, rank_slice(local, m, k))
    return state, metrics


class ConfigRun(NamedTuple):
    """A DeepSpeed config trained beside the composition written by hand for it (see :func:`config_vs_hand`)."""

    step: Any  # from the config
    state: Any
    metrics: dict
    hand: Any  # written by hand
    hand_state: Any
    total: int  # the config's train_batch_size
    equal: bool  # the two steps' parameters are bit for bit equal
    moved: bool  # and differ from the initial ones


def config_vs_hand(config: dict, by_hand, steps: int, *, warn: str = "error", **kw) -> ConfigRun:
    """Train ``from_deepspeed(config, loss_fn, **kw)`` and ``by_hand(loss_fn)`` (a Step) for ``steps`` updates
    on this rank's slice of the same MLP batches; ``warn``: the warnings filter around ``from_deepspeed``
    ("error": the config maps without a warning)."""
    import warnings

    from zerofn import collectives as C
    from zerofn.deepspeed import from_deepspeed

    rank, world = C.rank(), C.world_size()
    with warnings.catch_warnings():
        warnings.simplefilter(warn)
        _, apply, loss_fn = make_mlp()
        step, batch = from_deepspeed(config, loss_fn, **kw)
    total = batch.train_batch_size
    state, metrics = train(step, step.init(apply.params), mlp_batch, steps, total, world, rank)
    ours = step.full_params(state)
    _, apply2, loss_fn2 = make_mlp()
    hand = by_hand(loss_fn2)
    hand_state, _ = train(hand, hand.init(apply2.params), mlp_batch, steps, total, world, rank)
    theirs = hand.full_params(hand_state)
    equal = all(torch.equal(ours[k], theirs[k]) for k in ours)
    moved = not all(torch.equal(ours[k], v.to(ours[k].dtype)) for k, v in make_mlp()[1].params.items())
    return ConfigRun(step, state, metrics, hand, hand_state, total, equal, moved)


def compositions() -> dict:
    """Each stage, amp and offload as a transform of a step, by name (imported lazily: ranks import this module)."""
    from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

    return {
        "plain": lambda s: s,
        "shard_optimizer": shard_optimizer,
        "shard_grads": shard_grads,
        "shard_params": shard_params,
        "amp": amp,
        "offload": lambda s: offload(s, "cpu"),
    }


READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


class _Reads(TorchDispatchMode):
    """Counts host reads of tensors: ``_local_scalar_dense`` (item, float(t), int(t), bool(t)) through
    the dispatcher, and ``tolist``/``numpy``, which do not go through it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.n += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting():
    """Count the host reads of tensors made on this thread inside the block (``.n``): each waits for the
    device to drain."""
    mode, patched = _Reads(), {}
    for name in ("tolist", "numpy"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, **k):
            mode.n += 1
            return _real(self, *a, **k)

        patched[name] = real
        setattr(torch.Tensor, name, spy)
    try:
        with mode:
            yield mode
    finally:
        for name, real in patched.items():
            setattr(torch.Tensor, name, real)


@contextlib.contextmanager
def agreements():
    """Every agreement shard_params' ranks make on the units inside the block, in order: (point, "waited") for
    one waited for before anything else ran, (point, "posted") for one left in flight."""
    from zerofn.transforms.shard_params._agreement import Agreement

    seen, agree, post = [], Agreement.agree, Agreement.post

    def agreeing(self, point, unit, wait=True, plan=None, digest=0):
        seen.append((point.name, "waited" if wait else "posted"))
        Agreement.post = post  # the agreement's own post is counted above
        try:
            return agree(self, point, unit, wait, plan, digest)
        finally:
            Agreement.post = posting

    def posting(self, point, unit, digest=0):
        seen.append((point.name, "posted"))
        return post(self, point, unit, digest)

    Agreement.agree, Agreement.post = agreeing, posting
    try:
        yield seen
    finally:
        Agreement.agree, Agreement.post = agree, post


def groups_in_step(case: int) -> bool:
    """Whether both process groups still pair this rank's collectives with the other ranks': an all-gather on the
    default group and a max-reduce on the control one, of values that tell the case and the rank. A collective
    that a failed step left in flight on one rank would pair with these instead (wrong values, or a wait)."""
    C = zf.collectives
    world, rank = C.world_size(), C.rank()
    full = torch.empty(world, dtype=torch.int64)
    C.all_gather(full, torch.tensor([100 * case + rank]))
    hi, lo = C.max_min(torch.tensor([case]))
    return full.tolist() == [100 * case + r for r in range(world)] and int(hi) == int(lo) == case
