"""Where a model is cut into stages: its :class:`Parts` (found for Hugging Face decoders, or given), which
parameters each stage holds, and what a stage's forward swaps in the model while it runs (:func:`patched`).

A stage runs the model's own forward, with the parts it does not own taken out: the blocks of other stages
pass their input through (:class:`_Pass`), a stage after the first receives its input where the input
embedding would have made it (:class:`_Received`; the position embeddings it does not hold read zeros), and a
stage before the last stops where the final norm would run (:class:`_Stop`), its output the hidden states
that reached it. So whatever the model computes around its blocks (masks, rotary tables, position ids) is
computed on every stage as one process computes it, from the same micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["KNOWN", "Parts", "Stages", "Stopped", "assign", "find_parts", "patched"]


@dataclass(frozen=True)
class Parts:
    """Where a decoder's pieces are, as paths of the model's modules (``model.get_submodule(path)``).

    Attributes:
        blocks: the ``nn.ModuleList`` of its blocks, run in order (Llama's ``model.layers``, GPT-2's
            ``transformer.h``): divided between the stages.
        embedding: the input embedding, on the first stage; on the others it returns the hidden states the
            stage received.
        norm: the module the blocks' output enters first (the final norm): a stage before the last stops
            there, its output what entered it; the last stage runs it, the head and the loss.
        first: more parameters or modules of the first stage (position embeddings: ``transformer.wpe``, a
            parameter ``pos``): the other stages read zeros in their place.
        skip: modules that the other stages skip (identity): a dropout after the embeddings.
    """

    blocks: str
    embedding: str
    norm: str
    first: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()


# (blocks, embedding, norm, first, skip), relative to the module that holds them: Llama, Qwen2/3, Mistral,
# Gemma (``model.*``); GPT-2 (``transformer.*``); zerofn's example GPT.
KNOWN = (
    ("layers", "embed_tokens", "norm", (), ()),
    ("h", "wte", "ln_f", ("wpe",), ("drop",)),
    ("blocks", "tok", "ln", ("pos",), ()),
)


def _has(module: nn.Module, name: str) -> bool:
    return isinstance(getattr(module, name, None), (nn.Module, torch.Tensor))


def find_parts(model: nn.Module) -> Parts | None:
    """The parts of ``model`` when a module of it holds blocks, embedding and norm under a known name."""
    for prefix, m in model.named_modules():
        for blocks, embedding, norm, first, skip in KNOWN:
            if isinstance(getattr(m, blocks, None), nn.ModuleList) and _has(m, embedding) and _has(m, norm):
                dot = f"{prefix}." if prefix else ""
                return Parts(
                    dot + blocks,
                    dot + embedding,
                    dot + norm,
                    tuple(dot + f for f in first if _has(m, f)),
                    tuple(dot + s for s in skip if _has(m, s)),
                )
    return None


@dataclass(frozen=True)
class Stages:
    """How the model is cut: ``count`` stages, stage ``s`` holding blocks ``bounds[s]:bounds[s + 1]``, and
    which stage holds each parameter (``owner``), every stage that reads it (``readers``)."""

    parts: Parts
    count: int
    bounds: tuple[int, ...]
    owner: dict  # parameter name -> the stage that holds it
    readers: dict  # parameter name -> the stages whose forward reads it (a tied weight: more than one)

    def names(self, stage: int) -> list[str]:
        """The parameters stage ``stage`` holds."""
        return [n for n, s in self.owner.items() if s == stage]

    def borrowed(self, stage: int) -> list[str]:
        """The parameters stage ``stage`` reads but another stage holds (a head tied to the embedding)."""
        return [n for n, r in self.readers.items() if stage in r and self.owner[n] != stage]


def _stage_of(path: str, parts: Parts, block_stage: list[int], last: int) -> int:
    """The stage that runs the module or parameter at ``path``."""
    for p in (parts.embedding, *parts.first):
        if path == p or path.startswith(p + "."):
            return 0
    prefix = parts.blocks + "."
    if path.startswith(prefix):
        return block_stage[int(path[len(prefix) :].split(".", 1)[0])]
    return last


def assign(model: nn.Module, parts: Parts, count: int, split: Sequence[int] | None, where: str) -> Stages:
    """Cut ``model``'s blocks into ``count`` stages (as even as they divide, the first stages taking one more;
    or at the block indices ``split`` lists, ``count - 1`` of them; the first and the last stage may hold no
    block: the last then runs the final norm, the head and the loss alone, which may weigh as much as several
    blocks) and say which stage
    holds each parameter:
    the embeddings (and ``parts.first``) the first, each block its stage, the rest (the final norm, the head)
    the last. A weight shared by modules of two stages (a head tied to the input embedding) is held by the
    first of them and read by both.

    Raises:
        ValueError: fewer blocks than stages, or a ``split`` that is not ``count - 1`` increasing block
            indices.
    """
    blocks = model.get_submodule(parts.blocks)
    n = len(blocks)
    if split is None:
        if n < count:
            raise ValueError(
                f"{where}: the model has {n} blocks ({parts.blocks}) for {count} stages; each stage needs one. "
                "Use fewer stages (stages x virtual_stages <= blocks)."
            )
        base, more = divmod(n, count)
        sizes = [base + (1 if s < more else 0) for s in range(count)]
        bounds = [0]
        for k in sizes:
            bounds.append(bounds[-1] + k)
    else:
        inner = [int(b) for b in split]
        bounds = [0, *inner, n]
        empty = [s for s in range(1, count - 1) if bounds[s + 1] <= bounds[s]]
        if len(inner) != count - 1 or any(b < a for a, b in zip(bounds, bounds[1:])) or empty:
            raise ValueError(
                f"{where}: split={list(split)} must list {count - 1} non-decreasing block indices from 0 to {n} "
                f"(where stages 1..{count - 1} start), one boundary per stage after the first, every stage between "
                "the first and the last holding a block (the first holds the embeddings, the last the head: they "
                f"may hold none); e.g. split={[round(n * (s + 1) / count) for s in range(count - 1)]}"
            )
    block_stage = [s for s in range(count) for _ in range(bounds[s], bounds[s + 1])]
    owner: dict[str, int] = {}
    readers: dict[str, set] = {}
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        held = first_name.setdefault(id(p), name)
        stage = _stage_of(name, parts, block_stage, count - 1)
        owner.setdefault(held, stage)
        readers.setdefault(held, set()).add(stage)
    return Stages(parts, count, tuple(bounds), owner, {k: frozenset(v) for k, v in readers.items()})


class Stopped(Exception):  # noqa: N818 - a signal, not an error: the stage's forward ends here
    """Raised by :class:`_Stop`: the hidden states that reached the final norm on a stage before the last."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("a pipeline stage stops at the final norm")
        self.hidden = hidden


