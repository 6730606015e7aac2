"""SinkQuantCache (qsinkkv/cache.py): construction refusals; a model step kept in step over the layers (a step
refused in layer l rolls back the layers that took it); per-sequence lengths (a sequence in a ragged batch gets the
answer it gets alone, and the float64 oracle's; rows join, finish, are reset, cropped and leave); a packed step
equals the padded one; caches of one process do not share state; the Triton backend on ragged rows."""
from functools import partial

import helpers
import pytest
import torch
from helpers import HKV, D, G, assert_same_state, assert_unchanged, draw, rel, run_rows, snapshot, visible_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import attention_oracle, bf16_exact, stored_history, visible

from qsinkkv import CacheConfig, Rotary, SinkQuantCache
from qsinkkv.decode import decode_attention_reference

B, H = 2, HKV * G
ROT = Rotary.from_schedule(D, base=100.0)
make = partial(helpers.make, layers=3, B=B, Hkv=HKV)  # this file's model caches: 3 layers, B sequences


@pytest.mark.parametrize("kwargs,msg", [
    (dict(head_dim=12), "value_group_size must divide head_dim=12"),
    (dict(head_dim=7, cfg=dict(value_group_size=2)), "even head_dim, got head_dim=7"),
    (dict(num_layers=0), "num_layers must be an int >= 1, got 0"),
    (dict(batch_size=2.0), "batch_size must be an int >= 1"),
    (dict(dtype=torch.int32), "dtype must be one of torch.bfloat16, torch.float16, torch.float32, torch.float64"),
    (dict(dtype=torch.float8_e4m3fn), "dtype must be one of"),
    (dict(dtype=torch.float8_e5m2), "dtype must be one of"),
    (dict(cfg=dict(positions="cache_index")), "positions='cache_index' needs rotary"),
    (dict(cfg=dict(positions="cache_index"), rotary=Rotary.from_schedule(16)), "rotary covers head_dim=16"),
    (dict(rotary=Rotary.from_schedule(8)), "rotary is only used with positions='cache_index'"),
])
def test_bad_construction(kwargs, msg):
    cfg = CacheConfig(**dict(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=8)
                      | kwargs.pop("cfg", {}))
    args = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, dtype=torch.float32) | kwargs
    with pytest.raises(ValueError, match=msg):
        SinkQuantCache(cfg, **args)


# --- a refused step in layer l rolls back the layers that already took it ----------------------

@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), S=st.integers(0, 3), W=st.integers(1, 12), bs=st.integers(1, 4),
       R=st.integers(0, 3), prefix=st.lists(st.integers(1, 9), min_size=0, max_size=5), T=st.integers(1, 7),
       fail_layer=st.integers(0, 2), how=st.sampled_from(["nan", "scale_overflow", "bad_q"]),
       seed=st.integers(0, 2**31))
def test_refused_step_rolls_back_every_layer(bits, S, W, bs, R, prefix, T, fail_layer, how, seed):
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=2,
                      residual_tokens=min(R, W))
    g = torch.Generator().manual_seed(seed)
    a, b = make(cfg), make(cfg)  # b is the twin that never sees the refused step
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    for n in prefix:
        for layer in range(3):
            k, v = rnd(B, HKV, n, D), rnd(B, HKV, n, D)
            a.append(layer, k, v)
            b.append(layer, k, v)
    for layer in range(3):
        q, k, v = rnd(B, H, T, D), rnd(B, HKV, T, D), rnd(B, HKV, T, D)
        if layer == fail_layer:
            if how == "nan":
                k[1, 0, T - 1, 3] = float("nan")
            elif how == "scale_overflow":
                k[0, 1, :, 2] = -1e6  # finite, but the key zero of every block it completes overflows fp16
            else:
                q[0, 0, 0, 0] = float("inf")
            before = a.get_seq_length(layer)
            try:
                a.attend(layer, q, k, v)
            except ValueError:
                break
            assert how == "scale_overflow" and a.get_seq_length(layer) == before + T  # no block was completed
            b.attend(layer, q, k, v)
            continue
        a.attend(layer, q, k, v)
    else:
        return  # nothing was refused (the huge key completed no block): nothing to roll back
    assert len(set(a.layer_lengths())) == 1
    assert a.layer_lengths() == b.layer_lengths()
    assert_same_state(a, b)
    for _ in range(3):  # and the two caches go on identically
        for layer in range(3):
            q, k, v = rnd(B, H, 1, D), rnd(B, HKV, 1, D), rnd(B, HKV, 1, D)
            assert torch.equal(a.attend(layer, q, k, v), b.attend(layer, q, k, v))
    assert_same_state(a, b)


