"""The C decode (``qsinkkv.decode_c``, the "c" backend's decode) vs the PyTorch reference and the
float64 oracle: every bits and dtype, ragged and paged batches, bit-identical rows alone and on
any thread, and how the backend is chosen when C is not at hand. (Every layout of the kernel tests,
beside the PyTorch CPU path: ``tests/test_decode.py::test_cpu_decode_matches_reference_and_rows_alone``.)"""
import ctypes
import math
import os
import shlex
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import random_storage_layer, rel_rms, run_stream, scattered_pool

from qsinkkv import CacheConfig, Rotary, SinkQuantCache, decode_c, trace
from qsinkkv.decode import decode_attention_reference

pytestmark = pytest.mark.skipif(not decode_c.available()[0], reason=f"no C decode: {decode_c.available()[1]}")
D = 16


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_stream_matches_float64_oracle(bits):
    """A cache on the "c" backend through a stream (prefill past the capacity, 240 decode steps, a
    mid-stream chunk) against the float64 oracle on the K/V it stored."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=20, bits=bits, block_size=4, value_group_size=8)
    worst, rms = run_stream(cfg, backend="c", sink_logits=torch.randn(6))
    assert worst < 1e-5, f"vs oracle on stored K/V: {worst:.2e}"
    assert rms < (1e-5 if bits == 16 else 0.1)


@pytest.mark.parametrize("sink_dtype, window_dtype, scale_dtype", [
    (torch.float16, torch.float16, torch.float16), (torch.float32, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16, torch.float32)])
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_storage_dtypes(bits, sink_dtype, window_dtype, scale_dtype):
    """Sinks, float ring and scales in every dtype the config takes (fp16 read bit by bit in C),
    with values down in fp16's subnormals."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=21, bits=bits, block_size=4, value_group_size=8,
                      residual_tokens=2, sink_dtype=sink_dtype, window_dtype=window_dtype, scale_dtype=scale_dtype)
    g = torch.Generator().manual_seed(bits)
    cache = SinkQuantCache(cfg, 1, 2, 2, D, dtype=torch.float32, backend="torch")
    v = torch.randn(2, 2, 45, D, generator=g)
    v[:, :, ::5] *= 1e-6
    cache.append(0, torch.randn(2, 2, 45, D, generator=g) * 2, v, lengths=[45, 30])
    layer = cache.layers[0]
    q = torch.randn(2, 6, D, generator=g)
    assert rel_rms(decode_c.decode_attention_c(q, layer), decode_attention_reference(q, layer)) < 1e-5
    half = q.to(torch.bfloat16)
    out = decode_c.decode_attention_c(half, layer, scale=0.2)
    assert out.dtype == torch.bfloat16
    assert rel_rms(out.float(), decode_attention_reference(half.float(), layer, scale=0.2)) < 1e-2


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_positions_past_2_31_and_empty_rows(bits):
    cfg = CacheConfig(sink_tokens=3, recent_tokens=13, bits=bits, block_size=4, value_group_size=8, residual_tokens=2)
    layer = random_storage_layer(cfg, 4, 2, seed=bits)
    layer.seq_lens.copy_(torch.tensor([2**31 + 5, 0, 2**32 + 78, 2**31 - 1]))
    q = torch.randn(4, 4, D, generator=torch.Generator().manual_seed(1))
    ref = decode_attention_reference(q, layer)
    out = decode_c.decode_attention_c(q, layer)
    keep = torch.tensor([True, False, True, True])
    assert rel_rms(out[keep], ref[keep]) < 1e-5
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # a sequence with no token sees nothing: 0, not NaN


@pytest.mark.parametrize("bits, head_dim, group, heads", [
    (4, 64, 32, 9),   # value groups of whole vectors (dequantized in registers), > 8 query heads (two passes)
    (4, 64, 32, 3),   # int4 codes widened in registers (one pass of heads), both nibbles of a byte
    (4, 128, 128, 2),  # the same over 128 channels: low nibbles in chunks 0-3, high in 4-7
    (8, 64, 8, 3),    # groups narrower than a vector on AVX-512 (dequantized row by row first)
    (4, 12, 6, 2),    # int4 halves of 6 codes (no whole vector): the scalar unpack; rows padded past D
    (8, 24, 24, 5),   # int8 rows of 24 codes: whole 8-code loads and a padded tail
    (16, 20, 20, 4)])
def test_every_row_shape_matches_the_reference(bits, head_dim, group, heads):
    """Each way the C decode reads a row (codes unpacked 8 at a time or one by one, value groups folded into
    the vector loop or dequantized first, rows padded to whole vectors, query heads in passes of 8) against
    the float64 reference, with the fp16 scales read by F16C where the machine has it; and each row alone."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=45, bits=bits, block_size=8, value_group_size=group)
    Hkv = 2
    layer = random_storage_layer(cfg, 3, Hkv, seed=head_dim + bits, D=head_dim)
    layer.seq_lens.copy_(torch.tensor([70, 9, 33]))
    q = torch.randn(3, Hkv * heads, head_dim, generator=torch.Generator().manual_seed(head_dim))
    out = decode_c.decode_attention_c(q, layer, scale=0.3)
    ref = decode_attention_reference(q.double(), layer, scale=0.3)
    assert rel_rms(out.double(), ref) < 1e-6
    for b in range(3):
        assert torch.equal(decode_c.decode_attention_c(q[b:b + 1], layer.rows(b), scale=0.3), out[b:b + 1])


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("pool_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
def test_store_rows_c_writes_the_bits_of_the_reference(x_dtype, pool_dtype):
    """The one-token write in C against ``write.store_rows`` (PyTorch's indexed write and ``.to()``), bitwise, for
    every dtype pair: values at rounding ties, fp16 subnormals and overflow, bf16's and fp16's ends, inf (and
    NaN, as NaN);
    pools whose blocks are far apart (an engine's pages) and a table that is a column view."""
    from qsinkkv import write
    g = torch.Generator().manual_seed(len(str(x_dtype)) * 7 + len(str(pool_dtype)))
    H, Dh, rpb, blocks, B = 3, 24, 5, 20, 6
    special = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 3e-8, 6e-5, 65504.0, 65520.0,
                            7e4, 3.3895e38, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, 2.5])
    k, v = (torch.randn(B + 2, H, Dh, generator=g) * 10 for _ in range(2))
    k.view(-1)[:16], v.view(-1)[-16:] = special, special.flip(0)
    k, v = k.to(x_dtype), v.to(x_dtype)
    at = torch.tensor([0, 2, 3, 5, 7], dtype=torch.long)
    seqs = torch.tensor([4, 0, 5, 1, 2], dtype=torch.long)
    ring_rows = torch.tensor([0, 7, 14, 3, 9], dtype=torch.long)
    table = torch.randperm(blocks, generator=g)[:B * 3].view(B, 3)
    # the pools as an engine's pages: the K and V regions of each block inside a bigger row, which holds other bytes
    pages = torch.randn(H, blocks, 3 * rpb * Dh + 40, generator=g).to(pool_dtype)
    outs = []
    for store in (write.store_rows, decode_c.store_rows_c):
        out = pages.clone()
        pk = out[:, :, :rpb * Dh].unflatten(-1, (rpb, Dh))
        pv = out[:, :, rpb * Dh + 8:2 * rpb * Dh + 8].unflatten(-1, (rpb, Dh))
        store(pk, pv, table.t().contiguous().t(), k, v, at, seqs, ring_rows, rpb)  # (a column-major table)
        outs.append(out)
    bits = torch.int32 if pool_dtype == torch.float32 else torch.int16
    # (NaN: any NaN; PyTorch's own casts give 0x7FC0 or 0xFFFF for a bf16 NaN, by path. None is ever stored)
    same = (outs[0].view(bits) == outs[1].view(bits)) | (outs[0].isnan() & outs[1].isnan())
    assert bool(same.all()), f"{int((~same).sum())} elements differ"
    assert not torch.equal(outs[0].view(bits), pages.view(bits))
    # the sinks' form: a [B] table, one block of rows_per_block rows per sequence
    sink_k, sink_v = (torch.zeros(H, blocks, rpb, Dh, dtype=pool_dtype) for _ in range(2))
    results = []
    for store in (write.store_rows, decode_c.store_rows_c):
        sink_k.zero_(), sink_v.zero_()
        store(sink_k, sink_v, table[:, 1].unsqueeze(1), k, v, at, seqs, ring_rows % rpb, rpb)
        results.append((sink_k.clone(), sink_v.clone()))
    for a_, b_ in zip(*results):
        assert bool(((a_.view(bits) == b_.view(bits)) | (a_.isnan() & b_.isnan())).all())


