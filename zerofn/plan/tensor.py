"""Tensor parallelism in the planner: what one GPU holds and sends under ``tensor_parallel(step, tp)``
(:class:`TensorParallelPlan`, :func:`tensor_parallel_plan`), for :func:`estimate`'s ``tp=``.

``tensor_parallel`` splits every block's projections Megatron's way over ``tp`` consecutive ranks:
attention's q, k and v and the MLP's gate and up column-wise (each GPU holds ``1 / tp`` of their output
features, biases included), attention's o and the MLP's down row-wise (``1 / tp`` of their input
features; their biases whole). Attention's heads are split whole, so ``tp`` divides the attention heads
and divides the key/value heads or is a multiple of them (fewer key/value heads than ``tp`` are shared:
``tp / kv_heads`` consecutive GPUs hold each). The input embedding and the output head are split over the
vocabulary (``vocab / tp`` rows each; tied, they are one parameter) when ``tp`` divides the vocabulary,
and whole otherwise. Everything else (the norms, a row-wise layer's bias) is whole on every GPU of a
tensor-parallel group.

The planner states each split parameter's placement on the ``tp`` axis by the transform's own rules
(:func:`split_shapes`: its Llama plan, its rule for shared key/value heads and its placements) and counts
what one GPU holds from them with :func:`~zerofn.plan.local.local_params`, as it would any parallelism's
placements. The step runs on the data-parallel group of
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zerofn.plan.local import local_params
from zerofn.plan.lora import projections
from zerofn.sharding import Placement
from zerofn.transforms.tensor_parallel import EMBEDDING, HEAD, LLAMA, kv_share, placement

__all__ = ["TensorParallelPlan", "split_shapes", "tensor_parallel_plan"]


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


def _numel(shapes: Mapping[str, Sequence[int]], only: Mapping[str, Sequence[Placement]] | None = None) -> int:
    """The elements of the ``shapes`` (those ``only`` names, when given), whole."""
    return sum(math.prod(s) for name, s in shapes.items() if only is None or name in only)


def split_shapes(
    *,
    size: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int | None,
    ffn: int,
    gated: bool,
    biases: tuple[bool, bool, bool] = (False, False, False),
    vocab: int | None = None,
    tied: bool = True,
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]], dict[str, tuple[Placement, ...]]]:
    """The parameters ``tensor_parallel(step, size)`` cuts, whole, and their placements on the ``tp`` axis,
    by the transform's own rules, as it states them for a Hugging Face Llama of these shapes.

    Returns ``(block, outside, placements)``: one block's projections' weights and biases (name -> whole
    shape, named as in the block: ``self_attn.q_proj.weight``, ``mlp.down_proj.bias``), the input embedding
    and an untied head (``model.embed_tokens.weight``, ``lm_head.weight``; none without ``vocab``), and the
    placement of each that is cut (name -> ``(Shard,)``: column-wise layers ``Shard(0)``, row-wise weights
    ``Shard(1)``, key/value heads fewer than ``size`` ``Shard(0, share=size // kv_heads)``, the embedding and
    the head ``Shard(0)`` when ``size`` divides the vocabulary; a row-wise bias, or a vocabulary that does not
    divide, has none: whole). ``biases``: (q/k/v, o, the MLP's). A GPT-2 block's fused q/k/v
    (``Shard(1, parts=3)`` of its ``(in, out)`` weight) holds what its three projections hold here.

    Example:
        >>> from zerofn.plan.tensor import split_shapes
        >>> block, outside, placements = split_shapes(size=4, hidden=64, heads=4, kv_heads=2, head_dim=None,
        ...     ffn=128, gated=True, vocab=256, tied=False)
        >>> block["self_attn.k_proj.weight"], str(placements["self_attn.k_proj.weight"][0])
        ((32, 64), 'S(0,share=2)')
        >>> str(placements["mlp.down_proj.weight"][0]), str(placements["lm_head.weight"][0])
        ('S(1)', 'S(0)')
    """
    kv = kv_share(heads, kv_heads, size)
    if kv is None:
        raise ValueError(f"split_shapes: {size} ranks can neither split nor share {kv_heads} key/value heads")
    linears = projections(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, gated=gated)
    paths = [path for path in LLAMA if gated or path != "mlp.gate_proj"]  # q, k, v, o, (gate,) up, down
    qkv_bias, out_bias, mlp_bias = biases
    block: dict[str, tuple[int, ...]] = {}
    placements: dict[str, tuple[Placement, ...]] = {}
    for path, (i, o) in zip(paths, linears):
        leaf = path.rpartition(".")[2]
        bias = mlp_bias if path.startswith("mlp.") else out_bias if leaf == "o_proj" else qkv_bias
        share = kv if leaf in ("k_proj", "v_proj") else 1
        for pname, shape in (("weight", (o, i)), ("bias", (o,))):
            if pname == "weight" or bias:
                block[f"{path}.{pname}"] = shape
                p = placement(LLAMA[path], pname, share=share)
                if p is not None:
                    placements[f"{path}.{pname}"] = (p,)
    outside: dict[str, tuple[int, ...]] = {}
    if vocab:
        # the embedding and the head split over the vocabulary when it divides (a tied pair: one parameter)
        for name, how in (("model.embed_tokens.weight", EMBEDDING), ("lm_head.weight", HEAD))[: 1 if tied else 2]:
            outside[name] = (int(vocab), hidden)
            if int(vocab) % size == 0:
                placements[name] = (placement(how, "weight"),)
    return block, outside, placements


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
    ``vocab`` and ``tied``: the embedding and an untied head (``vocab x hidden`` each; tied, one) are split
    over the vocabulary when ``size`` divides it; with ``vocab`` None, they are counted whole. What one GPU
    holds is counted from the placements :func:`split_shapes` states.

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
    share = kv_share(heads, kv_heads, size)  # key/value heads fewer than tp (a divisor of it) are shared
    for count, what, whole in ((heads, "attention", heads % size == 0), (kv_heads, "key/value", share is not None)):
        if not whole:
            fit = [d for d in _divisors(gpus) if heads % d == 0 and kv_share(heads, kv_heads, d) is not None]
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
    block_shapes, outside, placements = split_shapes(
        size=size,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=f,
        gated=gated,
        biases=biases,
        vocab=vocab,
        tied=tied,
    )
    block_split = _numel(block_shapes, placements)
    block_params = int(layer_params) if layer_params else block_split
    if block_split > block_params:
        raise ValueError(
            f"estimate: one block's projections hold {block_split} parameters, more than the block's {block_params}; "
            "the shapes (hidden, heads, kv_heads, ffn) disagree with the parameter count"
        )
    # what one GPU holds: the split parameters' pieces, counted from their placements, and the rest whole
    block = block_params - _numel(block_shapes) + local_params(block_shapes, placements, (size,))
    vocab_split = _numel(outside, placements)
    root = params - layers * block_params
    local = root - _numel(outside) + local_params(outside, placements, (size,)) + layers * block
    allreduce = int(micro_batch or 0) * int(seq or 0) * hidden * activation_bytes
    return TensorParallelPlan(
        size=size,
        data=gpus * nodes // size,
        layers=layers,
        params=params,
        split=layers * block_split + vocab_split,
        block_split=block_split,
        block=block,
        local=local,
        allreduce=allreduce,
        vocab_split=vocab_split,
    )
