"""The Triton write (kernels/write.py, ``WRITER_TRITON``) under the interpreter: a stream of steps (prompts, decodes,
chunks past the window) written by it and by the reference writer (``write.WRITER_TORCH``; and the C writer where it
compiles) into twin storages -- a cache's own pools and an engine's pages -- leaves every pool byte for byte the
same after every step; a block whose scale overflows is refused by name with nothing written; a table entry
outside its pool (or -1) for a row or block the write follows is refused by every writer alike, nothing written, and
the Triton row kernel itself never follows one."""
import pytest
import torch

from qsinkkv import CacheConfig, decode_c, quant, trace, write
from qsinkkv.engine_pages import LayerPools, PageLayout, step_tables, storages
from qsinkkv.kernels.write import WRITER_TRITON, _launch_store_rows
from qsinkkv.layout import WindowLayout
from qsinkkv.storage import STORAGE_TENSORS, LayerStorage

HKV, D = 2, 16
C_OK = decode_c.available()[0]
# per step, the tokens each of 3 rows brings: prompts, decodes, chunks that complete blocks and pass the window
STEPS = [[5, 9, 1], [1, 1, 1], [7, 2, 13], [1, 1, 1], [1, 0, 1], [30, 1, 4], [1, 1, 1], [2, 17, 1]]

CONFIGS = {
    "int4 bf16": CacheConfig(sink_tokens=3, recent_tokens=20, bits=4, block_size=4, value_group_size=8),
    "int4 residual, group over both halves": CacheConfig(sink_tokens=3, recent_tokens=20, bits=4, block_size=4,
                                                         value_group_size=16, residual_tokens=3),
    "int8 fp16 window, bf16 scales": CacheConfig(sink_tokens=2, recent_tokens=24, bits=8, block_size=8,
                                                 value_group_size=4, window_dtype=torch.float16,
                                                 scale_dtype=torch.bfloat16),
    "int4 float32, block 1": CacheConfig(sink_tokens=1, recent_tokens=9, bits=4, block_size=1, value_group_size=8,
                                         sink_dtype=torch.float32, window_dtype=torch.float32,
                                         scale_dtype=torch.float32),
    "int8 no sinks": CacheConfig(sink_tokens=0, recent_tokens=16, bits=8, block_size=8, value_group_size=16),
}


def _tokens(lens, dtype, g, strided):
    N = sum(lens)
    k, v = (torch.randn(N, HKV, D, generator=g).to(dtype) for _ in range(2))
    if strided:  # rows of a wider tensor (a fused qkv buffer's view)
        wide = torch.randn(N, 3 * HKV, D, generator=g).to(dtype)
        wide[:, :HKV], wide[:, 2 * HKV:] = k, v
        k, v = wide[:, :HKV], wide[:, 2 * HKV:]
    return k, v


def _same_bytes(a: LayerStorage, b: LayerStorage, where: str) -> None:
    for name in STORAGE_TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), f"{where}: {name}"
    assert torch.equal(a.seq_lens, b.seq_lens), where


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_triton_write_equals_the_reference_on_own_pools(name, dtype, strided):
    cfg = CONFIGS[name]
    layout = WindowLayout(cfg)
    twins = {w.kernel: LayerStorage.allocate(layout, 3, HKV, D, torch.device("cpu"))
             for w in (write.WRITER_TORCH, WRITER_TRITON)}
    g = torch.Generator().manual_seed(7)
    completed = 0
    for i, lens in enumerate(STEPS):
        k, v = _tokens(lens, dtype, g, strided)
        starts = torch.tensor([0, *lens]).cumsum(0)[:-1].tolist()
        for writer in (write.WRITER_TORCH, WRITER_TRITON):
            with trace.recording() as ran:
                write.append_tokens(twins[writer.kernel], k, v, range(3), starts, lens, quant, False, writer)
            if writer is WRITER_TRITON:
                assert {kernel for _, kernel in ran} == {"triton"}, ran
                completed += ("write_blocks", "triton") in ran
        _same_bytes(twins["torch"], twins["triton"], f"{name}, step {i}")
    assert completed >= 3


