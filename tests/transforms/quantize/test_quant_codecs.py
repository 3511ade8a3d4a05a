"""The quantization codecs of zerofn.transforms.quantize: NF4 bit-equal to torchao's NF4 where torchao accepts
the weight, well defined (padded) where it does not, and int8 within half a scale of the weight."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from zerofn.transforms.quantize._codecs import NF4, Codec, Int8, _nearest, codec, nf4_code_book

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ao():
    """torchao's NF4 module (the reference); the tests that use it are skipped without torchao."""
    return pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so that equality also tells -0.0 from 0.0 (and compares NaNs)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    same = bits(a) == bits(b)
    assert bool(same.all()), f"{int((~same).sum())} of {a.numel()} differ, first at {int((~same).nonzero()[0, 0])}"


def assert_parts_equal_torchao(parts: dict, ref) -> None:
    assert torch.equal(parts["codes"], ref.quantized_data)
    assert torch.equal(parts["scalers"], ref.quantized_scalers)
    assert_bit_equal(parts["factors"], ref.quantization_factor)
    assert_bit_equal(parts["mean"], ref.scaler_mean.reshape(1))


def weight(shape, dtype, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * std).to(dtype)


# ----------------------------------------------------------------------------- NF4 against torchao


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
def test_code_book_is_torchaos(ao, dtype):
    ref = ao.to_nf4(torch.ones(64 * 256, dtype=dtype), 64, 256)
    assert_bit_equal(nf4_code_book(dtype), ref.nf4)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("shape", [(256, 64), (128, 256), (2 * 64 * 256,), (512, 96), (1024, 512)])
def test_nf4_bit_equal_to_torchao(ao, dtype, shape):
    w = weight(shape, dtype, seed=sum(shape))
    ref = ao.to_nf4(w, 64, 256)
    parts = NF4().encode(w)
    assert_parts_equal_torchao(parts, ref)
    assert_bit_equal(NF4().decode(parts, w.shape, dtype), ref.get_original_weight())


@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_bit_equal_on_a_transposed_weight_and_other_block_sizes(ao, dtype):
    w = weight((256, 128), dtype, seed=3).t()  # not contiguous: flattened in its logical order
    ref = ao.to_nf4(w, 64, 256)
    assert_bit_equal(NF4().decode(NF4().encode(w), w.shape, dtype), ref.get_original_weight())
    c = NF4(block_size=32, scaler_block_size=128)
    w = weight((64, 256), dtype, seed=4)
    ref = ao.to_nf4(w, 32, 128)
    parts = c.encode(w)
    assert_parts_equal_torchao(parts, ref)
    assert_bit_equal(c.decode(parts, w.shape, dtype), ref.get_original_weight())


@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_ties_at_code_book_midpoints_go_where_torchaos_do(ao, dtype):
    # Each block's absmax is 1, so an element is compared to the code book as it is: the midpoints between
    # neighbouring entries (rounded to dtype) and a few steps either side of them, both signs.
    book = nf4_code_book(dtype)
    mids = ((book[:-1].double() + book[1:].double()) / 2).to(dtype)
    near = [mids, book]
    up, down = mids.clone(), mids.clone()
    for _ in range(4):
        up = torch.nextafter(up, torch.ones_like(up))
        down = torch.nextafter(down, -torch.ones_like(down))
        near += [up, down]
    special = torch.cat(near)
    blocks = weight((256, 64), torch.float32, seed=5, std=0.3).clamp(-1, 1).to(dtype)
    blocks[:, 0] = 1.0
    flat = blocks[:, 1:].reshape(-1)  # the special values, eight times, after each block's 1.0
    flat[: special.numel() * 8] = special.repeat(8)
    blocks[:, 1:] = flat.view(256, 63)
    # absmaxes of powers of two (so that w / absmax is exact), varied so that the scalers are not all equal
    blocks *= (2.0 ** (torch.arange(256) % 5 - 2)).to(dtype)[:, None]
    w = blocks.view(128, 128)
    # there are real ties in this weight: two code-book entries at the same rounded distance
    diff = (blocks.reshape(-1, 1) / blocks[:, :1].repeat_interleave(64, 0) - book).abs()
    assert int((diff == diff.min(dim=-1, keepdim=True).values).sum(dim=-1).gt(1).sum()) > 0

    ref = ao.to_nf4(w, 64, 256)
    parts = NF4().encode(w)
    assert_parts_equal_torchao(parts, ref)
    assert_bit_equal(NF4().decode(parts, w.shape, dtype), ref.get_original_weight())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nearest_code_equals_torchaos_on_every_value_of_a_16_bit_dtype(ao, dtype):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[x.isfinite() & (x.abs() <= 1)]
    book = nf4_code_book(dtype)
    assert torch.equal(_nearest(x, book), ao.NF4Tensor.quantize_tensor_nearest(x, book))