@pytest.mark.parametrize("bits, window_dtype, scale_dtype, residual, group, x_dtype", [
    (4, torch.bfloat16, torch.float16, 0, 8, torch.float32), (8, torch.float16, torch.bfloat16, 2, 16, torch.float32),
    (4, torch.float32, torch.float32, 2, 4, torch.float32), (8, torch.bfloat16, torch.float16, 0, 16, torch.bfloat16)])
def test_one_token_write_in_c_gives_the_bits_of_the_reference(bits, window_dtype, scale_dtype, residual, group,
                                                               x_dtype):
    """A one-token step over rows at every kind of length (to the sinks, to the float ring, completing a block,
    completing one whose slot held a block still visible): ``decode_c.WRITER_C`` leaves every storage tensor
    and length bit for bit as ``write.WRITER_TORCH`` does; a block whose scale overflows fp16 is refused by
    both, with nothing written."""
    from qsinkkv import quant, write
    cfg = CacheConfig(sink_tokens=3, recent_tokens=21, bits=bits, block_size=4, value_group_size=group,
                      residual_tokens=residual, window_dtype=window_dtype, scale_dtype=scale_dtype)
    layout = random_storage_layer(cfg, 1, 2).layout
    seventy = tuple(range(70))
    every = write.plan(layout, seventy, (1,) * 70, seventy, seventy)  # each length's kind of row
    lengths = [0, 2] + every.float_rows[::9].tolist() + every.full_rows[::2].tolist()
    rows = tuple(range(len(lengths)))
    plan = write.plan(layout, tuple(lengths), (1,) * len(rows), rows, rows)
    assert len(plan.full_at) >= 3 and len(plan.sink_at) >= 2 and len(plan.float_at) >= 3
    g = torch.Generator().manual_seed(bits + residual)
    k, v = (torch.randn(len(lengths), 2, D, generator=g).mul(3).to(x_dtype) for _ in range(2))
    results = []
    for impl in (write.WRITER_TORCH, decode_c.WRITER_C):
        layer = random_storage_layer(cfg, len(lengths), 2, seed=5)
        layer.seq_lens.copy_(torch.tensor(lengths))
        with trace.recording() as ran:
            write.append_tokens(layer, k, v, rows, rows, [1] * len(rows), quant, keep_undo=False, writer=impl)
        assert {kernel for op, kernel in ran if op.startswith("write")} == {impl.kernel}, ran
        results.append(layer)
    for name, t in results[0].tensors().items():
        assert torch.equal(t.view(torch.uint8), results[1].tensors()[name].view(torch.uint8)), name
    assert torch.equal(results[0].seq_lens, results[1].seq_lens)
    if scale_dtype == torch.float16:  # 1e5 overflows an fp16 scale: refused, nothing written
        huge = k.clone()
        huge[plan.full_at[0], 0, 0] = -1e5  # (beyond fp16's 65504: the block's zero cannot be stored)
        for impl in (write.WRITER_TORCH, decode_c.WRITER_C):
            layer = random_storage_layer(cfg, len(lengths), 2, seed=5)
            layer.seq_lens.copy_(torch.tensor(lengths))
            before = {name: t.clone() for name, t in layer.tensors().items()}
            with pytest.raises(ValueError, match="overflow scale_dtype"):
                write.append_tokens(layer, huge, v, rows, rows, [1] * len(rows), quant, keep_undo=False,
                                    writer=impl)
            assert all(torch.equal(t.view(torch.uint8), before[n].view(torch.uint8))
                       for n, t in layer.tensors().items())


@pytest.mark.parametrize("bits, window_dtype, scale_dtype, residual, x_dtype", [
    (4, torch.bfloat16, torch.float16, 0, torch.float32), (8, torch.float16, torch.bfloat16, 3, torch.bfloat16),
    (4, torch.float32, torch.float32, 5, torch.float32)])
def test_chunk_write_in_c_gives_the_bits_of_the_reference(bits, window_dtype, scale_dtype, residual, x_dtype):
    """A packed step of chunks (rows out of order, some crossing the sinks, completing several blocks, skipping
    blocks that leave the window, wrapping the float ring; one row idle): ``decode_c.WRITER_C`` (a block's newer
    tokens a run of the step's) leaves every storage tensor and length bit for bit as ``write.WRITER_TORCH``; a
    block whose scale overflows fp16 is refused by both, with nothing written."""
    from qsinkkv import quant, write
    cfg = CacheConfig(sink_tokens=3, recent_tokens=21, bits=bits, block_size=4, value_group_size=4,
                      residual_tokens=residual, window_dtype=window_dtype, scale_dtype=scale_dtype)
    held = [0, 2, 9, 30, 17, 3, 40, 11]
    rows, lens = (6, 0, 3, 1, 7, 2, 4), (5, 9, 1, 40, 7, 3, 0)   # row 5 gets none
    starts = [sum(lens[:i]) for i in range(len(rows))]
    layout = random_storage_layer(cfg, 1, 2).layout
    p = write.plan(layout, tuple(held[b] for b in rows), lens, tuple(starts), rows)
    assert len(p.full_at) >= 6 and len(p.sink_at) >= 4 and (p.full_from > p.full_block * 4).any()
    g = torch.Generator().manual_seed(bits + residual)
    k, v = (torch.randn(sum(lens), 2, D, generator=g).mul(3).to(x_dtype) for _ in range(2))

    def write_with(impl, k):
        layer = random_storage_layer(cfg, len(held), 2, seed=5)
        layer.seq_lens.copy_(torch.tensor(held))
        before = {name: t.clone() for name, t in layer.tensors().items()}
        try:
            with trace.recording() as ran:
                write.append_tokens(layer, k, v, rows, starts, lens, quant, keep_undo=False, writer=impl)
            assert {kernel for op, kernel in ran if op.startswith("write")} == {impl.kernel}, ran
        except ValueError as e:
            assert "overflow scale_dtype" in str(e)
            for name, t in layer.tensors().items():
                assert torch.equal(t.view(torch.uint8), before[name].view(torch.uint8)), name
            assert torch.equal(layer.seq_lens, torch.tensor(held))
            return None
        return layer

    ref, fast = (write_with(impl, k) for impl in (write.WRITER_TORCH, decode_c.WRITER_C))
    for name, t in ref.tensors().items():
        assert torch.equal(t.view(torch.uint8), fast.tensors()[name].view(torch.uint8)), name
    assert torch.equal(ref.seq_lens, fast.seq_lens) and ref.seq_lens.tolist() == [
        n + (lens[rows.index(b)] if b in rows else 0) for b, n in enumerate(held)]
    if scale_dtype == torch.float16:  # 1e5 overflows an fp16 scale: refused, nothing written
        huge = k.clone()
        huge[p.full_at[-1], 0, 0] = -1e5
        assert write_with(write.WRITER_TORCH, huge) is None and write_with(decode_c.WRITER_C, huge) is None


