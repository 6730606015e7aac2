"""Triton block quantize + pack, bit-identical to ``qsinkkv.quant`` (the reference).

Same layout, same rounding: scale = ``(max - min) / qmax`` (IEEE division) rounded to
``scale_dtype``, zero = ``min`` rounded to ``scale_dtype``, codes
``floor((x - zero) / scale + 0.5)`` clamped to ``[0, qmax]`` from the stored values;
int4 packs channel ``j`` in the low nibble and ``j + D/2`` in the high nibble of byte ``j``
(``qsinkkv.quant.pack``): both kernels work on the two halves of the channels as two tiles.
Divisions use ``div_rn`` (correctly rounded) so GPU codes match the CPU reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from qsinkkv import trace
from qsinkkv.quant import check_scales_fit, codes_per_byte, max_code

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _round_to(x, SCALE_DTYPE: tl.constexpr):
    """Round float32 to a storage dtype (a scale's, a pool's), to nearest even, as torch's ``.to()`` does. bf16 is
    rounded by hand: Triton's interpreter truncates on fp32 -> bf16 casts, the GPU rounds; this is exact on both."""
    if SCALE_DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(SCALE_DTYPE)


@triton.jit
def _codes(x, scale, zero, QMAX: tl.constexpr):
    """The shared rounding rule on float32 ``x`` with stored (rounded) ``scale``/``zero``."""
    s = scale.to(tl.float32)
    s = tl.where(s == 0.0, 1.0, s)
    q = tl.floor(tl.math.div_rn(x - zero.to(tl.float32), s) + 0.5)
    return tl.minimum(tl.maximum(q, 0.0), QMAX).to(tl.uint8)


@triton.jit
def _channel_stats(x, ok, QMAX: tl.constexpr, SCALE_DTYPE: tl.constexpr):
    """Per-channel (column) scale and zero of a block tile ``x [T, C]`` over its ``ok`` entries,
    rounded to the storage dtype (columns with no entry get 0, never inf - inf)."""
    col_ok = tl.max(ok.to(tl.int32), axis=0) > 0
    lo = tl.where(col_ok, tl.min(tl.where(ok, x, float("inf")), axis=0), 0.0)
    hi = tl.where(col_ok, tl.max(tl.where(ok, x, float("-inf")), axis=0), 0.0)
    return _scale_zero(lo, hi, QMAX, SCALE_DTYPE)


@triton.jit
def _scale_zero(lo, hi, QMAX: tl.constexpr, SCALE_DTYPE: tl.constexpr):
    """The stored scale ``(max - min) / qmax`` (correctly rounded division) and zero ``min`` of a
    group's ``lo = min`` and ``hi = max``, rounded to the storage dtype."""
    # (+ 0: a zero is +0 whichever sign the min or max of equal zeros has, quant.py's rule)
    return _round_to(tl.math.div_rn(hi - lo, QMAX * 1.0) + 0.0, SCALE_DTYPE), _round_to(lo + 0.0, SCALE_DTYPE)


@triton.jit
def _key_block(x_lo, x_hi, ok, c, C, scale_ptr, zero_ptr, QMAX: tl.constexpr, BITS: tl.constexpr,
               SCALE_DTYPE: tl.constexpr):
    """One block's keys, quantized per channel over its tokens: float32 tiles ``x_lo [T, C]`` (channels ``[0, C)``)
    and ``x_hi`` (int4: channels ``[C, 2C)``), ``ok`` the real entries. Stores the block's scale and zero of channel
    j at ``scale_ptr + j``, ``zero_ptr + j``; returns its codes ``[T, C]`` (int4: both halves packed)."""
    scale, zero = _channel_stats(x_lo, ok, QMAX, SCALE_DTYPE)
    tl.store(scale_ptr + c, scale, mask=c < C)
    tl.store(zero_ptr + c, zero, mask=c < C)
    codes = _codes(x_lo, scale[None, :], zero[None, :], QMAX)
    if BITS == 4:
        scale_hi, zero_hi = _channel_stats(x_hi, ok, QMAX, SCALE_DTYPE)
        tl.store(scale_ptr + C + c, scale_hi, mask=c < C)
        tl.store(zero_ptr + C + c, zero_hi, mask=c < C)
        codes = codes | (_codes(x_hi, scale_hi[None, :], zero_hi[None, :], QMAX) << 4)
    return codes


