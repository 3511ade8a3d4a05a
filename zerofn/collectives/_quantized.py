"""Block-quantized collectives, ZeRO++'s: :func:`all_gather_quantized` (qwZ) and
:func:`reduce_scatter_quantized` (qgZ), and the blocks they travel as (:func:`quantize_blocks`,
:func:`dequantize_blocks`).

A tensor travels as int8 with one fp32 scale per block of ``block`` elements
(symmetric absmax: ``scale = absmax / 127``, ``q = round(x / scale)`` in
[-127, 127]; a block of zeros has scale 0 and comes back as zeros). Each
element comes back within ``scale / 2 = absmax(its block) / 254`` of what
was sent (up to fp32 rounding, about 1e-7 of the value). An fp32 tensor
travels as 1/4 of its bytes and 4 bytes of scale per block (0.2% more at
the default block of 2048); a bf16 or fp16 one as 1/2 and the scales.

At world size 1 both are exact copies: nothing is quantized, nothing
travels, nothing is counted.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerofn.collectives._accounting import count, tensor_bytes
from zerofn.collectives._groups import joined
from zerofn.collectives._handle import Handle, done, named

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

BLOCK = 2048
"""The default block: DeepSpeed's ZeRO++ quantizes in groups of a few thousand elements. 2048 keeps the
scales at 4 bytes in 2048 (0.2% of the int8 payload) and, a power of two, divides the shards and chunks
of power-of-two sizes evenly."""

_QMAX = 127.0
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZED_DTYPES = _FLOATS
"""The dtypes the quantized collectives take; others travel as they are."""


def _size(g: Any) -> int:
    return g.size() if g is not None else 1


def _blocks(k: int, block: int) -> int:
    """How many blocks ``k`` elements make (the last one shorter when ``block`` does not divide ``k``)."""
    return -(-k // block)


def _check(kind: str, full: torch.Tensor, part: torch.Tensor, n: int, block: int) -> None:
    """The argument checks: ``full`` holds one ``part`` per rank, both floating, ``block`` positive."""
    if full.numel() != n * part.numel():
        raise ValueError(
            f"{kind}: full tensor has {full.numel()} elements, expected world_size {n} x {part.numel()} "
            f"= {n * part.numel()}; pad the full tensor to a multiple of the world size"
        )
    if (
        full.dtype not in _FLOATS
        or part.dtype not in _FLOATS
        or not isinstance(block, int)
        or isinstance(block, bool)
        or block < 1
    ):
        raise ValueError(
            f"{kind}: quantizes float32, bfloat16 or float16 tensors in blocks of a positive number of elements; "
            f"got {full.dtype} and {part.dtype} with block={block!r} (other dtypes travel unquantized)"
        )


# ---------------------------------------------------------------- blocks


def _quantize_rows(x: torch.Tensor, block: int, q: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize each row of ``x`` (R, k) on its own, in blocks of ``block``, into ``q`` (R, k) int8 and
    ``scales`` (R, blocks) float32. Device ops only: no value is read on the host."""
    rows, k = x.shape
    whole = k // block
    m = whole * block
    parts = []  # (values, their scales' columns) of the whole blocks and the short last one
    if whole:
        parts.append((x[:, :m].reshape(rows, whole, block), scales[:, :whole], q[:, :m].view(rows, whole, block)))
    if m < k:
        parts.append((x[:, m:].unsqueeze(1), scales[:, whole:], q[:, m:].unsqueeze(1)))
    for values, s, into in parts:
        v = values.float()
        torch.div(v.abs().amax(-1), _QMAX, out=s)
        denom = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)  # a block of zeros: q = 0, scale 0
        into.copy_(torch.div(v, denom).round_().clamp_(-_QMAX, _QMAX))


def _dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """``out`` (R, k), any float dtype, = ``q`` (R, k) int8 x its blocks' ``scales`` (R, blocks), in fp32."""
    rows, k = q.shape
    whole = k // block
    m = whole * block
    if whole:
        view = out[:, :m].view(rows, whole, block)
        torch.mul(q[:, :m].reshape(rows, whole, block).float(), scales[:, :whole].unsqueeze(-1), out=view)
    if m < k:
        torch.mul(q[:, m:].float(), scales[:, whole:], out=out[:, m:])