def _near_ties(groups: int, size: int, qmax: int, scale_dtype, g) -> torch.Tensor:
    """``[groups, size]`` float32: each group's element 0 its min (0) and element 1 its max, so that its stored scale
    is known; the others within 2 ulps of a half-way point (k + 1/2) * scale, where a code rounds one way or the
    other on the last bit of the quotient."""
    hi = torch.rand(groups, generator=g) * 4 + 0.5
    scale = (hi / qmax).to(scale_dtype).double()  # (quant.py's: (max - min) / qmax, rounded to the scale dtype)
    k = torch.randint(0, qmax, (groups, size), generator=g).double()
    x = ((k + 0.5) * scale.unsqueeze(1)).float()
    nudge = torch.randint(-2, 3, x.shape, generator=g)
    for step in range(2):
        x = torch.where(nudge > step, torch.nextafter(x, torch.tensor(math.inf)), x)
        x = torch.where(nudge < -step, torch.nextafter(x, torch.tensor(-math.inf)), x)
    x[:, 0], x[:, 1] = 0.0, hi
    return x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_codes_near_half_way_give_the_bits_of_the_reference(bits, scale_dtype):
    """The C block quantization rounds by a product with the scale's inverse and divides only where that could
    round another way: over keys and values built to sit within 2 ulps of a code's half-way point (where the
    product alone gives other codes than ``quant.py``'s division: asserted), ``decode_c.WRITER_C`` writes every
    storage tensor bit for bit as ``write.WRITER_TORCH``."""
    from qsinkkv import quant, write
    S, bs, Hkv, group, nblk, B = 2, 8, 2, 8, 6, 3
    cfg = CacheConfig(sink_tokens=S, recent_tokens=bs * nblk * 2, bits=bits, block_size=bs, value_group_size=group,
                      window_dtype=torch.float32, scale_dtype=scale_dtype)
    qmax, g = 2 ** bits - 1, torch.Generator().manual_seed(bits)
    per_row = S + nblk * bs
    key_groups = _near_ties(B * nblk * Hkv * D, bs, qmax, scale_dtype, g)          # a group: a block's channel
    value_groups = _near_ties(B * nblk * bs * Hkv * D // group, group, qmax, scale_dtype, g)  # a token's group
    for x in (key_groups, value_groups):  # the hazard is there: the product's codes are not all the division's
        scale = (x[:, 1:2] / qmax).to(scale_dtype).float()
        assert (torch.floor(x / scale + 0.5) != torch.floor(x * (1 / scale) + 0.5)).any()
    keys = key_groups.view(B, nblk, Hkv, D, bs).permute(0, 1, 4, 2, 3).reshape(B, nblk * bs, Hkv, D)
    values = value_groups.view(B, nblk * bs, Hkv, D)
    sinks = torch.randn(B, S, Hkv, D, generator=g)
    k, v = (torch.cat([sinks, x], 1).reshape(B * per_row, Hkv, D) for x in (keys, values))
    rows, starts, lens = tuple(range(B)), [b * per_row for b in range(B)], [per_row] * B
    written = []
    for impl in (write.WRITER_TORCH, decode_c.WRITER_C):
        layer = random_storage_layer(cfg, B, Hkv, seed=5)
        layer.seq_lens.zero_()
        with trace.recording() as ran:
            write.append_tokens(layer, k, v, rows, starts, lens, quant, keep_undo=False, writer=impl)
        assert {kernel for op, kernel in ran if op.startswith("write")} == {impl.kernel}, ran
        written.append(layer)
    ref, fast = written
    for name, t in ref.tensors().items():
        assert torch.equal(t.view(torch.uint8), fast.tensors()[name].view(torch.uint8)), name
    assert ref.seq_lens.tolist() == [per_row] * B


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_value_peaks_in_c_equal_the_reference(dtype):
    """``decode_c.peaks_c`` (the value checks' max |x| on the values' bits) gives ``checks.peaks_torch``'s answer on
    every layout it reads -- a fused qkv row's column slices (rows any stride apart), a tensor it must copy, a flat
    one, an empty one -- with NaN (anywhere: NaN), +-inf, the dtype's largest finite value and signed zeros among
    fresh random values; and the C backend's ops take it (``Ops.peaks``), recorded as the value checks' kernel."""
    from qsinkkv import checks
    from qsinkkv.ops import select_ops
    g = torch.Generator().manual_seed(11)
    top = torch.finfo(dtype).max
    for special in [None, math.nan, math.inf, -math.inf, top, -top, -0.0]:
        qkv = torch.randn(37, (6 + 2 * 2) * 16, generator=g).mul(5).to(dtype)
        if special is not None:
            at = torch.randint(0, qkv.numel(), (1,), generator=g).item()
            qkv.view(-1)[at] = special
        q, k, v = qkv[:, :96].view(37, 6, 16), qkv[:, 96:128].view(37, 2, 16), qkv[:, 128:].view(37, 2, 16)
        xs = [qkv, q, k, v, qkv[:, 3:9], qkv.t(), qkv.flatten(), qkv[:0], -qkv]
        with trace.recording() as ran:
            fast = decode_c.peaks_c(xs)
        assert ("value_checks", "c") in ran and ("value_checks", "torch") not in ran
        expect = checks.peaks_torch(xs)
        for x, a, b in zip(xs, fast, expect):
            assert (math.isnan(a) and math.isnan(b)) or a == b, (special, list(x.shape), a, b)
    assert select_ops("c", torch.device("cpu"), 16, None).peaks is decode_c.peaks_c
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        decode_c.peaks_c([torch.ones(3, dtype=torch.int32)])


def test_threads_do_not_change_the_bits(monkeypatch):
    """The (KV head, sequence) units split over threads: each unit's arithmetic is the same."""
    monkeypatch.setattr(decode_c, "THREAD_WORK", 1)  # threads for any work
    cfg = CacheConfig(sink_tokens=4, recent_tokens=300, bits=4, block_size=16, value_group_size=8)
    layer = random_storage_layer(cfg, 3, 4, seed=3)
    layer.seq_lens.copy_(torch.tensor([310, 150, 900]))
    q = torch.randn(3, 8, D)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(decode_c.decode_attention_c(q, layer))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert rel_rms(outs[0], decode_attention_reference(q, layer)) < 1e-5


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_reads_a_paged_pool_through_its_tables(bits):
    """A pool whose blocks are scattered (sequences admitted and released in between): the C decode
    reads each sequence's blocks through the tables, as the reference does."""
    pool, draw = scattered_pool(bits, "c")
    layer = pool.layers[0]
    assert pool.backend == "c"
    q = draw(3, 1)[0][:, :, 0]
    out = decode_c.decode_attention_c(q, layer)
    assert rel_rms(out, decode_attention_reference(q, layer)) < 1e-5
    for b in range(3):
        assert torch.equal(decode_c.decode_attention_c(q[b:b + 1], layer.rows(b)), out[b:b + 1])


def test_backend_choice_and_refusals(monkeypatch, tmp_path):
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=2)
    assert SinkQuantCache(cfg, 1, 1, 1, D).backend == "c"  # auto on the CPU
    assert SinkQuantCache(cfg, 1, 1, 1, D, backend="torch").backend == "torch"
    with pytest.raises(ValueError, match="backend='c' decodes absolute positions"):
        SinkQuantCache(CacheConfig(value_group_size=8, positions="cache_index"), 1, 1, 1, D, backend="c",
                       rotary=Rotary.from_schedule(D, base=100.0))
    with pytest.raises(ValueError, match="backend='c' needs head_dim <= 512, got head_dim=520"):
        SinkQuantCache(cfg, 1, 1, 1, 520, backend="c")
    # a machine whose compiler fails: auto falls back to torch, "c" says why
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("QSINKKV_CACHE", str(tmp_path))
    monkeypatch.delenv("QSINKKV_MARCH", raising=False)  # (the default target: native, then the compiler's own)
    with pytest.raises(RuntimeError, match="false -O3 -march=native .* failed: .*; false -O3 -fopenmp-simd .* failed"):
        decode_c._load()
    monkeypatch.setattr(decode_c, "_lib", None)
    monkeypatch.setattr(decode_c, "_why_not", "RuntimeError: false failed")
    assert SinkQuantCache(cfg, 1, 1, 1, D).backend == "torch"
    with pytest.raises(ValueError, match=r"backend='c' could not build its C library \(RuntimeError: false failed\)"):
        SinkQuantCache(cfg, 1, 1, 1, D, backend="c")
    monkeypatch.setenv("QSINKKV_C", "0")
    with pytest.raises(RuntimeError, match="turned off by QSINKKV_C=0"):
        decode_c._load()


