"""Triton block quantize + pack, bit-identical to ``qsinkkv.quant`` (the reference).

Same layout, same rounding: scale = ``(max - min) / qmax`` (IEEE division) rounded to
``scale_dtype``, zero = ``min`` rounded to ``scale_dtype``, codes
``floor((x - zero) / scale + 0.5)`` clamped to ``[0, qmax]`` from the stored values;
int4 packs channel ``2j`` in the low nibble and ``2j + 1`` in the high nibble.
Divisions use ``div_rn`` (correctly rounded) so GPU codes match the CPU reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from qsinkkv.quant import check_scales_fit, codes_per_byte, max_code

_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _to_scale_dtype(x, SCALE_DTYPE: tl.constexpr):
    """Round float32 to the storage dtype, to nearest even. bf16 is rounded by hand: Triton's
    interpreter truncates on fp32 -> bf16 casts, the GPU rounds; this is exact on both."""
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
def _pack_last(codes, BITS: tl.constexpr):
    """[..., 2n] uint8 codes -> [..., n] bytes (int4) ; int8 is returned as is."""
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, codes.shape[:-1] + [codes.shape[-1] // 2, 2]))
        return lo | (hi << 4)
    else:
        return codes


@triton.jit
def _quantize_key_blocks_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, D,
                                BS: tl.constexpr, BITS: tl.constexpr, SCALE_DTYPE: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per block of BS tokens: stats per channel over the block's tokens
    blk = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask = (t[:, None] < BS) & (d[None, :] < D)
    x = tl.load(x_ptr + blk * BS * D + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    lo = tl.where(d < D, tl.min(tl.where(mask, x, float("inf")), axis=0), 0.0)
    hi = tl.where(d < D, tl.max(tl.where(mask, x, float("-inf")), axis=0), 0.0)
    QMAX: tl.constexpr = (1 << BITS) - 1
    scale = _to_scale_dtype(tl.math.div_rn(hi - lo, QMAX * 1.0), SCALE_DTYPE)
    zero = _to_scale_dtype(lo, SCALE_DTYPE)
    tl.store(scale_ptr + blk * D + d, scale, mask=d < D)
    tl.store(zero_ptr + blk * D + d, zero, mask=d < D)
    packed = _pack_last(_codes(x, scale[None, :], zero[None, :], QMAX), BITS)
    CPB: tl.constexpr = 2 if BITS == 4 else 1
    j = tl.arange(0, BLOCK_D // CPB)
    DC = D // CPB
    tl.store(codes_ptr + blk * BS * DC + t[:, None] * DC + j[None, :], packed,
             mask=(t[:, None] < BS) & (j[None, :] < DC))


@triton.jit
def _quantize_values_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, N, D,
                            GROUP: tl.constexpr, BITS: tl.constexpr, SCALE_DTYPE: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_NG: tl.constexpr, BLOCK_G: tl.constexpr):
    # one program per BLOCK_T tokens; tile [token, group, channel-in-group]
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.arange(0, BLOCK_NG)
    c = tl.arange(0, BLOCK_G)
    NG = D // GROUP
    t3, g3, c3 = t[:, None, None], g[None, :, None], c[None, None, :]
    mask = (t3 < N) & (g3 < NG) & (c3 < GROUP)
    x = tl.load(x_ptr + t3 * D + g3 * GROUP + c3, mask=mask, other=0.0).to(tl.float32)
    smask = (t[:, None] < N) & (g[None, :] < NG)
    lo = tl.where(smask, tl.min(tl.where(mask, x, float("inf")), axis=2), 0.0)
    hi = tl.where(smask, tl.max(tl.where(mask, x, float("-inf")), axis=2), 0.0)
    QMAX: tl.constexpr = (1 << BITS) - 1
    scale = _to_scale_dtype(tl.math.div_rn(hi - lo, QMAX * 1.0), SCALE_DTYPE)
    zero = _to_scale_dtype(lo, SCALE_DTYPE)
    tl.store(scale_ptr + t[:, None] * NG + g[None, :], scale, mask=smask)
    tl.store(zero_ptr + t[:, None] * NG + g[None, :], zero, mask=smask)
    packed = _pack_last(_codes(x, scale[:, :, None], zero[:, :, None], QMAX), BITS)
    CPB: tl.constexpr = 2 if BITS == 4 else 1
    j = tl.arange(0, BLOCK_G // CPB)[None, None, :]
    tl.store(codes_ptr + t3 * (D // CPB) + g3 * (GROUP // CPB) + j, packed,
             mask=(t3 < N) & (g3 < NG) & (j < GROUP // CPB))


def _check(name: str, x: Tensor, bits: int, scale_dtype: torch.dtype) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {type(x).__name__} {getattr(x, 'dtype', '')}")
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if scale_dtype not in _TL_DTYPE:
        raise ValueError(f"scale_dtype must be one of {list(_TL_DTYPE)}, got {scale_dtype!r}")
    if bits == 4 and x.shape[-1] % 2:
        raise ValueError(f"int4 packs channel pairs and needs an even last dimension, got {x.shape[-1]}")


def quantize_key_blocks(k: Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """k ``[..., nblk, bs, D]`` float -> packed codes ``[..., nblk, bs, D/cpb]`` uint8 and
    scale, zero ``[..., nblk, D]`` in ``scale_dtype`` (one per block and channel).
    Same signature and bits as ``qsinkkv.quant.quantize_key_blocks``."""
    _check("k", k, bits, scale_dtype)
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
                                             SCALE_DTYPE=_TL_DTYPE[scale_dtype],
                                             BLOCK_T=triton.next_power_of_2(bs), BLOCK_D=triton.next_power_of_2(D))
    check_scales_fit(scale, zero, k)
    return codes, scale, zero


def quantize_values(v: Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """v ``[..., T, D]`` float -> packed codes ``[..., T, D/cpb]`` uint8 and scale, zero
    ``[..., T, D/group_size]`` in ``scale_dtype``. Same as ``qsinkkv.quant.quantize_values``."""
    _check("v", v, bits, scale_dtype)
    D = v.shape[-1]
    if D % group_size or (bits == 4 and group_size % 2):
        raise ValueError(f"group_size must divide D={D} (and be even for int4), got {group_size}")
    x = v.contiguous()
    N = x.numel() // D
    codes = torch.empty(*v.shape[:-1], D // codes_per_byte(bits), dtype=torch.uint8, device=v.device)
    scale = torch.empty(*v.shape[:-1], D // group_size, dtype=scale_dtype, device=v.device)
    zero = torch.empty_like(scale)
    BLOCK_T = 16
    if N:
        _quantize_values_kernel[(triton.cdiv(N, BLOCK_T),)](
            x, codes, scale, zero, N, D, GROUP=group_size, BITS=bits, SCALE_DTYPE=_TL_DTYPE[scale_dtype],
            BLOCK_T=BLOCK_T, BLOCK_NG=triton.next_power_of_2(D // group_size),
            BLOCK_G=max(triton.next_power_of_2(group_size), 2))
    check_scales_fit(scale, zero, v)
    return codes, scale, zero


__all__ = ["quantize_key_blocks", "quantize_values", "max_code"]
