"""The paged block pool: sequences admitted, stepped (decode and prefill chunks mixed) and released
over one pool give each sequence the answer it gets alone through the plain cache (and the float64
oracle's), hold exactly the blocks their lengths need, and never share or leak a block."""
import pytest
import torch
from helpers import assert_unchanged, rel, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import attention_oracle, bf16_exact, stored_history

from qsinkkv import CacheConfig, Rotary, SinkQuantCache, gather
from qsinkkv.layout import WindowLayout
from qsinkkv.paged import PagedCache, PoolExhausted, block_bytes, sequence_bytes

HKV, G, D = 2, 2, 8
ROT = Rotary.from_schedule(D, base=100.0)


def held_blocks(cache):
    """Per kind, the blocks the tables name (each must appear once)."""
    first = cache.layers[0]
    return {"sink": first.sink_table.tolist(),
            "float": [x for x in first.float_table.flatten().tolist() if x >= 0],
            "quant": [x for x in first.quant_table.flatten().tolist() if x >= 0]}


def check_accounting(cache):
    """Blocks held = what the lengths need; none shared between sequences; held + free = the pool."""
    held = held_blocks(cache)
    L, bs = cache.layout, cache.config.block_size
    lens = torch.stack([layer.seq_lens for layer in cache.layers]).amax(0).tolist() if cache.batch_size else []
    m = [L.recent_count(n) for n in lens]
    assert len(held["float"]) == sum(min(-(-x // bs), L.float_slots) for x in m)
    assert len(held["quant"]) == sum(min(L.quantized_blocks(x), L.quant_slots) for x in m)
    assert len(held["sink"]) == cache.batch_size
    for kind, blocks in held.items():
        free = cache.blocks.free[kind]
        assert len(set(blocks)) == len(blocks), f"a {kind} block is shared"
        assert not set(blocks) & set(free), f"a held {kind} block is also free"
        assert sorted(blocks + free) == list(range(cache.blocks.sizes[kind])), f"{kind} blocks leaked or duplicated"
    assert cache.blocks_in_use() == {kind: len(b) for kind, b in held.items()}
    sizes = block_bytes(cache.config, HKV, D)
    assert cache.nbytes_in_use() == cache.num_layers * sum(sizes[k] * len(b) for k, b in held.items())
    for layer in cache.layers:  # tables are shared by every layer
        assert layer.quant_table is cache.layers[0].quant_table and layer.float_table is cache.layers[0].float_table


OPS = st.one_of(st.tuples(st.just("admit")), st.tuples(st.just("release"), st.integers(0, 7)),
                st.tuples(st.just("step"), st.lists(st.sampled_from([0, 1, 1, 1, 2, 5, 9]), min_size=8, max_size=8)))


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), S=st.integers(0, 3), W=st.integers(1, 10), bs=st.integers(1, 4),
       R=st.integers(0, 3), rope=st.booleans(), seed=st.integers(0, 2**31),
       ops=st.lists(OPS, min_size=1, max_size=25))
def test_schedule_equals_each_sequence_alone(bits, S, W, bs, R, rope, seed, ops):
    """Random admit / step / release schedules over a pool with room for 3 sequences: every output
    equals the sequence's own plain cache and the float64 oracle; the accounting holds after every
    call; bad calls (unknown or released ids, a full pool) raise and change nothing."""
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=2,
                      residual_tokens=min(R, W), positions="cache_index" if rope else "absolute")
    rotary = ROT if rope else None
    layers = 2
    pool = PagedCache.for_bytes(cfg, layers, HKV, D, 3 * sequence_bytes(cfg, layers, HKV, D), dtype=torch.float32,
                                rotary=rotary)
    assert pool.blocks.sizes["sink"] == 3
    g = torch.Generator().manual_seed(seed)
    alone, history, released = {}, {}, []
    for op in ops + [("step", [1] * 8)]:
        if op[0] == "admit":
            if pool.batch_size == 3:
                snap = snapshot(pool)
                with pytest.raises(PoolExhausted, match="max_seqs=3"):
                    pool.admit()
                assert_unchanged(pool, snap)
                continue
            sid = pool.admit()
            alone[sid] = SinkQuantCache(cfg, layers, 1, HKV, D, dtype=torch.float32, rotary=rotary)
            history[sid] = []
        elif op[0] == "release":
            if not pool.seq_ids or op[1] % 2 and released:  # a released id (or none): refused, nothing changes
                snap = snapshot(pool)
                with pytest.raises(KeyError, match="admitted sequence id"):
                    pool.release(released[-1] if released else 99)
                assert_unchanged(pool, snap)
                continue
            sid = pool.seq_ids[op[1] % pool.batch_size]
            pool.release(sid)
            released.append(sid)
        elif pool.batch_size:
            lens = op[1][:pool.batch_size]
            T = max(max(lens), 1)
            if released:  # a step naming a released sequence
                snap = snapshot(pool)
                with pytest.raises(KeyError, match="admitted sequence id"):
                    pool.reserve({released[-1]: 1})
                assert_unchanged(pool, snap)
            B = pool.batch_size
            q, k, v = (bf16_exact(B, h, T, D, generator=g) for h in (HKV * G, HKV, HKV))
            for layer in range(layers):
                out = pool.attend(layer, q, k, v, lens)
                for b, (sid, t) in enumerate(zip(pool.seq_ids, lens)):
                    if t == 0:
                        assert out[b].abs().max() == 0
                        continue
                    n0 = alone[sid].get_seq_length(layer)
                    own = alone[sid].attend(layer, q[b:b + 1, :, :t], k[b:b + 1, :, :t], v[b:b + 1, :, :t])
                    assert rel(out[b:b + 1, :, :t], own) < 1e-5
                    if layer:
                        continue
                    history[sid].append((k[b:b + 1, :, :t], v[b:b + 1, :, :t]))
                    hk, hv = (torch.cat([h[i] for h in history[sid]], 2) for i in (0, 1))
                    if t == 1:
                        kv = stored_history(hk, hv, n0 + 1, cfg)
                    else:
                        prior = stored_history(hk, hv, n0, cfg)
                        kv = tuple(torch.cat((p, h[:, :, n0:].double()), 2) for p, h in zip(prior, (hk, hv)))
                    ref = attention_oracle(q[b:b + 1, :, :t], lambda i: kv, S, W, range(n0, n0 + t), rotary)
                    assert rel(out[b:b + 1, :, :t], ref) < 1e-5
        check_accounting(pool)
    for b, sid in enumerate(pool.seq_ids):  # storage read through the tables = the sequence's own
        assert pool.seq_lens()[b] == alone[sid].seq_length
        kp, vp, pos = gather(pool.layers[1], torch.float32)
        ka, va, pa = gather(alone[sid].layers[1], torch.float32)
        seen = pos[b] >= 0
        assert torch.equal(pos[b][seen], pa[0][pa[0] >= 0])