@pytest.mark.slow
def test_a_corrupt_cached_library_is_rebuilt(monkeypatch, tmp_path):
    """An empty or truncated cached .so made available() say "file too short" for good."""
    # each load in its own process, as in life (truncating a library this process has mapped would crash it)
    env = dict(os.environ, QSINKKV_CACHE=str(tmp_path))
    load = [sys.executable, "-c", "from qsinkkv import decode_c; print(decode_c.available())"]
    assert "(True," in subprocess.run(load, env=env, capture_output=True, text=True, check=True).stdout
    (lib,) = tmp_path.glob("decode_c-*.so")
    good = lib.read_bytes()
    for broken in (b"", good[:100]):
        lib.write_bytes(broken)
        run = subprocess.run(load, env=env, capture_output=True, text=True, check=True)
        assert "(True," in run.stdout and lib.stat().st_size == len(good), run.stdout + run.stderr


def _mirror(struct, swap=None, retype=None):
    """``struct``'s ctypes mirror with two fields swapped or one field's type changed (the same total size)."""
    fields = list(struct._fields_)
    if swap:
        i, j = (next(n for n, (name, _) in enumerate(fields) if name == f) for f in swap)
        fields[i], fields[j] = fields[j], fields[i]
    if retype:
        name, ctype = retype
        fields = [(n, ctype if n == name else t) for n, t in fields]
    return type(struct.__name__, (ctypes.Structure,), {"_fields_": fields})


@pytest.mark.parametrize("struct,change", [
    ("_Args", dict(swap=("B", "G"))),                        # two int64s: the same size, the struct loads
    ("_Args", dict(swap=("sink_table", "float_table"))),      # two pointers
    ("_Store", dict(swap=("table_st0", "table_st1"))),
    ("_Complete", dict(swap=("seqs", "blocks"))),
    ("_Store", dict(retype=("x_dtype", ctypes.c_void_p))),    # an int64 read as a pointer (same size on 64-bit)
], ids=["args-ints", "args-tables", "store-strides", "complete-pointers", "store-retyped"])
def test_every_field_of_the_c_structs_is_checked_at_load(monkeypatch, struct, change):
    """The ctypes mirrors of decode_c.c's structs are compared field by field (name, offset, size) with the
    library's own table (``qsinkkv_field``) when it is opened: a mirror with two same-sized fields swapped had the
    same ``sizeof``, which was all that was checked, and would have passed one field's value as the other."""
    lib = decode_c._lib._name if decode_c._lib is not None else decode_c._load()._name
    decode_c._open(lib)  # as it stands: every field agrees
    mirror = _mirror(getattr(decode_c, struct), **change)
    assert ctypes.sizeof(mirror) == ctypes.sizeof(getattr(decode_c, struct))
    monkeypatch.setattr(decode_c, struct, mirror)
    with pytest.raises(decode_c._StaleLibrary, match=f"decode_c.c's {struct[1:]} and decode_c.py's {struct} disagree"):
        decode_c._open(lib)


@pytest.mark.parametrize("change", ["renumbered", "missing", "extra"])
def test_the_return_codes_are_one_table_in_c_and_python(monkeypatch, change):
    """``decode_c.Status`` is compared, name by name and value by value, with the library's own table
    (``qsinkkv_status``) when it is opened: a code renumbered, missing or added on one side refuses the library."""
    import enum
    lib = decode_c._lib._name if decode_c._lib is not None else decode_c._load()._name
    decode_c._open(lib)  # as it stands: the same table
    members = {s.name: s.value for s in decode_c.Status}
    if change == "renumbered":
        members["PAST_POOL"], members["OUT_OF_RANGE"] = members["OUT_OF_RANGE"], members["PAST_POOL"]
    elif change == "missing":
        del members["NO_SINK_PAGE"]
    else:
        members["SOMETHING_NEW"] = -99
    monkeypatch.setattr(decode_c, "Status", enum.IntEnum("Status", members))
    with pytest.raises(decode_c._StaleLibrary, match="return codes and decode_c.py's Status disagree"):
        decode_c._open(lib)