@triton.jit
def _value_rows(x_lo, x_hi, ok, t_ok, c, C, GROUP, NG, scale_rows, zero_rows, QMAX: tl.constexpr,
                BITS: tl.constexpr, SCALE_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Tokens' values, quantized per token within groups of GROUP channels: float32 tiles ``x_lo``, ``x_hi`` as in
    ``_key_block``, ``t_ok [T]`` the real tokens. Stores token t's scale and zero of group g at ``scale_rows[t] + g``,
    ``zero_rows[t] + g``; returns the codes ``[T, C]``. The channels are one tile (int8) or two, the halves the
    nibbles hold (int4); a group may span both halves, so each group's stats take the entries of either tile that
    belong to it."""
    grp_lo = (c // GROUP)[None, :]
    grp_hi = ((c + C) // GROUP)[None, :]
    s_lo = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    z_lo = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    s_hi = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    z_hi = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for g in range(0, NG):
        in_lo = ok & (grp_lo == g)
        in_hi = ok & (grp_hi == g) & (BITS == 4)
        lo = tl.minimum(tl.min(tl.where(in_lo, x_lo, float("inf")), axis=1),
                        tl.min(tl.where(in_hi, x_hi, float("inf")), axis=1))
        hi = tl.maximum(tl.max(tl.where(in_lo, x_lo, float("-inf")), axis=1),
                        tl.max(tl.where(in_hi, x_hi, float("-inf")), axis=1))
        lo = tl.where(t_ok, lo, 0.0)  # rows with no entry: never inf - inf
        hi = tl.where(t_ok, hi, 0.0)
        scale, zero = _scale_zero(lo, hi, QMAX, SCALE_DTYPE)
        tl.store(scale_rows + g, scale, mask=t_ok)
        tl.store(zero_rows + g, zero, mask=t_ok)
        s_lo = tl.where(grp_lo == g, scale.to(tl.float32)[:, None], s_lo)
        z_lo = tl.where(grp_lo == g, zero.to(tl.float32)[:, None], z_lo)
        s_hi = tl.where(grp_hi == g, scale.to(tl.float32)[:, None], s_hi)
        z_hi = tl.where(grp_hi == g, zero.to(tl.float32)[:, None], z_hi)
    codes = _codes(x_lo, s_lo, z_lo, QMAX)
    if BITS == 4:
        codes = codes | (_codes(x_hi, s_hi, z_hi, QMAX) << 4)
    return codes


@triton.jit
def _quantize_key_blocks_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, D,
                                BS: tl.constexpr, BITS: tl.constexpr, SCALE_DTYPE: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # one program per block of BS tokens: stats per channel over the block's tokens; int4 works
    # on the two halves of the channels (the low and the high nibbles), int8 on all D at once
    blk = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_C)
    QMAX: tl.constexpr = (1 << BITS) - 1
    C = D // 2 if BITS == 4 else D           # channels per tile; also the bytes per token row
    ok = (t[:, None] < BS) & (c[None, :] < C)
    rows = blk * BS * D + t[:, None] * D + c[None, :]
    x = tl.load(x_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptr + rows + C, mask=ok & (BITS == 4), other=0.0).to(tl.float32)
    codes = _key_block(x, x_hi, ok, c, C, scale_ptr + blk * D, zero_ptr + blk * D, QMAX, BITS, SCALE_DTYPE)
    tl.store(codes_ptr + blk * BS * C + t[:, None] * C + c[None, :], codes, mask=ok)


@triton.jit
def _quantize_values_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, N, D, GROUP,
                            BITS: tl.constexpr, SCALE_DTYPE: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # one program per BLOCK_T tokens, stats per token within groups of GROUP channels
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_C)
    QMAX: tl.constexpr = (1 << BITS) - 1
    C = D // 2 if BITS == 4 else D
    NG = D // GROUP
    ok = (t[:, None] < N) & (c[None, :] < C)
    rows = t[:, None] * D + c[None, :]
    x_lo = tl.load(x_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptr + rows + C, mask=ok & (BITS == 4), other=0.0).to(tl.float32)
    codes = _value_rows(x_lo, x_hi, ok, t < N, c, C, GROUP, NG, scale_ptr + t * NG, zero_ptr + t * NG, QMAX, BITS,
                        SCALE_DTYPE, BLOCK_T, BLOCK_C)
    tl.store(codes_ptr + t[:, None] * C + c[None, :], codes, mask=ok)


def _check(name: str, x: Tensor, bits: int, scale_dtype: torch.dtype) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {type(x).__name__} {getattr(x, 'dtype', '')}")
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if scale_dtype not in _TL_DTYPE:
        raise ValueError(f"scale_dtype must be one of {list(_TL_DTYPE)}, got {scale_dtype!r}")
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"int4 packs the two halves of the channels and needs an even last dimension, "
                         f"got {x.shape[-1]}")


def quantize_key_blocks(k: Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """k ``[..., nblk, bs, D]`` float -> packed codes ``[..., nblk, bs, D/cpb]`` uint8 and
    scale, zero ``[..., nblk, D]`` in ``scale_dtype`` (one per block and channel).
    Same signature and bits as ``qsinkkv.quant.quantize_key_blocks``."""
    _check("k", k, bits, scale_dtype)
    trace.ran("quantize", "triton")
    if k.ndim < 2:
        raise ValueError(f"k must be [..., nblk, bs, D], got shape {tuple(k.shape)}")
    *lead, bs, D = k.shape
    x = k.contiguous()
    nblk = x.numel() // (bs * D)
    codes = torch.empty(*lead, bs, D // codes_per_byte(bits), dtype=torch.uint8, device=k.device)
    scale = torch.empty(*lead, D, dtype=scale_dtype, device=k.device)
    zero = torch.empty_like(scale)
    if nblk:
        _quantize_key_blocks_kernel[(nblk,)](x, codes, scale, zero, D, BS=bs, BITS=bits,
                                             SCALE_DTYPE=_TL_DTYPE[scale_dtype], BLOCK_T=triton.next_power_of_2(bs),
                                             BLOCK_C=triton.next_power_of_2(D // codes_per_byte(bits)))
    check_scales_fit(scale, zero, k)
    return codes, scale, zero


def quantize_values(v: Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """v ``[..., T, D]`` float -> packed codes ``[..., T, D/cpb]`` uint8 and scale, zero
    ``[..., T, D/group_size]`` in ``scale_dtype``. Same as ``qsinkkv.quant.quantize_values``."""
    _check("v", v, bits, scale_dtype)
    trace.ran("quantize", "triton")
    D = v.shape[-1]
    if D % group_size:
        raise ValueError(f"group_size must divide D={D}, got {group_size}")
    x = v.contiguous()
    N = x.numel() // D
    codes = torch.empty(*v.shape[:-1], D // codes_per_byte(bits), dtype=torch.uint8, device=v.device)
    scale = torch.empty(*v.shape[:-1], D // group_size, dtype=scale_dtype, device=v.device)
    zero = torch.empty_like(scale)
    BLOCK_T = 16
    if N:
        _quantize_values_kernel[(triton.cdiv(N, BLOCK_T),)](
            x, codes, scale, zero, N, D, group_size, BITS=bits, SCALE_DTYPE=_TL_DTYPE[scale_dtype],
            BLOCK_T=BLOCK_T, BLOCK_C=triton.next_power_of_2(D // codes_per_byte(bits)))
    check_scales_fit(scale, zero, v)
    return codes, scale, zero


__all__ = ["quantize_key_blocks", "quantize_values", "max_code"]
