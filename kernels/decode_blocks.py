"""Decode over an engine's own float blocks named by a table, in Triton: vLLM's position-aligned pages (the
plugin's bits=16), where a row reads its sink blocks and its window's blocks and a bias says which slots its query
sees.

Grid ``(B * Hkv, splits)``: one program per (sequence, KV head, run of blocks) serves the G query heads of the KV
head (each K/V byte read once): it walks its run of the row's ``nb`` blocks, each a ``[bs, D]`` tile of keys and
of values read through the pools' (head, block) strides (vLLM's ``[blocks, Hkv, bs, 2 D]`` pages seen as
``[Hkv, blocks, bs, D]`` views), adds the bias to the scores and folds the tile into an online softmax (base 2);
the decode kernel's merge (``decode_attention._merge_kernel``) combines the runs' (max, sum, acc) and adds the
learned sink logits (flash-decoding: splits sized from the SM count, ``_num_splits``). A table entry outside the
pool is refused by name, as the reference and the C kernel refuse it (a device-side assert on a GPU), and the kernel
never follows one either (its tile reads zeros and its slots are masked); -1 names no block: its slots unseen.

Same arguments and contract as ``qsinkkv.decode.decode_blocks_torch`` (the reference) and
``qsinkkv.decode_c.decode_blocks_c`` (the CPU's).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from qsinkkv import checks, trace
from qsinkkv.decode import decode_blocks_torch  # noqa: F401  (the kernel's reference)
from qsinkkv.kernels.decode_attention import _merge_kernel, _num_splits

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _decode_blocks_kernel(q_ptr, k_ptr, v_ptr, table_ptr, bias_ptr, part_acc_ptr, part_ml_ptr,
                          k_head_stride, k_block_stride, v_head_stride, v_block_stride, num_blocks,
                          H_KV, G, NB, BLOCKS_PER_SPLIT, qk_scale,
                          D: tl.constexpr, BS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)            # (sequence, KV head)
    split = tl.program_id(1)          # its run of blocks
    b = (pid // H_KV).to(tl.int64)
    h = (pid % H_KV).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, BS)
    g_ok = g < G
    d_ok = d < D
    q_rows = (b * H_KV * G + h * G + g) * D
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    j0 = split * BLOCKS_PER_SPLIT
    for i in range(0, tl.minimum(BLOCKS_PER_SPLIT, NB - j0)):
        j = j0 + i
        block = tl.load(table_ptr + b * NB + j)
        inside = (block >= 0) & (block < num_blocks)
        seen = tl.load(bias_ptr + b * NB * BS + j * BS + t)                        # [BS]: 0 seen, -inf not
        ok = (seen == 0.0) & (t < tl.where(inside, BS, 0))
        rows = t[:, None] * D + d[None, :]
        mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + h * k_head_stride + block * k_block_stride + rows, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + h * v_head_stride + block * v_block_stride + rows, mask=mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    # this split's partial state, as _decode_kernel leaves it for the merge: acc [G, D], (max, sum) [G, 2]
    prow = ((b * H_KV + h) * SPLITS + split) * G + g
    tl.store(part_acc_ptr + prow[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(part_ml_ptr + prow * 2, m_i, mask=g_ok)
    tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=g_ok)


def decode_blocks(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, bias: Tensor, *, scale: float,
                  sink_logits: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """``qsinkkv.decode.decode_blocks_torch``'s contract: ``q [B, H, D]``, ``k_pool, v_pool [Hkv, blocks, bs, D]``
    (any head and block strides, each block's rows contiguous), ``block_table [B, nb]`` int64, ``bias [B, nb * bs]``
    float32, ``sink_logits [H]`` or None -> ``[B, H, D]`` float32 (or into ``out``, rounded as ``.to()`` rounds).
    ``bs`` a power of two >= 16 (vLLM's blocks are multiples of 16), ``D`` a multiple of 4; a call outside these
    raises by name."""
    B, H, D = q.shape
    Hkv, num_blocks, bs, _ = k_pool.shape
    nb = block_table.shape[1]
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"the Triton blocks decode needs a block of a power of two >= 16 rows, got {bs}")
    if D % 4 or H % Hkv or k_pool.shape != v_pool.shape or k_pool.shape[3] != D:
        raise ValueError(f"q must be [B, H, D] (D % 4 == 0, H a multiple of Hkv={Hkv}) over pools [Hkv, blocks, bs, "
                         f"D={D}], got q {list(q.shape)}, pools {list(k_pool.shape)} and {list(v_pool.shape)}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.stride(3) != 1 or pool.stride(2) != D:
            raise ValueError(f"{name}'s blocks must be rows of D contiguous values, got strides {pool.stride()}")
    if bias.shape != (B, nb * bs) or bias.dtype != torch.float32 or block_table.shape[0] != B:
        raise ValueError(f"bias must be float32 [B={B}, nb * bs={nb * bs}] and block_table [B, nb], got bias "
                         f"{bias.dtype} {list(bias.shape)}, block_table {list(block_table.shape)}")
    trace.ran("decode", "triton")
    checks.table_in_step("block_table", block_table, num_blocks, "k_pool and v_pool")  # (as the reference refuses)
    return _launch(q, k_pool, v_pool, block_table, bias, scale=scale, sink_logits=sink_logits, out=out)


def _launch(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, bias: Tensor, *, scale: float,
            sink_logits: Tensor | None, out: Tensor | None) -> Tensor:
    """``decode_blocks``' launches, after its checks (the kernel never follows an entry outside the pool either: its
    slots count as unseen; on a GPU the check's assert fires after the launch)."""
    B, H, D = q.shape
    Hkv, num_blocks, bs, _ = k_pool.shape
    nb = block_table.shape[1]
    G = H // Hkv
    q = q.contiguous()
    splits = _num_splits(B * Hkv, nb, q.device)
    per_split = triton.cdiv(max(nb, 1), splits)
    part_acc = torch.empty(B, Hkv, splits, G, D, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(B, Hkv, splits, G, 2, dtype=torch.float32, device=q.device)
    _decode_blocks_kernel[(B * Hkv, splits)](
        q, k_pool, v_pool, block_table.to(torch.int64).contiguous(), bias.contiguous(), part_acc, part_ml,
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), num_blocks, Hkv, G, nb, per_split,
        scale * math.log2(math.e),
        D=D, BS=bs, SPLITS=splits, BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_D=max(16, triton.next_power_of_2(D)), DOT_PRECISION="ieee" if _INTERPRET else "tf32")
    result = torch.empty(B, H, D, dtype=torch.float32, device=q.device)
    if sink_logits is not None:
        sink_logits = sink_logits.to(device=q.device, dtype=torch.float32).contiguous()
    _merge_kernel[(B * H,)](part_acc, part_ml, sink_logits if sink_logits is not None else part_ml, result, Hkv, G, D,
                            SPLITS=splits, BLOCK_SPLITS=triton.next_power_of_2(splits),
                            BLOCK_D=triton.next_power_of_2(D), HAS_SINK_LOGITS=sink_logits is not None)
    return result if out is None else out.copy_(result)