def _target_isa(march: str) -> str:
    """The instruction set the compiler's target ``-march=march`` gives decode_c.c's paths, from its own macros."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    macros = subprocess.run([*cc, f"-march={march}", "-dM", "-E", "-"], input="", capture_output=True,
                            text=True).stdout
    for isa, macro in (("avx512", "__AVX512F__"), ("avx2", "__AVX2__"), ("avx", "__AVX__")):
        if f"#define {macro} " in macros:
            return isa
    return "scalar"


def test_the_library_reports_the_instruction_set_its_build_targets():
    """``decode_c.isa()`` is the instruction set of the target the library was built for (``QSINKKV_MARCH``, default
    native), as the compiler's own macros for that target say: the ISA matrix (``make test-isa``) runs the C tests
    against a scalar, an AVX2 and the native build, each asserted to be what it claims."""
    decode_c._require_lib()
    assert decode_c.isa() == _target_isa(os.environ.get("QSINKKV_MARCH") or "native")
    assert decode_c.isa() in ("avx512", "avx2", "avx", "scalar")


def test_a_named_target_the_compiler_refuses_is_never_dropped(monkeypatch, tmp_path):
    """A build for ``QSINKKV_MARCH`` that fails stops, naming the target: the library never silently becomes another
    instruction set's (only the default, native, falls back to the compiler's own target)."""
    monkeypatch.setenv("QSINKKV_CACHE", str(tmp_path))
    monkeypatch.setenv("QSINKKV_MARCH", "no-such-cpu")
    with pytest.raises(RuntimeError, match=r"-march=no-such-cpu .* failed") as refused:
        decode_c._load()
    assert "; " not in str(refused.value)  # (one attempt: no fallback build)


@pytest.mark.parametrize("cc", ["cc -O2", "env cc"])
def test_cc_with_arguments_is_split_as_a_shell_would(monkeypatch, tmp_path, cc):
    """CC='gcc -O2' (or 'ccache gcc') was taken as one program name."""
    monkeypatch.setenv("QSINKKV_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", cc)
    assert decode_c._load().qsinkkv_args_size() > 0


def test_auto_warns_when_it_falls_back_for_a_reason_but_no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("QSINKKV_CACHE", str(tmp_path))
    for cc, warns in (("false", True), ("/no/such/compiler", False)):
        monkeypatch.setenv("CC", cc)
        monkeypatch.setattr(decode_c, "_lib", None)
        monkeypatch.setattr(decode_c, "_why_not", None)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            ok, why = decode_c.available()
        assert not ok
        assert any("C decode is unavailable" in str(w.message) for w in seen) == warns, (cc, why)
        if not warns:
            assert why.startswith("NoCompiler: no C compiler: '/no/such/compiler' not found")


@pytest.mark.parametrize("learned_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 3), (1, 5)])
def test_decode_blocks_over_engine_pages_matches_float64(dtype, heads, learned_sinks):
    """``decode_blocks_c`` (bits=16 over vLLM's own pages): each row reads the blocks its table names, in an
    engine's block-major layout (a block's keys then its values per head), and sees the slots its bias leaves
    at 0; against the float64 softmax over exactly those slots (with learned sink logits: one more logit per head
    whose value is zero; -inf: none), and a row alone gives the same bits. NaN or +inf logits are refused by name."""
    Hkv, G = heads
    bs, nblocks, B, nb, Dh = 4, 20, 5, 4, 24
    g = torch.Generator().manual_seed(Hkv * 10 + G)
    pages = torch.randn(nblocks, Hkv, 2 * bs, Dh, generator=g).to(dtype)           # vLLM: [blocks, Hkv, 2 bs, D]
    k_pool, v_pool = (x.transpose(0, 1) for x in pages.chunk(2, dim=2))            # [Hkv, blocks, bs, D] views
    table = torch.stack([torch.randperm(nblocks, generator=g)[:nb] for _ in range(B)])
    table[1, 2] = -1                                                                # a slot with no block
    seen = torch.rand(B, nb * bs, generator=g) < 0.6
    seen[:, 0] = True
    seen[1, 2 * bs:3 * bs] = False
    bias = torch.zeros(B, nb * bs).masked_fill_(~seen, float("-inf"))
    q = torch.randn(B, Hkv * G, Dh, generator=g).to(dtype)
    logits = None
    if learned_sinks:
        logits = torch.randn(Hkv * G, generator=g) + 2   # (large enough to take much of the mass)
        logits[-1] = float("-inf")
    out = decode_c.decode_blocks_c(q, k_pool, v_pool, table, bias, scale=0.3, sink_logits=logits)
    assert out.dtype == dtype and out.shape == q.shape
    for b in range(B):
        blocks = table[b].clamp(min=0)
        k = k_pool[:, blocks].reshape(Hkv, nb * bs, Dh).double()
        v = v_pool[:, blocks].reshape(Hkv, nb * bs, Dh).double()
        qb = q[b].double().view(Hkv, G, Dh)
        scores = (qb @ k.mT * 0.3).masked_fill(~seen[b], float("-inf"))
        if learned_sinks:  # the sink's value is zero: its mass leaves the output
            scores = torch.cat((scores, logits.double().view(Hkv, G, 1)), dim=-1)
            v = torch.cat((v, v.new_zeros(Hkv, 1, Dh)), dim=1)
        p = torch.softmax(scores, dim=-1)
        expect = (p @ v).reshape(Hkv * G, Dh)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[b].double(), expect, rtol=tol, atol=tol)
        alone = decode_c.decode_blocks_c(q[b:b + 1], k_pool, v_pool, table[b:b + 1], bias[b:b + 1], scale=0.3,
                                         sink_logits=logits)
        assert torch.equal(alone[0], out[b])
    with pytest.raises(ValueError, match="bias must be float32"):
        decode_c.decode_blocks_c(q, k_pool, v_pool, table, bias[:, 1:], scale=0.3)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sink_logits must be free of NaN"):
            decode_c.decode_blocks_c(q, k_pool, v_pool, table, bias, scale=0.3,
                                     sink_logits=torch.full((Hkv * G,), bad))
    with pytest.raises(ValueError, match=rf"sink_logits must be a float tensor of shape \[H={Hkv * G}\]"):
        decode_c.decode_blocks_c(q, k_pool, v_pool, table, bias, scale=0.3, sink_logits=torch.zeros(Hkv * G + 1))


def test_blocks_decode_prepared_once_serves_every_layer():
    """``BlocksDecode`` keeps the first layer's C struct for the later layers of a step (only the pointers change):
    each layer's output equals a fresh ``decode_blocks_c`` over that layer's pages, also after a layer whose
    pages lie otherwise (a copy, not kept) and with ``out`` given; a q of another batch is refused by name."""
    Hkv, G, bs, nblocks, B, nb, Dh = 3, 3, 8, 12, 4, 3, 32
    g = torch.Generator().manual_seed(7)
    table = torch.stack([torch.randperm(nblocks, generator=g)[:nb] for _ in range(B)])
    seen = torch.rand(B, nb * bs, generator=g) < 0.7
    seen[:, 0] = True
    bias = torch.zeros(B, nb * bs).masked_fill_(~seen, float("-inf"))
    step = decode_c.BlocksDecode(table, bias)
    for layer in range(4):
        pages = torch.randn(nblocks, Hkv, 2 * bs, Dh, generator=g).to(torch.bfloat16)
        k_pool, v_pool = (x.transpose(0, 1) for x in pages.chunk(2, dim=2))
        if layer == 2:  # pools whose blocks are not contiguous: read through a copy
            k_pool, v_pool = (x.transpose(2, 3).contiguous().transpose(2, 3) for x in (k_pool, v_pool))
        q = torch.randn(B, Hkv * G, Dh, generator=g).to(torch.bfloat16)
        expect = decode_c.decode_blocks_c(q, k_pool, v_pool, table, bias, scale=0.2)
        out = torch.empty_like(q) if layer == 3 else None
        got = step.run(q, k_pool, v_pool, scale=0.2, out=out)
        assert torch.equal(got, expect)
        assert out is None or got is out
    with pytest.raises(ValueError, match=r"q must be \[B=4"):
        step.run(q[:2], k_pool, v_pool, scale=0.2)


# --- a table is input: every entry point checks it against its pool --------------------------

def test_tables_past_the_pool_are_refused_by_name_before_any_access():
    """The probe's tables: ``decode_blocks_c`` with a block far past its 4 blocks (SEGV before), float64 pools (a bare
    KeyError before); the C decode over a storage whose quantized table names a block past its pool; the C row
    write with a table past its pool, or naming no block (-1) for a row it writes. Each raises a ValueError naming
    the table (or the pools), and writes nothing."""
    g = torch.Generator().manual_seed(41)
    Hkv, G, bs, Dh = 2, 2, 4, 16
    pools = torch.randn(Hkv, 4, bs, Dh, generator=g)
    q, bias = torch.randn(1, Hkv * G, Dh, generator=g), torch.zeros(1, 2 * bs)
    with pytest.raises(ValueError, match=r"block_table must name blocks of k_pool and v_pool in \[0, 4\).*1000000"):
        decode_c.decode_blocks_c(q, pools, pools, torch.tensor([[0, 1000000]]), bias, scale=0.5)
    with pytest.raises(ValueError, match=r"block_table must name .*-7"):
        decode_c.decode_blocks_c(q, pools, pools, torch.tensor([[0, -7]]), bias, scale=0.5)
    with pytest.raises(ValueError, match="k_pool, v_pool must be float32, bfloat16 or float16"):
        decode_c.decode_blocks_c(q.double(), pools.double(), pools.double(), torch.tensor([[0, 1]]), bias, scale=0.5)

    pool, draw = scattered_pool(4, "c")
    layer = pool.layers[0]
    layer.quant_table[1, 0] = layer.key_codes.shape[1]            # one past the pool
    with pytest.raises(ValueError, match=r"quant_table must name blocks of its pool"):
        decode_c.decode_attention_c(draw(3, 1)[0][:, :, 0], layer)

    table = torch.tensor([[0, 1], [2, 9]])
    k, v = torch.randn(2, Hkv, Dh, generator=g), torch.randn(2, Hkv, Dh, generator=g)
    pool_k, pool_v = torch.zeros(Hkv, 4, bs, Dh), torch.zeros(Hkv, 4, bs, Dh)
    index = [torch.tensor(x) for x in ([0, 1], [0, 1], [1, 6])]
    with pytest.raises(ValueError, match=r"table must name blocks of pool_k and pool_v .* in \[0, 4\); got \[9\]"):
        decode_c.store_rows_c(pool_k, pool_v, table, k, v, *index, bs)
    table[1, 1] = -1                                               # row 1's ring row 6 is in its block 1: none
    with pytest.raises(ValueError, match=r"table must name blocks of pool_k and pool_v .*; got \[-1\]"):
        decode_c.store_rows_c(pool_k, pool_v, table, k, v, *index, bs)
    assert not pool_k.any() and not pool_v.any()


def test_a_table_rewritten_in_place_without_a_new_version_is_checked_again():
    """A write through numpy leaves a tensor's version counter as it was: a check memoized per version (as the C
    entry points once kept one) would let the C decode read through a table naming a block past its pool."""
    pool, draw = scattered_pool(4, "c")
    layer = pool.layers[0]
    q = draw(3, 1)[0][:, :, 0]
    decode_c.decode_attention_c(q, layer)  # checked once, as it stands
    version = layer.quant_table._version
    layer.quant_table.numpy()[0, 0] = layer.key_codes.shape[1] + 999
    assert layer.quant_table._version == version
    with pytest.raises(ValueError, match=r"quant_table must name blocks of its pool"):
        decode_c.decode_attention_c(q, layer)


def test_tables_made_under_inference_mode_are_checked_too():
    """An engine runs under ``torch.inference_mode``, whose tensors carry no version counter: the table check
    serves such tables as well (it once kept a check per version and had to tell them apart)."""
    pool, draw = scattered_pool(4, "c")
    layer = pool.layers[0]
    q = draw(3, 1)[0][:, :, 0]
    expect = decode_c.decode_attention_c(q, layer)
    with torch.inference_mode():
        from dataclasses import replace
        tables = {n: getattr(layer, n).clone() for n in ("sink_table", "float_table", "quant_table")}
        inferred = replace(layer, **tables)
        assert torch.equal(decode_c.decode_attention_c(q, inferred), expect)
        inferred.quant_table[0, 0] = layer.key_codes.shape[1]
        with pytest.raises(ValueError, match="quant_table must name blocks"):
            decode_c.decode_attention_c(q, inferred)


# --- a kernel refuses what it cannot serve, by name, and never hands the call on -------------------------

def test_the_c_block_completion_refuses_pools_it_would_write_through_a_copy():
    """A quantized pool whose blocks are not contiguous (a transposed view): the C code would write a copy, and the
    pool would keep its old bytes while the lengths advance. Refused by name, nothing written."""
    from qsinkkv import quant, write
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=8, block_size=4, value_group_size=8)
    layer = random_storage_layer(cfg, 1, 2)
    layer.seq_lens.zero_()
    layer.key_codes = layer.key_codes.transpose(2, 3).contiguous().transpose(2, 3)  # blocks [bs, D] column-major
    before = {name: t.clone() for name, t in layer.tensors().items()}
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 2, 12, D, generator=g) for _ in range(2))
    with pytest.raises(ValueError, match="the C writers write the pools in place: key_codes must be"):
        write.append(layer, k, v, [12], quant, decode_c.WRITER_C)
    assert all(torch.equal(t, before[name]) for name, t in layer.tensors().items())
    assert int(layer.seq_lens[0]) == 0


def test_a_scale_overflow_names_the_blocks_values_as_the_reference_does():
    """A sink of 1e9 and a window value of 1e8 past fp16's range: the C writer names the block's 1e8 (the values it
    quantizes), as the PyTorch writer does, not the sink's 1e9."""
    from qsinkkv import quant, write
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=8, block_size=4, value_group_size=8,
                      window_dtype=torch.float32, sink_dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(1, 2, 12, D, generator=g) for _ in range(2))
    k[0, 0, 0, 0], k[0, 0, 3, 1] = 1e9, 1e8
    errors = []
    for writer in (write.WRITER_TORCH, decode_c.WRITER_C):
        layer = random_storage_layer(cfg, 1, 2)
        layer.seq_lens.zero_()
        with pytest.raises(ValueError, match="overflow scale_dtype") as e:
            write.append(layer, k, v, [12], quant, writer)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "up to 1e+08" in errors[0], errors


