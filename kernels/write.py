"""The write op in Triton: a step's rows stored, and the blocks it completes quantized, reading and writing every
pool through its (head, block) strides -- the cache's own pools and an engine's pages alike. Same arguments and the
same bits as the reference, ``qsinkkv.write.store_rows`` and ``qsinkkv.write.complete_blocks`` (``WRITER_TRITON``,
a ``qsinkkv.write.Writer``).

``complete_blocks``: one program per (completing block, KV head) gathers the block's tokens where they lie -- its
older ones in the float ring (through ``float_table``), the step's from ``k, v`` (rounded to ``window_dtype`` as the
ring would hold them) -- and quantizes them with the rule of ``kernels/quantize.py`` (``_key_block``,
``_value_rows``: codes, scales and zeros bit-identical to ``qsinkkv.quant``) into a small buffer of the step's
blocks; the blocks are checked (a scale or zero that overflowed ``scale_dtype`` refuses the step, nothing written:
``checks.condition_in_step``, no host read on a GPU) and put into their quantized-ring slots
(``write.put_blocks``). No gather of the window is made in torch, and nothing is read back to the host.

``store_rows``: one program per (token, KV head) copies the token's K and V row into its block's row, rounded to
the pool's dtype to nearest even (as ``.to()`` rounds; by hand for bf16: the interpreter truncates).

Both refuse a table entry they would follow outside its pool, or to no block (-1), before anything is written
(``write.check_rows``, ``write.check_blocks``: by name on the CPU, a device-side assert on a GPU, no host read), as
the reference and the C writer do; the kernels themselves never follow such an entry either (on a GPU the assert
fires after the launch): such a row or ring token is neither read nor written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from qsinkkv import checks, trace, write
from qsinkkv.kernels.quantize import _TL_DTYPE, _key_block, _round_to, _value_rows
from qsinkkv.quant import codes_per_byte
from qsinkkv.storage import LayerStorage


@triton.jit
def _rows_as_stored(x_ptr, x_rows, ring_ptr, ring_rows, new, ring_ok, real, c, off, WINDOW_DTYPE: tl.constexpr):
    """A block tile ``[T, C]`` (channels ``off + c``) in float32 as the block is quantized: row t from the step's
    tokens (at ``x_rows[t]``, rounded to ``window_dtype`` as the ring holds them) where ``new[t]``, else from the float
    ring (at ``ring_rows[t]``; zeros where its block is outside the pool: ``ring_ok``)."""
    from_x = tl.load(x_ptr + x_rows[:, None] + off + c[None, :], mask=real & new[:, None], other=0.0)
    from_x = _round_to(from_x.to(tl.float32), WINDOW_DTYPE).to(tl.float32)
    from_ring = tl.load(ring_ptr + ring_rows[:, None] + off + c[None, :], mask=real & (~new & ring_ok)[:, None],
                        other=0.0)
    return tl.where(new[:, None], from_x, from_ring.to(tl.float32))


@triton.jit
def _complete_blocks_kernel(x_k, x_v, x_token_stride, x_head_stride,
                            ring_k, ring_v, ring_head_stride, ring_block_stride, float_blocks,
                            float_table, float_table_stride,
                            at_ptr, seqs_ptr, blocks_ptr, first_new_ptr,
                            key_codes, key_scale, key_zero, value_codes, value_scale, value_zero,
                            Hkv, D, F, FR, GROUP,
                            BS: tl.constexpr, BITS: tl.constexpr, SCALE_DTYPE: tl.constexpr,
                            WINDOW_DTYPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)   # the completing block
    h = tl.program_id(1).to(tl.int64)   # the KV head
    seq = tl.load(seqs_ptr + i)
    block = tl.load(blocks_ptr + i)
    first_new = tl.load(first_new_ptr + i)
    at = tl.load(at_ptr + i)
    t = tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_C)
    QMAX: tl.constexpr = (1 << BITS) - 1
    C = D // 2 if BITS == 4 else D      # channels a tile holds; also the code bytes of a row
    NG = D // GROUP
    token = block * BS + t              # recent indices of the block's tokens
    new = token >= first_new            # the step's (in k, v), else in the float ring
    x_rows = (at + token - first_new) * x_token_stride + h * x_head_stride
    ring_row = token % tl.maximum(F, 1)
    ring_block = tl.load(float_table + seq * float_table_stride + ring_row // FR, mask=(t < BS) & ~new, other=-1)
    ring_ok = (ring_block >= 0) & (ring_block < float_blocks)
    ring_rows = h * ring_head_stride + ring_block * ring_block_stride + (ring_row % FR) * D
    real = (t[:, None] < BS) & (c[None, :] < C)
    real_hi = real & (BITS == 4)
    unit = i * Hkv + h                  # this (block, head) in the step's buffers
    k_lo = _rows_as_stored(x_k, x_rows, ring_k, ring_rows, new, ring_ok, real, c, 0, WINDOW_DTYPE)
    k_hi = _rows_as_stored(x_k, x_rows, ring_k, ring_rows, new, ring_ok, real_hi, c, C, WINDOW_DTYPE)
    codes = _key_block(k_lo, k_hi, real, c, C, key_scale + unit * D, key_zero + unit * D, QMAX, BITS, SCALE_DTYPE)
    tl.store(key_codes + unit * BS * C + t[:, None] * C + c[None, :], codes, mask=real)
    v_lo = _rows_as_stored(x_v, x_rows, ring_v, ring_rows, new, ring_ok, real, c, 0, WINDOW_DTYPE)
    v_hi = _rows_as_stored(x_v, x_rows, ring_v, ring_rows, new, ring_ok, real_hi, c, C, WINDOW_DTYPE)
    rows = (unit * BS + t) * NG
    codes = _value_rows(v_lo, v_hi, real, t < BS, c, C, GROUP, NG, value_scale + rows, value_zero + rows, QMAX, BITS,
                        SCALE_DTYPE, BLOCK_T, BLOCK_C)
    tl.store(value_codes + unit * BS * C + t[:, None] * C + c[None, :], codes, mask=real)


@triton.jit
def _store_rows_kernel(x_k, x_v, x_token_stride, x_head_stride, pool_k, pool_v, pool_head_stride, pool_block_stride,
                       num_blocks, table, table_stride, at_ptr, seqs_ptr, ring_rows_ptr, rows_per_block, D,
                       POOL_DTYPE: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)   # the token
    h = tl.program_id(1).to(tl.int64)   # the KV head
    at = tl.load(at_ptr + i)
    seq = tl.load(seqs_ptr + i)
    ring_row = tl.load(ring_rows_ptr + i)
    block = tl.load(table + seq * table_stride + ring_row // rows_per_block)
    d = tl.arange(0, BLOCK_D)
    ok = d < tl.where((block >= 0) & (block < num_blocks), D, 0)  # (a block outside the pool: nothing written)
    src = at * x_token_stride + h * x_head_stride + d
    dst = h * pool_head_stride + block * pool_block_stride + (ring_row % rows_per_block) * D + d
    tl.store(pool_k + dst, _round_to(tl.load(x_k + src, mask=ok).to(tl.float32), POOL_DTYPE), mask=ok)
    tl.store(pool_v + dst, _round_to(tl.load(x_v + src, mask=ok).to(tl.float32), POOL_DTYPE), mask=ok)


def _rows(x: Tensor, name: str) -> Tensor:
    """``x [N, Hkv, D]`` with each row contiguous (a copy otherwise)."""
    if x.dim() != 3:
        raise ValueError(f"{name} must be [N, Hkv, D], got shape {tuple(x.shape)}")
    return x if x.stride(2) == 1 else x.contiguous()


def _pool(pool: Tensor, name: str) -> Tensor:
    """A pool ``[Hkv, blocks, rows, D]`` whose blocks are contiguous rows of D (any head and block strides)."""
    if pool.stride(3) != 1 or pool.stride(2) != pool.shape[3]:
        raise ValueError(f"the Triton write reads {name} as [Hkv, blocks, rows, D] with each block's rows contiguous; "
                         f"got shape {tuple(pool.shape)}, strides {tuple(pool.stride())}")
    return pool


def store_rows(pool_k: Tensor, pool_v: Tensor, table: Tensor, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor,
               ring_rows: Tensor, rows_per_block: int) -> None:
    """``qsinkkv.write.store_rows`` in one launch: the same arguments, the same bits."""
    trace.ran("write_rows", "triton")
    if not at.numel():
        return
    write.check_rows(pool_k, pool_v, table, seqs, ring_rows, rows_per_block)
    _launch_store_rows(pool_k, pool_v, table, k, v, at, seqs, ring_rows, rows_per_block)


def _launch_store_rows(pool_k: Tensor, pool_v: Tensor, table: Tensor, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor,
                       ring_rows: Tensor, rows_per_block: int) -> None:
    """``store_rows``' launch, after its check (the kernel never follows an entry outside the pool either: on a GPU
    the check's assert fires after the launch)."""
    dev = pool_k.device
    k, v = _rows(k, "k"), _rows(v, "v")
    k, v = (k, v) if k.stride() == v.stride() else (k.contiguous(), v.contiguous())  # (one set of strides: both)
    pool_k, pool_v = _pool(pool_k, "pool_k"), _pool(pool_v, "pool_v")
    if pool_k.stride() != pool_v.stride() or pool_k.dtype != pool_v.dtype:
        raise ValueError(f"pool_k and pool_v must lie alike, got strides {pool_k.stride()} and {pool_v.stride()}, "
                         f"dtypes {pool_k.dtype} and {pool_v.dtype}")
    Hkv, num_blocks, _, D = pool_k.shape
    table = table.to(dev, torch.long)
    index = [x.to(dev, torch.long).contiguous() for x in (at, seqs, ring_rows)]
    _store_rows_kernel[(at.shape[0], Hkv)](
        k, v, k.stride(0), k.stride(1), pool_k, pool_v, pool_k.stride(0), pool_k.stride(1), num_blocks,
        table, table.stride(0), *index, rows_per_block, D,
        POOL_DTYPE=_TL_DTYPE[pool_k.dtype], BLOCK_D=triton.next_power_of_2(D))


