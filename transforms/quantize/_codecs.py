"""The codecs that hold a frozen weight quantized: NF4 (QLoRA's 4-bit NormalFloat) and int8.

A codec turns a weight into a few flat component tensors (its *parts*) and back. The parts' sizes depend
only on the weight's number of elements and dtype (:meth:`Codec.parts`), never on its values, so a plan
can size, shard and offload them before any weight is encoded.

NF4 follows torchao's ``NF4Tensor`` (``torchao.quantization.quantize_.workflows.nf4``) bit for bit. torchao
is the reference because its NF4 is the one torchtune's QLoRA recipes train with, it runs on CPU as well as
CUDA, and it shards under FSDP2, so a weight quantized here dequantizes to the same numbers a torchtune
QLoRA run computes with. zerofn does not depend on torchao at run time: the kernels below are its own,
written in plain torch (the nearest-code search, for one, is a bucket search over the code book rather
than torchao's 16-wide difference table), and the tests check them bit-equal against torchao where torchao
accepts the weight: ``numel % block_size == 0`` and ``(numel // block_size) % scaler_block_size == 0``, in
float32, bfloat16 (and float16). As torchao does, the code book, the block absmaxes, their mean and the
scaler factors are computed in the weight's dtype, and so is the dequantization.

NF4, per ``block_size`` elements of the flattened weight: the block's absmax ``a`` and each element's
nearest code-book entry to ``w / a`` (a tie between two entries goes to the lower one, as torchao's first
minimum does), two 4-bit codes per byte, the first element in the high nibble. The absmaxes are
double-quantized: their mean is subtracted, and each ``scaler_block_size`` of them is stored as int8 with a
factor ``256 / (2 * absmax)`` of that scaler block. Decoding computes ``code * (q / factor + mean)``.

Sizes torchao refuses are padded, so that a divisible size gives torchao's result and any other size a
well-defined one: the flattened weight with zeros to a multiple of ``block_size`` (zeros change no block's
absmax; the padding's codes are dropped on decode), the centered absmaxes with zeros to a multiple of
``scaler_block_size`` (zeros change no scaler block's absmax; only the real blocks' scalers are stored,
and the mean is that of the real blocks only). A weight of fewer blocks than ``scaler_block_size`` thus has
one, short, scaler block.

All-zero blocks (absmax 0). torchao computes ``0 / 0`` there and takes the first code of the resulting NaN
differences, code 0 (-1.0), so the block decodes to ``-1.0 * scaler``. A scaler block whose centered
absmaxes are all 0 (an all-zero weight, or one whose blocks share one absmax) gets a factor of ``inf``
and int8 scalers cast from NaN (0 on x86; a NaN's cast to an integer is undefined in C++), which decode
to ``0 / inf + mean``. Both decode to finite numbers, so these kernels give the same numbers, without
computing a NaN: an all-zero block gets code 0 explicitly (it decodes to minus its dequantized scaler,
which is 0 up to the scaler's rounding, and -0.0 for an all-zero weight), and a scaler block whose
factor would not be finite stores the factor 1 and scalers 0, so that its blocks decode to
``0 / 1 + mean``, torchao's value. The parts stay finite: they differ from torchao's only in that factor
(1 where torchao keeps ``inf``). Weights must be finite.

Int8 follows no reference library: per ``block_size`` elements, ``scale = absmax / 127`` in float32 and
``codes = round(w / scale)`` clamped to [-127, 127] (``torch.round``: half to even); an all-zero block has
scale 0 and codes 0. Decoding computes ``codes * scale`` in float32, then casts.
"""

from __future__ import annotations

import abc
import dataclasses
import math

import torch

__all__ = ["NF4", "Codec", "Int8", "codec"]

# Elements quantized at a time: the encoders' temporaries (the scaled block values, the candidate codes and
# their distances) stay within a few tens of MB whatever the weight's size.
_CHUNK = 1 << 20

# QLoRA's NormalFloat4 code book as torchao writes it; built in the weight's dtype from these Python floats,
# as torchao builds it, so that a bfloat16 or float16 code book rounds the same way.
_NF4_BOOK = (
    -1.0000,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0000,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0000,
)


_BOOKS: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the code book there, made once


