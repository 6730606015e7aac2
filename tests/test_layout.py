"""The visible set (qsinkkv/layout.py: which stored tokens a query sees) is token-exact: what the cache stores and
masks equals the design sheet's definition (``oracle.visible``), for every layout, and per sequence."""
import pytest
import torch
from helpers import make
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import visible

from qsinkkv import CacheConfig, SinkQuantCache
from qsinkkv.layout import token_positions

D = 8


DESIGN_SHEET = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5],
                [0, 1, 3, 4, 5, 6], [0, 1, 4, 5, 6, 7], [0, 1, 5, 6, 7, 8], [0, 1, 6, 7, 8, 9]]


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("residual", [0, 1, 4])
def test_design_sheet_example(bits, block_size, residual):
    cfg = CacheConfig(sink_tokens=2, recent_tokens=4, bits=bits, block_size=block_size, value_group_size=4,
                      residual_tokens=residual)
    cache = make(cfg)
    got = []
    for _ in range(10):
        cache.append(0, torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))
        got.append(cache.visible_positions())
    assert got == DESIGN_SHEET


def test_empty_cache_sees_nothing():
    assert make(CacheConfig(sink_tokens=2, recent_tokens=4, value_group_size=4)).visible_positions() == []


@settings(max_examples=60, deadline=None)
@given(S=st.integers(0, 5), W=st.integers(1, 12), bs=st.integers(1, 6), bits=st.sampled_from([16, 8, 4]),
       r=st.integers(0, 12), chunks=st.lists(st.integers(1, 30), min_size=1, max_size=12))
def test_visible_set_property(S, W, bs, bits, r, chunks):
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=2,
                      residual_tokens=min(r, W))
    cache = make(cfg, D=4)
    n = 0
    for T in chunks:
        cache.append(0, torch.randn(1, 1, T, 4), torch.randn(1, 1, T, 4))
        n += T
        assert cache.visible_positions() == visible(n - 1, S, W)


def test_visible_positions_per_sequence():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=4, bits=16)
    cache = SinkQuantCache(cfg, 1, 2, 1, D, dtype=torch.float32)
    cache.append(0, torch.randn(2, 1, 10, D), torch.randn(2, 1, 10, D), [10, 7])
    assert cache.visible_positions(0, 0) == [0, 1, 6, 7, 8, 9]
    assert cache.visible_positions(0, 1) == [0, 1, 3, 4, 5, 6]
    with pytest.raises(IndexError, match=r"seq must be an int in \[0, 2\)"):
        cache.visible_positions(0, 2)


@pytest.mark.parametrize("S,W,bits,bs", [(2, 6, 4, 2), (0, 5, 8, 1), (3, 8, 16, 4), (1, 7, 4, 3)])
def test_visible_slots_are_the_rule_in_position_order(S, W, bits, bs):
    """``WindowLayout.visible_slots``: the slots a row's newest query sees, sorted by position, read back
    through ``gather`` hold exactly the positions the visible-set rule names, with their own K."""
    from qsinkkv import gather
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=4)
    cache = SinkQuantCache(cfg, 1, 1, 1, 4, dtype=torch.float32)
    for n in range(1, 40):
        cache.append(0, torch.full((1, 1, 1, 4), float(n - 1)), torch.randn(1, 1, 1, 4))
        slots, positions = cache.layout.visible_slots(n)
        assert positions.tolist() == [p for p in range(n) if p < S or p > n - 1 - W]
        keys, _, pos = gather(cache.layers[0], torch.float32)
        assert pos[0, slots].tolist() == positions.tolist()
        if bits == 16:  # exact: the key of position p holds p
            assert keys[0, 0, slots, 0].tolist() == [float(p) for p in positions.tolist()]


def test_token_positions_counts_each_rows_tokens_on_from_what_it_held():
    held, lens = torch.tensor([5, 0, 9, 2]), torch.tensor([3, 1, 0, 2])
    expect = [5, 6, 7, 0, 2, 3]                    # row 2 brings nothing
    assert token_positions(held, lens).tolist() == expect
    assert token_positions(torch.tensor([4]), torch.tensor([0])).tolist() == []
