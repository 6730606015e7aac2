"""Per-sequence lengths: a sequence in a ragged batch gets the answer it gets alone (and the float64
oracle's), with its own sinks, window and positions; rows join, finish and leave."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import attention_oracle, bf16_exact, stored_history, visible
from test_errors import assert_unchanged, snapshot

from qsinkkv import CacheConfig, Rotary, SinkQuantCache, gather, visible_mask

HKV, G, D = 2, 2, 8
ROT = Rotary.from_schedule(D, base=100.0)


def visible_rows(cache, layer=0):
    """Per sequence: its visible (positions, k, v), sorted by position."""
    storage = cache.layers[layer]
    k, v, pos = gather(storage, torch.float32)
    n = storage.seq_lens
    seen = visible_mask((n - 1).unsqueeze(1), pos, cache.config.sink_tokens, cache.config.recent_tokens)[:, 0]
    out = []
    for b in range(len(n)):
        order = torch.argsort(torch.where(seen[b], pos[b], pos[b].max() + 1))[: int(seen[b].sum())]
        out.append((pos[b, order], k[b][:, order], v[b][:, order]))
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), S=st.integers(0, 3), W=st.integers(1, 10), bs=st.integers(1, 4),
       R=st.integers(0, 3), rope=st.booleans(), seed=st.integers(0, 2**31),
       steps=st.lists(st.tuples(st.integers(1, 7), st.lists(st.integers(0, 7), min_size=3, max_size=3)),
                      min_size=1, max_size=10))
def test_ragged_batch_equals_each_sequence_alone_and_the_oracle(bits, S, W, bs, R, rope, seed, steps):
    """Random schedules of ragged chunks (row b takes lengths[b] <= T tokens; 0 = idle) and decode
    steps, every block size, bits, residual and both position contracts."""
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=2,
                      residual_tokens=min(R, W), positions="cache_index" if rope else "absolute")
    rotary = ROT if rope else None
    B = 3
    g = torch.Generator().manual_seed(seed)
    batch = SinkQuantCache(cfg, 1, B, HKV, D, dtype=torch.float32, rotary=rotary)
    alone = [SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float32, rotary=rotary) for _ in range(B)]
    history = [[] for _ in range(B)]  # each row's full-precision (q, k, v) stream
    steps = steps + [(1, [1, 1, 1])] * 3
    for T, lens in steps:
        lens = [min(t, T) for t in lens]
        q, k, v = (bf16_exact(B, h, T, D, generator=g) for h in (HKV * G, HKV, HKV))
        out = batch.attend(0, q, k, v, lens)
        for b, t in enumerate(lens):
            assert out[b, :, t:].abs().max() == 0 if t < T else True  # padding: output zero
            if t == 0:
                continue
            n0 = alone[b].seq_length
            own = alone[b].attend(0, q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t])
            assert rel(out[b:b + 1, :, :t], own) < 1e-5
            history[b].append((q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t]))
            hk = torch.cat([h[1] for h in history[b]], 2)
            hv = torch.cat([h[2] for h in history[b]], 2)
            if t == 1:  # decode: attends over what is stored
                kv = stored_history(hk, hv, n0 + 1, cfg)
            else:       # prefill: what was stored before + the chunk in full precision
                prior = stored_history(hk, hv, n0, cfg)
                kv = (torch.cat((prior[0], hk[:, :, n0:].double()), 2),
                      torch.cat((prior[1], hv[:, :, n0:].double()), 2))
            ref = attention_oracle(q[b:b + 1, :, :t], lambda i: kv, S, W, range(n0, n0 + t), rotary)
            assert rel(out[b:b + 1, :, :t], ref) < 1e-5
    assert batch.seq_lens().tolist() == [c.seq_length for c in alone]
    for b, (row, single) in enumerate(zip(visible_rows(batch), alone)):
        own = visible_rows(single)[0]
        assert all(torch.equal(x, y) for x, y in zip(row, own)), f"sequence {b}'s storage"
        assert batch.visible_positions(0, b) == visible(batch.seq_lens()[b].item() - 1, S, W) if \
            batch.seq_lens()[b] else batch.visible_positions(0, b) == []


def run_rows(cfg, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda T=1: tuple(torch.randn(B, h, T, D, generator=g) for h in (HKV * G, HKV, HKV))


def test_a_finished_row_leaves_and_the_rest_go_on():
    """select_batch drops a finished row mid-stream; every remaining row still equals its own stream."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=9, bits=4, block_size=3, value_group_size=4)
    batch = SinkQuantCache(cfg, 2, 3, HKV, D, dtype=torch.float32)
    alone = [SinkQuantCache(cfg, 2, 1, HKV, D, dtype=torch.float32) for _ in range(3)]
    rows, draw = [0, 1, 2], run_rows(cfg)
    for step in range(30):
        T, lens = (7, [7, 3, 5]) if step == 0 else (1, None)
        if step == 12:  # row 1 finishes
            batch.select_batch(torch.tensor([True, False, True]))
            rows = [0, 2]
        q, k, v = (x[: len(rows)] for x in draw(T))
        for layer in range(2):
            out = batch.attend(layer, q, k, v, lens)
            for i, b in enumerate(rows):
                t = T if lens is None else lens[b]
                own = alone[b].attend(layer, q[i:i + 1, :, :t], k[i:i + 1, :, :t], v[i:i + 1, :, :t])
                assert rel(out[i:i + 1, :, :t], own) < 1e-5
    assert batch.seq_lens().tolist() == [alone[0].seq_length, alone[2].seq_length]


