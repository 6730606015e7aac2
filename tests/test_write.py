"""The write op (qsinkkv/write.py): a refused chunk stores nothing, and a step refused in a later layer leaves every
layer as a twin cache that never saw it (the Undo record of the uniform write and of the one-pass ragged write
restores each row it overwrote); both then go on identically."""
import pytest
import torch
from helpers import HKV, D, G, assert_same_state, assert_unchanged, draw, snapshot, visible_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from qsinkkv import CacheConfig, SinkQuantCache


def feed(caches, layers, q, k, v, lens=None):
    """One step (q, k, v, lengths) through every layer of each cache."""
    for layer in range(layers):
        for c in caches:
            c.attend(layer, q, k, v, lens)


def test_scale_overflow_leaves_cache_unchanged():
    cfg = CacheConfig(sink_tokens=1, recent_tokens=4, bits=8, block_size=2, value_group_size=8)
    cache = SinkQuantCache(cfg, 1, 1, 1, D, dtype=torch.float32)
    cache.append(0, torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D))
    snap = snapshot(cache)
    huge = torch.randn(1, 1, 3, D)
    huge[0, 0, 0, 0] = -1e6  # finite, but its block's zero overflows float16
    with pytest.raises(ValueError, match="scale_dtype"):
        cache.append(0, huge, torch.randn(1, 1, 3, D))
    assert_unchanged(cache, snap)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), S=st.integers(0, 3), W=st.integers(1, 10), bs=st.integers(1, 4),
       R=st.integers(0, 3), prompts=st.lists(st.integers(0, 12), min_size=3, max_size=3),
       decode_steps=st.integers(0, 6), T=st.sampled_from([1, 1, 3]), fail_layer=st.integers(0, 2),
       how=st.sampled_from(["nan", "scale_overflow"]), seed=st.integers(0, 2**31))
def test_refused_ragged_step_rolls_back(bits, S, W, bs, R, prompts, decode_steps, T, fail_layer, how, seed):
    """Sequences of different lengths (decode steps take the one-pass ragged write); a step refused in
    one layer leaves every layer as a twin cache that never saw it, and both go on identically."""
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=2,
                      residual_tokens=min(R, W))
    B = 3
    g = torch.Generator().manual_seed(seed)
    a, b = (SinkQuantCache(cfg, 3, B, HKV, D, dtype=torch.float32) for _ in range(2))
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    width = max(max(prompts), 1)
    steps = [(width, prompts)] + [(1, None)] * decode_steps
    for n, lens in steps:
        for layer in range(3):
            q, k, v = rnd(B, HKV * G, n, D), rnd(B, HKV, n, D), rnd(B, HKV, n, D)
            assert torch.equal(a.attend(layer, q, k, v, lens), b.attend(layer, q, k, v, lens))
    lens = [T, 1, 0] if T > 1 else None
    for layer in range(3):
        q, k, v = rnd(B, HKV * G, T, D), rnd(B, HKV, T, D), rnd(B, HKV, T, D)
        if layer == fail_layer:
            if how == "nan":
                k[1, 0, 0, 3] = float("nan")
            else:
                k[0, 1, :, 2] = -1e6
            try:
                a.attend(layer, q, k, v, lens)
            except ValueError:
                break
            b.attend(layer, q, k, v, lens)  # nothing refused: the huge key completed no block
            continue
        a.attend(layer, q, k, v, lens)
    else:
        return
    assert a.in_step() and torch.equal(a.seq_lens(), b.seq_lens())
    for layer in range(3):
        for x, y in zip(visible_rows(a, layer), visible_rows(b, layer)):
            assert all(torch.equal(s, t) for s, t in zip(x, y))
    for _ in range(3):
        for layer in range(3):
            q, k, v = rnd(B, HKV * G, 1, D), rnd(B, HKV, 1, D), rnd(B, HKV, 1, D)
            assert torch.equal(a.attend(layer, q, k, v), b.attend(layer, q, k, v))


