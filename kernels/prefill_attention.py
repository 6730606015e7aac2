"""Flash-style prefill attention over a qsinkkv layer, in Triton.

A chunk of T new tokens per sequence attends over what the layer stored before the chunk plus
the chunk's own full-precision K/V, under the exact sink + window mask, never materializing a
``[T, N]`` score matrix. Two key segments, each read in tiles of ``BLOCK_N`` keys:

* the stored slots, dequantized once by ``qsinkkv.storage.gather`` (at most the capacity plus a
  block per sequence: O(capacity) memory, not O(T)); a query tile past the first W queries sees
  only the stored sinks, which ``gather`` puts first, so it reads only those;
* the chunk, read in place: the chunk tokens that are sinks (while the sequence holds fewer than
  S tokens) and the keys inside the window of the query tile, ``[t0 - W + 1, t0 + BLOCK_M)``.

So a query tile touches at most ``capacity + S + W + BLOCK_M`` keys: time grows linearly with T
at a fixed capacity, and the extra memory is the stored slots plus the output.

Grid ``(B * H, cdiv(T, BLOCK_M))``: one program per (sequence, query head, query tile); the query
head h reads kv head ``h // (H / Hkv)``, and the G heads of a kv head are neighbours in launch order
(their K/V tiles meet in L2); the first grid axis takes any batch (the second stops at 65,535
tiles: CUDA's limit on a grid's y dimension, ``maxGridSize[1]`` of the device properties). Online
softmax (base 2); the learned sink logits start the running (max, sum) at ``(s_h, 1)`` with no value.
Positions inside the kernel are int32 and relative to the chunk's first one (a stream is unbounded, a
window is not).

Under the ``cache_index`` contract (``rotary``) q, k and the stored keys are pre-RoPE and are turned
as ``sink_window_attention`` turns them: a recent key and a query by their distance to a common base
(only the difference of two indices enters a score), a sink key by its position and a query meeting
it by ``min(i, S + W - 1)``; a key tile that may hold sinks takes both query rotations.

The reference is ``qsinkkv.prefill.prefill_attention_reference`` (same ``gather``, the dense
``sink_window_attention`` per tile of queries).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from qsinkkv import trace
from qsinkkv.kernels.launch import launch
from qsinkkv.prefill import prefill_attention_reference  # noqa: F401  (the kernel's reference)
from qsinkkv.rope import Rotary
from qsinkkv.storage import LayerStorage, gather

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _visible(q_rel, k_rel, k_ok, k_sink, W):
    """``qsinkkv.layout.visible_mask`` ``[M, N]`` in positions relative to the chunk's first one (int32:
    a stream's absolute positions are int64, its window is not): ``q_rel [M]``; ``k_rel [N]`` with
    ``k_ok`` (a key is there) and ``k_sink`` (its absolute position is < S) per key."""
    q = q_rel[:, None]
    k = k_rel[None, :]
    return k_ok[None, :] & (k <= q) & (k_sink[None, :] | (k > q - W))


@triton.jit
def _load_rows(base, rows, stride, ok, c, c_ok, partner, sign, freq, idx, DOT_DTYPE: tl.constexpr,
               ROPE: tl.constexpr):
    """Rows ``[N, DP]`` of a ``[.., rows, D]`` tensor (row r at ``base + r * stride``), zero where not
    ``ok``. With ROPE, rotated by the integer positions ``idx [N]`` (rotate_half form: channel c pairs
    with ``partner[c] = (c + D/2) % D``, turned by ``freq[c] = inv_freq[c % (D/2)]``, ``sign[c]`` = -1
    on the first half)."""
    off = rows[:, None].to(tl.int64) * stride
    mask = ok[:, None] & c_ok[None, :]
    x = tl.load(base + off + c[None, :], mask=mask, other=0.0)
    if ROPE:
        pair = tl.load(base + off + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        ang = idx.to(tl.float32)[:, None] * freq[None, :]
        x = x.to(tl.float32) * tl.cos(ang) + sign[None, :] * pair * tl.sin(ang)
    return x.to(DOT_DTYPE)


@triton.jit
def _attend_rows(q, q_sink, q_rel, k_base, v_base, k_stride, v_stride, rows, k_ok, k_rel, k_sink, rot_idx,
                 m_i, l_i, acc, W, qk_scale, c, c_ok, partner, sign, freq, MIXED: tl.constexpr, ROPE: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr = True):
    """One tile of keys (``rows [N]``; per key: ``k_ok``, position relative to the chunk's first
    ``k_rel``, ``k_sink``, rotation index ``rot_idx``) folded into the running max ``m_i [M]``, sum
    ``l_i [M]`` and output ``acc [M, DP]`` (float32) of the queries ``q [M, DP]``. MIXED (a tile that
    may hold sinks, under ROPE): sink keys meet the query at its sink rotation ``q_sink``. Not MASKED: the
    caller knows every key of the tile is real and visible to every query of the tile."""
    k = _load_rows(k_base, rows, k_stride, k_ok, c, c_ok, partner, sign, freq, rot_idx, DOT_DTYPE, ROPE)
    # padding keys are never read: a masked key still meets its value in p @ v
    v = _load_rows(v_base, rows, v_stride, k_ok, c, c_ok, partner, sign, freq, rot_idx, DOT_DTYPE, False)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MIXED:
        s = tl.where(k_sink[None, :], tl.dot(q_sink, tl.trans(k), input_precision=DOT_PRECISION), s)
    if MASKED:
        s = tl.where(_visible(q_rel, k_rel, k_ok, k_sink, W), s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _attend_stored(q, q_sink, q_rel, sk_base, sv_base, ss_n, spos_base, held, start, stop, base_rel, S, W,
                   m_i, l_i, acc, qk_scale, c, c_ok, partner, sign, freq, BLOCK_N: tl.constexpr,
                   MIXED: tl.constexpr, ROPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The stored slots ``[start, stop)`` (positions from ``spos``; -1: empty)."""
    for n in range(start, stop, BLOCK_N):
        j = n + tl.arange(0, BLOCK_N)
        k_pos = tl.load(spos_base + j, mask=j < stop, other=-1)
        k_sink = k_pos < S
        # a stored non-sink key is within W + a block of held; a sink's relative position is never used
        k_rel = tl.where(k_sink, 0, k_pos - held).to(tl.int32)
        rot_idx = tl.where(k_sink, k_pos.to(tl.int32), k_rel - base_rel)
        m_i, l_i, acc = _attend_rows(q, q_sink, q_rel, sk_base, sv_base, ss_n, ss_n, j, k_pos >= 0, k_rel, k_sink,
                                     rot_idx, m_i, l_i, acc, W, qk_scale, c, c_ok, partner, sign, freq, MIXED, ROPE,
                                     DOT_DTYPE, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attend_chunk(q, q_sink, q_rel, k_base, v_base, sk_t, sv_t, held, length, chunk_sinks, start, stop, base_rel, W,
                  m_i, l_i, acc, qk_scale, c, c_ok, partner, sign, freq, BLOCK_N: tl.constexpr, MIXED: tl.constexpr,
                  ROPE: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  MASKED: tl.constexpr = True):
    """The chunk's keys ``[start, stop)``: row ``j`` at relative position ``j``, real while ``j < length``,
    a sink while ``j < chunk_sinks``."""
    for n in range(start, stop, BLOCK_N):
        j = n + tl.arange(0, BLOCK_N)
        k_sink = j < chunk_sinks
        rot_idx = tl.where(k_sink, (held + j).to(tl.int32), j - base_rel)
        m_i, l_i, acc = _attend_rows(q, q_sink, q_rel, k_base, v_base, sk_t, sv_t, j, j < length, j, k_sink, rot_idx,
                                     m_i, l_i, acc, W, qk_scale, c, c_ok, partner, sign, freq, MIXED, ROPE,
                                     DOT_DTYPE, DOT_PRECISION, MASKED)
    return m_i, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, sk_ptr, sv_ptr, spos_ptr, held_ptr, len_ptr, sink_logits_ptr, inv_freq_ptr,
                    out_ptr, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, ss_b, ss_h, ss_n, sp_b,
                    so_b, so_h, so_t, T, H, G, N_STORED, S, W, qk_scale,
                    D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SINK_LOGITS: tl.constexpr,
                    ROPE: tl.constexpr):
    bh = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_M
    b = bh // H
    h = bh % H
    hk = h // G
    held = tl.load(held_ptr + b)        # int64: tokens stored before the chunk (the chunk's first position)
    length = tl.load(len_ptr + b)     # the chunk's real tokens in this row; the rest is padding
    m = t0 + tl.arange(0, BLOCK_M)    # the queries' positions relative to held
    c = tl.arange(0, DP)
    if D == DP:  # a constant mask: lets the compiler see whole rows and vectorize the loads
        c_ok = tl.full([DP], 1, tl.int1)
    else:
        c_ok = c < D
    row_ok = m < length
    # cache_index (ROPE): recent keys and queries turn by their distance to a base inside this tile's
    # window (only differences matter), sinks by their position, queries meeting sinks by min(i, S+W-1)
    base_rel = tl.maximum(t0 - W + 1, -tl.minimum(held, 1 << 30).to(tl.int32))
    partner = (c + D // 2) % D
    sign = tl.where(c < D // 2, -1.0, 1.0)
    if ROPE:
        freq = tl.load(inv_freq_ptr + c % (D // 2), mask=c_ok, other=0.0)
    else:
        freq = tl.zeros([DP], tl.float32)
    q_base = q_ptr + b.to(tl.int64) * sq_b + h * sq_h
    q = _load_rows(q_base, m, sq_t, row_ok, c, c_ok, partner, sign, freq, m - base_rel, DOT_DTYPE, ROPE)
    if ROPE:
        q_sink = _load_rows(q_base, m, sq_t, row_ok, c, c_ok, partner, sign, freq,
                            tl.minimum(held + m, S + W - 1).to(tl.int32), DOT_DTYPE, ROPE)
    else:
        q_sink = q
    if HAS_SINK_LOGITS:  # exp(s_h) in the denominator: a key with score s_h and no value
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sink_logits_ptr + h) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)

    # --- the stored slots: sinks first; past the first W queries of the chunk, only those are visible ---
    n_stored = tl.where(t0 >= W, tl.minimum(S, N_STORED), N_STORED)
    sk_base = sk_ptr + b.to(tl.int64) * ss_b + hk * ss_h
    sv_base = sv_ptr + b.to(tl.int64) * ss_b + hk * ss_h
    spos_base = spos_ptr + b.to(tl.int64) * sp_b
    sink_tiles = 0
    if ROPE:  # the tiles holding the stored sinks take both query rotations
        sink_tiles = tl.minimum(tl.cdiv(S, BLOCK_N) * BLOCK_N, n_stored)
        m_i, l_i, acc = _attend_stored(q, q_sink, m, sk_base, sv_base, ss_n, spos_base, held, 0, sink_tiles, base_rel,
                                       S, W, m_i, l_i, acc, qk_scale, c, c_ok, partner, sign, freq, BLOCK_N, True,
                                       ROPE, DOT_DTYPE, DOT_PRECISION)
    m_i, l_i, acc = _attend_stored(q, q_sink, m, sk_base, sv_base, ss_n, spos_base, held, sink_tiles, n_stored,
                                   base_rel, S, W, m_i, l_i, acc, qk_scale, c, c_ok, partner, sign, freq, BLOCK_N,
                                   False, ROPE, DOT_DTYPE, DOT_PRECISION)

    # --- the chunk: its own sinks, then the keys inside this tile's window (disjoint runs of tiles) ---
    k_base = k_ptr + b.to(tl.int64) * sk_b + hk * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + hk * sv_h
    chunk_sinks = tl.minimum(tl.maximum(S - held, 0), length).to(tl.int32)  # chunk tokens at positions < S
    sink_end = tl.cdiv(chunk_sinks, BLOCK_N) * BLOCK_N
    lo = tl.maximum(tl.maximum(t0 - W + 1, 0) // BLOCK_N * BLOCK_N, sink_end)
    hi = tl.minimum(t0 + BLOCK_M, length)
    m_i, l_i, acc = _attend_chunk(q, q_sink, m, k_base, v_base, sk_t, sv_t, held, length, chunk_sinks, 0, sink_end,
                                  base_rel, W, m_i, l_i, acc, qk_scale, c, c_ok, partner, sign, freq, BLOCK_N, ROPE,
                                  ROPE, DOT_DTYPE, DOT_PRECISION)
    # the window's inner tiles, [full_lo, full_hi): every key real, at or before the tile's first query and
    # inside its last query's window, so no mask (FlashAttention's split of masked and full tiles)
    full_hi = tl.maximum(tl.minimum(t0 + 1, length) // BLOCK_N * BLOCK_N, lo)
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(t0 + BLOCK_M - W, 0), BLOCK_N) * BLOCK_N, lo), full_hi)
    m_i, l_i, acc = _attend_chunk(q, q_sink, m, k_base, v_base, sk_t, sv_t, held, length, chunk_sinks, lo, full_lo,
                                  base_rel, W, m_i, l_i, acc, qk_scale, c, c_ok, partner, sign, freq, BLOCK_N, False,
                                  ROPE, DOT_DTYPE, DOT_PRECISION)
    m_i, l_i, acc = _attend_chunk(q, q_sink, m, k_base, v_base, sk_t, sv_t, held, length, chunk_sinks, full_lo, full_hi,
                                  base_rel, W, m_i, l_i, acc, qk_scale, c, c_ok, partner, sign, freq, BLOCK_N, False,
                                  ROPE, DOT_DTYPE, DOT_PRECISION, MASKED=False)
    m_i, l_i, acc = _attend_chunk(q, q_sink, m, k_base, v_base, sk_t, sv_t, held, length, chunk_sinks, full_hi, hi,
                                  base_rel, W, m_i, l_i, acc, qk_scale, c, c_ok, partner, sign, freq, BLOCK_N, False,
                                  ROPE, DOT_DTYPE, DOT_PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out = tl.where(row_ok[:, None], out, 0.0)  # padding rows (their q is zero and saw keys) are zero
    tl.store(out_ptr + b.to(tl.int64) * so_b + h * so_h + m[:, None].to(tl.int64) * so_t + c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(m < T)[:, None] & c_ok[None, :])


def _dot_dtype(dtype: torch.dtype):
    # fp16/bf16 tensor-core dots with fp32 accumulation on a GPU; the interpreter computes bf16 dots
    # wrongly (design.md), so there bf16 is widened to fp32
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not _INTERPRET:
        return tl.bfloat16
    return tl.float32


def default_blocks(head_dim: int, rope: bool = False) -> tuple[int, int]:
    """(queries per program, keys per tile): FlashAttention-2's Hopper tiles for head_dim <= 128; smaller
    under cache_index, which holds two rotations of the queries and turns every key tile."""
    if rope:
        return 64, 32
    return (128 if head_dim <= 128 else 64), 64


def prefill_launch(block_m: int, rope: bool = False) -> dict:
    """Warps and pipeline stages (shared with benchmarks/kernel_sass.py, which compiles the defaults for
    sm_90a at head_dim 64 and 128 and prints their registers and spills)."""
    return dict(num_warps=8 if block_m >= 64 else 4, num_stages=2 if rope else 3)


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, *,
                      scale: float | None = None, rotary: Rotary | None = None, sink_logits: Tensor | None = None,
                      block_m: int | None = None, block_n: int | None = None) -> Tensor:
    """q ``[B, H, T, D]``, the chunk's k, v ``[B, Hkv, T, D]`` of which row b holds ``lengths[b]`` tokens
    (the rest is padding) at positions ``layer.seq_lens[b] ..`` -> ``[B, H, T, D]`` in q's dtype, zero at
    padding. The caller (the cache) has checked the shapes. ``rotary``: the ``cache_index`` contract
    (q, k and the stored keys pre-RoPE, turned in the kernel as ``sink_window_attention`` turns them).

    block_m / block_n: queries per program and keys per tile (powers of two >= 16); the defaults suit
    an H100/H200 at head_dim 64-128."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    cfg = layer.layout.config
    default_m, default_n = default_blocks(D, rotary is not None)
    block_m, block_n = block_m or default_m, block_n or default_n
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")
    if triton.cdiv(T, block_m) > 65535:
        raise ValueError(f"a prefill chunk holds at most 65535 * block_m = {65535 * block_m} tokens, got T={T}: "
                         "split it into chunks")
    trace.ran("prefill", "triton")
    stored_k, stored_v, stored_pos = gather(layer, q.dtype)     # [B, Hkv, N, D], [B, N]
    stored_pos = stored_pos.contiguous()
    if stored_k.stride(3) != 1 or stored_k.stride() != stored_v.stride():  # one set of strides for both
        stored_k, stored_v = stored_k.contiguous(), stored_v.contiguous()
    q, k, v = (x if x.stride(3) == 1 else x.contiguous() for x in (q, k, v))
    held = layer.seq_lens.to(device=q.device, dtype=torch.int64)
    lengths = lengths.to(device=q.device, dtype=torch.int64)
    scale = D ** -0.5 if scale is None else scale
    qk_scale = scale * math.log2(math.e)
    if rotary is not None:  # HF scales cos and sin: both q and k carry the factor
        qk_scale *= rotary.attention_scaling ** 2
        inv_freq = rotary.inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    else:
        inv_freq = lengths  # any pointer: the kernel reads inv_freq under ROPE only (sink logits likewise)
    if sink_logits is not None:
        sink_logits = sink_logits.to(device=q.device, dtype=torch.float32).contiguous()
    # the interpreter narrows float32 to bf16 by truncation, not rounding: it writes float32 there
    out_dtype = torch.float32 if _INTERPRET and q.dtype == torch.bfloat16 else q.dtype
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    options = prefill_launch(block_m, rotary is not None)
    launch(_prefill_kernel, (B * H, triton.cdiv(T, block_m)), (
        q, k, v, stored_k, stored_v, stored_pos, held, lengths, sink_logits if sink_logits is not None else q, inv_freq,
        out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), stored_k.stride(0), stored_k.stride(1), stored_k.stride(2), stored_pos.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        T, H, H // Hkv, stored_k.shape[2], cfg.sink_tokens, cfg.recent_tokens, qk_scale,
    ), dict(
        D=D, DP=max(16, triton.next_power_of_2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_DTYPE=_dot_dtype(q.dtype), DOT_PRECISION="ieee" if _INTERPRET else "tf32",
        HAS_SINK_LOGITS=sink_logits is not None, ROPE=rotary is not None,
    ), key=(q.device, q.dtype, k.dtype, out.dtype), stages=tuple(range(options["num_stages"], 0, -1)),
        num_warps=options["num_warps"], name="prefill",
        what=f"head_dim={D}, block_m={block_m}, block_n={block_n}", fix="smaller block_m/block_n "
        "(prefill_attention's arguments), or backend='torch'")
    return out.to(q.dtype)