@pytest.mark.parametrize("bad", ["k and v dtypes", "k shape", "q shape", "device"])
def test_the_engine_step_refuses_tensors_it_cannot_read(bad):
    """The fused C engine step reads q, k and v by pointer: k and v of two dtypes (one ``x_dtype``), a k or q of
    another shape, tensors off the CPU are refused by name before any pointer is taken, nothing written."""
    from qsinkkv.engine_pages import EngineStep, LayerPools, PageLayout, step_tables
    from qsinkkv.layout import WindowLayout
    from qsinkkv.ops import select_ops
    cfg = CacheConfig(sink_tokens=3, recent_tokens=40, bits=4, block_size=8, value_group_size=8)
    layout, pl, Hkv = WindowLayout(cfg), PageLayout.of(cfg, 2, D), 2
    buf = torch.zeros(1 + 2 * (pl.pinned + 3), pl.page_bytes, dtype=torch.uint8)
    table = 1 + torch.arange(2 * (pl.pinned + 3)).view(2, -1)
    ops = select_ops("c", torch.device("cpu"), D, None)
    layer = LayerPools(pl.views(buf))
    g = torch.Generator().manual_seed(3)

    def step(held, lens, q, k, v):
        tables = step_tables(pl, table, held, lens)
        return EngineStep(layout, held, lens, tables).attend(ops, layer, q, k, v)

    step(torch.tensor([0, 0]), torch.tensor([12, 10]), *(torch.randn(22, h, D, generator=g) for h in (4, Hkv, Hkv)))
    q, k, v = (torch.randn(2, h, D, generator=g) for h in (4, Hkv, Hkv))
    if bad == "k and v dtypes":
        v = v.to(torch.bfloat16)
    elif bad == "k shape":
        k = torch.randn(2, Hkv + 1, D, generator=g)
    elif bad == "q shape":
        q = torch.randn(2, 3, D, generator=g)
    else:
        q, k, v = (x.to("meta") for x in (q, k, v))
    before = buf.clone()
    with trace.recording() as ran, pytest.raises(ValueError, match={
            "k and v dtypes": "k and v of one such dtype", "device": "reads CPU tensors"}.get(bad, "must be")):
        step(torch.tensor([12, 10]), torch.tensor([1, 1]), q, k, v)
    assert torch.equal(buf, before) and ran == []