@pytest.mark.parametrize("bits", [4, 8])
def test_the_triton_write_equals_the_reference_and_c_on_engine_pages(bits):
    """An engine's pages (``PageLayout``: every pool a strided view of one uint8 tensor, the float ring in pages of
    ``float_block_rows`` rows): three twin page tensors written by torch, Triton and C from the same tables."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=20, bits=bits, block_size=4, value_group_size=8)
    layout, pages = WindowLayout(cfg), PageLayout.of(cfg, HKV, D)
    writers = [write.WRITER_TORCH, WRITER_TRITON] + ([decode_c.WRITER_C] if C_OK else [])
    num_pages = 64
    g = torch.Generator().manual_seed(bits)
    start = torch.randint(0, 256, (num_pages, pages.page_bytes + 16), dtype=torch.uint8, generator=g)
    start[0] = 0
    bufs = {w.kernel: start.clone() for w in writers}
    # each row its own pages, as an engine hands them out (no page handed back: the tables stay simple)
    per_row = 1 + (num_pages - 1) // 3
    table = 1 + torch.arange(3 * per_row).view(3, per_row)
    held = torch.zeros(3, dtype=torch.long)
    for i, lens in enumerate(STEPS[:6]):
        lens_t = torch.tensor(lens)
        tables = step_tables(pages, table, held, lens_t)
        k, v = _tokens(lens, torch.float32, g, False)
        starts = torch.tensor([0, *lens]).cumsum(0)[:-1].tolist()
        for w in writers:
            layer = LayerPools(pages.views(bufs[w.kernel][:, :pages.page_bytes]))
            _, store = storages(layer, layout, tables, held)
            store.clear((held == 0).nonzero().flatten())
            write.append_tokens(store, k, v, range(3), starts, lens, quant, False, w)
        for w in writers[1:]:
            assert torch.equal(bufs[w.kernel], bufs["torch"]), f"step {i}: {w.kernel}"
        held += lens_t


def test_a_block_whose_scale_overflows_is_refused_with_nothing_written():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=12, bits=4, block_size=4, value_group_size=8)
    store = LayerStorage.allocate(WindowLayout(cfg), 2, HKV, D, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    k, v = _tokens([3, 3], torch.float32, g, False)
    write.append_tokens(store, k, v, range(2), [0, 3], [3, 3], quant, False, WRITER_TRITON)
    before = [getattr(store, n).clone() for n in STORAGE_TENSORS] + [store.seq_lens.clone()]
    k, v = _tokens([4, 4], torch.float32, g, False)
    k[5, 1, 3] = 1e6   # row 1 completes a block this step: its scale (1e6 - min) / 15 is past fp16's range
    with pytest.raises(ValueError, match="overflow scale_dtype=torch.float16"):
        write.append_tokens(store, k, v, range(2), [0, 4], [4, 4], quant, False, WRITER_TRITON)
    after = [getattr(store, n) for n in STORAGE_TENSORS] + [store.seq_lens]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


WRITERS = [write.WRITER_TORCH, WRITER_TRITON] + ([decode_c.WRITER_C] if C_OK else [])


@pytest.mark.parametrize("entry", [4, -1], ids=["past the pool", "no block"])
@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.kernel)
def test_a_row_write_through_a_table_outside_the_pool_is_refused_by_name(writer, entry):
    """``store_rows`` given a table that names, for a row it stores, a block past its 4 blocks or none (-1): every
    writer raises a ValueError naming the entry, with no pool byte written (the reference once wrote -1's row into
    the pool's last block, the Triton kernel dropped the row, the C code refused: now all refuse alike), and says
    which kernel refused (``trace``)."""
    raw = torch.zeros(2, HKV, 5, 4, D)       # block 4: the bytes past pools of 4 blocks
    pool_k, pool_v = raw[0, :, :4], raw[1, :, :4]
    table = torch.tensor([[1, entry, 2]])
    x = torch.randn(3, HKV, D)
    at, seqs, rows = torch.arange(3), torch.zeros(3, dtype=torch.long), torch.tensor([1, 5, 9])
    with trace.recording() as ran, pytest.raises(
            ValueError, match=rf"table must name blocks of pool_k and pool_v .* in \[0, 4\); got \[{entry}\]"):
        writer.store_rows(pool_k, pool_v, table, x, x, at, seqs, rows, 4)
    assert ran == [("write_rows", writer.kernel)], ran
    assert not raw.any()


@pytest.mark.parametrize("table", ["quant_table", "float_table"])
@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.kernel)
def test_a_block_write_through_a_table_outside_the_pool_is_refused_by_name(writer, table):
    """``complete_blocks`` whose completing block's quantized slot names no block, or one of whose older tokens' float
    block does (-1): every writer refuses by name, every pool byte and length as it was."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=12, bits=4, block_size=4, value_group_size=8)
    store = LayerStorage.allocate(WindowLayout(cfg), 2, HKV, D, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    k, v = _tokens([4, 4], torch.float32, g, False)
    write.append_tokens(store, k, v, range(2), [0, 4], [4, 4], quant, False, writer)  # 2 sinks + 2 ring rows each
    if table == "quant_table":
        store.quant_table[1] = -1
    else:
        store.float_table[1] = -1
    before = [getattr(store, n).clone() for n in STORAGE_TENSORS] + [store.seq_lens.clone()]
    k, v = _tokens([3, 3], torch.float32, g, False)   # each row completes its first block: 2 older tokens + 2 new
    with pytest.raises(ValueError, match=rf"{table} must name blocks of the .* pools .*; got \[-1\]"):
        write.append_tokens(store, k, v, range(2), [0, 3], [3, 3], quant, False, writer)
    after = [getattr(store, n) for n in STORAGE_TENSORS] + [store.seq_lens]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def test_the_triton_row_kernel_never_follows_a_table_entry_outside_the_pool():
    """The kernel's own guard, under the refusal (on a GPU the refusal is a device-side assert, raised after the
    launch): given a table that names a block past the pool or none, it writes the rows that name real blocks and
    no byte outside the pool."""
    raw = torch.zeros(2, HKV, 5, 4, D)
    pool_k, pool_v = raw[0, :, :4], raw[1, :, :4]
    table = torch.tensor([[1, 4, -1]])       # blocks 1 (real), 4 (past the pool), -1 (none)
    x = torch.randn(3, HKV, D)
    at, seqs, rows = torch.arange(3), torch.zeros(3, dtype=torch.long), torch.tensor([1, 5, 9])
    _launch_store_rows(pool_k, pool_v, table, x, x, at, seqs, rows, 4)
    assert torch.equal(pool_k[:, 1, 1], x[0].float()) and torch.equal(pool_v[:, 1, 1], x[0].float())
    assert not raw[:, :, 4].any() and int((pool_k != 0).sum()) == int((pool_v != 0).sum()) == HKV * D