def test_rollback_note_when_a_layer_cannot_be_restored():
    cfg = CacheConfig(sink_tokens=1, recent_tokens=6, bits=8, block_size=2, value_group_size=2)
    cache = make(cfg)
    cache.append(0, torch.randn(B, HKV, 3, D), torch.randn(B, HKV, 3, D))
    cache.append(0, torch.randn(B, HKV, 2, D), torch.randn(B, HKV, 2, D))  # layer 0 two appends ahead of layer 1
    bad = torch.randn(B, HKV, 1, D)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="contains NaN") as err:
        cache.append(1, bad, bad)
    assert "layers [0] could not be rolled back to the refused step" in "\n".join(err.value.__notes__)
    assert cache.layer_lengths() == [5, 0, 0]


# --- per-sequence lengths: rows alone, joining, finishing, reset and cropped ---------------------------------------

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


def _two_layers_two_rows(lengths):
    """A 2-layer int4 cache (block 4) whose two rows hold ``lengths`` tokens in both layers, and its row draw."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=12, bits=4, block_size=4, value_group_size=4)
    cache = SinkQuantCache(cfg, 2, 2, HKV, D, dtype=torch.float32)
    draw = run_rows(cfg, B=2)
    for layer in range(2):
        cache.append(layer, *draw(max(lengths))[1:], lengths)
    return cache, draw


def test_crop_per_sequence():
    batch, _ = _two_layers_two_rows([9, 4])
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


def test_crop_to_refusals_change_nothing():
    cache, draw = _two_layers_two_rows([8, 4])
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


def test_select_batch_with_repeats_then_ragged_steps():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=7, bits=4, block_size=3, value_group_size=4, residual_tokens=2)
    g = torch.Generator().manual_seed(2)
    batch = SinkQuantCache(cfg, 2, 2, HKV, D, dtype=torch.float32)
    rows = [SinkQuantCache(cfg, 2, 1, HKV, D, dtype=torch.float32) for _ in range(3)]
    q, k, v = draw(g, 2, 9)
    for layer in range(2):
        batch.attend(layer, q, k, v, [9, 4])
        for r, (b, t) in zip(rows, [(1, 4), (0, 9), (1, 4)]):
            r.attend(layer, q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t])
    batch.select_batch([1, 0, 1])                       # row 1 twice
    for step in range(18):
        T = 1 if step % 3 else 3
        q, k, v = draw(g, 3, T)
        lens = [T, 1, 0] if T > 1 else None
        for layer in range(2):
            out = batch.attend(layer, q, k, v, lens)
            for b in range(3):
                t = T if lens is None else lens[b]
                if t:
                    own = rows[b].attend(layer, q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t])
                    assert rel(out[b:b + 1, :, :t], own) < 1e-5, (step, layer, b)


def test_reset_row_then_ragged_decode():
    cfg = CacheConfig(sink_tokens=3, recent_tokens=5, bits=8, block_size=2, value_group_size=4)
    g = torch.Generator().manual_seed(3)
    batch = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32)
    batch.attend(0, *draw(g, 3, 12), [12, 7, 10])
    batch.reset([1])
    alone = SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float32)
    for step in range(12):                              # row 1 goes through its sinks, the others wrap
        q, k, v = draw(g, 3, 1)
        out = batch.attend(0, q, k, v)
        own = alone.attend(0, q[1:2], k[1:2], v[1:2])
        assert rel(out[1:2], own) < 1e-5, step


def test_float64_ragged_rows_equal_each_row_alone():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4, residual_tokens=1)
    g = torch.Generator().manual_seed(5)
    batch = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float64)
    alone = [SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float64) for _ in range(2)]
    for step in range(15):
        T, lens = (5, [5, 3]) if step == 0 else (1, None)
        q, k, v = draw(g, 2, T, torch.float64)
        out = batch.attend(0, q, k, v, lens)
        assert out.dtype == torch.float64
        for b in range(2):
            t = T if lens is None else lens[b]
            own = alone[b].attend(0, q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t])
            assert rel(out[b:b + 1, :, :t], own) < 1e-12, (step, b)


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_packed_step_on_a_dense_cache_equals_padded_and_each_row_alone(bits):
    """``attend_packed`` runs its rows by group (one-token rows decode, longer rows prefill padded
    to their own longest), never padded to ``[B, T_max]``; the answer is the padded step's, bit for bit, and
    each row's is the row's alone. The schedule crosses the sinks, fills and wraps the window, idles rows."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=8, bits=bits, block_size=2, value_group_size=4)
    B = 4
    packed, padded = (SinkQuantCache(cfg, 1, B, HKV, D, dtype=torch.float32) for _ in range(2))
    alone = [SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float32) for _ in range(B)]
    g = torch.Generator().manual_seed(bits)
    for lens in ([2, 1, 0, 5], [1, 1, 1, 1], [9, 1, 3, 0], [1, 0, 1, 12], [0, 0, 0, 0], [1, 6, 1, 1]):
        T = max(max(lens), 1)
        q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (HKV * G, HKV, HKV))
        real = torch.arange(T) < torch.tensor(lens).unsqueeze(1)
        pack = lambda x: x.transpose(1, 2)[real]  # noqa: E731
        qsl = torch.tensor([0, *lens]).cumsum(0)
        out = packed.attend_packed(0, pack(q), pack(k), pack(v), qsl)
        ref = padded.attend(0, q, k, v, lens)
        assert out.shape == (sum(lens), HKV * G, D)
        assert torch.equal(out, pack(ref))
        assert packed.seq_lens().tolist() == padded.seq_lens().tolist()
        for b, t in enumerate(lens):
            if t:
                mine = alone[b].attend(0, *(x[b:b + 1, :, :t] for x in (q, k, v)))
                assert rel(out[qsl[b]:qsl[b + 1]], mine[0].transpose(0, 1)) < 1e-6