def test_reset_one_row_for_a_new_sequence():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=8, block_size=2, value_group_size=4)
    batch = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float32)
    draw = run_rows(cfg, B=2)
    batch.attend(0, *draw(11))
    batch.reset([1])
    assert batch.seq_lens().tolist() == [11, 0]
    fresh = SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float32)
    q, k, v = draw(5)
    out = batch.attend(0, q, k, v, [0, 5])  # row 0 idles while row 1 takes its prompt
    torch.testing.assert_close(out[1:], fresh.attend(0, q[1:], k[1:], v[1:]), rtol=1e-5, atol=1e-6)
    assert out[0].abs().max() == 0
    assert batch.seq_lens().tolist() == [11, 5]


def test_crop_per_sequence():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=12, bits=4, block_size=4, value_group_size=4)
    batch = SinkQuantCache(cfg, 2, 2, HKV, D, dtype=torch.float32)
    draw = run_rows(cfg, B=2)
    for layer in range(2):
        batch.append(layer, *draw(9)[1:], [9, 4])
    batch.crop([1, 2])
    assert batch.seq_lens(1).tolist() == [8, 2]
    snap = snapshot(batch)
    with pytest.raises(ValueError, match="sequence 0: a block they share with older tokens was already quantized"):
        batch.crop([4, 0])
    with pytest.raises(ValueError, match="sequence 1 holds 2 tokens; cannot crop 3"):
        batch.crop([0, 3])
    with pytest.raises(ValueError, match="tokens must be an int or 2 ints"):
        batch.crop([1.5, 1])
    assert_unchanged(batch, snap)


@pytest.mark.parametrize("lengths,msg", [
    ([1, 2], r"lengths must be a 1-D int tensor \(or list\) of B=3 counts in \[0, T=4\]"),
    ([1, 2, 5], r"got \[1, 2, 5\]"),
    ([1, -1, 2], r"got \[1, -1, 2\]"),
    (torch.tensor([1.0, 2.0, 3.0]), "got torch.float32"),
    (torch.tensor([True, False, True]), "got torch.bool"),
    ("abc", "lengths must be"),
])
def test_bad_lengths_change_nothing(lengths, msg):
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    cache = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32)
    draw = run_rows(cfg)
    cache.append(0, *draw(5)[1:], [5, 2, 0])
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=msg):
        cache.attend(0, *draw(4), lengths)
    assert_unchanged(cache, snap)