def test_pool_exhausted_changes_nothing_and_release_makes_room():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4)
    pool = PagedCache(cfg, 2, HKV, D, max_seqs=3, float_blocks=3, quant_blocks=5, dtype=torch.float32)
    a, b = pool.admit(), pool.admit()
    draw = lambda T: tuple(torch.randn(2, h, T, D) for h in (HKV * G, HKV, HKV))  # noqa: E731
    for layer in range(2):
        pool.attend(layer, *draw(6))      # 4 recent tokens each: 2 quantized blocks each, 4 of 5 taken
    snap = snapshot(pool)
    with pytest.raises(PoolExhausted, match="quant blocks"):
        pool.attend(0, *draw(4))          # both sequences fill their rings: 8 quantized blocks > 5
    assert_unchanged(pool, snap)
    with pytest.raises(PoolExhausted, match="quant blocks"):
        pool.reserve([4, 4])
    assert_unchanged(pool, snap)
    pool.release(a)
    check_accounting(pool)
    assert pool.seq_ids == [b]
    one = tuple(x[:1] for x in draw(4))
    for layer in range(2):
        pool.attend(layer, *one)
    check_accounting(pool)


def test_refused_step_in_a_later_layer_gives_its_new_blocks_back():
    """A NaN in layer 1 rolls layer 0 back and returns the blocks layer 0's store took."""
    cfg = CacheConfig(sink_tokens=1, recent_tokens=6, bits=8, block_size=2, value_group_size=4)
    pool = PagedCache(cfg, 2, HKV, D, max_seqs=2, float_blocks=4, quant_blocks=6, dtype=torch.float32)
    pool.admit()
    q, k, v = (torch.randn(1, h, 3, D) for h in (HKV * G, HKV, HKV))
    for layer in range(2):
        pool.attend(layer, q, k, v)
    snap = snapshot(pool)
    q, k, v = (torch.randn(1, h, 6, D) for h in (HKV * G, HKV, HKV))
    pool.attend(0, q, k, v)
    assert pool.blocks_in_use()["quant"] > len(snap[2][0][3][snap[2][0][3] >= 0])  # layer 0 took blocks
    bad = k.clone()
    bad[0, 0, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        pool.attend(1, q, bad, v)
    assert_unchanged(pool, snap)
    check_accounting(pool)


def test_packed_input_equals_padded_and_slot_mapping_names_where_tokens_land():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=9, bits=4, block_size=3, value_group_size=4, residual_tokens=2)
    padded = PagedCache(cfg, 1, HKV, D, max_seqs=3, float_blocks=9, quant_blocks=9, dtype=torch.float32)
    packed = PagedCache(cfg, 1, HKV, D, max_seqs=3, float_blocks=9, quant_blocks=9, dtype=torch.float32)
    for c in (padded, packed):
        c.admit(), c.admit(), c.admit()
    g = torch.Generator().manual_seed(3)
    for lens in ([5, 0, 2], [1, 1, 1], [0, 7, 1], [13, 1, 0], [1, 1, 1]):
        T = max(lens)
        q, k, v = (torch.randn(3, h, T, D, generator=g) for h in (HKV * G, HKV, HKV))
        real = torch.arange(T) < torch.tensor(lens).unsqueeze(1)
        meta = packed.reserve(lens)
        assert meta.query_start_loc.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
        pack = lambda x: x.transpose(1, 2)[real]  # noqa: E731
        out = packed.attend_packed(0, pack(q), pack(k), pack(v), meta.query_start_loc)
        ref = padded.attend(0, q, k, v, lens)
        assert torch.equal(out, pack(ref))
        assert meta.seq_lens.tolist() == packed.seq_lens().tolist()
        new_k = pack(k)                                                   # [N, Hkv, D]
        ring = packed.layers[0].float_k                                   # [Hkv, blocks, bs, D]
        flat = ring.flatten(1, 2)
        for i, slot in enumerate(meta.slot_mapping.tolist()):
            if slot >= 0:
                assert torch.equal(flat[:, slot], new_k[i].to(ring.dtype))
        assert (meta.slot_mapping >= 0).any()
    with pytest.raises(ValueError, match="query_start_loc must be"):
        packed.attend_packed(0, torch.randn(3, HKV * G, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D), [0, 1, 2])