def test_every_pointer_of_a_kept_struct_is_either_set_per_call_or_the_steps_own():
    """A struct kept as a step's template holds pointers only into the step's own tensors; every other pointer field
    is set at each call (``_point`` refuses a call that leaves one out): the two sets split every pointer field."""
    for struct in (decode_c._Args, decode_c._Store, decode_c._Complete):
        per_call, owned = decode_c._PER_CALL[struct], decode_c._STEP_OWNED[struct]
        assert per_call | owned == decode_c._POINTERS[struct] and not per_call & owned, struct.__name__
    with pytest.raises(RuntimeError, match="are not its per-call fields"):
        decode_c._point(decode_c._Complete(), x_k=1)


def test_the_engine_step_refuses_a_plan_that_is_not_a_plain_decode_step():
    """``EngineDecode`` serves a plain decode step of its store's rows (``StepPlan.decoding``): a plan of rows that
    prefill, or start inside the sinks, or of another batch, is refused by name at construction."""
    from qsinkkv import plan
    from qsinkkv.engine_pages import LayerPools, PageLayout, step_tables, storages
    from qsinkkv.layout import WindowLayout
    cfg = CacheConfig(sink_tokens=3, recent_tokens=40, bits=4, block_size=8, value_group_size=8)
    layout, pl = WindowLayout(cfg), PageLayout.of(cfg, 2, D)
    layer = LayerPools(pl.views(torch.zeros(1 + 2 * (pl.pinned + 3), pl.page_bytes, dtype=torch.uint8)))
    table = 1 + torch.arange(2 * (pl.pinned + 3)).view(2, -1)
    held = torch.tensor([12, 10])
    store = storages(layer, layout, step_tables(pl, table, held, torch.tensor([1, 1])), held)[1]
    def refuse(q, k, v):
        raise AssertionError("not reached: nothing runs")

    decode_c.EngineDecode(store, plan.packed(layout, held, [1, 1]), refuse)  # a plain decode step: served
    for step_plan in (plan.packed(layout, held, [1, 2]), plan.packed(layout, torch.tensor([12, 2]), [1, 1]),
                      plan.packed(layout, torch.tensor([12, 10, 9]), [1, 1, 1])):
        with pytest.raises(ValueError, match="serves a plain decode step of the store's 2 rows"):
            decode_c.EngineDecode(store, step_plan, refuse)


# --- NaN stays NaN; every public C entry point checks what it is handed -----------------------------------

def test_a_nan_softmax_stays_nan_and_nothing_visible_stays_0():
    """Defect 1: a float32 window key of 2e38 (accepted: below float32's bound) makes a score overflow; the softmax
    sum is NaN, and the C decode answered exactly 0 for that head ("nothing visible") where the reference answers
    NaN. Now NaN, as the reference; a sequence with no token still reads 0."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=16, block_size=2, window_dtype=torch.float32,
                      sink_dtype=torch.float32)
    layer = random_storage_layer(cfg, 2, 1)
    layer.seq_lens.copy_(torch.tensor([5, 0]))
    layer.float_k[0, 0, 0, 0] = 2e38
    q = torch.full((2, 2, D), 10.0)
    ref, out = decode_attention_reference(q, layer), decode_c.decode_attention_c(q, layer)
    assert torch.isnan(ref[0]).all() and torch.isnan(out[0]).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_sink_logits_are_checked_in_float32():
    """Defect 1 (related): float64 sink logits of 1e300 passed the NaN/inf check made in float64, then became +inf
    in float32 (the C decode answered 0). Refused by name, by the C decode and by the value checks alike."""
    from qsinkkv import checks, step
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=8, block_size=2, value_group_size=8)
    layer = random_storage_layer(cfg, 1, 1)
    layer.seq_lens.fill_(5)
    logits = torch.tensor([1e300, 0.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="sink_logits must be free of NaN and \\+inf"):
        decode_c.decode_attention_c(torch.randn(1, 2, D), layer, sink_logits=logits)
    assert not bool(checks.sink_logits_ok(logits)) and bool(checks.sink_logits_ok(torch.tensor([1e30, -math.inf])))
    k = torch.randn(1, 1, 1, D)
    with pytest.raises(ValueError, match="sink_logits must be free"):
        step.check_values(cfg, torch.tensor([5]), None, k, k, torch.randn(1, 2, 1, D), logits)


def _storage_snapshot(layer):
    return {name: t.clone() for name, t in layer.tensors().items()}


@pytest.mark.parametrize("bad", ["q head_dim smaller", "q head_dim larger", "q more rows", "H not a multiple",
                                 "q not float", "pool head_dim", "codes shape", "table shape"])
def test_the_c_decode_checks_q_and_the_storage_before_reading(bad):
    """Defect 2: ``decode_attention_c`` did not check q against the storage (a smaller head_dim wrote past the
    output buffer, more rows read past the tables, a larger head_dim or H not a multiple of Hkv answered with
    uninitialised memory) nor the storage's own tensors against each other. Each is refused by name before any
    buffer is touched (the sanitizer lane runs this)."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=4, block_size=4, value_group_size=8)
    layer = random_storage_layer(cfg, 2, 2)
    layer.seq_lens.copy_(torch.tensor([9, 13]))
    q = torch.randn(2, 4, D)
    match = "q must be a float"
    if bad == "q head_dim smaller":
        q = q[..., :8].contiguous()
    elif bad == "q head_dim larger":
        q = torch.randn(2, 4, 2 * D)
    elif bad == "q more rows":
        q = torch.randn(5, 4, D)
    elif bad == "H not a multiple":
        q = torch.randn(2, 3, D)
    elif bad == "q not float":
        q = torch.ones(2, 4, D, dtype=torch.int32)
    elif bad == "pool head_dim":
        layer.float_k, match = layer.float_k[..., :8], r"float_k must be .*\[2, blocks, 4, 16\]"
    elif bad == "codes shape":
        layer.key_codes, match = layer.key_codes[..., :4], r"key_codes must be torch.uint8 \[2, blocks, 4, 8\]"
    else:
        layer.quant_table, match = layer.quant_table[:, :1], r"quant_table must be torch.int64 \[2, 3\]"
    before = _storage_snapshot(layer)
    with trace.recording() as ran, pytest.raises(ValueError, match=match):
        decode_c.decode_attention_c(q, layer)
    assert ran == [] and all(torch.equal(t, before[name]) for name, t in layer.tensors().items())