def complete_blocks(storage: LayerStorage, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor, blocks: Tensor,
                    first_new: Tensor, quantizer=None) -> None:
    """``qsinkkv.write.complete_blocks`` in one launch (and the put into the slots): the same arguments, the same
    bits. ``quantizer`` is taken for the ``Writer`` interface: the kernel quantizes by the one rule every quantizer
    shares. Raises ValueError (nothing written) if a scale or zero overflows ``scale_dtype`` (on a GPU: a
    device-side assert)."""
    trace.ran("write_blocks", "triton")
    n = seqs.shape[0]
    if not n:
        return
    slots, _ = write.check_blocks(storage, seqs, blocks, first_new)
    layout, cfg = storage.layout, storage.layout.config
    dev, Hkv, D, bs = storage.device, storage.num_kv_heads, storage.head_dim, cfg.block_size
    k, v = _rows(k, "k"), _rows(v, "v")
    k, v = (k, v) if k.stride() == v.stride() else (k.contiguous(), v.contiguous())
    ring_k, ring_v = _pool(storage.float_k, "float_k"), _pool(storage.float_v, "float_v")
    if ring_k.stride() != ring_v.stride():
        raise ValueError(f"float_k and float_v must lie alike, got strides {ring_k.stride()} and {ring_v.stride()}")
    Dc, NG = D // codes_per_byte(cfg.bits), D // cfg.value_group_size
    sd = cfg.scale_dtype
    out = [torch.empty(n, Hkv, bs, Dc, dtype=torch.uint8, device=dev), torch.empty(n, Hkv, D, dtype=sd, device=dev),
           torch.empty(n, Hkv, D, dtype=sd, device=dev), torch.empty(n, Hkv, bs, Dc, dtype=torch.uint8, device=dev),
           torch.empty(n, Hkv, bs, NG, dtype=sd, device=dev), torch.empty(n, Hkv, bs, NG, dtype=sd, device=dev)]
    table = storage.float_table
    index = [x.to(dev, torch.long).contiguous() for x in (at, seqs, blocks, first_new)]
    _complete_blocks_kernel[(n, Hkv)](
        k, v, k.stride(0), k.stride(1), ring_k, ring_v, ring_k.stride(0), ring_k.stride(1), ring_k.shape[1],
        table, table.stride(0), *index, *out, Hkv, D, layout.float_rows, ring_k.shape[2], cfg.value_group_size,
        BS=bs, BITS=cfg.bits, SCALE_DTYPE=_TL_DTYPE[sd], WINDOW_DTYPE=_TL_DTYPE[cfg.window_dtype],
        BLOCK_T=triton.next_power_of_2(bs), BLOCK_C=triton.next_power_of_2(Dc))
    scales = torch.cat([x.flatten() for x in (out[1], out[2], out[4], out[5])])
    checks.condition_in_step(torch.isfinite(scales).all(),
                             lambda: write.overflow_error(storage, k, v, at, seqs, blocks, first_new))
    write.put_blocks(storage, seqs, blocks, out, slots)


WRITER_TRITON = write.Writer("triton", complete_blocks, store_rows)
