"""Quantization primitives in plain PyTorch: the CPU path and the reference for the kernels.

Asymmetric integer codes (KIVI): ``x ≈ code * scale + zero`` with ``zero = min`` and
``scale = (max - min) / (2**bits - 1)`` over a reduction group, codes in ``[0, 2**bits - 1]``
stored as uint8. int4 packs two codes per byte, split by halves of the channel axis: byte ``j``
holds channel ``j`` in its low nibble and channel ``j + D/2`` in its high nibble, so each nibble
plane is one contiguous half of the channels (the half split RoPE's ``rotate_half`` pairs): a
kernel reads a row's bytes once and gets both halves with a mask and a shift, no shuffles.

Rounding rule (the Triton kernels use the same, so codes are bit-identical):
scale and zero are rounded to the storage ``scale_dtype`` first, and codes are computed
in float32 from the *stored* values as ``floor((x - zero) / scale + 0.5)``, clamped.
A group whose stored scale is 0 (all values equal) gets codes 0. A scale or zero that is zero is +0, never -0
(whichever sign the group's equal zeros have): every quantizer stores the same bits.

Keys are quantized per channel within a block of tokens, values per token within
groups of channels; both are thin views over one ``quantize_asym``.

Also here: per-tensor symmetric int8/int4, the baseline the eval compares against.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import trace


def max_code(bits: int) -> int:
    return (1 << bits) - 1


def codes_per_byte(bits: int) -> int:
    return 2 if bits == 4 else 1


def quantize_asym(x: Tensor, bits: int, dim: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric quantization of ``x`` with one (scale, zero) per slice along ``dim``.

    Returns unpacked ``codes`` (uint8, shape of x) and ``scale``, ``zero`` (``scale_dtype``,
    shape of x with ``dim`` reduced to size 1). Raises ValueError if a scale or zero does
    not fit in ``scale_dtype`` (it would poison the whole group).
    """
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    # (+ 0: a zero is +0 whichever sign the min or max of equal zeros has; every quantizer's rule, the same bits)
    scale = ((hi - lo) / max_code(bits) + 0.0).to(scale_dtype)
    zero = (lo + 0.0).to(scale_dtype)
    check_scales_fit(scale, zero, x)
    codes = quantize_with(xf, scale, zero, bits)
    return codes, scale, zero


def check_scales_fit(scale: Tensor, zero: Tensor, x: Tensor) -> None:
    """Refuse a group whose scale or zero overflowed ``scale.dtype``: it would poison the group."""
    if not (torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        raise scale_overflow(scale.dtype, x.float().abs().max().item())


def scale_overflow(scale_dtype: torch.dtype, magnitude: float) -> ValueError:
    """The error of a block whose values (up to ``magnitude``) overflow ``scale_dtype``: every quantizer's."""
    # (a range max - min past float32's max overflows where the stats are computed, whatever scale_dtype)
    wide = magnitude > torch.finfo(torch.float32).max / 2 or scale_dtype == torch.float32
    hint = ("use CacheConfig(scale_dtype=torch.float32)" if not wide else
            "the range of such values does not fit any scale (max - min is computed in float32)")
    return ValueError(f"values of magnitude up to {magnitude:.3g} overflow scale_dtype={scale_dtype}; {hint}")


def quantize_with(xf: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """Codes of float32 ``xf`` under stored ``scale``/``zero`` (broadcastable), the shared rounding rule."""
    s = scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.floor((xf - zero.float()) / s + 0.5)
    return q.clamp_(0, max_code(bits)).to(torch.uint8)


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 codes along the last axis: int4 -> two per byte ``[..., D] -> [..., D/2]``, the
    first half of the channels in the low nibbles, the second half in the high ones; int8 as is."""
    if bits == 8:
        return codes
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {codes.shape[-1]}")
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """Inverse of ``pack``: ``[..., D/2] -> [..., D]`` uint8 codes for int4; int8 as is."""
    if bits == 8:
        return packed
    return torch.cat((packed & 0xF, packed >> 4), dim=-1)


def unpack_float(packed: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """``unpack`` straight to float32 codes ``[..., D]`` (into ``out`` when given, which may be a
    strided view): each nibble plane is converted into its half of the channels."""
    D = packed.shape[-1] * codes_per_byte(bits)
    if out is None:
        out = torch.empty(*packed.shape[:-1], D, dtype=torch.float32, device=packed.device)
    if bits == 8:
        return out.copy_(packed)
    # (the bitwise ops' own out= into float ran several times slower on the CPU than a uint8 result and a copy)
    out[..., :D // 2] = packed & 0xF
    out[..., D // 2:] = packed >> 4
    return out


# --- keys: per channel within a block of tokens -------------------------------------------

def quantize_key_blocks(k: Tensor, bits: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """k ``[..., nblk, bs, D]`` -> packed codes ``[..., nblk, bs, D/cpb]`` uint8,
    scale/zero ``[..., nblk, D]`` (one per block and channel)."""
    trace.ran("quantize", "torch")
    codes, scale, zero = quantize_asym(k, bits, dim=-2, scale_dtype=scale_dtype)
    return pack(codes, bits), scale.squeeze(-2), zero.squeeze(-2)


def dequantize_key_blocks(codes: Tensor, scale: Tensor, zero: Tensor, bits: int,
                          out: Tensor | None = None) -> Tensor:
    """Inverse of ``quantize_key_blocks``: float32 ``[..., nblk, bs, D]`` (written into ``out`` when
    given: the CPU decode fills a reused buffer)."""
    out = unpack_float(codes, bits, out)
    return torch.addcmul(zero.float().unsqueeze(-2), out, scale.float().unsqueeze(-2), out=out)


# --- values: per token within groups of channels -------------------------------------------

def quantize_values(v: Tensor, bits: int, group_size: int, scale_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """v ``[..., T, D]`` -> packed codes ``[..., T, D/cpb]`` uint8, scale/zero ``[..., T, D/group_size]``."""
    trace.ran("quantize", "torch")
    d = v.shape[-1]
    grouped = v.reshape(*v.shape[:-1], d // group_size, group_size)
    codes, scale, zero = quantize_asym(grouped, bits, dim=-1, scale_dtype=scale_dtype)
    return pack(codes.flatten(-2), bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_values(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int,
                      out: Tensor | None = None) -> Tensor:
    """Inverse of ``quantize_values``: float32 ``[..., T, D]`` (into ``out`` when given)."""
    out = unpack_float(codes, bits, out)
    grouped = out.unflatten(-1, (out.shape[-1] // group_size, group_size))
    # (two passes: addcmul with a scale broadcast along the last axis ran several times slower on the CPU)
    grouped.mul_(scale.float().unsqueeze(-1)).add_(zero.float().unsqueeze(-1))
    return out


# --- per-tensor symmetric: the baseline ------------------------------------------------------

def quantize_per_tensor_symmetric(x: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """One float32 scale for the whole tensor: ``x ≈ code * scale``, int8 codes in
    ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]`` (unpacked, one code per element)."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    qmax = (1 << (bits - 1)) - 1
    xf = x.float()
    scale = xf.abs().amax() / qmax
    s = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.floor(xf / s + 0.5).clamp_(-qmax, qmax).to(torch.int8)
    return codes, scale


def dequantize_per_tensor_symmetric(codes: Tensor, scale: Tensor) -> Tensor:
    return codes.float() * scale
