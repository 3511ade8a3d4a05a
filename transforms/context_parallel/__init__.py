"""``context_parallel``: the sequence split over a ``cp`` axis of the mesh, through the whole model.

ZeRO shards the state, not the activations: without this, a step's activation memory grows with the
sequence on every rank. Under ``context_parallel(step, size)`` the ``size`` ranks of a ``cp`` group each
hold a slice of every micro-batch's sequence from the embedding to the loss, so the longest sequence a
step trains grows with the ranks (the attention's working set aside, each rank holds ``1 / size`` of the
activations).

The ranks of a ``cp`` group feed the same micro-batch, that of their data-parallel rank
(``zf.collectives.data_rank(step)``), as under ``tensor_parallel``. The step cuts it before ``loss_fn``
sees it (:mod:`._feed`): ``loss_fn`` gets this rank's tokens of every sequence-shaped tensor, the labels
shifted on the whole sequence first (``shift_labels``, which replaces ``labels``: the logits at ``t`` score
against ``shift_labels`` at ``t``, no shift), and the global ``position_ids`` of its tokens (rotary
embeddings). Attention is the one place tokens meet; two methods:

- ``"ulysses"`` (DeepSpeed's, :mod:`._ulysses`): q, k and v exchanged by an all-to-all from sequence
  slices to head slices, attention on the whole sequence for ``heads / size`` heads, an all-to-all back.
  Four all-to-alls of a layer's activations in forward and four in backward, each ``1 / size`` of them
  per rank. Needs the query heads (on this rank, after ``tensor_parallel``) a multiple of ``size``;
  key/value heads fewer than the ranks are repeated so that each rank receives the one it reads.
- ``"ring"`` (:mod:`._ring`): key/value blocks pass around the ring while each rank computes blockwise
  attention merged by log-sum-exp, the next block's transfer overlapping the current block's compute; for
  models whose heads are fewer than the ranks. For causal attention the sequence is cut into ``2 size``
  chunks, rank ``r`` holding chunks ``r`` and ``2 size - 1 - r``, so that every rank has as much work.

Both are installed through transformers' attention interface (:mod:`._hf`), so any Hugging Face model that
uses it (Llama, Qwen2/3, Mistral, Gemma, ...) is covered without a plan. torch's own
``torch.distributed.tensor.experimental.context_parallel`` is not used: its ring runs only on CUDA's SDPA
kernels (flash, efficient, cuDNN), not on the CPU's, and works by replacing
``F.scaled_dot_product_attention`` for the whole process; the function here runs on any device and only
inside the step's forward.

The loss: a Hugging Face model given ``shift_labels`` (``model(**batch)``) returns on each rank ``size``
times its tokens' share of the micro-batch's mean, so that the step's average over the ranks is one
process's loss over the whole sequence, padding included; a ``loss_fn`` computing its own loss returns
``zf.Mean(total, count)`` over its tokens (``batch['shift_labels'] != -100``), which the step sums over
every rank exactly (``zf.losses.chunked_cross_entropy`` computes ``total`` without the logits).

The step runs on the group over the data-parallel axes and ``cp`` together (the claim's ``reduces``):
each parameter's gradient is the sum of every rank's part, and ZeRO's stages shard their buckets over all
of those ranks, as torchtitan's FSDP shards over ``dp_shard x cp``. Parameters are whole along ``cp``
(only activations are cut), so a checkpoint saved at one ``size`` loads at any other.

On a step that already has a mesh (``tensor_parallel`` applied first), ``cp`` joins it outside ``tp``
(``step.mesh.with_axes(cp=size)``); ``tensor_parallel`` applied after ``context_parallel`` is refused with
the order that works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofn.transforms.context_parallel._feed import ACTIVE, feed
from zerofn.transforms.context_parallel._hf import Around, check_model

from zerofn.extension import Extension
from zerofn.mesh import for_step
from zerofn.sharding import Claim
from zerofn.step import Step, reapply, transform

__all__ = ["METHODS", "ContextParallelOptions", "context_parallel"]

METHODS = ("ulysses", "ring")


@dataclass(frozen=True)
class ContextParallelOptions:
    """What ``context_parallel`` was asked for (compared by value when it is applied again)."""

    size: int
    method: str
    chunked_loss: bool
    mlp_tiles: int | None


@transform
def context_parallel(
    step: Step, size: int, /, *, method: str = "ulysses", chunked_loss: bool = True, mlp_tiles: int | None = None
) -> Step:
    """Split every micro-batch's sequence over ``size`` ranks, through the whole model (see the module).

    Args:
        step: a Step (any transforms applied before or after; ``tensor_parallel`` before). Called without it,
            returns a decorator.
        size: ranks per context-parallel group; it must divide the world size.
        method: ``"ulysses"`` (all-to-all to head slices; the heads a multiple of ``size``) or ``"ring"``
            (key/value blocks around the ring; any number of heads).
        chunked_loss: a Llama, Mistral or Qwen2/3 model given labels computes its loss with
            :func:`zerofn.losses.chunked_cross_entropy` (its output's ``logits`` None): the logits, tokens x
            vocabulary in fp32, the largest tensor of a long step, are never whole. False: the model's own.
        mlp_tiles: run every block's MLP over this many tiles of the sequence, each recomputed in backward
            (:func:`zerofn.tiling.tile_mlps`, ALST's tiled MLP); None: whole.

    Returns:
        The rewritten Step, named ``context_parallel(...)``, running on the group over the data-parallel
        ranks and the ``cp`` ones.

    Raises:
        ValueError: a ``size`` that does not divide the world, an unknown method; at ``init``: a model that
            does not read attention through transformers' interface; at a step: a batch that is not a
            mapping of Hugging Face inputs, a sequence that does not cut into equal slices (the length to
            pad to named), heads ``size`` cannot split under Ulysses.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"context_parallel: size must be an int >= 1 (ranks per context-parallel group), got {size!r}")
    if method not in METHODS:
        raise ValueError(f"context_parallel: method must be one of {list(METHODS)}, got {method!r}")
    if mlp_tiles is not None and (not isinstance(mlp_tiles, int) or isinstance(mlp_tiles, bool) or mlp_tiles < 1):
        raise ValueError(
            f"context_parallel: mlp_tiles must be None or an int >= 1 (tiles of the sequence), got {mlp_tiles!r}"
        )
    m = for_step(step.mesh, "context_parallel", "cp", size)
    options = ContextParallelOptions(size, method, bool(chunked_loss), mlp_tiles)
    have = step.extension("context_parallel")
    if reapply(step, "context_parallel", have and have.options, options, "splits the sequence"):
        return step
    out = step.extend(
        Extension(
            "context_parallel",
            options,
            prepare=_prepare,
            around=lambda model, state: Around(method, m, model, options.chunked_loss, mlp_tiles),
            feed=lambda batch: feed(ACTIVE.get(), batch),
        )
    )
    return out.claim(Claim("cp", "context_parallel", reduces=True), m)


def _prepare(split: Any, functional: Any, where: str) -> Any:
    """At ``init``: the model must read attention through transformers' interface; nothing is changed."""
    check_model(functional.module if functional is not None else None, where)
    return split