def quantize_blocks(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, read flat; float32, bfloat16 or float16) as int8 in blocks of ``block`` elements
    and one float32 scale per block: ``(q, scales)``, ``q`` of ``x.numel()`` elements, ``scales`` of
    ``ceil(x.numel() / block)`` (the last block shorter when ``block`` does not divide it).

    Symmetric absmax: ``scale = absmax(block) / 127``, ``q = round(x / scale)`` clamped to [-127, 127];
    a block of zeros has scale 0. :func:`dequantize_blocks` gives each element back within
    ``scale / 2 = absmax(block) / 254`` (up to fp32 rounding, about 1e-7 of the value); values that are
    integers times ``scale`` (such as integers in [-127, 127] in a block whose absmax is 127) exactly.

    Example:
        >>> import torch
        >>> q, s = quantize_blocks(torch.tensor([127.0, -1.0, 3.0, 0.0, 0.0]), block=3)
        >>> q.tolist(), s.tolist()   # two blocks: [127, -1, 3] (scale 1) and the short [0, 0] (scale 0)
        ([127, -1, 3, 0, 0], [1.0, 0.0])
        >>> dequantize_blocks(q, s, 3).tolist()
        [127.0, -1.0, 3.0, 0.0, 0.0]
    """
    flat = x.reshape(1, -1)
    q = torch.empty(flat.shape, dtype=torch.int8, device=x.device)
    scales = torch.empty(1, _blocks(flat.shape[1], block), dtype=torch.float32, device=x.device)
    _quantize_rows(flat, block, q, scales)
    return q.view(-1), scales.view(-1)


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``q`` (int8, read flat) times its blocks' ``scales`` (float32, one per ``block`` elements), computed
    in fp32: into ``out`` (a contiguous tensor of ``q.numel()`` elements, any float dtype, rounded to it)
    or a new 1-D float32 tensor. Returns it. The inverse of :func:`quantize_blocks` up to its error."""
    if out is None:
        out = torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    _dequantize_rows(q.reshape(1, -1), scales.reshape(1, -1), block, out.view(1, -1))
    return out


# ---------------------------------------------------------------- collectives


