"""LoRA adapters on a frozen base, the base held quantized or not (QLoRA): what :func:`estimate` counts for
``lora_rank=`` and ``quantize=`` (:class:`LoraPlan`, :func:`lora_plan`, :func:`dequant_bytes`).

The adapters: peft's LoRA on every linear projection of every block (q, k, v, o and the MLP's gate, up
and down for a gated, Llama-shaped block; q, k, v, o, up and down otherwise), ``r x (in + out)``
trainable parameters each (A is r x in, B out x r). Everything else is frozen: no gradient, no optimizer
state.

The frozen base, as ``quantize(step, kind)`` holds it: each of those projections' weights as its codec's
parts (``codec(kind, block_size).parts(numel, dtype)``: NF4's 4-bit codes two per byte, its int8 block
scalers and the scalers' factors and mean in the weight's dtype; int8's codes and an fp32 scale per block),
quantized per weight; the embeddings, the output head, the norms and any biases in the parameters' dtype
(amp's bf16, or fp32). Under ``shard_params`` each unit holds one flat buffer per dtype of its frozen
parameters, padded to a multiple of N and sharded, beside the buffer of its adapters; a block's frozen
buffers are its quantized parts and its norms, the root unit's the embeddings, head and final norm.

A quantized layer dequantizes its weight just for its call, forward and again in backward, one layer at
a time: :func:`dequant_bytes` is what decoding the largest one holds at its peak.

Example:
    >>> from zerofn.plan import estimate, model_shape
    >>> llama2_70b = model_shape({"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192,
    ...     "num_hidden_layers": 80, "intermediate_size": 28672, "num_attention_heads": 64,
    ...     "num_key_value_heads": 8, "tie_word_embeddings": False})
    >>> p = estimate(llama2_70b, gpus=2, stage=3, lora_rank=16, quantize="nf4").lora
    >>> round(p.trainable / 1e6, 1), round(p.quantized / 1e9, 2), round(p.bytes_per_quantized(), 4)
    (207.1, 68.45, 0.5157)
    >>> round(p.base_bytes(1) / 1e9, 2), round(p.base_bytes(2) / 1e9, 2)  # the frozen base per rank: DDP, ZeRO-3
    (36.35, 18.18)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LoraPlan", "dequant_bytes", "lora_plan", "projections"]

_KINDS = ("nf4", "int8")


def projections(
    *, hidden: int, heads: int | None, kv_heads: int | None, head_dim: int | None, ffn: int | None, gated: bool
) -> tuple[tuple[int, int], ...]:
    """(in, out) of each linear projection of one block: q, k, v, o, then gate, up, down (gated) or up,
    down."""
    heads = int(heads or max(1, hidden // 64))
    kv_heads = int(kv_heads or heads)
    head_dim = int(head_dim or hidden // heads)
    f = int(ffn or 4 * hidden)
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = ((hidden, q), (hidden, kv), (hidden, kv), (q, hidden))
    mlp = ((hidden, f), (hidden, f), (f, hidden)) if gated else ((hidden, f), (f, hidden))
    return attn + mlp


def dequant_bytes(kind: str, numel: int, dtype: torch.dtype, block_size: int = 64) -> int:
    """Bytes alive at the peak of dequantizing one weight of ``numel`` elements held as ``kind`` from ``dtype``
    (what ``codec(kind, block_size).decode`` allocates). NF4 decodes in the weight's dtype: every element's
    code-book value beside the scaled result (2 x the weight), with the block scales and the scalers' factors
    expanded to one per block (the last scaler block's whole) and its 256-entry table of byte pairs (the code
    book itself is made once per dtype and device and kept, not allocated per decode). int8
    decodes through fp32: its codes as floats beside their scaled product (8 bytes per element, the last
    block's padding included), then casts.

    Example:
        >>> import torch
        >>> from zerofn.plan import dequant_bytes
        >>> round(dequant_bytes("nf4", 8192 * 28672, torch.bfloat16) / 2**20)  # Llama-2-70B's MLP weight in bf16
        910
    """
    if kind not in _KINDS:
        raise ValueError(f"dequant_bytes: kind must be one of {list(_KINDS)}, got {kind!r}")
    blocks = -(-int(numel) // block_size)
    if kind == "nf4":
        scaler_blocks = -(-blocks // 256)  # the codec's scaler_block_size
        per_block = blocks + 256 * scaler_blocks  # the scales, and the factors repeated per block
        table = 2 * 256  # the byte pairs' values in the weight's dtype (the 16-value code book is made once, kept)
        return (2 * int(numel) + per_block + table) * dtype.itemsize + 256 * 8  # and the 256 bytes as int64
    return 8 * blocks * block_size


@dataclass(frozen=True)
class LoraPlan:
    """LoRA adapters on a frozen base, per the counts :func:`estimate` uses (see the module docs).

    Attributes:
        rank: the adapters' rank r.
        quantize: ``"nf4"``, ``"int8"`` or None (the base in the parameters' dtype).
        block_size: the codec's elements per scale.
        dtype: the parameters' dtype (amp's bf16, or fp32): the frozen rest's, and the codec's input.
        layers: blocks.
        linears: (in, out) of each adapted projection of one block.
        trainable: adapter parameters in all (Psi of the ZeRO table).
        block_trainable: one block's adapter parameters.
        quantized: base parameters held quantized (the projections' weights of every block).
        frozen: base parameters in all (``quantized`` and the rest).
        block_frozen: one block's frozen parameters as ``(dtype, elements)`` per flat buffer (the quantized
            parts by their dtypes, the norms and biases in ``dtype``).
        root_frozen: elements (in ``dtype``) of the root unit: embeddings, head and final norm.
        dequant: :func:`dequant_bytes` of the largest projection (0 unquantized).
    """

    rank: int
    quantize: str | None
    block_size: int
    dtype: torch.dtype
    layers: int
    linears: tuple[tuple[int, int], ...]
    trainable: int
    block_trainable: int
    quantized: int
    frozen: int
    block_frozen: tuple[tuple[torch.dtype, int], ...]
    root_frozen: int
    dequant: int

    def block_bytes(self) -> int:
        """One block's frozen bytes, whole (what its gather brings in besides its adapters)."""
        return sum(n * dt.itemsize for dt, n in self.block_frozen)

    def root_bytes(self) -> int:
        """The root unit's frozen bytes, whole."""
        return self.root_frozen * self.dtype.itemsize

    def base_bytes(self, shards: int = 1) -> int:
        """The frozen base's bytes per rank: whole (``shards=1``: DDP, ZeRO-1 and 2, which replicate it), or
        this rank's shard of every unit's flat buffers, each padded to a multiple of ``shards`` (ZeRO-3)."""
        per = lambda n: -(-n // shards)  # noqa: E731  (elements of a padded buffer's shard)
        block = sum(per(n) * dt.itemsize for dt, n in self.block_frozen)
        return self.layers * block + per(self.root_frozen) * self.dtype.itemsize

    def bytes_per_quantized(self) -> float:
        """Bytes per quantized base parameter, its scales included (NF4 with block 64: 0.5157)."""
        if not self.quantize:
            return float(self.dtype.itemsize)
        from zerofn.transforms.quantize import codec

        fmt = codec(self.quantize, self.block_size)
        return sum(fmt.nbytes(i * o, self.dtype) for i, o in self.linears) / sum(i * o for i, o in self.linears)


def lora_plan(
    *,
    layers: int,
    hidden: int,
    heads: int | None,
    kv_heads: int | None,
    ffn: int | None,
    gated: bool,
    layer_params: int,
    psi: int,
    rank: int,
    quantize: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int | None = None,
    block_size: int = 64,
) -> LoraPlan:
    """The adapters and the frozen base of a model of ``psi`` parameters, ``layers`` blocks of
    ``layer_params`` each (projections, norms, biases) and a root unit of the rest, with LoRA of ``rank`` on
    every projection and the projections' weights held as ``quantize`` (None: in ``dtype``).

    Raises:
        ValueError: a rank below 1, an unknown ``quantize``, or projections larger than the block.
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"estimate: lora_rank must be an int >= 1 (the adapters' rank), got {rank!r}")
    if quantize is not None and quantize not in _KINDS:
        raise ValueError(
            f"estimate: quantize must be one of {list(_KINDS)} or None (the base in the parameters' dtype), got "
            f"{quantize!r}"
        )
    linears = projections(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ffn=ffn, gated=gated)
    weights = sum(i * o for i, o in linears)
    if weights > layer_params:
        raise ValueError(
            f"estimate: one block's projections hold {weights} parameters, more than the block's {layer_params}; "
            "the shapes (hidden, heads, kv_heads, ffn) disagree with the parameter count: pass a ModelShape "
            "(zerofn.plan.model_shape(config)) or consistent shapes"
        )
    block_trainable = rank * sum(i + o for i, o in linears)
    rest = layer_params - weights  # norms and biases: frozen, in the parameters' dtype
    buffers: dict[torch.dtype, int] = {}
    if quantize is None:
        buffers[dtype] = layer_params
    else:
        from zerofn.transforms.quantize import codec

        fmt = codec(quantize, block_size)
        for i, o in linears:
            for n, dt in fmt.parts(i * o, dtype).values():
                buffers[dt] = buffers.get(dt, 0) + n
        if rest:
            buffers[dtype] = buffers.get(dtype, 0) + rest
    largest = max(i * o for i, o in linears)
    return LoraPlan(
        rank=rank,
        quantize=quantize,
        block_size=block_size,
        dtype=dtype,
        layers=layers,
        linears=linears,
        trainable=layers * block_trainable,
        block_trainable=block_trainable,
        quantized=layers * weights if quantize else 0,
        frozen=psi,
        block_frozen=tuple(buffers.items()),
        root_frozen=psi - layers * layer_params,
        dequant=dequant_bytes(quantize, largest, dtype, block_size) if quantize else 0,
    )
