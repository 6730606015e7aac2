"""Fused two-segment decode attention over a qsinkkv layer, in Triton.

One query token per sequence. Segment 1: the sinks (``sink_dtype``). Segment 2: the
recent window, a run of logical blocks ``[first_visible // bs, ceil(m / bs))``, each
either quantized (codes + scales in the quantized ring) or unquantized (float ring); see
``qsinkkv/layout.py``. Codes are dequantized in registers; the window is never
materialized. Online softmax (base 2) across both segments.

Grid ``(B * Hkv, splits)``: one program serves all ``G = H / Hkv`` query heads of a KV
head (each KV byte is read once) over one contiguous range of blocks (flash-decoding);
split 0 also takes the sinks. A second kernel merges the partial ``(max, sum, acc)``
states and adds the optional learned sink logits (``exp(s_h)`` in the denominator).

Channels are handled as two halves ``[0, D/2)`` and ``[D/2, D)``: the half split is what
RoPE's ``rotate_half`` pairs, so the ``cache_index`` contract rotates a dequantized key by
its local index with no shuffles, and it is how int4 is packed (byte j: channel j in the low
nibble, j + D/2 in the high one), so a row's bytes give both halves with a mask and a shift.

Every pool is read through its own (head, block) strides, each block's own dims contiguous (``pool_strides``):
the cache's own head-major pools, views of them, or an engine's pages (``qsinkkv/engine_pages.py``: every pool a
strided view of one uint8 page tensor). The float ring comes in blocks of ``float_k.shape[2]`` rows,
``float_table.shape[1]`` a sequence (the pools' own blocks of ``block_size`` rows, or an engine's pages of
``float_block_rows``), read as ``storage.py`` says: ring row r is row ``r % fr`` of block ``float_table[b, r // fr]``.

The reference is ``qsinkkv.decode.decode_attention_reference``: ``qsinkkv.storage.gather``
plus ``qsinkkv.attention.sink_window_attention`` on the same ``LayerStorage``.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from qsinkkv import trace
from qsinkkv.decode import decode_attention_reference  # noqa: F401  (the kernel's reference)
from qsinkkv.kernels.launch import launch
from qsinkkv.rope import Rotary
from qsinkkv.storage import STORAGE_TENSORS, LayerStorage

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# How the kernel reads a quantized block, one ``@triton.jit`` helper each, chosen per call
# (``decode_attention(variant=...)``; a cache's ``decode_variant=``, bound in by ``qsinkkv.ops.select_ops``):
#   "dequantize" (default): codes * scale + zero per element into fp32 tiles (``_block_dequantize``).
#   "folded": values read straight from the codes, their per-token scale folded into the probabilities
#             (``_block_folded``): fewer instructions per KV byte on sm_90a, at every head_dim and bit width
#             compiled (benchmarks/kernel_sass.py; docs/benchmarks.md, "Offline codegen check");
#             validated in the interpreter, not yet on a GPU.
#   "fp16": keys and values dequantized in fp16 (packed fp16 multiply-adds) into fp16 tensor-core dots with fp32
#           accumulation (``_block_fp16``): the fewest instructions per KV byte on sm_90a (int4 under the yardstick's
#           0.35, kernel_sass.py); every operand rounded once to fp16's 11 bits, as TF32 rounds the others' fp32
#           operands. Needs scale_dtype fp16 (which bounds every stored value below fp16's limit) and the absolute
#           contract (its keys are never rotated). Held to the GPU tolerance in the tests (``FP16_TOL``,
#           tests/test_kernels.py).
# "folded" and "fp16" need each half of the channels in one value group (value_group_size a multiple of
# head_dim / 2, as the default 64 is for head_dim <= 128); other layouts, and bits=16 (no codes), read their
# blocks as "dequantize" does.
VARIANTS = ("dequantize", "folded", "fp16")
# Pipeline stages tried in turn (launch.py): Triton's default, then fewer where a large block x
# head_dim overflows shared memory (head_dim 256, block 128, int8 at 3 stages: ``benchmarks/kernel_sass.py --dims
# 256 --bits 8 --block 128 --stages 3``; docs/benchmarks.md, "Offline codegen check").
STAGES = (3, 2, 1)


def decode_warps(block_size: int, variant: str = "dequantize") -> int:
    """Warps per program of ``_decode_kernel`` for the body that runs (``decode_constexprs(...)["VARIANT"]``; the
    launch and benchmarks/kernel_sass.py take it from here). Each warp repeats a block's fixed work (loop control,
    the block's addresses and stats, the softmax on the G query rows), which weighs more the fewer bytes a block
    holds, so small blocks get fewer warps, as many as fit the registers without spills: the counts per block size
    below are the fewest warp-instructions per KV byte of the main loop without spills, by ``kernel_sass.py``'s
    offline count (docs/benchmarks.md, "Decisions in the code")."""
    if variant == "fp16":
        return max(1, min(4, block_size // 32))
    return 1 if block_size <= 16 else 2 if block_size <= 32 else 4


@triton.jit
def _rotate(x_lo, x_hi, idx, inv_freq):
    """RoPE (rotate_half form) of the halves ``[N, DH]`` by integer positions ``idx [N]``."""
    ang = idx.to(tl.float32)[:, None] * inv_freq[None, :]
    c = tl.cos(ang)
    s = tl.sin(ang)
    return x_lo * c - x_hi * s, x_hi * c + x_lo * s


@triton.jit
def _softmax_step(q_lo, q_hi, k_lo, k_hi, valid, m_i, l_i, qk_scale, DOT_PRECISION: tl.constexpr):
    """Scores of a tile of keys ``[N, DH]`` for ``[G, ...]`` queries, folded into the running (max,
    sum): returns the new max and sum, the rescale ``alpha [G]`` of the accumulators and ``p [G, N]``."""
    s = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PRECISION)
    s += tl.dot(q_hi, tl.trans(k_hi), input_precision=DOT_PRECISION)
    return _softmax_update(s, valid, m_i, l_i, qk_scale)


@triton.jit
def _softmax_update(s, valid, m_i, l_i, qk_scale):
    """Raw scores ``s [G, N]`` into the running (max, sum): see ``_softmax_step``."""
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _online_update(q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, valid, m_i, l_i, acc_lo, acc_hi, qk_scale,
                   DOT_PRECISION: tl.constexpr):
    """One tile of keys ``[N, DH]`` into the running (max, sum, acc) of ``[G, ...]`` queries."""
    m_new, l_i, alpha, p = _softmax_step(q_lo, q_hi, k_lo, k_hi, valid, m_i, l_i, qk_scale, DOT_PRECISION)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo, input_precision=DOT_PRECISION)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi, input_precision=DOT_PRECISION)
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _online_update_codes(q_lo, q_hi, k_lo, k_hi, cv_lo, cv_hi, vs_lo, vz_lo, vs_hi, vz_hi, valid, m_i, l_i,
                         acc_lo, acc_hi, qk_scale, DOT_PRECISION: tl.constexpr):
    """``_online_update`` with the values as codes ``cv [N, DH]`` whose half lies in one value group:
    the per-token scale ``vs [N]`` folds into the probabilities and the zero ``vz [N]`` into a
    per-row sum, ``acc += (p * vs) @ codes + sum(p * vz)``, so no ``[N, DH]`` scale tile is read."""
    m_new, l_i, alpha, p = _softmax_step(q_lo, q_hi, k_lo, k_hi, valid, m_i, l_i, qk_scale, DOT_PRECISION)
    acc_lo = (acc_lo * alpha[:, None] + tl.dot(p * vs_lo[None, :], cv_lo, input_precision=DOT_PRECISION)
              + tl.sum(p * vz_lo[None, :], axis=1)[:, None])
    acc_hi = (acc_hi * alpha[:, None] + tl.dot(p * vs_hi[None, :], cv_hi, input_precision=DOT_PRECISION)
              + tl.sum(p * vz_hi[None, :], axis=1)[:, None])
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _load_codes(block_ptr, t, c, DC, DHALF, t_ok, BITS: tl.constexpr, HALVED: tl.constexpr = False):
    """A block's uint8 codes (``block_ptr``: its first byte; rows of ``DC`` bytes) for the token rows
    ``t [T]`` as fp32 halves ``[T, BLOCK_DH]``: channels ``c`` and ``DHALF + c`` (c < DHALF); ``HALVED``: as
    ``code / 2`` in fp16 (``_half_code``), for variant "fp16".
    int4 reads each row's bytes once: its low nibbles are the first half, its high nibbles the second
    (``qsinkkv.quant.pack``), no shuffles. Offsets from one scalar base per block, so the compiler
    sees contiguous rows (vector loads) and no per-element 64-bit address math."""
    mask = t_ok[:, None] & (c[None, :] < DHALF)
    offs = t[:, None] * DC + c[None, :]
    if BITS == 4:
        byte = tl.load(block_ptr + offs, mask=mask, other=0).to(tl.uint16)
        if HALVED:  # each nibble masked where it lies: no shift
            lo, hi = _half_code(byte & 0xF, 0x6000, 512.0), _half_code(byte & 0xF0, 0x5000, 32.0)
        else:
            lo, hi = (byte & 0xF).to(tl.float32), (byte >> 4).to(tl.float32)
    else:
        lo = tl.load(block_ptr + offs, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(block_ptr + DHALF + offs, mask=mask, other=0).to(tl.uint16)
        if HALVED:
            lo, hi = _half_code(lo, 0x6000, 512.0), _half_code(hi, 0x6000, 512.0)
        else:
            lo, hi = lo.to(tl.float32), hi.to(tl.float32)
    return lo, hi


@triton.jit
def _half_code(bits, MAGIC: tl.constexpr, BASE: tl.constexpr):
    """``code / 2`` in fp16, exactly, without a conversion instruction: ``bits`` (uint16) holds the code in the
    mantissa of ``BASE`` (fp16 ``MAGIC``), whose ulp is half the weight of the code's lowest bit there -- 512.0
    (ulp 1/2) for a code in bits 0-7, 32.0 (ulp 1/32) for an int4 high nibble left in bits 4-7 -- so
    ``bits(MAGIC | bits) - BASE`` is the code / 2: an OR and an fp16 subtraction instead of an I2F conversion,
    which the SMs issue at a fraction of the rate of plain arithmetic (the CUDA C++ Programming Guide's table of
    arithmetic instruction throughput); the fast int4 -> fp16 of TensorRT-LLM/LMDeploy, halved for
    ``_block_fp16``'s range."""
    return (bits | MAGIC).to(tl.float16, bitcast=True) - BASE