def test_nan_in_padding_is_not_refused_nan_in_a_real_token_is():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    cache = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float32)
    q, k, v = run_rows(cfg, B=2)(4)
    k[1, :, 3] = float("nan")  # row 1 holds 2 tokens: its slot 3 is padding, never stored
    q[1, :, 3] = float("nan")
    out = cache.attend(0, q, k, v, [4, 2])
    assert torch.isfinite(out).all()
    snap = snapshot(cache)
    k[1, 0, 1, 0] = float("inf")
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        cache.attend(0, q, k, v, [4, 2])
    assert_unchanged(cache, snap)


def test_visible_positions_per_sequence():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=4, bits=16)
    cache = SinkQuantCache(cfg, 1, 2, 1, D, dtype=torch.float32)
    cache.append(0, torch.randn(2, 1, 10, D), torch.randn(2, 1, 10, D), [10, 7])
    assert cache.visible_positions(0, 0) == [0, 1, 6, 7, 8, 9]
    assert cache.visible_positions(0, 1) == [0, 1, 3, 4, 5, 6]
    with pytest.raises(IndexError, match=r"seq must be an int in \[0, 2\)"):
        cache.visible_positions(0, 2)


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


@pytest.mark.parametrize("rope", [False, True], ids=["absolute", "cache_index"])
def test_long_prefill_reads_only_what_each_tile_sees(rope):
    """A prefill of 700 tokens (3 query tiles of 256) with W = 100: each tile reads the stored slots,
    the chunk's sinks and the W keys before it; rows start at different lengths, so the chunk holds
    sinks for one row and not the other. Equal to the float64 oracle."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=100, bits=16, sink_dtype=torch.float32,
                      window_dtype=torch.float32, positions="cache_index" if rope else "absolute")
    rotary = ROT if rope else None
    g = torch.Generator().manual_seed(4)
    cache = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float32, rotary=rotary)
    k, v, q = (torch.randn(2, h, 702, D, generator=g) for h in (HKV, HKV, HKV * G))
    cache.append(0, k[:, :, :2], v[:, :, :2], [0, 2])                      # row 1 holds 2 tokens, row 0 none
    chunk = [torch.cat((x[:1, :, :700], x[1:, :, 2:702])) for x in (q, k, v)]
    out = cache.attend(0, *chunk, [700, 650])
    for b, (n0, t) in enumerate(((0, 700), (2, 650))):
        ref = attention_oracle(q[b:b + 1, :, n0:n0 + t], lambda i: (k[b:b + 1].double(), v[b:b + 1].double()),
                               3, 100, range(n0, n0 + t), rotary)
        assert rel(out[b:b + 1, :, :t], ref) < 1e-5


def test_crop_to_refusals_change_nothing():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=12, bits=4, block_size=4, value_group_size=4)
    cache = SinkQuantCache(cfg, 2, 2, HKV, D, dtype=torch.float32)
    draw = run_rows(cfg, B=2)
    for layer in range(2):
        cache.append(layer, *draw(8)[1:], [8, 4])
    cache.append(0, *draw(1)[1:])  # layer 0 one step ahead (completing no block), as after an interrupt
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"layer 1 holds \[8, 4\] tokens, fewer than \[9, 5\]"):
        cache.crop_to([9, 5])
    with pytest.raises(ValueError, match="a block they share with older tokens was already quantized"):
        cache.crop_to([4, 4])  # row 0 would lose tokens of a quantized block
    with pytest.raises(ValueError, match="lengths must be an int or 2 ints"):
        cache.crop_to([8.0, 4])
    assert_unchanged(cache, snap)
    cache.crop_to([8, 4])  # back in step
    assert cache.in_step() and cache.seq_lens(0).tolist() == [8, 4]


@pytest.mark.parametrize("bits,S,W,bs", [(4, 3, 20, 4), (16, 0, 9, 2), (8, 4, 300, 16)])
def test_torch_prefill_equals_the_reference(bits, S, W, bs):
    """The torch backend's prefill (SDPA per tile under the visible set as a mask) against the reference
    and its float64 run, on a ragged chunk into rows holding different lengths, with NaN in the padding,
    tiles past the window (T > 256) and a scale of its own; sink logits take the reference."""
    from qsinkkv.prefill import prefill_attention_reference, prefill_attention_torch
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=4)
    cache = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(bits + W)
    cache.attend(0, *(torch.randn(3, h, 40, D, generator=g) for h in (HKV * G, HKV, HKV)), [40, 2, 0])
    layer = cache.layers[0]
    q, k, v = (torch.randn(3, h, 600, D, generator=g) for h in (HKV * G, HKV, HKV))
    lengths = torch.tensor([600, 333, 7])
    k[1, :, 333:], v[2, :, 7:] = float("nan"), float("inf")
    for kw in (dict(scale=0.3), dict(sink_logits=torch.randn(HKV * G, generator=g))):
        ref = prefill_attention_reference(q, k, v, layer, lengths, **kw)
        ref64 = prefill_attention_reference(q.double(), k.double(), v.double(), layer, lengths,
                                            **{n: x.double() if torch.is_tensor(x) else x for n, x in kw.items()})
        got = prefill_attention_torch(q, k, v, layer, lengths, **kw)
        assert torch.isfinite(got).all()
        assert rel(got, ref) < 1e-5 and rel(got, ref64) < 1e-5, kw


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_torch_decode_row_in_a_batch_is_bitwise_the_row_alone(bits):
    """The CPU decode op on a ragged batch (D 64, 3 KV heads of 3 query heads: the shape at which
    PyTorch's fused CPU SDPA gave one row of a batch a result a rounding apart from the row alone):
    each row bit-identical to that row's storage on its own, and to the reference at 1e-5."""
    from qsinkkv.decode import decode_attention_reference, decode_attention_torch
    cfg = CacheConfig(sink_tokens=4, recent_tokens=40, bits=bits, block_size=8)
    g = torch.Generator().manual_seed(bits)
    cache = SinkQuantCache(cfg, 1, 3, 3, 64, dtype=torch.float32, backend="torch")
    cache.append(0, torch.randn(3, 3, 61, 64, generator=g), torch.randn(3, 3, 61, 64, generator=g),
                 lengths=[61, 17, 40])
    layer = cache.layers[0]
    for _ in range(3):
        q = torch.randn(3, 9, 64, generator=g)
        out = decode_attention_torch(q, layer)
        for b in range(3):
            assert torch.equal(out[b:b + 1], decode_attention_torch(q[b:b + 1], layer.rows(b))), b
        ref = decode_attention_reference(q, layer)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
        cache.append(0, torch.randn(3, 3, 1, 64, generator=g), torch.randn(3, 3, 1, 64, generator=g))


@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "tables"])
def test_torch_decode_in_chunks_of_heads_and_rows(bits, dense, monkeypatch):
    """The CPU decode op's chunks of (KV heads, sequences) -- one head of one row, rows 2 + 1, heads
    2 + 1 -- on a dense storage and through block tables, with and without sink logits: bitwise
    equal to one chunk, and to the reference at 1e-5."""
    import dataclasses

    from qsinkkv import decode
    from qsinkkv.decode import decode_attention_reference
    cfg = CacheConfig(sink_tokens=3, recent_tokens=30, bits=bits, block_size=4, residual_tokens=2, value_group_size=8)
    g = torch.Generator().manual_seed(11 + bits)
    cache = SinkQuantCache(cfg, 1, 3, 3, 16, dtype=torch.float32, backend="torch")
    cache.append(0, torch.randn(3, 3, 41, 16, generator=g), torch.randn(3, 3, 41, 16, generator=g),
                 lengths=[41, 9, 26])
    layer = cache.layers[0] if dense else dataclasses.replace(cache.layers[0], dense=False)
    q, logits = torch.randn(3, 6, 16, generator=g), torch.randn(6, generator=g)
    one = cache.layout.num_slots * 16 * 4                              # buffer bytes of one head of one row
    for sinks in (None, logits):
        whole = decode.decode_attention_torch(q, layer, sink_logits=sinks)
        ref = decode_attention_reference(q, cache.layers[0], sink_logits=sinks)
        assert ((whole - ref).norm() / ref.norm()).item() < 1e-5
        for budget in (1, 2 * one, 3 * 2 * one):
            monkeypatch.setattr(decode, "BUFFER_BYTES", budget)
            assert torch.equal(decode.decode_attention_torch(q, layer, sink_logits=sinks), whole), budget
        monkeypatch.undo()
