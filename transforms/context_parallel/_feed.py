"""What each rank of a context-parallel group is fed: its slice of the micro-batch's sequence.

The ranks of a ``cp`` group feed the same micro-batch (that of their data-parallel rank); the step cuts it
before ``loss_fn`` sees it, so that ``loss_fn``, the model and the loss all run on this rank's tokens:

- the layout (:func:`layout`): which global positions each rank holds. Ulysses runs attention on the whole
  sequence, so each rank holds one contiguous slice. Ring attention's causal work is balanced by giving
  each rank two chunks from opposite ends (the sequence cut into ``2 cp`` chunks, rank ``r`` holding
  chunks ``r`` and ``2 cp - 1 - r``): every rank then has as many (query, key) pairs below the diagonal.
- the labels are shifted on the whole sequence first (``shift_labels[t] = labels[t + 1]``, -100 at the
  end), as one process's loss pairs the logits at ``t`` with the token at ``t + 1``; cut after, no pair is
  lost at a slice's edge. The fed batch holds ``shift_labels`` in place of ``labels``.
- ``position_ids``: the global positions of this rank's tokens (rotary embeddings), given or ``0 .. S-1``.
- every other tensor whose second dimension is the sequence (``input_ids``, ``attention_mask``,
  ``inputs_embeds``, ...) is cut the same way; the rest is passed whole.

What attention needs of the whole sequence (the positions of every rank's tokens, the padding mask) stays
in the forward's :class:`Active` context, which the attention functions read; nothing of it travels.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

IGNORE = -100  # the label the losses skip (torch's and Hugging Face's ignore_index)


@dataclass
class Active:
    """One forward's context-parallel state, from the fed batch (set while a step's forward and backward
    run; ``fed`` once the batch was cut)."""

    cp: int
    rank: int
    group: Any
    method: str
    fed: bool = False
    seq: int = 0  # tokens in the whole sequence
    positions: torch.Tensor | None = None  # [cp, L], on the host: the global positions each rank holds
    key_valid: torch.Tensor | None = None  # [B, S] bool (False on padding), or None: no padding given
    items: torch.Tensor | None = None  # the labels the loss counts over the whole micro-batch (0-dim), or None
    ring_valid: torch.Tensor | None = None  # [cp, B, L]: key_valid as each rank holds its keys (ring)


ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar("zerofn_context_parallel", default=None)

HELP = (
    "Under context_parallel the step feeds loss_fn this rank's slice of the sequence, with the labels shifted "
    "on the whole sequence first: compute the loss against batch['shift_labels'] as they are (logits at t "
    "against shift_labels at t, no shift), or pass the batch to a Hugging Face model (model(**batch) or "
    "labels=batch['shift_labels']) whose loss then counts every token once."
)


class CutBatch(dict):
    """The fed batch: a dict of this rank's slices, without ``labels`` (see ``shift_labels``)."""

    def __missing__(self, key: Any) -> Any:
        if key == "labels":
            raise KeyError(f"'labels': {HELP}")
        raise KeyError(key)


def chunks(seq: int, cp: int, method: str) -> int:
    """How many equal chunks the sequence is cut into: ``cp`` (one per rank) or ``2 cp`` for ring."""
    return 2 * cp if method == "ring" else cp


def layout(seq: int, cp: int, method: str, device: Any = None) -> torch.Tensor:
    """``[cp, seq // cp]``: the global positions rank ``j`` holds, row ``j`` (see the module)."""
    if method != "ring":
        return torch.arange(seq, device=device).view(cp, seq // cp)
    c = seq // (2 * cp)
    halves = torch.arange(seq, device=device).view(2 * cp, c)
    return torch.cat([halves[:cp], halves[cp:].flip(0)], 1)


def check_length(seq: int, cp: int, method: str) -> None:
    """Raises unless the sequence cuts into the layout's equal chunks, naming the length to pad to."""
    n = chunks(seq, cp, method)
    if seq % n:
        pad = -(-seq // n) * n
        how = f"{n} equal chunks (2 per rank, for ring attention's balance)" if method == "ring" else f"{n} slices"
        raise ValueError(
            f"context_parallel: the sequence has {seq} tokens, which cp {cp} with method={method!r} cuts into "
            f"{how}: pad it to {pad} tokens (a multiple of {n}), e.g. the tokenizer's pad_to_multiple_of={n}, "
            "with attention_mask 0 and labels -100 on the padding"
        )


def shifted(batch: Mapping) -> torch.Tensor | None:
    """The labels the logits at each position are scored against, on the whole sequence."""
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    labels = batch.get("labels")
    if labels is None:
        return None
    end = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat([labels[:, 1:], end], 1)


def feed(active: Active | None, batch: Any) -> CutBatch:
    """This rank's slice of ``batch`` (see the module); records what attention needs in ``active``."""
    if active is None:
        raise RuntimeError("context_parallel: a batch was fed outside the step's forward")
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"context_parallel: the batch is a {type(batch).__name__}; it cuts a batch given as a mapping of "
            "Hugging Face inputs ({'input_ids': [batch, seq], 'attention_mask': ..., 'labels': ...}), whose "
            "sequence dimension it knows. Feed the step a dict."
        )
    ref = batch.get("input_ids")
    ref = batch.get("inputs_embeds") if ref is None else ref
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
        raise ValueError(
            "context_parallel: the batch holds no 'input_ids' (or 'inputs_embeds') of shape [batch, seq, ...], "
            f"from which it reads the sequence it cuts; it holds {sorted(map(str, batch))}"
        )
    rows, seq = ref.shape[0], ref.shape[1]
    cp, method = active.cp, active.method
    check_length(seq, cp, method)
    positions = layout(seq, cp, method)  # on the host: ring attention plans its blocks from it
    mine = positions[active.rank].to(ref.device)
    labels = shifted(batch)
    given = batch.get("position_ids")
    whole = given if given is not None else torch.arange(seq, device=ref.device).unsqueeze(0)
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape == (rows, seq):
        # one host read a micro-batch, and only when a mask is given: attention runs unmasked (causal
        # kernels, no [S, S] mask) when it holds no padding
        key_valid = None if bool(mask.bool().all()) else mask.bool()
    else:
        key_valid = None
    out = CutBatch()
    for key, value in batch.items():
        if key in ("labels", "shift_labels", "position_ids"):
            continue
        out[key] = _cut(value, rows, seq, mine)
    if labels is not None:
        out["shift_labels"] = _cut(labels, rows, seq, mine)
    out["position_ids"] = whole.index_select(1, mine)
    active.fed, active.seq, active.positions, active.key_valid = True, seq, positions, key_valid
    if key_valid is not None and method == "ring":  # each rank's keys' padding, [cp, B, L]
        active.ring_valid = key_valid[:, positions.to(ref.device)].permute(1, 0, 2)
    active.items = None if labels is None else (labels != IGNORE).sum()
    return out


def _cut(value: Any, rows: int, seq: int, mine: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq and value.shape[0] in (rows, 1):
        return value.index_select(1, mine)
    return value