class _Pass(nn.Module):
    """A block of another stage: passes its input through (keeps the block's attributes the model reads)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        for attr in ("attention_type", "layer_idx", "is_sliding"):
            if hasattr(block, attr):
                object.__setattr__(self, attr, getattr(block, attr))

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden


class _Received(nn.Module):
    """The input embedding on a stage after the first: the hidden states the stage received."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.hidden


class _Zeros(nn.Module):
    """A position embedding on a stage after the first: zeros of what it would return (the first stage
    added it already)."""

    def __init__(self, width: int, like: torch.Tensor):
        super().__init__()
        self.width, self.like = width, like

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.like.new_zeros((*ids.shape, self.width))


class _Stop(nn.Module):
    """The final norm on a stage before the last: its input is the stage's output."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise Stopped(hidden)


def _set(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent, _, attr = path.rpartition(".")
    owner = model.get_submodule(parent)
    before = owner._modules[attr]
    owner._modules[attr] = module
    return before


@contextlib.contextmanager
def patched(model: nn.Module, stages: Stages, stage: int, received: torch.Tensor | None) -> Iterator[None]:
    """While inside, ``model``'s forward runs stage ``stage`` only (see the module): on ``received``, the
    hidden states from the stage before (None on the first stage)."""
    parts = stages.parts
    put: list[tuple[str, nn.Module]] = []
    swapped: list[tuple[nn.Module, str, Any]] = []
    try:
        blocks = model.get_submodule(parts.blocks)
        lo, hi = stages.bounds[stage], stages.bounds[stage + 1]
        for i in [*range(lo), *range(hi, len(blocks))]:
            path = f"{parts.blocks}.{i}"
            put.append((path, _set(model, path, _Pass(blocks[i]))))
        if stage > 0:
            put.append((parts.embedding, _set(model, parts.embedding, _Received(received))))
            for path in parts.skip:
                put.append((path, _set(model, path, nn.Identity())))
            for path in parts.first:
                parent, _, attr = path.rpartition(".")
                owner = model.get_submodule(parent)
                if attr in owner._parameters:  # a parameter read as it is (the example GPT's ``pos``)
                    held = owner._parameters[attr]
                    zeros = received.new_zeros(held.shape)
                    owner._parameters[attr] = zeros
                    swapped.append((owner, attr, held))
                else:
                    width = owner._modules[attr].weight.shape[-1]
                    put.append((path, _set(model, path, _Zeros(width, received))))
        if stage < stages.count - 1:
            put.append((parts.norm, _set(model, parts.norm, _Stop())))
        yield
    finally:
        for path, before in reversed(put):
            _set(model, path, before)
        for owner, attr, held in swapped:
            owner._parameters[attr] = held