# From the review of the per-sequence-lengths work, a defect now fixed: a ragged decode step (rows at
# different lengths, one indexed write) with block_size=1 and a window that is wholly unquantized (bits=16, or
# residual_tokens == recent_tokens) wrote the new token into the float-ring row that holds the oldest token the
# shorter stream still sees, but saved that row in the Undo record only for rows that complete a *visible* block.
# A step refused in a later layer then "rolled back" layer 0 to a state whose oldest visible token held the refused
# step's K/V; a legal crop brings it back into view (a row at exactly the capacity, m == W, may shorten).
@pytest.mark.parametrize("cfg", [
    CacheConfig(sink_tokens=1, recent_tokens=3, bits=16, block_size=1),
    CacheConfig(sink_tokens=1, recent_tokens=3, bits=8, block_size=1, residual_tokens=3, value_group_size=4),
], ids=["bits16", "int8-residual=W"])
def test_refused_ragged_decode_step_rolls_back_with_block_size_1(cfg):
    g = torch.Generator().manual_seed(0)
    a, twin = (SinkQuantCache(cfg, 2, 2, HKV, D, dtype=torch.float32) for _ in range(2))
    feed((a, twin), 2, *draw(g, 2, 6), [4, 6])          # row 0 exactly at the capacity 4, row 1 past it
    q, k, v = draw(g, 2, 1)
    a.attend(0, q, k, v)                                # layer 0 takes the decode step (ragged write)
    bad = k.clone()
    bad[1, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="k contains NaN"):
        a.attend(1, q, bad, v)                          # layer 1 refuses it: layer 0 must roll back
    assert a.in_step() and torch.equal(a.seq_lens(), twin.seq_lens())
    for c in (a, twin):
        c.crop([1, 0])                                  # allowed: row 0 holds 4 tokens, none evicted
    for layer in range(2):                              # row 0's query now sees its position-1 token again
        q, k, v = draw(g, 2, 1)
        out, ref = a.attend(layer, q, k, v), twin.attend(layer, q, k, v)
        assert torch.equal(out, ref), f"layer {layer}: max |diff| {(out - ref).abs().max().item():.3g}"
    assert_same_state(a, twin)


def test_refused_ragged_step_after_block_completion_with_residual():
    """Rows at different lengths in one decode step: one completes a block whose first token sits in
    the float row the new token overwrites (residual 1, block 2: the Undo's float-row save), one does
    not, one is still filling its sinks; the last layer refuses; every layer equals a twin, then and
    after more steps."""
    cfg = CacheConfig(sink_tokens=1, recent_tokens=6, bits=4, block_size=2, value_group_size=4, residual_tokens=1)
    g = torch.Generator().manual_seed(7)
    a, twin = (SinkQuantCache(cfg, 3, 3, HKV, D, dtype=torch.float32) for _ in range(2))
    feed((a, twin), 3, *draw(g, 3, 10), [5, 6, 0])      # recent r = 4 (completes a block), 5, and a sink row
    for _ in range(6):
        q, k, v = draw(g, 3, 1)
        for layer in range(2):
            a.attend(layer, q, k, v)
        bad = k.clone()
        bad[2, 1, 0, 3] = float("nan")
        with pytest.raises(ValueError):
            a.attend(2, q, bad, v)
        assert_same_state(a, twin)
        feed((a, twin), 3, q, k, v)                     # the step, accepted this time, on both
        assert_same_state(a, twin)


@pytest.mark.parametrize("bits, held", [(4, 13), (8, 40), (16, 7)])
def test_the_cheapest_case_writes_what_the_general_commit_writes(bits, held):
    """A decode step of equal rows on a dense storage is the plan's cheapest case (one strided copy per ring):
    the same bytes and lengths as the general indexed commit of the same plan."""
    import dataclasses

    from helpers import random_storage_layer

    from qsinkkv import quant, write
    cfg = CacheConfig(sink_tokens=3, recent_tokens=21, bits=bits, block_size=4, value_group_size=4)
    B = 5
    layout = random_storage_layer(cfg, 1, 2).layout
    p = write.plan(layout, (held,) * B, (1,) * B, tuple(range(B)), tuple(range(B)))
    assert p.ring_row is not None and not p.full_at.numel()
    k, v = torch.randn(2, B, 2, 16).unbind(0)
    results = []
    for plan in (p, dataclasses.replace(p, ring_row=None)):
        layer = random_storage_layer(cfg, B, 2, seed=3)
        layer.seq_lens.fill_(held)
        assert write.commit(layer, plan, k, v, quant, write.WRITER_TORCH) == []
        results.append(layer)
    for name, t in results[0].tensors().items():
        assert torch.equal(t, results[1].tensors()[name]), name
    assert results[0].seq_lens.tolist() == results[1].seq_lens.tolist() == [held + 1] * B