def _pack(x: torch.Tensor, rows: int, block: int) -> tuple[torch.Tensor, int]:
    """``x`` as ``rows`` rows, each quantized on its own, packed one row a rank into one uint8 buffer
    (rows, scale bytes + k): each row's float32 scales' bytes, then its int8 values. Returns it and the
    number of scale bytes a row has."""
    k = x.numel() // rows
    sb = 4 * _blocks(k, block)
    buf = torch.empty(rows, sb + k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, sb // 4, dtype=torch.float32, device=x.device)
    _quantize_rows(x.reshape(rows, k), block, buf[:, sb:].view(torch.int8), scales)
    buf[:, :sb].copy_(scales.view(torch.uint8))
    return buf, sb


def _unpack(buf: torch.Tensor, sb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 values (rows, k) and float32 scales (rows, blocks) of a buffer :func:`_pack` made (the
    scales copied out: a row's bytes need not start 4-aligned)."""
    return buf[:, sb:].view(torch.int8), buf[:, :sb].contiguous().view(torch.float32)


def all_gather_quantized(
    full: torch.Tensor, shard: torch.Tensor, *, block: int = BLOCK, async_op: bool = False, group: Any = None
):
    """ZeRO++'s quantized weight all-gather (qwZ): gather every rank's ``shard`` into ``full`` (rank r's
    at ``[r * k:(r + 1) * k]``, as :func:`all_gather`) over the ranks of ``group`` (default: the current
    group), each shard travelling as int8 in blocks of ``block`` elements with a float32 scale per block.

    ``shard`` and ``full``: float32, bfloat16 or float16, ``full.numel() == N * shard.numel()``.
    ``shard`` is read (quantized) before anything travels and is not modified, unless it is this rank's
    own slice of ``full``: every piece is dequantized into ``full``, this rank's too, so that every rank
    holds the same values. ``block`` (default 2048, ``BLOCK``): DeepSpeed quantizes in groups of a few
    thousand; 2048 keeps the scales at 0.2% of the payload and divides power-of-two shards evenly. A
    shard whose length it does not divide ends in a shorter block.

    Error: each element of ``full`` is within ``absmax(its block) / 254`` (half a quantization step) of
    the sending rank's value, plus fp32 rounding (about 1e-7 of the value) and the rounding to
    ``full``'s dtype (half a bf16 or fp16 ulp); a block of zeros comes back exactly.

    Counts ``N * (k + 4 * ceil(k / block))`` bytes as ``"all_gather"`` (the int8 payload and every
    scale, in one collective: a uint8 buffer per rank); an fp32 ``full`` would count ``4 N k``
    unquantized. At world size 1 ``shard`` is copied into ``full`` exactly and nothing is counted.
    Returns ``full`` (or a Handle whose ``wait()`` dequantizes and returns it, with ``async_op``).
    """
    g = joined(group, "all_gather_quantized")
    n = _size(g)
    _check("all_gather_quantized", full, shard, n, block)
    if n == 1 or shard.numel() == 0:
        if full.data_ptr() != shard.data_ptr():
            full.copy_(shard.reshape(full.shape))
        return done(full) if async_op else full
    send, sb = _pack(shard, 1, block)
    recv = torch.empty(n, send.shape[1], dtype=torch.uint8, device=shard.device)
    nbytes = tensor_bytes(recv)
    count("all_gather", nbytes, g)
    with named("all_gather_quantized", nbytes, group=g) as started:
        work = _all_gather_single(recv.view(-1), send.view(-1), async_op=True, group=g)

    def dequantize(result: torch.Tensor) -> None:
        q, scales = _unpack(recv, sb)
        _dequantize_rows(q, scales, block, result.view(n, -1))

    h = Handle(work, full, dequantize, "all_gather_quantized", nbytes, started, g)
    return h if async_op else h.wait()


def reduce_scatter_quantized(
    out: torch.Tensor, full: torch.Tensor, *, block: int = BLOCK, async_op: bool = False, group: Any = None
):
    """ZeRO++'s quantized gradient reduce-scatter (qgZ): sum ``full`` across the ranks of ``group``
    (default: the current group) and keep this rank's ``1/N`` slice in ``out``, as
    :func:`reduce_scatter` with ``"sum"``, by one all-to-all of int8 blocks.

    Each rank quantizes each of its N chunks of ``k = out.numel()`` elements on its own (blocks of
    ``block`` elements, never across two chunks; the last one of a chunk shorter when ``block`` does not
    divide ``k``) and sends chunk j with its scales to rank j; rank r dequantizes the N chunks it
    receives and sums them in fp32, in rank order, then writes the sum in ``out``'s dtype.

    Error: each element of ``out`` is within ``sum over the ranks of absmax(that rank's block) / 254`` of
    the exact sum, plus fp32 rounding and the rounding to ``out``'s dtype (half an ulp of the sum).

    Counts ``N * (k + 4 * ceil(k / block))`` bytes as ``"reduce_scatter"``: the int8 chunks and scales
    this rank sends, its own chunk included (as :func:`all_to_all` counts its input); an fp32 ``full``
    would count ``4 N k`` unquantized. At world size 1 ``full`` is copied into ``out`` exactly and nothing
    is counted. Returns ``out`` (or a Handle whose ``wait()`` sums and returns it, with ``async_op``).
    """
    g = joined(group, "reduce_scatter_quantized")
    n = _size(g)
    _check("reduce_scatter_quantized", full, out, n, block)
    if n == 1 or out.numel() == 0:
        if out.data_ptr() != full.data_ptr():
            out.copy_(full.reshape(out.shape))
        return done(out) if async_op else out
    send, sb = _pack(full, n, block)
    recv = torch.empty_like(send)
    nbytes = tensor_bytes(send)
    count("reduce_scatter", nbytes, g)
    with named("reduce_scatter_quantized", nbytes, group=g) as started:
        work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=g, async_op=True)

    def dequantize_and_sum(result: torch.Tensor) -> None:
        q, scales = _unpack(recv, sb)
        total = torch.empty(1, q.shape[1], dtype=torch.float32, device=q.device)
        _dequantize_rows(q[:1], scales[:1], block, total)
        piece = torch.empty_like(total)
        for j in range(1, n):
            _dequantize_rows(q[j : j + 1], scales[j : j + 1], block, piece)
            total.add_(piece)
        result.copy_(total.view(result.shape))

    h = Handle(work, out, dequantize_and_sum, "reduce_scatter_quantized", nbytes, started, g)
    return h if async_op else h.wait()
