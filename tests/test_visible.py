"""The visible set is token-exact: what the cache stores and masks equals the design sheet."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import visible

from qsinkkv import CacheConfig, SinkQuantCache

DESIGN_SHEET = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5],
                [0, 1, 3, 4, 5, 6], [0, 1, 4, 5, 6, 7], [0, 1, 5, 6, 7, 8], [0, 1, 6, 7, 8, 9]]


def make(cfg, D=8):
    return SinkQuantCache(cfg, 1, 1, 1, D, dtype=torch.float32)


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