def test_a_step_refused_in_a_later_layer_leaves_the_free_lists_in_their_order():
    """A step that layer 0 took for two sequences, each taking new blocks, refused at layer 1:
    lengths, tables and which blocks are free came back, but the free lists came back reordered (the blocks given
    back row by row in the order they were taken), so later steps took other blocks. Now in their order."""
    cfg = CacheConfig(sink_tokens=1, recent_tokens=6, bits=8, block_size=2, value_group_size=4)
    pool = PagedCache(cfg, 2, HKV, D, max_seqs=3, float_blocks=8, quant_blocks=12, dtype=torch.float32)
    for _ in range(3):
        pool.admit()
    q, k, v = (torch.randn(3, h, 3, D) for h in (HKV * G, HKV, HKV))
    for layer in range(2):
        pool.attend(layer, q, k, v, [3, 2, 3])
    snap = snapshot(pool)
    q, k, v = (torch.randn(3, h, 5, D) for h in (HKV * G, HKV, HKV))
    pool.attend(0, q, k, v, [5, 1, 4])
    bad = k.clone()
    bad[2, 0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        pool.attend(1, q, bad, v, [5, 1, 4])
    assert_unchanged(pool, snap)
    check_accounting(pool)


def test_packed_refusals_name_the_input_and_change_nothing():
    """Values are checked on the packed tokens themselves (the sinks' dtype for a sequence's first tokens, the
    window's after), shapes by name; a refused packed step leaves the pool as it was."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=8, bits=4, block_size=2, value_group_size=4)
    pool = PagedCache(cfg, 1, HKV, D, max_seqs=3, float_blocks=6, quant_blocks=12, dtype=torch.float32)
    for _ in range(3):
        pool.admit()
    pool.attend_packed(0, torch.randn(6, HKV * G, D), torch.randn(6, HKV, D), torch.randn(6, HKV, D), [0, 4, 5, 6])
    snap = snapshot(pool)
    qsl = [0, 1, 4, 5]                                        # row 1 crosses its last sink, rows 0 and 2 decode
    fresh = lambda: [torch.randn(5, h, D) for h in (HKV * G, HKV, HKV)]  # noqa: E731
    for which, token, value, match in ((1, 0, float("nan"), "k contains NaN"),      # a one-token row
                                       (2, 1, float("inf"), "v contains NaN"),      # the longer row's sink token
                                       (1, 3, 3.4e38, "k contains NaN"),             # past bf16: window_dtype
                                       (0, 4, float("nan"), "q contains NaN")):
        q, k, v = fresh()
        (q, k, v)[which][token, 0, 0] = value
        with pytest.raises(ValueError, match=match):
            pool.attend_packed(0, q, k, v, qsl)
        assert_unchanged(pool, snap)
    q, k, v = fresh()
    for args, match in (((q[:, :3], k, v), r"q must be a packed \[N, H \(a positive multiple of Hkv=2\)"),
                        ((q, k[..., :4], v), "k must be a packed"),
                        ((q, k, v.double()), "v.dtype must be the cache dtype"),
                        ((q, k, v[:4]), "query_start_loc must be")):
        with pytest.raises(ValueError, match=match):
            pool.attend_packed(0, *args, qsl)
        assert_unchanged(pool, snap)
    with pytest.raises(ValueError, match="scale must be"):
        pool.attend_packed(0, q, k, v, qsl, scale=-1.0)
    assert_unchanged(pool, snap)
    out = pool.attend_packed(0, q, k, v, qsl)                 # the same step, valid, then goes through
    assert torch.isfinite(out).all() and pool.seq_lens().tolist() == [5, 4, 2]
    check_accounting(pool)


def test_bad_sizes_and_calls_are_named():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4)
    with pytest.raises(ValueError, match="quant_blocks must be an int >= 4"):
        PagedCache(cfg, 1, HKV, D, max_seqs=2, float_blocks=2, quant_blocks=3)
    with pytest.raises(ValueError, match="max_seqs must be an int >= 1"):
        PagedCache(cfg, 1, HKV, D, max_seqs=0, float_blocks=2, quant_blocks=4)
    with pytest.raises(ValueError, match="pool_bytes must be an int >="):
        PagedCache.for_bytes(cfg, 1, HKV, D, 10)
    pool = PagedCache(cfg, 1, HKV, D, max_seqs=2, float_blocks=2, quant_blocks=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="admit"):
        pool.attend(0, torch.randn(0, 4, 1, D), torch.randn(0, HKV, 1, D), torch.randn(0, HKV, 1, D))
    a = pool.admit()
    pool.admit()
    with pytest.raises(ValueError, match="cannot repeat"):
        pool.select_batch([0, 0])
    pool.select_batch([1])
    assert pool.seq_ids == [a + 1]
    check_accounting(pool)


# --- reservations, refusals by name --------------------------------------------------

def test_a_step_gives_back_what_a_reservation_took_beyond_it():
    """Reserve({a: 8}) then one-token steps held the 8 tokens' blocks until crop/reset/release,
    and admitting b raised PoolExhausted although the pool fits it. Held == needed after every call."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4)
    L = cfg.recent_tokens // cfg.block_size
    pool = PagedCache(cfg, 2, HKV, D, max_seqs=2, float_blocks=2, quant_blocks=L + 1, dtype=torch.float32)
    a = pool.admit()
    pool.reserve({a: 10})
    assert pool.blocks_in_use()["quant"] == L  # the reservation holds what 10 tokens need
    for _ in range(4):
        for layer in range(2):
            pool.attend(layer, *(torch.randn(1, h, 1, D) for h in (HKV * G, HKV, HKV)))
        check_accounting(pool)                  # the first step gave the rest back
    b = pool.admit()
    for _ in range(6):  # b alone grows to 2 quantized blocks: 1 + 2 fit in 5, the reservation's 4 + 2 did not
        for layer in range(2):
            pool.attend(layer, *(torch.randn(2, h, 1, D) for h in (HKV * G, HKV, HKV)), lengths=[0, 1])
        check_accounting(pool)
    assert pool.seq_ids == [a, b]


def test_refused_reservation_after_a_larger_one_changes_nothing():
    """A reservation that cannot grow leaves the earlier one in place (all or none)."""
    cfg = CacheConfig(sink_tokens=1, recent_tokens=8, bits=8, block_size=2, value_group_size=4)
    pool = PagedCache(cfg, 1, HKV, D, max_seqs=2, float_blocks=2, quant_blocks=5, dtype=torch.float32)
    a, b = pool.admit(), pool.admit()
    pool.reserve({a: 9})
    snap = snapshot(pool)
    with pytest.raises(PoolExhausted):
        pool.reserve({a: 9, b: 9})
    assert_unchanged(pool, snap)


def test_packed_step_with_no_sequence_says_admit():
    """Max() of an empty reduction before."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4)
    pool = PagedCache(cfg, 1, HKV, D, max_seqs=2, float_blocks=2, quant_blocks=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"admit\(\) one first"):
        pool.attend_packed(0, torch.randn(0, HKV * G, D), torch.randn(0, HKV, D), torch.randn(0, HKV, D), [0])
    assert pool.blocks_in_use() == {"sink": 0, "float": 0, "quant": 0}


@pytest.mark.parametrize("pool_bytes", [2**70, 10**30])
def test_a_pool_larger_than_the_device_is_named(pool_bytes):
    """A torch overflow error before; now pool_bytes and what the device holds."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4)
    with pytest.raises(ValueError, match=r"pool_bytes=\d+ is more than cpu has \(\d+ bytes\)"):
        PagedCache.for_bytes(cfg, 1, HKV, D, pool_bytes)


# --- pooled = alone, bit for bit (the probe's defect: a chunk padded to its neighbours' lengths) ---------

# Row lengths per step (0: the row waits); rows join as the steps name more of them. Rows of one length
# that differ in what they hold (a fresh row beside a held one, step 4), rows past the sinks and the window,
# decode rows beside prefill rows, a step of equal chunks, and chunks of two query tiles (T > 256) into rows
# holding fewer and more than S tokens (each reads the chunk's sinks its own way, step 7).
POOLED_STEPS = [[5, 9, 2], [1, 6, 13], [11, 1, 0], [9, 2, 1, 9], [20, 7, 1, 16], [0, 0, 0, 0, 1],
                [0, 0, 260, 0, 260], [4, 4, 4, 4, 4], [1, 1, 1, 1, 1]]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("bits,R", [(16, 0), (8, 0), (4, 0), (4, 3)], ids=["bits16", "int8", "int4", "int4-residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("backend", ["torch", "c"])
def test_chunk_steps_pooled_equal_each_sequence_alone_bit_for_bit(backend, dtype, bits, R, packed):
    """Every row of a pooled step (padded ``attend`` or packed ``attend_packed``) equals, bit for bit, the same
    sequence run alone through the same steps in a pool of its own. Before, the prefill padded every longer row
    to the step's longest chunk (and read the chunk's sinks of the row holding the fewest tokens): masked keys
    that still lengthen SDPA's sums over the keys, up to 2.4e-7 apart from the row alone in float32."""
    pooled_equals_alone(CacheConfig(sink_tokens=3, recent_tokens=12, bits=bits, block_size=4, value_group_size=4,
                                    residual_tokens=R), backend, dtype, packed)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("rope,logits", [(True, False), (False, True), (True, True)],
                         ids=["cache_index", "sink_logits", "cache_index-sink_logits"])
def test_reference_prefill_pooled_equals_alone_bit_for_bit(rope, logits, packed):
    """The same through the reference prefill and decode (the cache_index contract, learned sink logits): the
    reference's softmax and ``probs @ v`` sum over the keys too."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=12, bits=4, block_size=4, value_group_size=4, residual_tokens=3,
                      positions="cache_index" if rope else "absolute")
    logits = torch.randn(HKV * G, generator=torch.Generator().manual_seed(1)) if logits else None
    pooled_equals_alone(cfg, "torch", torch.float32, packed, rotary=ROT if rope else None, sink_logits=logits)


def pooled_equals_alone(cfg, backend, dtype, packed, rotary=None, sink_logits=None):
    """``POOLED_STEPS`` through one pool and through each sequence's own pool: every output row equal, bit for
    bit. The pools start full of random finite values: a read of another sequence's blocks would show."""
    fs, qs = WindowLayout(cfg).float_slots, WindowLayout(cfg).quant_slots
    n = len(POOLED_STEPS[-1])
    make = lambda seqs: PagedCache(cfg, 1, HKV, D, max_seqs=seqs, float_blocks=seqs * fs,  # noqa: E731
                                   quant_blocks=seqs * qs, dtype=dtype, backend=backend, rotary=rotary)
    pool, alone = make(n), [make(1) for _ in range(n)]
    g = torch.Generator().manual_seed(cfg.bits + cfg.residual_tokens)
    for cache in (pool, *alone):
        for t in cache.layers[0].tensors().values():
            t.copy_(torch.randint(0, 256, t.shape, generator=g) if t.dtype == torch.uint8 else
                    torch.randn(t.shape, generator=g))
    for lens in POOLED_STEPS:
        while pool.batch_size < len(lens):
            pool.admit(), alone[pool.batch_size - 1].admit()
        B, T = len(lens), max(lens)
        q, k, v = (torch.randn(B, h, T, D, generator=g).to(dtype) for h in (HKV * G, HKV, HKV))
        if packed:
            real = torch.arange(T) < torch.tensor(lens).unsqueeze(1)
            qsl = [0, *torch.tensor(lens).cumsum(0).tolist()]
            out = pool.attend_packed(0, *(x.transpose(1, 2)[real] for x in (q, k, v)), qsl, sink_logits=sink_logits)
            rows = [out[qsl[b]:qsl[b + 1]] for b in range(B)]
        else:
            out = pool.attend(0, q, k, v, lens, sink_logits=sink_logits)
            rows = [out[b, :, :t].transpose(0, 1) for b, t in enumerate(lens)]
        for b, t in enumerate(lens):
            if t == 0:
                continue
            if packed:
                own = alone[b].attend_packed(0, *(x[b, :, :t].transpose(0, 1) for x in (q, k, v)), [0, t],
                                             sink_logits=sink_logits)
            else:
                own = alone[b].attend(0, *(x[b:b + 1, :, :t] for x in (q, k, v)), sink_logits=sink_logits)
                own = own[0].transpose(0, 1)
            assert torch.equal(rows[b], own), \
                f"step {lens}, row {b}: max diff {(rows[b].double() - own.double()).abs().max().item():.3g}"
    assert pool.seq_lens().tolist() == [a.seq_length for a in alone]
