"""The block managers alone, with no layer and no K/V: a paged manager holds exactly what the lengths need
after every call, takes all or nothing, never shares or leaks a block, and gives back what a kept row set
drops; the dense one is the identity. ``step_metadata`` says where each new token lands."""
import random

import pytest
import torch

from qsinkkv import CacheConfig
from qsinkkv.blocks import DenseBlocks, PagedBlocks, PoolExhausted, needed_blocks, step_metadata
from qsinkkv.layout import WindowLayout

LAYOUT = WindowLayout(CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4))


def check(blocks: PagedBlocks, lengths: list[int]) -> None:
    """Held == needed by ``lengths``; each block held once, never also free; held + free == the pool."""
    need = needed_blocks(blocks.layout, lengths)
    for kind in ("float", "quant"):
        table = blocks.host[kind]
        assert blocks.held[kind] == need[kind]
        for b, n in enumerate(need[kind]):  # a prefix of the ring
            assert (table[b, :n] >= 0).all() and (table[b, n:] == -1).all()
    for kind in ("sink", "float", "quant"):
        held = [x for x in blocks.host[kind].flatten().tolist() if x >= 0]
        assert len(set(held)) == len(held), f"a {kind} block is shared"
        assert sorted(held + blocks.free[kind]) == list(range(blocks.sizes[kind])), f"{kind} leaked"
    assert blocks.in_use() == {k: blocks.sizes[k] - len(blocks.free[k]) for k in blocks.sizes}


@pytest.mark.parametrize("seed", range(6))
def test_random_schedule_holds_exactly_what_lengths_need(seed):
    rnd = random.Random(seed)
    blocks = PagedBlocks(LAYOUT, max_seqs=4, float_blocks=6, quant_blocks=14)
    lengths: list[int] = []
    for _ in range(60):
        op = rnd.choice(["add", "keep", "grow", "grow", "grow", "shrink"])
        if op == "add":
            try:
                blocks.add()
                lengths.append(0)
            except PoolExhausted:
                assert blocks.batch_size == 4
        elif op == "keep" and lengths:
            rows = rnd.sample(range(len(lengths)), rnd.randint(0, len(lengths)))
            blocks.keep(rows)
            lengths = [lengths[r] for r in rows]
        elif op in ("grow", "shrink") and lengths:
            step = [max(0, n + (rnd.choice([0, 1, 1, 3, 9]) if op == "grow" else -rnd.randint(0, 3)))
                    for n in lengths]
            before = ({k: v[:] for k, v in blocks.free.items()}, {k: t.clone() for k, t in blocks.host.items()})
            try:
                blocks.hold(step)
                lengths = step
            except PoolExhausted:  # all or nothing
                assert blocks.free == before[0]
                assert all(torch.equal(blocks.host[k], t) for k, t in before[1].items())
        check(blocks, lengths)


def test_a_held_window_stays_bounded_and_refusals_name_the_counts():
    blocks = PagedBlocks(LAYOUT, max_seqs=1, float_blocks=LAYOUT.float_slots, quant_blocks=LAYOUT.quant_slots)
    blocks.add()
    for n in range(1, 200):  # a stream of any length holds at most its rings
        blocks.hold([n])
        check(blocks, [n])
    with pytest.raises(PoolExhausted, match="no free sequence slot: all max_seqs=1"):
        blocks.add()
    small = PagedBlocks(LAYOUT, max_seqs=2, float_blocks=LAYOUT.float_slots, quant_blocks=LAYOUT.quant_slots)
    small.add(), small.add()
    small.hold([40, 0])
    with pytest.raises(PoolExhausted, match=r"more quant blocks \(0 free\)"):
        small.hold([40, 12])
    check(small, [40, 0])
    with pytest.raises(ValueError, match="cannot repeat sequences"):
        small.keep([0, 0])
    check(small, [40, 0])
    with pytest.raises(ValueError, match="quant_blocks must be an int >= 4"):
        PagedBlocks(LAYOUT, max_seqs=1, float_blocks=1, quant_blocks=3)


def test_tables_from_a_manager_and_metadata_slots():
    blocks = PagedBlocks(LAYOUT, max_seqs=2, float_blocks=4, quant_blocks=8)
    blocks.add(), blocks.add()
    blocks.hold([5, 3])
    sink, floats, quants = blocks.tables(torch.device("cpu"))
    assert torch.equal(sink, blocks.host["sink"]) and sink.data_ptr() != blocks.host["sink"].data_ptr()
    meta = step_metadata(LAYOUT, blocks.host, [0, 0], [5, 3])
    assert meta.query_start_loc.tolist() == [0, 5, 8] and meta.seq_lens.tolist() == [5, 3]
    bs, S = LAYOUT.block_size, LAYOUT.sink_tokens
    for i, slot in enumerate(meta.slot_mapping.tolist()):
        b, p = (0, i) if i < 5 else (1, i - 5)
        if p < S:
            assert slot == -1  # to the sink page
        elif slot >= 0:
            r = (p - S) % LAYOUT.float_rows
            assert slot == int(floats[b, r // bs]) * bs + r % bs


def test_dense_blocks_are_the_identity_and_fixed():
    dense = DenseBlocks(LAYOUT, 3)
    sink, floats, quants = dense.tables(torch.device("cpu"))
    assert sink.tolist() == [0, 1, 2]
    assert floats.flatten().tolist() == list(range(3 * LAYOUT.float_slots))
    assert quants.shape == (3, LAYOUT.quant_slots)
    assert dense.hold([100, 0, 7]) is False
    dense.keep([0, 0, 1, 2])  # beam search repeats rows: the storage copies blocks
    assert dense.batch_size == 4
    with pytest.raises(ValueError, match="fixed batch"):
        dense.add()
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        DenseBlocks(LAYOUT, 0)


def test_a_cache_takes_a_manager_built_for_it_only():
    from qsinkkv import SinkQuantCache
    cfg = LAYOUT.config
    blocks = PagedBlocks(LAYOUT, max_seqs=2, float_blocks=4, quant_blocks=8)
    cache = SinkQuantCache(cfg, 2, 0, 2, 8, dtype=torch.float32, blocks=blocks)
    assert cache.batch_size == 0 and cache.layers[0].sink_table is cache.layers[1].sink_table
    other = CacheConfig(sink_tokens=2, recent_tokens=8, bits=8, block_size=2, value_group_size=4)
    with pytest.raises(ValueError, match="blocks must be built for this config with batch_size=0"):
        SinkQuantCache(other, 1, 0, 2, 8, blocks=blocks)
    with pytest.raises(ValueError, match="batch_size=3"):
        SinkQuantCache(cfg, 1, 3, 2, 8, blocks=blocks)
    with pytest.raises(TypeError, match="blocks must be a qsinkkv.blocks"):
        SinkQuantCache(cfg, 1, 1, 2, 8, blocks=object())
