"""Quantization primitives: pack/unpack round trips and error bounds."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsinkkv import CacheConfig, SinkQuantCache, quant

D = 8


@settings(max_examples=100, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=3), half=st.integers(1, 16), seed=st.integers(0, 2**31))
def test_int4_pack_round_trip(shape, half, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*shape, 2 * half), generator=g, dtype=torch.uint8)
    packed = quant.pack(codes, 4)
    assert packed.shape == (*shape, half) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack(packed, 4), codes)


def test_int4_nibble_order():
    # byte j: channel j in the low nibble, channel j + D/2 in the high one (the kernels and
    # quant.unpack_float read each nibble plane as one half of the channels)
    codes = torch.tensor([3, 10, 7, 12], dtype=torch.uint8)
    assert quant.pack(codes, 4).tolist() == [3 | (7 << 4), 10 | (12 << 4)]


def test_int8_pack_is_identity():
    codes = torch.randint(0, 256, (3, 7), dtype=torch.uint8)
    assert torch.equal(quant.unpack(quant.pack(codes, 8), 8), codes)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([8, 4]), bs=st.integers(1, 8), d=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31),
       offset=st.floats(-50, 50), spread=st.floats(1e-3, 100))
def test_key_block_error_bound(bits, bs, d, seed, offset, spread):
    """float32 scales: every element is within half a step of its dequantized value."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, bs, d, generator=g) * spread + offset
    codes, scale, zero = quant.quantize_key_blocks(k, bits, torch.float32)
    assert codes.shape == (2, 3, bs, d // quant.codes_per_byte(bits))
    assert scale.shape == zero.shape == (2, 3, d)
    deq = quant.dequantize_key_blocks(codes, scale, zero, bits)
    step = scale.unsqueeze(-2)
    slack = 1e-5 * (k.abs().amax() + 1)
    assert ((deq - k).abs() <= step / 2 + slack).all()


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([8, 4]), g_size=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**31),
       scale_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_value_error_bound(bits, g_size, seed, scale_dtype):
    """Per-token groups; rounding scale/zero to scale_dtype costs at most one ulp of the magnitude."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, 5, 8, generator=g) * 3
    codes, scale, zero = quant.quantize_values(v, bits, g_size, scale_dtype)
    assert scale.shape == (2, 5, 8 // g_size) and scale.dtype == scale_dtype
    deq = quant.dequantize_values(codes, scale, zero, bits, g_size)
    step = scale.float().repeat_interleave(g_size, dim=-1)
    eps = torch.finfo(scale_dtype).eps
    bound = step / 2 + eps * (1 + (1 << bits)) * v.abs().amax() + 1e-6
    assert ((deq - v).abs() <= bound).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_into_a_strided_buffer(bits):
    """``out=`` (the CPU decode fills slices of a reused buffer): the same values as a fresh tensor,
    written through the slice's strides, nothing outside it touched; int4 codes unpack as ``unpack``."""
    g = torch.Generator().manual_seed(bits)
    k, v = torch.randn(2, 3, 4, 8, generator=g) * 5, torch.randn(2, 3, 4, 8, generator=g) * 5
    kc, ks, kz = quant.quantize_key_blocks(k, bits, torch.float16)
    vc, vs, vz = quant.quantize_values(v, bits, 4, torch.float16)
    assert torch.equal(quant.unpack_float(kc, bits), quant.unpack(kc, bits).float())
    for fresh, fill in ((quant.dequantize_key_blocks(kc, ks, kz, bits),
                         lambda out: quant.dequantize_key_blocks(kc, ks, kz, bits, out=out)),
                        (quant.dequantize_values(vc, vs, vz, bits, 4),
                         lambda out: quant.dequantize_values(vc, vs, vz, bits, 4, out=out))):
        buf = torch.full((2, 3, 4 + 3, 8), float("nan"))                  # rows 0 and 5-6 are not ours
        assert fill(buf[:, :, 1:5]).data_ptr() == buf[:, :, 1:5].data_ptr()
        assert torch.equal(buf[:, :, 1:5], fresh)
        assert buf[:, :, 0].isnan().all() and buf[:, :, 5:].isnan().all()


def test_constant_group_is_exact():
    v = torch.full((1, 4, 8), 0.75)
    codes, scale, zero = quant.quantize_values(v, 4, 8, torch.float16)
    assert (scale == 0).all() and (codes == 0).all()
    assert torch.equal(quant.dequantize_values(codes, scale, zero, 4, 8), v)


def test_overflowing_scale_dtype_is_refused():
    k = torch.tensor([[-1e5], [1e5]]).expand(2, 4).unsqueeze(0)
    with pytest.raises(ValueError, match="scale_dtype"):
        quant.quantize_key_blocks(k, 8, torch.float16)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_a_range_past_float32_is_refused_on_arrival_and_never_suggests_float32(scale_dtype):
    """Tokens of +-3e38 were accepted as they arrived, then their block's max - min overflowed
    float32 when it completed and every later step of the batch was refused (the bf16 message suggested float32,
    which fails the same way). Now the value check refuses them on arrival, nothing stored; a quantizer handed such
    a range directly says no scale dtype fits."""
    cfg = CacheConfig(sink_tokens=0, recent_tokens=4, bits=8, block_size=2, value_group_size=8,
                      scale_dtype=scale_dtype)
    cache = SinkQuantCache(cfg, 1, 1, 1, D, dtype=torch.float32)
    k = torch.randn(1, 1, 1, D)
    k[0, 0, 0, 0] = 3e38  # below float32's max: finite, storable in bf16, but a block's range would overflow
    with pytest.raises(ValueError, match="max - min would overflow float32") as err:
        cache.append(0, k, torch.randn(1, 1, 1, D))
    assert "use CacheConfig(scale_dtype=torch.float32)" not in str(err.value)
    assert cache.layer_lengths() == [0]
    cache.append(0, torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D))  # the cache serves on
    pair = torch.tensor([[-3e38], [3e38]]).expand(2, D).unsqueeze(0)
    with pytest.raises(ValueError, match="does not fit any scale") as err:
        quant.quantize_key_blocks(pair, 8, scale_dtype)
    assert "use CacheConfig(scale_dtype=torch.float32)" not in str(err.value)


@pytest.mark.parametrize("bits", [8, 4])
def test_per_tensor_symmetric(bits):
    x = torch.randn(3, 64) * 2
    codes, scale = quant.quantize_per_tensor_symmetric(x, bits)
    qmax = (1 << (bits - 1)) - 1
    assert codes.dtype == torch.int8 and codes.abs().max() <= qmax
    err = (quant.dequantize_per_tensor_symmetric(codes, scale) - x).abs()
    assert err.max() <= scale / 2 + 1e-6
    assert torch.isclose(scale, x.abs().max() / qmax)