# --- caches side by side, and the Triton backend (its interpreter on the CPU) on ragged rows -----------------------

def test_two_caches_alternate_decode_workspace_and_memo():
    """decode.py's module-level workspace and each layout's visible_bias memo, with caches of equal
    shapes and lengths but different configs called in turn: each equals the dequantizing reference."""
    g = torch.Generator().manual_seed(4)
    cfgs = [CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4),
            CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=2),
            CacheConfig(sink_tokens=3, recent_tokens=5, bits=4, block_size=2, value_group_size=4),
            CacheConfig(sink_tokens=1, recent_tokens=9, bits=8, block_size=2, value_group_size=4)]
    caches = [SinkQuantCache(c, 1, 2, HKV, D, dtype=torch.float32, backend="torch") for c in cfgs]
    for step in range(16):
        for c in caches:
            q, k, v = draw(g, 2, 1)
            out = c.attend(0, q, k, v)
            ref = decode_attention_reference(q[:, :, 0], c.layers[0]).unsqueeze(2)
            assert rel(out, ref) < 1e-5, (step, c.config)


@pytest.mark.parametrize("variant", ["dequantize", "folded"])
def test_triton_ragged_decode_with_an_empty_row(variant):
    """The decode kernel (Triton interpreter on the CPU) on ragged rows, one of them empty and idle,
    and chunks with a one-token row: equal to the torch backend."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=5, bits=4, block_size=2, value_group_size=4, residual_tokens=1)
    g = torch.Generator().manual_seed(6)
    tri = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32, backend="triton", decode_variant=variant)
    ref = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32, backend="torch")
    for T, lens in [(4, [4, 1, 0]), (1, [1, 1, 0]), (3, [3, 1, 0]), (1, [1, 0, 0]), (1, [1, 1, 0]), (1, [1, 1, 0])]:
        q, k, v = draw(g, 3, T)
        a, b = tri.attend(0, q, k, v, lens), ref.attend(0, q, k, v, lens)
        assert torch.isfinite(a).all() and rel(a, b) < 1e-5, (T, lens)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_decode_refused_after_the_write_rolls_every_layer_back(packed):
    """A decode that raises after its layer's write (a kernel refused at launch, say) in layer 1 of a step that layer 0
    took: both layers back where they were, as a twin that never saw the step, which then goes on identically. The
    write's undo record is kept as soon as the write is done (before, a packed or mixed step lost it with the error
    and left the refused layer one token ahead)."""
    import dataclasses
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=4, block_size=4, value_group_size=4)
    a, b = (SinkQuantCache(cfg, 2, 2, HKV, D, dtype=torch.float32, backend="torch") for _ in range(2))
    g = torch.Generator().manual_seed(7)
    for layer in range(2):
        k, v = torch.randn(2, HKV, 15, D, generator=g), torch.randn(2, HKV, 15, D, generator=g)
        a.append(layer, k, v)
        b.append(layer, k, v)
    step = [torch.randn(2, h, 1, D, generator=g) for h in (HKV * G, HKV, HKV)]
    attend = (lambda c, layer: c.attend_packed(layer, *(x[:, :, 0] for x in step), torch.tensor([0, 1, 2]))) \
        if packed else (lambda c, layer: c.attend(layer, *step))
    attend(a, 0)
    ops = a.ops

    def refused(*args, **kwargs):
        raise RuntimeError("the decode kernel was refused at launch")
    a.ops = dataclasses.replace(ops, decode=refused)
    with pytest.raises(RuntimeError, match="refused at launch") as e:
        attend(a, 1)
    assert not getattr(e.value, "__notes__", None), e.value.__notes__  # (no layer left stuck)
    a.ops = ops
    assert a.layer_lengths() == b.layer_lengths() == [15, 15]
    assert_same_state(a, b)
    for layer in range(2):
        assert torch.equal(attend(a, layer), attend(b, layer))