def test_a_row_holding_tokens_with_no_sink_page_is_refused():
    """Defect 2: a ``sink_table`` entry of -1 for a row that holds tokens passed the table check and the C decode
    read sink page -1 (outside the pool). Refused by name; a row with no token and no sink page still reads 0."""
    pool, draw = scattered_pool(4, "c")
    layer = pool.layers[0]
    q = draw(3, 1)[0][:, :, 0]
    layer.sink_table[1] = -1
    with pytest.raises(ValueError, match=r"sink_table names no sink page \(-1\) for rows \[1\]"):
        decode_c.decode_attention_c(q, layer)
    layer.seq_lens[1] = 0
    assert torch.equal(decode_c.decode_attention_c(q, layer)[1], torch.zeros_like(q[1]))


@pytest.mark.parametrize("bad", ["more heads", "fewer heads", "head_dim", "v shape", "token past k", "seq past table",
                                 "ring row past table", "negative ring row", "rows_per_block", "float table",
                                 "index dtype", "index lengths"])
def test_store_rows_c_checks_every_shape_and_index_before_writing(bad):
    """Defect 2: ``store_rows_c`` with k of more heads than the pools wrote past them (heap-buffer-overflow in
    ``convert``), a token index past k, a sequence or ring row past the table read outside them. Each is refused by
    name, nothing written (the sanitizer lane runs this)."""
    Hkv, bs = 2, 4
    pool_k, pool_v = torch.zeros(Hkv, 4, bs, D), torch.zeros(Hkv, 4, bs, D)
    table = torch.tensor([[0, 1], [2, 3]])
    k, v = torch.randn(2, Hkv, D), torch.randn(2, Hkv, D)
    at, seqs, rows, rpb = torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([1, 6]), bs
    match = "must"
    if bad == "more heads":
        k = v = torch.randn(2, Hkv + 2, D)
    elif bad == "fewer heads":
        k = v = torch.randn(2, 1, D)
    elif bad == "head_dim":
        k = v = torch.randn(2, Hkv, 8)
    elif bad == "v shape":
        v = torch.randn(3, Hkv, D)
    elif bad == "token past k":
        at, match = torch.tensor([0, 2]), r"at must lie in \[0, 2\) \(k's tokens\), got \[2\]"
    elif bad == "seq past table":
        seqs, match = torch.tensor([0, 2]), r"seqs must lie in \[0, 2\) \(table's rows\), got \[2\]"
    elif bad == "ring row past table":
        rows, match = torch.tensor([1, 8]), r"ring_rows // rows_per_block must lie in \[0, 2\).*got \[2\]"
    elif bad == "negative ring row":
        rows, match = torch.tensor([-1, 6]), r"ring_rows // rows_per_block must lie"
    elif bad == "rows_per_block":
        rpb, match = bs + 1, r"rows_per_block must be an int in \[1, 4\]"
    elif bad == "float table":
        table, match = table.float() + 0.7, "table must be an int64"
    elif bad == "index dtype":
        at = at.int()
    else:
        seqs = torch.tensor([0])
    with pytest.raises(ValueError, match=match):
        decode_c.store_rows_c(pool_k, pool_v, table, k, v, at, seqs, rows, rpb)
    assert not pool_k.any() and not pool_v.any()


@pytest.mark.parametrize("bad", ["k heads", "seq past batch", "token past k", "negative block", "index lengths"])
def test_complete_blocks_c_checks_every_shape_and_index_before_writing(bad):
    """The C block completion, another public entry point that writes pools by pointer: k of another head count, a
    sequence past the batch, a token past k, a negative block, index tensors of two lengths: each refused by name,
    nothing written."""
    from qsinkkv import quant
    cfg = CacheConfig(sink_tokens=0, recent_tokens=8, bits=8, block_size=4, value_group_size=8)
    layer = random_storage_layer(cfg, 1, 2)
    layer.seq_lens.zero_()
    k, v = torch.randn(4, 2, D), torch.randn(4, 2, D)
    at, seqs, blocks, first_new = (torch.tensor([x]) for x in (0, 0, 0, 0))
    match = "must"
    if bad == "k heads":
        k = v = torch.randn(4, 3, D)
    elif bad == "seq past batch":
        seqs, match = torch.tensor([1]), r"seqs must lie in \[0, 1\)"
    elif bad == "token past k":
        at, match = torch.tensor([1]), r"at must name the tokens of k \(N=4\)"
    elif bad == "negative block":
        blocks, first_new, match = torch.tensor([-1]), torch.tensor([-4]), "blocks must lie in"
    else:
        first_new = torch.tensor([0, 0])
    before = _storage_snapshot(layer)
    with pytest.raises(ValueError, match=match):
        decode_c.complete_blocks_c(layer, k, v, at, seqs, blocks, first_new, quant)
    assert all(torch.equal(t, before[name]) for name, t in layer.tensors().items())


@pytest.mark.parametrize("table", [torch.tensor([[0.7, 1.0]]), torch.tensor([[0, 1]], dtype=torch.int16),
                                   torch.tensor([0, 1])])
def test_decode_blocks_c_refuses_tables_as_the_torch_decode_does(table):
    """Defect 7: ``decode_blocks_c`` read a float or int16 table through ``.long()`` (0.7 became block 0) where
    ``decode_blocks_torch`` refuses it, and a 1-D table failed with "not enough values to unpack"."""
    from qsinkkv.decode import decode_blocks_torch
    pools, q, bias = torch.randn(2, 4, 4, D), torch.randn(1, 4, D), torch.zeros(1, 8)
    with pytest.raises(ValueError, match="block_table must be"):
        decode_c.decode_blocks_c(q, pools, pools, table, bias, scale=0.5)
    if table.dim() == 2:
        with pytest.raises(ValueError, match="block_table must be"):
            decode_blocks_torch(q, pools, pools, table, bias, scale=0.5)


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_groups_store_the_same_zero_bits_in_every_quantizer(bits):
    """Defect 8: a group of equal zeros (signs mixed, or all -0.0) gave key_zero/value_zero (and scales) of +0.0 in
    one quantizer and -0.0 in another: numerically equal, but the same bits is the contract. Every quantizer
    stores +0 (quant.py's rule), checked bit for bit over the torch, C and Triton writers."""
    from qsinkkv import SinkQuantCache
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=bits, block_size=4, value_group_size=8)
    g = torch.Generator().manual_seed(bits)
    k, v = torch.randn(1, 2, 14, D, generator=g), torch.randn(1, 2, 14, D, generator=g)
    signs = torch.where(torch.rand(1, 2, 12, D, generator=g) < 0.5, -0.0, 0.0)
    k[..., 2:, :5], v[..., 2:, :8] = signs[..., :5], signs[..., :8]  # whole key channels, whole value groups
    k[..., 6:10, 7], v[..., 7, 8:] = -0.0, -0.0
    stored = {}
    for backend in ("torch", "c", "triton"):
        cache = SinkQuantCache(cfg, 1, 1, 2, D, dtype=torch.float32, backend=backend)
        cache.append(0, k, v)
        layer = cache.layers[0]
        stored[backend] = [getattr(layer, n).view(torch.int16 if getattr(layer, n).element_size() == 2 else torch.int32)
                           for n in ("key_scale", "key_zero", "value_scale", "value_zero")]
    for backend in ("c", "triton"):
        assert all(torch.equal(a, b) for a, b in zip(stored["torch"], stored[backend])), backend
    assert not (stored["torch"][1] == torch.tensor(-0.0).to(torch.bfloat16).view(torch.int16)).any()
