"""Tensor parallelism in the planner: what one GPU holds and sends under ``tensor_parallel(step, tp)``
(:class:`TensorParallelPlan`, :func:`tensor_parallel_plan`), for :func:`estimate`'s ``tp=``.

``tensor_parallel`` splits every block's projections Megatron's way over ``tp`` consecutive ranks:
attention's q, k and v and the MLP's gate and up column-wise (each GPU holds ``1 / tp`` of their output
features, biases included), attention's o and the MLP's down row-wise (``1 / tp`` of their input
features; their biases whole). Attention's heads are split whole, so ``tp`` divides the attention heads
and the key/value heads. The input embedding and the output head are split over the vocabulary
(``vocab / tp`` rows each) when they are not tied and ``tp`` divides the vocabulary, and whole
otherwise. Everything else (the norms, a row-wise layer's bias) is whole on every GPU of a
tensor-parallel group. The step runs on the data-parallel group of
``world / tp`` ranks, so the ZeRO stages shard what one GPU holds over those ranks: the ZeRO table of
:mod:`zerofn.plan` applies to the local parameters with N the data-parallel ranks.

Traffic on the tensor-parallel group: two all-reduces of the activations per block in forward (after
attention's o and the MLP's down) and two in backward (the gradients of the column-wise layers' inputs),
each ``micro_batch x seq x hidden`` elements; remat recomputes each block's forward in backward, and
with it its two all-reduces (six a block). A split vocabulary adds two of the same size per
micro-batch (the embedding's lookups summed in forward, the head's input gradient in backward) and the
cross-entropy's all-reduces of a few numbers per token, which are not counted.

Example:
    >>> from zerofn.plan import estimate, model_shape
    >>> llama2_70b = model_shape({"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192,
    ...     "num_hidden_layers": 80, "intermediate_size": 28672, "num_attention_heads": 64,
    ...     "num_key_value_heads": 8, "tie_word_embeddings": False})
    >>> e = estimate(llama2_70b, gpus=16, tp=8, stage=3, seq=4096, micro_batch=1)
    >>> t = e.tensor_parallel
    >>> round(t.split / 1e9, 2), round(t.local / 1e9, 2), t.data          # split in all, held per GPU, dp ranks
    (68.98, 8.62, 2)
    >>> round(t.allreduce / 1e6, 1), round(t.traffic(remat=False) / 1e9, 2)  # bytes: one all-reduce, a micro-batch's
    (67.1, 21.61)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerofn.plan.lora import projections

__all__ = ["TensorParallelPlan", "tensor_parallel_plan"]


@dataclass(frozen=True)
class TensorParallelPlan:
    """What ``tensor_parallel(step, size)`` splits and what one GPU holds (:func:`tensor_parallel_plan`).

    Attributes:
        size: GPUs per tensor-parallel group (``tp``).
        data: data-parallel ranks, ``world / size``: the N of the ZeRO table.
        layers: blocks.
        params: the model's parameters, all of them.
        split: parameters in the split layers (whole, before splitting): every block's and
            ``vocab_split``.
        block_split: one block's share of ``split``.
        vocab_split: the input embedding's and the output head's parameters when they are split over the
            vocabulary (one tensor when they are tied; 0 when a vocabulary ``size`` does not divide).
        block: one block's parameters on one GPU (its split layers' ``1 / size``, the rest whole).
        local: parameters on one GPU: ``params - split + split / size`` (key/value heads fewer than
            ``size``, shared: ``1 / kv_heads`` of k and v instead).
        allreduce: bytes of one all-reduce of the activations, ``micro_batch x seq x hidden x`` the
            activations' bytes (0 without ``seq`` and ``micro_batch``).
    """

    size: int
    data: int
    layers: int
    params: int
    split: int
    block_split: int
    block: int
    local: int
    allreduce: int
    vocab_split: int = 0

    @property
    def replicated(self) -> int:
        """Parameters whole on every GPU of a tensor-parallel group (the norms, row-wise biases; the embedding and
        the head unless they are split over the vocabulary)."""
        return self.params - self.split

    def traffic(self, *, remat: bool) -> int:
        """Bytes all-reduced on the tensor-parallel group per micro-batch: 4 all-reduces a block (2 in
        forward, 2 in backward), 6 under remat (its recomputed forward runs its 2 again), and 2 more when
        the vocabulary is split. A ring all-reduce sends ``2 (size - 1) / size`` of these bytes from each
        GPU."""
        return ((6 if remat else 4) * self.layers + (2 if self.vocab_split else 0)) * self.allreduce


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_plan(
    *,
    size: int,
    gpus: int,
    nodes: int,
    params: int,
    layers: int | None,
    hidden: int | None,
    heads: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    ffn: int | None,
    gated: bool,
    layer_params: int | None,
    biases: tuple[bool, bool, bool] = (False, False, False),
    experts: int = 1,
    vocab: int | None = None,
    tied: bool = True,
    seq: int | None = None,
    micro_batch: int | None = None,
    activation_bytes: int = 2,
) -> TensorParallelPlan:
    """The split of a model over ``size`` GPUs per tensor-parallel group, as :func:`estimate` counts it.

    ``biases`` says which projections have biases: (q/k/v, o, the MLP's); ``layer_params`` is one
    block's parameters (norms and biases included), the rest of ``params`` being outside the blocks.
    ``vocab`` and ``tied``: an untied embedding and head (``vocab x hidden`` each) are split over the
    vocabulary when ``size`` divides it; tied (or ``vocab`` None), they are counted whole.

    Raises:
        ValueError: ``size`` not an int >= 1, not dividing the GPUs per node, the attention heads, the
            key/value heads or the MLP's width; no shapes (``layers`` and ``hidden``); a mixture-of-experts
            model.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"estimate: tp must be an int >= 1 (GPUs per tensor-parallel group), got {size!r}")
    if not (layers and hidden):
        raise ValueError(
            f"estimate: tp={size} splits every block's projections, whose shapes it needs: pass a ModelShape "
            "(zerofn.plan.model_shape(config); python -m zerofn plan --model config.json) or layers= and hidden= "
            "(with heads=, kv_heads=, ffn=, gated= where they differ from GPT's defaults)"
        )
    if experts > 1:
        raise ValueError(
            f"estimate: tp={size} on a mixture-of-experts model ({experts} experts per block) is not modelled: "
            "tensor_parallel splits one Linear per projection. Plan its dense counterpart, or without tp."
        )
    if gpus % size:
        raise ValueError(
            f"estimate: tp={size} does not divide the {gpus} GPUs per node: a tensor-parallel group is {size} "
            f"consecutive ranks, which stay within one node (where its 4 all-reduces a block run) only when tp "
            f"divides the GPUs per node. Pick tp from {_divisors(gpus)}, or plan a multiple of {size} GPUs per node."
        )
    heads = int(heads or max(1, hidden // 64))
    kv_heads = int(kv_heads or heads)
    f = int(ffn or 4 * hidden)
    # key/value heads fewer than tp (a divisor of it) are shared: each GPU holds the one its query heads read
    shared = kv_heads < size and size % kv_heads == 0 and heads % size == 0
    for count, what in ((heads, "attention"), (kv_heads, "key/value")):
        if count % size and not (shared and what == "key/value"):
            fit = [d for d in _divisors(gpus) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
            raise ValueError(
                f"estimate: tp={size} cannot split the model's {count} {what} heads whole nor share them (it has "
                f"{heads} attention and {kv_heads} key/value heads; tp must divide the attention heads, and divide "
                f"the key/value heads or be a multiple of them). Pick tp from {fit}."
            )
    if f % size:
        raise ValueError(
            f"estimate: tp={size} does not divide the MLP's width {f}: each GPU holds width / tp of its gate, up "
            f"and down. Pick tp from {[d for d in _divisors(math.gcd(f, gpus)) if heads % d == 0 == kv_heads % d]}."
        )
    linears = projections(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=f, gated=gated)
    qkv_bias, _, mlp_bias = biases
    rows = (3, 6) if gated else (3, 5)  # o and down: row-wise (their weights split, their biases whole)
    block_split = sum(i * o for i, o in linears)
    block_split += sum(o for j, (_, o) in enumerate(linears) if j not in rows and (qkv_bias if j < 3 else mlp_bias))
    block_params = int(layer_params) if layer_params else block_split
    if block_split > block_params:
        raise ValueError(
            f"estimate: one block's projections hold {block_split} parameters, more than the block's {block_params}; "
            "the shapes (hidden, heads, kv_heads, ffn) disagree with the parameter count"
        )
    # the embedding and the head split over the vocabulary (a tied pair: one parameter, the same slice)
    vocab_split = (1 if tied else 2) * int(vocab) * hidden if vocab and int(vocab) % size == 0 else 0
    split = layers * block_split + vocab_split
    kv = sum(i * o + (o if qkv_bias else 0) for j, (i, o) in enumerate(linears) if j in (1, 2))
    extra = kv // kv_heads - kv // size if shared else 0  # a shared key/value head: 1 / kv_heads of k and v
    block = block_params - block_split + block_split // size + extra
    local = params - split + split // size + layers * extra
    allreduce = int(micro_batch or 0) * int(seq or 0) * hidden * activation_bytes
    return TensorParallelPlan(
        size=size,
        data=gpus * nodes // size,
        layers=layers,
        params=params,
        split=split,
        block_split=block_split,
        block=block,
        local=local,
        allreduce=allreduce,
        vocab_split=vocab_split,
    )