@triton.jit
def _ring(first, i, size):
    """``(first + i) % size`` for ``first < size`` and ``i < size``: a block run never holds more blocks
    than its ring, so one conditional subtraction does it."""
    j = first + i
    return tl.where(j >= size, j - size, j)


@triton.jit
def _at(h, blk, st_h, st_b, blocks, BLOCK, CONTIGUOUS: tl.constexpr):
    """The offset (elements) of block ``blk`` (a scalar, or a tensor of them) of kv head ``h`` (int64) in a pool
    ``[Hkv, blocks, ...]``: through the pool's (head, block) strides ``st_h``, ``st_b``; in a contiguous pool
    (``CONTIGUOUS``: the cache's own pools) from ``h * blocks + blk``, the index every pool of a kind shares, times
    the block's size ``BLOCK`` (a constant but for the sinks). Why: per-pool head offsets are loop-invariant, so
    the compiler keeps one live per pool across the block loops, which cost registers and 64-bit multiplies per
    block in the head-major case (benchmarks/kernel_sass.py); the shared index costs one add."""
    if CONTIGUOUS:
        return (h * blocks + blk) * BLOCK
    else:
        return h * st_h + blk * st_b


# --- one quantized block into the running state: the three decode variants -----------------------
# Each reads the block's codes (``key_block``/``value_block``: its first byte), its per-channel key
# stats (``_key_stats``: fp32 ``ks``/``kz [DH]`` for "dequantize" and "folded"; "fp16" reads them as fp16) and its
# per-token value stats (``value_scales``/``value_zeros [T]``: pointers to each token's group 0), and returns the
# new (max, sum, acc_lo, acc_hi).