def test_nearest_code_equals_torchaos_around_float32_midpoints(ao):
    book = nf4_code_book(torch.float32)
    mids = ((book[:-1].double() + book[1:].double()) / 2).float()
    xs, up, down = [book, mids], mids, mids
    for _ in range(32):
        up, down = torch.nextafter(up, torch.full_like(up, 2.0)), torch.nextafter(down, torch.full_like(down, -2.0))
        xs += [up, down]
    x = torch.cat(xs + [torch.rand(1 << 16, generator=torch.Generator().manual_seed(6)) * 2 - 1])
    assert torch.equal(_nearest(x, book), ao.NF4Tensor.quantize_tensor_nearest(x, book))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_all_zero_blocks_decode_finite_and_as_torchao(ao, dtype):
    zeros = torch.zeros(128, 128, dtype=dtype)
    ones = torch.ones(128, 128, dtype=dtype)
    holes = weight((256, 128), dtype, seed=7, std=1.0)
    holes.view(-1, 64)[1] = 0  # an all-zero block whose centered scale is its scaler block's extreme
    holes.view(-1, 64)[300] = 0  # and one whose is not (an outlier block widens its scaler block)
    holes.view(-1)[400 * 64] = 40.0
    for w in (zeros, ones, holes):
        ref = ao.to_nf4(w, 64, 256)
        parts = NF4().encode(w)
        assert all(bool(t.float().isfinite().all()) for t in parts.values())
        out = NF4().decode(parts, w.shape, dtype)
        assert bool(out.isfinite().all())
        assert_bit_equal(out, ref.get_original_weight())
    assert bool((out.view(-1, 64)[1] == 0).all())  # -0.0: its scaler decodes to exactly 0
    assert float(out.view(-1, 64)[300].abs().max()) < 0.1  # minus its scaler: 0 up to the scaler's rounding
    assert NF4().decode(NF4().encode(zeros), zeros.shape, dtype).eq(0).all()


# ----------------------------------------------------------------------------- NF4 on sizes torchao refuses

NF4_HALF_GAP = float((nf4_code_book(torch.float64).diff().max() / 2).item())


def nf4_error_bound(w: torch.Tensor, c: NF4) -> torch.Tensor:
    """Per element: its block's absmax times half the largest code-book gap, plus the scaler's rounding
    (one int8 step of its scaler block: the largest centered scale clamps from 128 to 127), plus slack for
    the rounding of the dtype's arithmetic."""
    flat = w.reshape(-1).double()
    n, bs, sbs = flat.numel(), c.block_size, c.scaler_block_size
    blocks = torch.cat([flat, flat.new_zeros(-n % bs)]).view(-1, bs)
    absmax = blocks.abs().amax(dim=1)
    centered = absmax - absmax.mean()
    centered = torch.cat([centered, centered.new_zeros(-centered.numel() % sbs)]).view(-1, sbs)
    step = (2 * centered.abs().amax(dim=1) / 256).repeat_interleave(sbs)[: absmax.numel()]
    eps = 2.0**-7 if w.dtype == torch.bfloat16 else 2.0**-20
    bound = absmax * NF4_HALF_GAP + step + eps * (absmax + absmax.mean())
    return bound[:, None].expand(-1, bs).reshape(-1)[:n].view(w.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [(3, 5), (1,), (7, 11, 13), (10, 70), (64 * 256 - 10,), (300 * 64 + 7,), (33, 64), (4097,)],
    ids=str,
)
def test_nf4_odd_shapes_round_trip_within_the_nf4_bound(dtype, shape):
    w = weight(shape, dtype, seed=math.prod(shape), std=1.0)
    c = NF4()
    parts = c.encode(w)
    assert {k: (t.numel(), t.dtype) for k, t in parts.items()} == c.parts(w.numel(), dtype)
    out = c.decode(parts, shape, dtype)
    assert out.shape == w.shape and out.dtype == dtype
    err = (out.double() - w.double()).abs()
    bound = nf4_error_bound(w, c)
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_nf4_padding_leaves_the_real_blocks_as_torchao_has_them(ao, dtype):
    # 256 blocks, the last one 10 short: torchao accepts the weight padded with zeros, and gives the same parts
    n = 64 * 256 - 10
    w = weight((n,), dtype, seed=8)
    padded = torch.cat([w, w.new_zeros(10)])
    ref = ao.to_nf4(padded, 64, 256)
    parts = NF4().encode(w)
    assert_parts_equal_torchao(parts, ref)
    assert_bit_equal(NF4().decode(parts, (n,), dtype), ref.get_original_weight()[:n])

    # 301 blocks (two scaler blocks, the second short): the data codes are torchao's codes of the same values
    n = 300 * 64 + 7
    w = weight((n,), dtype, seed=9)
    padded = torch.cat([w, w.new_zeros(-n % 64)])
    parts = NF4().encode(w)
    want = ao.NF4Tensor.convert_to_norm_float_weight(padded, 301, 64, nf4_code_book(dtype))
    assert torch.equal(parts["codes"], want)
    # and the scaler mean is that of the 301 real blocks only
    assert_bit_equal(parts["mean"], padded.view(301, 64).abs().amax(dim=1).mean().reshape(1))
    # a divisible prefix of the same values has the same codes for its blocks
    assert torch.equal(NF4().encode(w[: 256 * 64])["codes"], parts["codes"][: 256 * 32])