def nf4_code_book(dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 NF4 values in ``dtype`` (torchao's table, rounded from the same floats); read-only.

    Made once per dtype and device: a tensor made from Python numbers on a GPU is a copy the host waits
    for, which every dequantization (every quantized layer, forward and backward) would otherwise pay.
    """
    key = (dtype, torch.device(device) if device is not None else torch.device("cpu"))
    if key not in _BOOKS:
        _BOOKS[key] = torch.tensor(_NF4_BOOK, dtype=dtype, device=key[1])
    return _BOOKS[key]


def _check_weight(w: torch.Tensor, name: str) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name}.encode expects a torch.Tensor, got {type(w).__name__}")
    if not w.is_floating_point():
        raise TypeError(f"{name} quantizes floating-point weights; got a {w.dtype} tensor of shape {tuple(w.shape)}")
    if w.numel() == 0:
        raise ValueError(
            f"{name} cannot quantize an empty weight (shape {tuple(w.shape)}): it has no blocks to scale. "
            "Leave this weight unquantized: exclude it in the quantize policy."
        )


def _check_size(numel: int, dtype: torch.dtype, name: str) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} quantizes floating-point weights; got dtype {dtype}")
    if numel <= 0:
        raise ValueError(
            f"{name} cannot quantize an empty weight ({numel} elements): leave it unquantized "
            "(exclude it in the quantize policy)."
        )


def _padded_blocks(w: torch.Tensor, block_size: int) -> torch.Tensor:
    """``w`` flattened, zero-padded to whole blocks, as a (blocks, block_size) tensor."""
    flat = w.reshape(-1)
    pad = -flat.numel() % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def _nearest(x: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Index of the entry of the ascending ``book`` nearest to each of ``x`` (values in [book[0], book[-1]]).

    Distances are computed in ``x``'s dtype, as torchao does, and a tie goes to the lower index (torchao's
    first minimum). Only the two entries around ``x`` are compared: the rounded distance ``|x - c|`` is
    monotone in ``c`` on either side of ``x``, and two neighbouring entries are further apart (>= 0.0796)
    than rounding can move a distance (half an ulp of a value <= 2: 2**-8 in bfloat16), so no farther
    entry can tie with the nearer one. The tests check this against torchao's 16-wide search on every
    bfloat16 and float16 value in [-1, 1].
    """
    hi = torch.searchsorted(book, x).clamp_(1, book.numel() - 1)  # first entry >= x
    lo = hi - 1
    d_lo = (x - book[lo]).abs_()
    d_hi = (x - book[hi]).abs_()
    return torch.where(d_hi < d_lo, hi, lo)


class Codec(abc.ABC):
    """A quantization format: a weight <-> flat component tensors (its parts). Each format is a frozen
    dataclass with a ``name`` and a ``block_size`` (elements per scale)."""

    name: str
    block_size: int

    @abc.abstractmethod
    def parts(self, numel: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """Component name -> (number of elements, dtype) of the flat component tensors that hold a weight of
        ``numel`` elements of ``dtype`` (before any sharding); the sizes do not depend on the values."""

    @abc.abstractmethod
    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The components of weight ``w`` (any shape, floating point; flattened), 1-D, as :meth:`parts` says."""

    @abc.abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], shape: torch.Size | tuple, dtype: torch.dtype) -> torch.Tensor:
        """The weight back, of ``shape``, in ``dtype``: computed in the dtype the weight was encoded from (which
        the components' float parts record), then cast."""

    def nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of the parts holding a weight of ``numel`` elements of ``dtype``."""
        return sum(n * dt.itemsize for n, dt in self.parts(numel, dtype).values())

    def _blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def _checked(self, parts: dict[str, torch.Tensor], numel: int, dtype: torch.dtype) -> None:
        want = self.parts(numel, dtype)
        if set(parts) != set(want):
            raise ValueError(f"{self.name}.decode: expected the parts {sorted(want)}, got {sorted(parts)}")
        for k, (n, dt) in want.items():
            t = parts[k]
            if t.numel() != n or t.dtype != dt:
                raise ValueError(
                    f"{self.name}.decode: part {k!r} should hold {n} elements of {dt} for a weight of {numel} "
                    f"elements, got {t.numel()} of {t.dtype}"
                )


@dataclasses.dataclass(frozen=True)
class NF4(Codec):
    """4-bit NormalFloat with double-quantized block scales, bit-equal to torchao's ``to_nf4`` (module doc).

    Parts: ``codes`` uint8 (two codes per byte, first element high), ``scalers`` int8 (one per block),
    ``factors`` (one per ``scaler_block_size`` blocks) and ``mean`` (1 element), both in the weight's dtype.
    """

    block_size: int = 64
    scaler_block_size: int = 256
    name = "nf4"

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"nf4 needs an even block_size >= 2 (two codes per byte), got {self.block_size!r}")
        if not isinstance(self.scaler_block_size, int) or self.scaler_block_size < 1:
            raise ValueError(f"nf4 needs a scaler_block_size >= 1, got {self.scaler_block_size!r}")

    def parts(self, numel: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        _check_size(numel, dtype, self.name)
        blocks = self._blocks(numel)
        return {
            "codes": (blocks * self.block_size // 2, torch.uint8),
            "scalers": (blocks, torch.int8),
            "factors": (-(-blocks // self.scaler_block_size), dtype),
            "mean": (1, dtype),
        }

    @torch.no_grad()
    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_weight(w, self.name)
        blocks = _padded_blocks(w, self.block_size)
        n_blocks, bs, sbs = blocks.shape[0], self.block_size, self.scaler_block_size
        absmax = blocks.abs().amax(dim=1)  # the block scales, in the weight's dtype

        # Double quantization of the scales: centered on their mean, int8 per scaler block.
        mean = absmax.mean()
        centered = absmax - mean
        pad = -n_blocks % sbs
        if pad:
            centered = torch.cat([centered, centered.new_zeros(pad)])
        centered = centered.view(-1, sbs)
        factors = 256 / (2 * centered.abs().amax(dim=1))
        # A scaler block whose centered absmaxes are all 0 (or so tiny that the factor overflows): torchao's
        # factor is inf and its scalers decode to the mean; factor 1 and scalers 0 give that value too.
        factors = torch.where(factors.isfinite(), factors, torch.ones_like(factors))
        scalers = (centered * factors[:, None]).round_().clamp_(-128, 127).to(torch.int8)
        scalers = scalers.view(-1)[:n_blocks]

        # The codes: each element scaled by its block's absmax, nearest code-book entry, two per byte.
        book = nf4_code_book(blocks.dtype, blocks.device)
        zero = absmax == 0
        divisor = torch.where(zero, torch.ones_like(absmax), absmax)
        codes = torch.empty(n_blocks * bs // 2, dtype=torch.uint8, device=blocks.device)
        step = max(1, _CHUNK // bs)
        for b0 in range(0, n_blocks, step):
            b1 = min(b0 + step, n_blocks)
            scaled = blocks[b0:b1] / divisor[b0:b1, None]
            scaled.masked_fill_(zero[b0:b1, None], book[0])  # torchao's code for 0/0: the first, -1.0
            idx = _nearest(scaled.view(-1), book).to(torch.uint8).view(-1, 2)
            codes[b0 * bs // 2 : b1 * bs // 2] = (idx[:, 0] << 4) | idx[:, 1]
        return {"codes": codes, "scalers": scalers, "factors": factors, "mean": mean.reshape(1)}

    def decode(self, parts: dict[str, torch.Tensor], shape: torch.Size | tuple, dtype: torch.dtype) -> torch.Tensor:
        shape = torch.Size(shape)
        numel = math.prod(shape)
        fdtype = parts["factors"].dtype if "factors" in parts else torch.float32
        self._checked(parts, numel, fdtype)
        n_blocks = self._blocks(numel)
        codes = parts["codes"].reshape(-1)
        book = nf4_code_book(fdtype, codes.device)
        # The two values of every byte at once: a 256 x 2 table indexed by the byte.
        byte = torch.arange(256, device=codes.device)
        pairs = torch.stack([book[byte >> 4], book[byte & 15]], dim=1)
        values = pairs.index_select(0, codes.int()).view(n_blocks, self.block_size)
        factors = parts["factors"].reshape(-1).repeat_interleave(self.scaler_block_size)[:n_blocks]
        scales = parts["scalers"].reshape(-1) / factors + parts["mean"].reshape(-1)
        w = (values * scales[:, None]).view(-1)
        return w[:numel].view(shape).to(dtype)


@dataclasses.dataclass(frozen=True)
class Int8(Codec):
    """int8 codes with a float32 absmax scale per block (module doc; follows no reference library).

    Parts: ``codes`` int8 (the weight zero-padded to whole blocks), ``scales`` float32 (one per block).
    """

    block_size: int = 64
    name = "int8"

    def __post_init__(self):
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"int8 needs a block_size >= 1, got {self.block_size!r}")

    def parts(self, numel: int, dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        _check_size(numel, dtype, self.name)
        blocks = self._blocks(numel)
        return {"codes": (blocks * self.block_size, torch.int8), "scales": (blocks, torch.float32)}

    @torch.no_grad()
    def encode(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        _check_weight(w, self.name)
        blocks = _padded_blocks(w, self.block_size)
        n_blocks, bs = blocks.shape
        scales = blocks.abs().amax(dim=1).float() / 127
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.empty(n_blocks * bs, dtype=torch.int8, device=blocks.device)
        step = max(1, _CHUNK // bs)
        for b0 in range(0, n_blocks, step):
            b1 = min(b0 + step, n_blocks)
            q = (blocks[b0:b1].float() / divisor[b0:b1, None]).round_().clamp_(-127, 127)
            codes[b0 * bs : b1 * bs] = q.view(-1).to(torch.int8)
        return {"codes": codes, "scales": scales}

    def decode(self, parts: dict[str, torch.Tensor], shape: torch.Size | tuple, dtype: torch.dtype) -> torch.Tensor:
        shape = torch.Size(shape)
        numel = math.prod(shape)
        self._checked(parts, numel, torch.float32)
        scales = parts["scales"].reshape(-1)
        w = parts["codes"].reshape(-1, self.block_size).float() * scales[:, None]
        return w.view(-1)[:numel].view(shape).to(dtype)


_CODECS = {"nf4": NF4, "int8": Int8}


def codec(kind: str, block_size: int = 64) -> Codec:
    """The codec of ``kind`` (``"nf4"`` or ``"int8"``) with ``block_size`` elements per scale."""
    try:
        cls = _CODECS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quantization kind {kind!r}: expected one of {sorted(_CODECS)}") from None
    return cls(block_size=block_size)