@triton.jit
def _key_stats(key_scale, key_zero, c, c_ok, DH):
    """A quantized block's per-channel key scales and zeros (``key_scale``/``key_zero``: its first) as fp32 halves
    ``[DH]``."""
    ks_lo = tl.load(key_scale + c, mask=c_ok, other=0.0).to(tl.float32)
    ks_hi = tl.load(key_scale + DH + c, mask=c_ok, other=0.0).to(tl.float32)
    kz_lo = tl.load(key_zero + c, mask=c_ok, other=0.0).to(tl.float32)
    kz_hi = tl.load(key_zero + DH + c, mask=c_ok, other=0.0).to(tl.float32)
    return ks_lo, ks_hi, kz_lo, kz_hi


@triton.jit
def _keys_and_value_codes(key_block, value_block, ks_lo, ks_hi, kz_lo, kz_hi, t, c, t_ok, k_idx, inv_freq, DC, DH,
                          BITS: tl.constexpr, ROPE: tl.constexpr):
    """A quantized block's keys dequantized (and rotated by ``k_idx`` under cache_index) and its value codes,
    as fp32 halves ``[T, DH]``. Keys stay dequantized per element here: folding their per-channel scale into q
    instead rescales the padded [BLOCK_G, DH] query tile at every block and adds a ``q . zero`` per block (the
    "fp16" variant does that, for its tensor-core dots; with fp32 dots no gain from it is on record: compile
    such a variant with benchmarks/kernel_sass.py before revisiting)."""
    k_lo, k_hi = _load_codes(key_block, t, c, DC, DH, t_ok, BITS)
    k_lo = k_lo * ks_lo[None, :] + kz_lo[None, :]
    k_hi = k_hi * ks_hi[None, :] + kz_hi[None, :]
    v_lo, v_hi = _load_codes(value_block, t, c, DC, DH, t_ok, BITS)
    if ROPE:
        k_lo, k_hi = _rotate(k_lo, k_hi, k_idx, inv_freq)
    return k_lo, k_hi, v_lo, v_hi