def test_nf4_fewer_blocks_than_a_scaler_block():
    c = NF4()
    w = weight((5, 64), torch.float32, seed=10, std=1.0)
    parts = c.encode(w)
    assert parts["scalers"].numel() == 5 and parts["factors"].numel() == 1
    out = c.decode(parts, w.shape, torch.float32)
    assert bool(((out - w).abs() <= nf4_error_bound(w, c)).all())


def test_nf4_decode_computes_in_the_encoded_dtype_then_casts():
    w = weight((64, 64), torch.bfloat16, seed=11)
    parts = NF4().encode(w)
    as_bf16 = NF4().decode(parts, (64, 64), torch.bfloat16)
    assert_bit_equal(NF4().decode(parts, (64, 64), torch.float32), as_bf16.float())


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("c", [NF4(), Int8()], ids=lambda c: c.name)
def test_empty_and_integer_weights_are_refused(c):
    with pytest.raises(ValueError, match=r"\(0, 16\).*unquantized"):
        c.encode(torch.zeros(0, 16))
    with pytest.raises(TypeError, match="floating"):
        c.encode(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError):
        c.parts(0, torch.float32)
    with pytest.raises(ValueError, match="part"):
        parts = c.encode(torch.ones(128))
        c.decode(parts, (64,), torch.float32)


def test_codec_names_and_bad_arguments():
    assert codec("nf4") == NF4() and codec("int8", 32) == Int8(32)
    assert isinstance(codec("nf4", 128), Codec) and codec("nf4", 128).block_size == 128
    assert (NF4.name, Int8.name) == ("nf4", "int8")
    with pytest.raises(ValueError, match="fp8.*int8.*nf4"):
        codec("fp8")
    with pytest.raises(ValueError, match="even"):
        NF4(block_size=63)
    with pytest.raises(ValueError):
        Int8(block_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        NF4().block_size = 32


# ----------------------------------------------------------------------------- int8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 64), (3, 5), (10, 70), (4097,)], ids=str)
def test_int8_round_trip_within_half_a_scale(dtype, shape):
    w = weight(shape, dtype, seed=12, std=1.0)
    c = Int8()
    parts = c.encode(w)
    scale = parts["scales"].double().repeat_interleave(64)[: w.numel()].view(shape)
    out = c.decode(parts, shape, torch.float32)
    err = (out.double() - w.double()).abs()
    assert bool((err <= scale * (0.5 + 2**-14)).all())  # half a scale, up to float32's rounding of w / scale
    assert c.decode(parts, shape, dtype).dtype == dtype and c.decode(parts, shape, dtype).shape == w.shape
    assert int(parts["codes"].abs().max()) == 127


def test_int8_all_zero_block_and_rounding():
    w = torch.zeros(3, 64)
    w[1] = torch.linspace(-1, 1, 64)
    w[2, :3] = torch.tensor([1.0, 0.5 / 127, 1.5 / 127])  # scale 1/127: ties round half to even
    parts = Int8().encode(w)
    assert parts["scales"][0] == 0 and bool((parts["codes"][:64] == 0).all())
    assert parts["codes"][128:131].tolist() == [127, 0, 2]
    out = Int8().decode(parts, w.shape, torch.float32)
    assert bool(out[0].eq(0).all()) and bool(out.isfinite().all())


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("c", [NF4(), Int8(), NF4(block_size=32, scaler_block_size=8), Int8(128)], ids=repr)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (64, 64), (300 * 64 + 7,), (2, 3, 4, 5)], ids=str)
def test_parts_sizes_are_what_encode_gives(c, dtype, shape):
    parts = c.encode(weight(shape, dtype, seed=13))
    assert list(parts) == list(c.parts(math.prod(shape), dtype))
    assert {k: (t.numel(), t.dtype) for k, t in parts.items()} == c.parts(math.prod(shape), dtype)
    assert all(t.dim() == 1 for t in parts.values())
    assert c.nbytes(math.prod(shape), dtype) == sum(t.numel() * t.element_size() for t in parts.values())


def test_nf4_bytes_per_parameter():
    n = 4096 * 4096
    per_param = NF4().nbytes(n, torch.bfloat16) / n
    assert 0.5 < per_param < 0.6
    assert NF4().nbytes(n, torch.bfloat16) == n // 2 + n // 64 + 2 * (n // 64 // 256) + 2
    assert Int8().nbytes(n, torch.bfloat16) == n + 4 * (n // 64)