@triton.jit
def _block_dequantize(q_lo, q_hi, m_i, l_i, acc_lo, acc_hi, qk_scale, key_block, value_block, value_scales,
                      value_zeros, ks_lo, ks_hi, kz_lo, kz_hi, t, c, t_ok, ok, k_idx, inv_freq,
                      DC, DH, BITS: tl.constexpr, GROUP: tl.constexpr, ROPE: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """Variant "dequantize" (any value group): keys and values ``codes * scale + zero`` per element into
    fp32 tiles, then ``_online_update``. ``k_idx [T]``: the keys' index in the cache (cache_index RoPE)."""
    c_ok = c < DH
    kv_mask = ok[:, None] & c_ok[None, :]
    k_lo, k_hi, v_lo, v_hi = _keys_and_value_codes(key_block, value_block, ks_lo, ks_hi, kz_lo, kz_hi, t, c, t_ok,
                                                   k_idx, inv_freq, DC, DH, BITS, ROPE)
    st_mask = t_ok[:, None] & c_ok[None, :]
    grp_lo = c[None, :] // GROUP
    grp_hi = (DH + c[None, :]) // GROUP
    v_lo = (v_lo * tl.load(value_scales[:, None] + grp_lo, mask=st_mask, other=0.0).to(tl.float32)
            + tl.load(value_zeros[:, None] + grp_lo, mask=st_mask, other=0.0).to(tl.float32))
    v_hi = (v_hi * tl.load(value_scales[:, None] + grp_hi, mask=st_mask, other=0.0).to(tl.float32)
            + tl.load(value_zeros[:, None] + grp_hi, mask=st_mask, other=0.0).to(tl.float32))
    # codes of stale tokens are real data, but keep masked rows at exactly zero
    v_lo = tl.where(kv_mask, v_lo, 0.0)
    v_hi = tl.where(kv_mask, v_hi, 0.0)
    return _online_update(q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ok, m_i, l_i, acc_lo, acc_hi, qk_scale,
                          DOT_PRECISION)


@triton.jit
def _value_stats(value_scales, value_zeros, ok, GROUP_HI):
    """Per-token value scales and zeros ``[T]`` of the two halves, each in one value group
    (``GROUP_HI``: the group of the second half)."""
    vs_lo = tl.load(value_scales, mask=ok, other=0.0).to(tl.float32)
    vz_lo = tl.load(value_zeros, mask=ok, other=0.0).to(tl.float32)
    vs_hi = tl.load(value_scales + GROUP_HI, mask=ok, other=0.0).to(tl.float32)
    vz_hi = tl.load(value_zeros + GROUP_HI, mask=ok, other=0.0).to(tl.float32)
    return vs_lo, vz_lo, vs_hi, vz_hi


@triton.jit
def _block_folded(q_lo, q_hi, m_i, l_i, acc_lo, acc_hi, qk_scale, key_block, value_block, value_scales,
                  value_zeros, ks_lo, ks_hi, kz_lo, kz_hi, t, c, t_ok, ok, k_idx, inv_freq,
                  DC, DH, BITS: tl.constexpr, GROUP_HI, ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Variant "folded" (each half of the channels in one value group): keys dequantized as in
    ``_block_dequantize``, values read straight from the codes, their per-token scale and zero folded
    into the probabilities (``_online_update_codes``): no ``[T, DH]`` value-scale tile."""
    vs_lo, vz_lo, vs_hi, vz_hi = _value_stats(value_scales, value_zeros, ok, GROUP_HI)
    k_lo, k_hi, v_lo, v_hi = _keys_and_value_codes(key_block, value_block, ks_lo, ks_hi, kz_lo, kz_hi, t, c, t_ok,
                                                   k_idx, inv_freq, DC, DH, BITS, ROPE)
    return _online_update_codes(q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, vs_lo, vz_lo, vs_hi, vz_hi, ok, m_i, l_i,
                                acc_lo, acc_hi, qk_scale, DOT_PRECISION)


@triton.jit
def _fp16_query(q_lo, q_hi, qk_scale):
    """The query of variant "fp16" as its fp16 operands ``[G, DH]`` and the per-row score scale ``[G, 1]`` that
    undoes what they carry: each row times a power of two that brings its largest |q| into [2^12, 2^13) (exact;
    far from fp16's limit and its subnormals), times 2 for the keys' halved stats (``_block_fp16``)."""
    top = tl.maximum(tl.max(tl.abs(q_lo), axis=1), tl.max(tl.abs(q_hi), axis=1))
    e = (top.to(tl.int32, bitcast=True) >> 23) - 139  # floor(log2(top)) - 12 (top >= 0: no sign bit)
    e = tl.minimum(tl.maximum(e, -126), 126)  # 2^-e a normal float32 (a zero row: any factor)
    pow2 = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e
    return ((q_lo * (2.0 * pow2)[:, None]).to(tl.float16), (q_hi * (2.0 * pow2)[:, None]).to(tl.float16),
            (qk_scale / pow2)[:, None])


@triton.jit
def _block_fp16(q16_lo, q16_hi, qk_rows, m_i, l_i, acc_lo, acc_hi, key_block, value_block, value_scales,
                value_zeros, key_scale, key_zero, t, c, c_ok, t_ok, ok, DC, DH, BITS: tl.constexpr, GROUP_HI):
    """Variant "fp16" (each half in one value group; scale_dtype fp16; the absolute contract): keys and values
    ``codes * scale + zero`` in fp16 -- codes by ``_half_code``'s mantissa trick, packed fp16 multiply-adds -- into
    fp16 tensor-core dots with fp32 accumulation. ``q16``, ``qk_rows``: ``_fp16_query``. Range: the stats enter
    halved (the codes by ``_half_code``, exactly; the zeros
    exactly but for subnormals), so a dequantized value, within its block's min and max (below 65504
    once stored under scale_dtype fp16), stays far below fp16's limit; the query and the probabilities carry the 2."""
    ks_lo = tl.load(key_scale + c, mask=c_ok, other=0.0)
    ks_hi = tl.load(key_scale + DH + c, mask=c_ok, other=0.0)
    kz_lo = tl.load(key_zero + c, mask=c_ok, other=0.0) * 0.5
    kz_hi = tl.load(key_zero + DH + c, mask=c_ok, other=0.0) * 0.5
    ck_lo, ck_hi = _load_codes(key_block, t, c, DC, DH, t_ok, BITS, True)  # code / 2
    s = tl.dot(q16_lo, tl.trans(ck_lo * ks_lo[None, :] + kz_lo[None, :]))
    s = tl.dot(q16_hi, tl.trans(ck_hi * ks_hi[None, :] + kz_hi[None, :]), s)
    m_new, l_i, alpha, p = _softmax_update(s, ok, m_i, l_i, qk_rows)
    vs_lo = tl.load(value_scales, mask=ok, other=0.0)  # [T]: a token's scale and zero of each half
    vz_lo = tl.load(value_zeros, mask=ok, other=0.0) * 0.5
    vs_hi = tl.load(value_scales + GROUP_HI, mask=ok, other=0.0)
    vz_hi = tl.load(value_zeros + GROUP_HI, mask=ok, other=0.0) * 0.5
    cv_lo, cv_hi = _load_codes(value_block, t, c, DC, DH, t_ok, BITS, True)
    p2 = (p * 2.0).to(tl.float16)
    acc_lo = tl.dot(p2, cv_lo * vs_lo[:, None] + vz_lo[:, None], acc_lo * alpha[:, None])
    acc_hi = tl.dot(p2, cv_hi * vs_hi[:, None] + vz_hi[:, None], acc_hi * alpha[:, None])
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _decode_kernel(
    q_ptr, sink_k_ptr, sink_v_ptr, float_k_ptr, float_v_ptr,
    key_codes_ptr, key_scale_ptr, key_zero_ptr, value_codes_ptr, value_scale_ptr, value_zero_ptr,
    sink_table_ptr, float_table_ptr, quant_table_ptr, seq_lens_ptr, inv_freq_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, H_KV, G, S, W, R, NQ, FS, NF, F_ROWS, BLOCKS_PER_SPLIT, SINK_PAGES, FLOAT_BLOCKS, QUANT_BLOCKS,
    # (head, block) strides in elements of each pool, in STORAGE_TENSORS' order (a block's own dims are contiguous)
    sk_h, sk_b, sv_h, sv_b, fk_h, fk_b, fv_h, fv_b, kc_h, kc_b, ks_h, ks_b, kz_h, kz_b, vc_h, vc_b, vs_h, vs_b,
    vz_h, vz_b,
    D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_DH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
    ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr, VARIANT: tl.constexpr, GROUP_HI: tl.constexpr,
    FR: tl.constexpr, CONTIGUOUS: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H_KV
    h = (pid % H_KV).to(tl.int64)  # kv head: pools are [Hkv, blocks, ...]
    bh = pid.to(tl.int64)  # (b, kv head) row of the [B, Hkv, ...] partial states
    DH = D // 2
    n = tl.load(seq_lens_ptr + b)
    m = tl.maximum(n - S, 0)                  # recent tokens seen
    qb = tl.maximum(m - R, 0) // BS           # blocks [0, qb) are quantized
    r_lo = tl.maximum(m - W, 0)               # oldest visible recent index
    blk_lo = r_lo // BS
    blk_end = (m + BS - 1) // BS
    n_sinks = tl.minimum(n, S)

    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_DH)
    g_ok = g < G
    c_ok = c < DH
    q_rows = (b * H_KV * G + (pid % H_KV) * G + g).to(tl.int64) * D
    qmask = g_ok[:, None] & c_ok[None, :]
    q_lo = tl.load(q_ptr + q_rows[:, None] + c[None, :], mask=qmask, other=0.0).to(tl.float32)
    q_hi = tl.load(q_ptr + q_rows[:, None] + DH + c[None, :], mask=qmask, other=0.0).to(tl.float32)
    inv_freq = tl.zeros([BLOCK_DH], tl.float32)  # the cache_index rotation's frequencies (unused otherwise)
    if ROPE:
        inv_freq = tl.load(inv_freq_ptr + c, mask=c_ok, other=0.0)
        q_idx = n_sinks + (m - r_lo) - 1      # the query's index in the cache: min(i, C-1)
        q_lo, q_hi = _rotate(q_lo, q_hi, tl.zeros([BLOCK_G], tl.int32) + q_idx, inv_freq)

    if VARIANT == "fp16":
        q16_lo, q16_hi, qk_rows = _fp16_query(q_lo, q_hi, qk_scale)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc_lo = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)
    acc_hi = tl.zeros([BLOCK_G, BLOCK_DH], tl.float32)

    # --- segment 1: sinks (split 0) ---
    if split == 0:
        page = tl.load(sink_table_ptr + b)
        sink_k = sink_k_ptr + _at(h, page, sk_h, sk_b, SINK_PAGES, S * D, CONTIGUOUS)  # its sink page: S rows of D
        sink_v = sink_v_ptr + _at(h, page, sv_h, sv_b, SINK_PAGES, S * D, CONTIGUOUS)
        for s0 in range(0, n_sinks, BLOCK_S):
            j = s0 + tl.arange(0, BLOCK_S)
            ok = j < n_sinks
            offs = j[:, None] * D + c[None, :]
            kv_mask = ok[:, None] & c_ok[None, :]
            k_lo = tl.load(sink_k + offs, mask=kv_mask, other=0.0).to(tl.float32)
            k_hi = tl.load(sink_k + DH + offs, mask=kv_mask, other=0.0).to(tl.float32)
            v_lo = tl.load(sink_v + offs, mask=kv_mask, other=0.0).to(tl.float32)
            v_hi = tl.load(sink_v + DH + offs, mask=kv_mask, other=0.0).to(tl.float32)
            if ROPE:
                k_lo, k_hi = _rotate(k_lo, k_hi, j, inv_freq)
            m_i, l_i, acc_lo, acc_hi = _online_update(q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ok, m_i, l_i,
                                                      acc_lo, acc_hi, qk_scale, DOT_PRECISION)

    # --- segment 2: this split's run of recent blocks: its quantized blocks, then its float ones ---
    # Two loops, each without a branch in its body: Triton's pipeliner turns a loop's tile loads
    # into asynchronous copies several blocks ahead (num_stages) only when no branch guards them.
    # Every pool is read through its own (head, block) strides: a block's base is one scalar per pool and
    # block, its rows offsets from it (contiguous rows: vector loads, no per-element 64-bit address math).
    t = tl.arange(0, BLOCK_T)
    t_ok = t < BS
    blk0 = blk_lo + split * BLOCKS_PER_SPLIT
    blk1 = tl.minimum(blk0 + BLOCKS_PER_SPLIT, blk_end)
    f0 = blk0  # this split's first float block
    if BITS != 16:
        CPB: tl.constexpr = 2 if BITS == 4 else 1
        DC: tl.constexpr = D // CPB
        NG: tl.constexpr = D // GROUP
        f0 = tl.maximum(blk0, tl.minimum(qb, blk1))
        ring0 = (blk0 % NQ).to(tl.int32)  # the one 64-bit modulo: inside the loop it would be a division call
        for i in range(0, f0 - blk0):
            blk = blk0 + i  # int64 like seq_lens (a loop over [blk0, f0) would count in int32 in the interpreter)
            r = blk * BS + t
            ok = t_ok & (r >= r_lo)  # a quantized block lies wholly before m
            slot = tl.load(quant_table_ptr + b * NQ + _ring(ring0, i, NQ))  # the slot's block (int64)
            # scalar bases: one address per pool and block
            key_block = key_codes_ptr + _at(h, slot, kc_h, kc_b, QUANT_BLOCKS, BS * DC, CONTIGUOUS)
            value_block = value_codes_ptr + _at(h, slot, vc_h, vc_b, QUANT_BLOCKS, BS * DC, CONTIGUOUS)
            # (per-token pointers, not offsets from a block base: loop-invariant offset tiles would stay live in
            # registers across the loop, ~40 more in the head-major case: benchmarks/kernel_sass.py)
            value_scales = value_scale_ptr + (_at(h, slot, vs_h, vs_b, QUANT_BLOCKS, BS * NG, CONTIGUOUS) + t * NG)
            value_zeros = value_zero_ptr + (_at(h, slot, vz_h, vz_b, QUANT_BLOCKS, BS * NG, CONTIGUOUS) + t * NG)
            key_scale = key_scale_ptr + _at(h, slot, ks_h, ks_b, QUANT_BLOCKS, D, CONTIGUOUS)
            key_zero = key_zero_ptr + _at(h, slot, kz_h, kz_b, QUANT_BLOCKS, D, CONTIGUOUS)
            if VARIANT == "fp16":
                m_i, l_i, acc_lo, acc_hi = _block_fp16(
                    q16_lo, q16_hi, qk_rows, m_i, l_i, acc_lo, acc_hi, key_block, value_block, value_scales,
                    value_zeros, key_scale, key_zero, t, c, c_ok, t_ok, ok, DC, DH, BITS, GROUP_HI)
            elif VARIANT == "folded":
                ks_lo, ks_hi, kz_lo, kz_hi = _key_stats(key_scale, key_zero, c, c_ok, DH)
                m_i, l_i, acc_lo, acc_hi = _block_folded(
                    q_lo, q_hi, m_i, l_i, acc_lo, acc_hi, qk_scale, key_block, value_block, value_scales,
                    value_zeros, ks_lo, ks_hi, kz_lo, kz_hi, t, c, t_ok, ok, n_sinks + r - r_lo,
                    inv_freq, DC, DH, BITS, GROUP_HI, ROPE, DOT_PRECISION)
            else:
                ks_lo, ks_hi, kz_lo, kz_hi = _key_stats(key_scale, key_zero, c, c_ok, DH)
                m_i, l_i, acc_lo, acc_hi = _block_dequantize(
                    q_lo, q_hi, m_i, l_i, acc_lo, acc_hi, qk_scale, key_block, value_block, value_scales,
                    value_zeros, ks_lo, ks_hi, kz_lo, kz_hi, t, c, t_ok, ok, n_sinks + r - r_lo,
                    inv_freq, DC, DH, BITS, GROUP, ROPE, DOT_PRECISION)
    # The float ring: F_ROWS rows in blocks of FR rows, NF a sequence; ring row j is row j % FR of block
    # float_table[b, j // FR] (qsinkkv/storage.py), and recent token r sits in ring row r % F_ROWS (layout.py).
    if FR == BS:  # (compile time) a window block is one ring block (the pools' own, or one page): a scalar base
        ring0 = (f0 % FS).to(tl.int32)
    else:  # an engine's pages of FR rows need not line up with the window's blocks: each row finds its page
        ring0 = ((f0 * BS) % F_ROWS).to(tl.int32)  # the ring row of the split's first float token
    for i in range(0, blk1 - f0):
        blk = f0 + i
        r = blk * BS + t
        ok = t_ok & (r >= r_lo) & (r < m)
        kv_mask = ok[:, None] & c_ok[None, :]
        if FR == BS:
            fblk = tl.load(float_table_ptr + b * NF + _ring(ring0, i, FS))  # the float-ring slot's block
            k_rows = float_k_ptr + _at(h, fblk, fk_h, fk_b, FLOAT_BLOCKS, FR * D, CONTIGUOUS) + (t * D)[:, None]
            v_rows = float_v_ptr + _at(h, fblk, fv_h, fv_b, FLOAT_BLOCKS, FR * D, CONTIGUOUS) + (t * D)[:, None]
        else:
            # a split's float rows span at most the ring (layout.py's float_slots), so i * BS + t < F_ROWS
            j = ring0 + i * BS + t
            j = tl.where(j >= F_ROWS, j - F_ROWS, j)
            fblk = tl.load(float_table_ptr + b * NF + j // FR, mask=ok, other=0)  # each row's block
            k_rows = float_k_ptr + _at(h, fblk, fk_h, fk_b, FLOAT_BLOCKS, FR * D, CONTIGUOUS) + (j % FR) * D
            v_rows = float_v_ptr + _at(h, fblk, fv_h, fv_b, FLOAT_BLOCKS, FR * D, CONTIGUOUS) + (j % FR) * D
            k_rows, v_rows = k_rows[:, None], v_rows[:, None]
        k_lo = tl.load(k_rows + c[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        k_hi = tl.load(k_rows + DH + c[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v_lo = tl.load(v_rows + c[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v_hi = tl.load(v_rows + DH + c[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if ROPE:
            k_lo, k_hi = _rotate(k_lo, k_hi, n_sinks + r - r_lo, inv_freq)
        m_i, l_i, acc_lo, acc_hi = _online_update(q_lo, q_hi, k_lo, k_hi, v_lo, v_hi, ok, m_i, l_i,
                                                  acc_lo, acc_hi, qk_scale, DOT_PRECISION)

    # --- partial state of this split: acc [G, D], (max, sum) [G, 2] ---
    part = (bh * SPLITS + split) * G
    prow = (part + g).to(tl.int64)
    tl.store(part_acc_ptr + prow[:, None] * D + c[None, :], acc_lo, mask=qmask)
    tl.store(part_acc_ptr + prow[:, None] * D + DH + c[None, :], acc_hi, mask=qmask)
    tl.store(part_ml_ptr + prow * 2, m_i, mask=g_ok)
    tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _merge_kernel(part_acc_ptr, part_ml_ptr, sink_logits_ptr, out_ptr, H_KV, G, D,
                  SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                  HAS_SINK_LOGITS: tl.constexpr):
    # one program per (b, query head): combine the splits' (max, sum, acc)
    pid = tl.program_id(0)            # = b * H + h
    h = pid % (H_KV * G)
    bh = pid // (H_KV * G) * H_KV + h // G
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    prow = ((bh * SPLITS + sp) * G + h % G).to(tl.int64)
    sp_ok = sp < SPLITS
    m_s = tl.load(part_ml_ptr + prow * 2, mask=sp_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + prow * 2 + 1, mask=sp_ok, other=0.0)
    acc = tl.load(part_acc_ptr + prow[:, None] * D + d[None, :], mask=sp_ok[:, None] & (d[None, :] < D), other=0.0)
    m = tl.max(m_s, axis=0)
    if HAS_SINK_LOGITS:
        sink = tl.load(sink_logits_ptr + h).to(tl.float32) * 1.4426950408889634  # log2(e)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_s - m_safe)
    denom = tl.sum(l_s * w, axis=0)
    if HAS_SINK_LOGITS:
        denom += tl.exp2(sink - m_safe)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + pid.to(tl.int64) * D + d, out, mask=d < D)


def decode_constexprs(cfg, head_dim: int, group_heads: int, splits: int, *, rope: bool, interpret: bool,
                      variant: str = "dequantize", float_block_rows: int | None = None,
                      contiguous: bool = True) -> dict:
    """The compile-time arguments of ``_decode_kernel`` (shared with benchmarks/kernel_sass.py).
    ``float_block_rows``: rows of the float pool's blocks (``float_k.shape[2]``), default ``block_size``;
    ``contiguous``: every pool is contiguous (the cache's own pools), else read through its strides."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}, got {variant!r}")
    if variant == "fp16" and rope:  # keys turn by their own index under cache_index; its fp16 body rotates none
        raise ValueError("variant='fp16' needs the absolute contract (rotary=None); use 'folded'")
    if variant == "fp16" and cfg.bits != 16 and cfg.scale_dtype != torch.float16:
        raise ValueError(f"variant='fp16' dequantizes in fp16: it needs scale_dtype=torch.float16 (which keeps every "
                         f"stored window value within fp16's range), got {cfg.scale_dtype}; use 'dequantize'")
    D = head_dim
    # a value group holding a whole half: its scale and zero fold out of the per-element work ("folded", "fp16");
    # bits=16 has no quantized block: every variant is the float loop
    fold_v = cfg.bits != 16 and cfg.value_group_size % (D // 2) == 0
    if variant != "dequantize" and cfg.bits != 16 and not fold_v:
        raise ValueError(f"variant={variant!r} folds each value group's scale out of a half of the head: it needs "
                         f"value_group_size a multiple of head_dim // 2 = {D // 2}, got {cfg.value_group_size}")
    return dict(
        D=D, BS=cfg.block_size, BITS=cfg.bits, GROUP=cfg.value_group_size if cfg.bits != 16 else 1, SPLITS=splits,
        BLOCK_G=max(16, triton.next_power_of_2(group_heads)), BLOCK_DH=max(16, triton.next_power_of_2(D // 2)),
        BLOCK_T=max(16, triton.next_power_of_2(cfg.block_size)), BLOCK_S=16,
        ROPE=rope, DOT_PRECISION="ieee" if interpret else "tf32",
        VARIANT=variant if fold_v else "dequantize",
        GROUP_HI=(D // 2) // cfg.value_group_size if cfg.bits != 16 else 0,
        FR=cfg.block_size if float_block_rows is None else float_block_rows, CONTIGUOUS=contiguous,
    )


def pool_strides(layer: LayerStorage) -> list[int]:
    """The (head, block) strides in elements of every pool (``STORAGE_TENSORS`` order), as ``_decode_kernel``
    takes them: any strides between heads and blocks (a pool's own layout, a slice of a bigger tensor, an
    engine's pages), each block's own dims contiguous, which the kernel's row offsets assume (refused otherwise)."""
    strides = []
    for name in STORAGE_TENSORS:
        pool = getattr(layer, name)
        step = 1
        for size, stride in zip(reversed(pool.shape[2:]), reversed(pool.stride()[2:])):  # innermost first
            if size > 1 and stride != step and pool.numel():
                raise ValueError(f"the Triton decode kernel reads {name} as [Hkv, blocks, ...] with each block "
                                 f"contiguous (any head and block strides); got shape {tuple(pool.shape)}, "
                                 f"strides {tuple(pool.stride())}")
            step *= size
        strides += [pool.stride(0), pool.stride(1)]
    return strides


def _num_splits(batch_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    if device.type != "cuda":
        return min(2, max(max_blocks, 1))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # enough programs to fill every SM twice, but at least 4 blocks of work each
    return max(1, min(triton.cdiv(2 * sms, batch_kv_heads), triton.cdiv(max_blocks, 4)))


def decode_attention(q: Tensor, layer: LayerStorage, *, scale: float | None = None, rotary: Rotary | None = None,
                     sink_logits: Tensor | None = None, num_splits: int | None = None, variant: str = "dequantize",
                     _poison: bool = False) -> Tensor:
    """Attention of one new query per sequence over a layer's stored sinks + recent window.

    q:           ``[B, H, D]``, H a multiple of the layer's Hkv (query head h reads kv head h // (H/Hkv)).
    layer:       a ``LayerStorage`` on q's device, its pools of any (head, block) strides with each block's
                 own dims contiguous (``pool_strides``; an engine's pages too); sequence b holds
                 ``layer.seq_lens[b]`` tokens and its query sits at position ``seq_lens[b] - 1``.
    scale:       softmax scale, default ``D ** -0.5``.
    rotary:      pass for the ``cache_index`` contract: q and the stored keys are pre-RoPE and are
                 rotated in the kernel by their index in the cache.
    sink_logits: ``[H]`` learned per-head logits adding ``exp(s_h)`` to the denominator.
    num_splits:  programs per (sequence, kv head) along the window; default fills the GPU.
    variant:     how quantized blocks are read: "dequantize", "folded" or "fp16" (``VARIANTS``).
    _poison:     tests: fill the partial-state workspace and the output with NaN first, so that an element
                 the kernels forget to write fails loudly.
    Returns ``[B, H, D]`` in q's dtype.
    """
    cfg, L = layer.layout.config, layer.layout
    B, Hkv, S, D = layer.batch_size, layer.num_kv_heads, cfg.sink_tokens, layer.head_dim
    if not isinstance(q, Tensor) or q.ndim != 3 or q.shape[0] != B or q.shape[2] != D or q.shape[1] % Hkv:
        raise ValueError(f"q must be [B={B}, H, D={D}] with H a multiple of Hkv={Hkv}, "
                         f"got {tuple(getattr(q, 'shape', ()))}")
    if q.device != layer.device:
        raise ValueError(f"q.device must be the cache device {layer.device}, got {q.device}")
    if D % 4:
        raise ValueError(f"the Triton decode kernel needs head_dim % 4 == 0, got head_dim={D}")
    fr, nf = layer.float_k.shape[2], layer.float_table.shape[1]
    if fr < 1 or nf * fr < L.float_rows:
        raise ValueError(f"the float ring's {L.float_rows} rows must fit its blocks: float_table has {nf} a "
                         f"sequence, of float_k.shape[2]={fr} rows")
    strides = pool_strides(layer)
    trace.ran("decode", "triton")
    H = q.shape[1]
    G = H // Hkv
    if sink_logits is not None:
        if not isinstance(sink_logits, Tensor) or sink_logits.shape != (H,):
            raise ValueError(f"sink_logits must be a tensor of shape [H={H}], "
                             f"got {getattr(sink_logits, 'shape', None)}")
        if sink_logits.device != q.device:
            raise ValueError(f"sink_logits.device must be q's device {q.device}, got {sink_logits.device}")
        sink_logits = sink_logits.float().contiguous()  # the kernel indexes it densely: no strides
    if rotary is not None and rotary.head_dim != D:
        raise ValueError(f"rotary covers head_dim={rotary.head_dim}, the cache has head_dim={D}")
    # int64: a stream's length is unbounded (int32 positions wrap at 2^31)
    seq_lens = layer.seq_lens.to(device=q.device, dtype=torch.int64).contiguous()
    max_blocks = L.quant_slots + L.float_slots + 1
    splits = _num_splits(B * Hkv, max_blocks, q.device) if num_splits is None else num_splits
    if not isinstance(splits, int) or splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    scale = D ** -0.5 if scale is None else scale
    qk_scale = scale * math.log2(math.e)
    if rotary is not None:  # HF scales cos and sin: both q and k carry the factor
        qk_scale *= rotary.attention_scaling ** 2
        inv_freq = rotary.inv_freq.to(device=q.device, dtype=torch.float32)
    else:
        inv_freq = torch.empty(1, device=q.device, dtype=torch.float32)
    alloc = (lambda *shape: torch.full(shape, float("nan"), device=q.device)) if _poison else \
        (lambda *shape: torch.empty(shape, device=q.device, dtype=torch.float32))
    part_acc = alloc(B, Hkv, splits, G, D)
    part_ml = alloc(B, Hkv, splits, G, 2)
    consts = decode_constexprs(cfg, D, G, splits, rope=rotary is not None, interpret=_INTERPRET, variant=variant,
                               float_block_rows=fr, contiguous=all(t.is_contiguous() for t in layer.tensors().values()))
    launch(_decode_kernel, (B * Hkv, splits), (
        q.contiguous(), layer.sink_k, layer.sink_v, layer.float_k, layer.float_v,
        layer.key_codes, layer.key_scale, layer.key_zero, layer.value_codes, layer.value_scale, layer.value_zero,
        layer.sink_table.contiguous(), layer.float_table.contiguous(), layer.quant_table.contiguous(),
        seq_lens, inv_freq, part_acc, part_ml,
        qk_scale, Hkv, G, S, cfg.recent_tokens, L.unquantized_tokens, max(L.quant_slots, 1),
        max(L.float_slots, 1), max(nf, 1), max(L.float_rows, 1), triton.cdiv(max_blocks, splits),
        layer.sink_k.shape[1], layer.float_k.shape[1], layer.key_codes.shape[1], *strides,
    ), consts, key=(q.device, q.dtype, cfg.sink_dtype, cfg.window_dtype, cfg.scale_dtype), stages=STAGES,
        name="decode", what=f"head_dim={D}, block_size={cfg.block_size}, bits={cfg.bits}",
        fix="use a smaller block_size, or backend='torch'", num_warps=decode_warps(cfg.block_size, consts["VARIANT"]))
    out = alloc(B, H, D)
    _merge_kernel[(B * H,)](
        part_acc, part_ml, sink_logits if sink_logits is not None else part_ml, out, Hkv, G, D,
        SPLITS=splits, BLOCK_SPLITS=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(D),
        HAS_SINK_LOGITS=sink_logits is not None,
    )
    return out.to(q.dtype)
