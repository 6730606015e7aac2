"""qsinkkv over an engine's block pool (engine_pages.py), driven by a small engine in the test: pages
taken and handed back as ``pages_needed`` / ``first_page`` say, freed and new pages full of random bytes
(NaN and inf patterns included), rows in any order, sequences that start and finish. Every step's output
must equal ``PagedCache`` fed the same K/V, bit for bit."""
import random

import pytest
import torch
from helpers import rel

from qsinkkv import CacheConfig, trace
from qsinkkv.engine_pages import (
    EngineStep,
    LayerPools,
    PageLayout,
    attend_packed,
    first_page,
    max_pages,
    pages_needed,
    step_tables,
    storages,
)
from qsinkkv.layout import WindowLayout
from qsinkkv.ops import select_ops
from qsinkkv.paged import PagedCache, block_bytes

Hkv, G, D = 2, 3, 16


class Engine:
    """The engine side: a page pool with a free list, a block table per sequence (logical -> page)."""

    def __init__(self, pages, num_pages, seed):
        self.layout, self.pinned, self.g = pages.layout, pages.pinned, torch.Generator().manual_seed(seed)
        self.free = list(range(1, num_pages))  # page 0: the null page, zeros, never handed out
        random.Random(seed).shuffle(self.free)
        self.tables, self.held = {}, {}

    def garbage(self, pages, buf):
        for p in pages:
            buf[p] = torch.randint(0, 256, (buf.shape[1],), dtype=torch.uint8, generator=self.g)

    def schedule(self, seq, n, t, buf):
        """Before a step that brings t tokens to seq (holding n): hand back what no query sees, take what it needs."""
        table = self.tables.setdefault(seq, [])
        window = range(self.pinned, min(first_page(self.layout, self.pinned, n), len(table)))
        gone = [table[j] for j in window if table[j] != 0]
        for j in window:
            table[j] = 0
        self.free += gone
        self.garbage(gone, buf)
        while len(table) < pages_needed(self.layout, self.pinned, n + t):
            table.append(self.free.pop(0))
        assert sum(p != 0 for p in table) <= max_pages(self.layout, self.pinned, t)

    def finish(self, seq, buf):
        pages = [p for p in self.tables.pop(seq) if p]
        self.free += pages
        self.garbage(pages, buf)

    def block_table(self, seqs, width):
        out = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            out[i, :len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        return out


def _schedule(seed, steps=40):
    """Per step: {seq: new tokens}; sequences start, stream (decode or chunks) and finish."""
    rng = random.Random(seed)
    live, plan, next_id = {}, [], 0
    for _ in range(steps):
        if len(live) < 4 and rng.random() < 0.5:
            live[next_id] = 0
            next_id += 1
        step = {}
        for s in list(live):
            if rng.random() < 0.15:
                continue  # not scheduled this step
            t = rng.choice([1, 1, 1, 1, rng.randint(2, 40)]) if live[s] else rng.randint(1, 60)
            step[s] = t
            live[s] += t
        finished = [s for s in live if live[s] > 30 and rng.random() < 0.1]
        for s in finished:
            del live[s]
        plan.append((step, finished))
    return plan


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("backend", ["torch", "c"])
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("through", ["attend_packed", "EngineStep", "EngineStep into bf16",
                                     "attend_packed, learned sinks", "EngineStep, learned sinks"])
def test_engine_pages_equal_paged_cache(bits, backend, shuffled, through):
    """Rows in PagedCache's order or in the engine's own (shuffled): bit for bit (a row's prefill reads exactly the
    keys it reads alone, whatever its neighbours: ``prefill._by_key_set``). ``EngineStep`` (what the vLLM backend
    calls: the decode steps in two C calls on the c backend) gives the same; written into the engine's bf16 output
    buffer (``out=``), the same bits as PagedCache's result rounded by ``.to(bfloat16)``. With learned sink logits
    (gpt-oss; one head's -inf: no sink), the same bits as PagedCache given the same logits."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=40, bits=bits, block_size=8, value_group_size=8,
                      sink_dtype=torch.bfloat16, window_dtype=torch.bfloat16, scale_dtype=torch.float16)
    layout = WindowLayout(cfg)
    pl = PageLayout.of(cfg, Hkv, D)
    num_pages = 64
    raw = torch.zeros(num_pages, pl.page_bytes + 32, dtype=torch.uint8)   # rows further apart than a page
    buf = raw[:, :pl.page_bytes]
    engine = Engine(pl, num_pages, seed=bits)
    engine.garbage(range(1, num_pages), buf)
    layer = LayerPools(pl.views(buf))
    ops = select_ops(backend, torch.device("cpu"), D, None)
    ref = PagedCache(cfg, 1, Hkv, D, max_seqs=8, float_blocks=32, quant_blocks=64, dtype=torch.float32,
                     backend=backend)
    ids, held, fused = {}, {}, 0
    g = torch.Generator().manual_seed(bits + 1)
    sink_logits = None
    if through.endswith("learned sinks"):
        sink_logits = torch.randn(Hkv * G, generator=g) * 2
        sink_logits[1] = float("-inf")
    for step, finished in _schedule(seed=bits):
        for s in step:
            if s not in ids:
                ids[s], held[s] = ref.admit(), 0
        seqs = list(step)
        seqs.sort(key=lambda s: ids[s])                              # PagedCache's row order (admission)
        if shuffled:
            random.Random(len(seqs)).shuffle(seqs)                   # the engine's row order is its own
        if not seqs:
            continue
        for s in seqs:
            engine.schedule(s, held[s], step[s], buf)
        lens = torch.tensor([step[s] for s in seqs], dtype=torch.int64)
        qsl = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0)))
        N = int(qsl[-1])
        q = torch.randn(N, Hkv * G, D, generator=g)
        k, v = torch.randn(N, Hkv, D, generator=g), torch.randn(N, Hkv, D, generator=g)
        before = torch.tensor([held[s] for s in seqs], dtype=torch.int64)
        width = max(len(engine.tables[s]) for s in seqs) + 2
        tables = step_tables(pl, engine.block_table(seqs, width), before, lens)
        into = None
        if through.startswith("EngineStep"):
            engine_step = EngineStep(layout, before, lens, tables)
            into = torch.full(q.shape, float("nan"), dtype=torch.bfloat16) if through.endswith("bf16") else None
            with trace.recording() as ran:
                out = engine_step.attend(ops, layer, q, k, v, out=into, sink_logits=sink_logits)
            assert into is None or out is into
            fused += ("engine_step", "c") in ran
        else:
            read, store = storages(layer, layout, tables, before)
            out = attend_packed(ops, read, store, q, k, v, qsl, sink_logits=sink_logits)
            assert store.seq_lens.tolist() == (before + lens).tolist()
        # the same K/V through PagedCache: every admitted row, in its own order (0 tokens: it waits)
        rows = ref.seq_ids
        row_of = {ids[s]: i for i, s in enumerate(seqs)}
        ref_lens = torch.tensor([step_by_id(step, ids, sid) for sid in rows], dtype=torch.int64)
        ref_qsl = torch.cat((torch.zeros(1, dtype=torch.int64), ref_lens.cumsum(0)))
        order = torch.cat([torch.arange(int(qsl[row_of[sid]]), int(qsl[row_of[sid] + 1]))
                           for sid in rows if sid in row_of])
        expect = ref.attend_packed(0, q[order].float(), k[order].float(), v[order].float(), ref_qsl,
                                   sink_logits=sink_logits)
        if into is not None:
            expect = expect.to(torch.bfloat16)
        assert torch.equal(out[order], expect), f"step {step}: max diff {(out[order] - expect).abs().max()}"
        for s in seqs:
            held[s] += step[s]
        for s in finished:
            engine.finish(s, buf)
            ref.release(ids.pop(s))
            del held[s]
    assert (fused >= 5) == (through.startswith("EngineStep") and backend == "c"), fused


def step_by_id(step, ids, sid):
    return next((t for s, t in step.items() if ids[s] == sid), 0)


@pytest.mark.parametrize("shape", [(3, 64, 32, 32), (8, 128, 64, 64), (1, 16, 8, 8), (2, 16, 16, 4)])
@pytest.mark.parametrize("bits", [8, 4])
def test_page_bytes_match_paged_cache_blocks(bits, shape):
    """A page holds one quantized block of every head (what PagedCache's quantized block holds), or a sink page, or
    ``float_block_rows`` rows of the filling block: it spans the fewest pages whose rows fit the page (at the
    default shape a bf16 block is 3.2 int4 pages: 4 pages of 8 rows; 1.8 int8 pages: 2 of 16), and no page grows
    for it."""
    Hkv_, D_, bs, group = shape
    cfg = CacheConfig(sink_tokens=4, recent_tokens=252, bits=bits, block_size=bs, value_group_size=group)
    pl = PageLayout.of(cfg, Hkv_, D_)
    sizes = block_bytes(cfg, Hkv_, D_)
    assert pl.page_bytes == max(sizes["quant"], sizes["sink"]) + (-max(sizes["quant"], sizes["sink"]) % 16)
    F, rows = pl.float_pages, pl.float_block_rows
    region = lambda r: -(-Hkv_ * r * D_ * 2 // 16) * 16  # noqa: E731  (bf16 K or V rows of every head, aligned)
    assert F * rows >= bs and 2 * region(rows) <= pl.page_bytes
    assert F == 1 or 2 * region(-(-bs // (F - 1))) > pl.page_bytes   # the fewest pages
    if shape == (3, 64, 32, 32):
        assert (F, rows) == ({4: 4, 8: 2}[bits], {4: 8, 8: 16}[bits])
    views = pl.views(torch.zeros(2, pl.page_bytes, dtype=torch.uint8))
    assert views["float_k"].shape == (Hkv_, 2, rows, D_) and views["float_k"].dtype == cfg.window_dtype


def test_refusals_name_the_input():
    cfg = CacheConfig(sink_tokens=4, recent_tokens=60, bits=16, block_size=16)
    with pytest.raises(ValueError, match="bits"):
        PageLayout.of(cfg, 2, 16)
    with pytest.raises(ValueError, match="residual_tokens"):
        PageLayout.of(CacheConfig(recent_tokens=60, residual_tokens=8, block_size=16, value_group_size=16), 2, 16)
    pl = PageLayout.of(CacheConfig(recent_tokens=60, block_size=16, value_group_size=16), 2, 16)
    with pytest.raises(ValueError, match="pages must be uint8"):
        pl.views(torch.zeros(4, pl.page_bytes, dtype=torch.float32))
    with pytest.raises(ValueError, match="aligned"):
        pl.views(torch.zeros(4, pl.page_bytes + 3, dtype=torch.uint8)[:, :pl.page_bytes])
    pl = PageLayout.of(CacheConfig(sink_tokens=4, recent_tokens=60, block_size=16, value_group_size=16), 2, 16)
    assert (pl.float_pages, pl.float_block_rows) == (3, 6)  # 16 rows of bf16 K and V in 3 pages of 768 bytes
    floats = [5, 6, 7]
    with pytest.raises(RuntimeError, match="null page"):   # a step that completes a block into a page never given
        step_tables(pl, torch.tensor([[3, *floats, 0]]), torch.tensor([19]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="null page"):   # a window token whose float page was never given
        step_tables(pl, torch.tensor([[3, 5, 0, 7]]), torch.tensor([4]), torch.tensor([1]))


def test_refused_step_changes_no_page_ring_or_length():
    """Non-finite K/V or q is refused by name before the step writes: every page byte (float pages included) and
    the lengths stay as they were."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=40, bits=4, block_size=8, value_group_size=8)
    layout = WindowLayout(cfg)
    pl = PageLayout.of(cfg, Hkv, D)
    buf = torch.zeros(1 + 2 * (pl.pinned + 3), pl.page_bytes, dtype=torch.uint8)
    pools = pl.views(buf)
    ops = select_ops("torch", torch.device("cpu"), D, None)
    g = torch.Generator().manual_seed(0)
    table = 1 + torch.arange(2 * (pl.pinned + 3)).view(2, -1)
    held, lens = torch.tensor([0, 0]), torch.tensor([12, 5])   # two prompts: both complete a block
    for bad in ("k", "v", "q"):
        qsl = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0)))
        q = torch.randn(17, Hkv * G, D, generator=g)
        k, v = torch.randn(17, Hkv, D, generator=g), torch.randn(17, Hkv, D, generator=g)
        {"k": k, "v": v, "q": q}[bad][9, 0, 1] = float("nan")
        tables = step_tables(pl, table, held, lens)
        read, store = storages(LayerPools(pools), layout, tables, held)
        before = (buf.clone(), store.seq_lens.clone())
        with pytest.raises(ValueError, match=bad):
            attend_packed(ops, read, store, q, k, v, qsl)
        assert torch.equal(buf, before[0])
        assert torch.equal(store.seq_lens, before[1]) and torch.equal(read.seq_lens, before[1])
    k[9, 0, 1] = v[9, 0, 1] = q[9, 0, 1] = 0.5   # the same step, finite: it does write the pages and a ring
    attend_packed(ops, read, store, q, k, v, qsl)
    assert not torch.equal(buf, before[0]) and store.float_k[:, tables[1].flatten()].any()
    assert store.seq_lens.tolist() == [12, 5]


@pytest.mark.parametrize("bad", ["k", "v", "q", "scale", "out", "sink_logits"])
def test_a_refused_decode_step_runs_the_named_refusal(bad):
    """A decode step (every row one token) that the fused C path refuses -- non-finite k, v or q, or a block
    whose scale overflows fp16 -- raises by name (``step.check_values``' error, ``quant.scale_overflow``'s), having
    written nothing: every page byte (float pages included) and the lengths stay as they were; no other kernel
    ran. An output buffer it cannot write (float64) and NaN learned sink logits are refused by name before anything
    is written."""
    if not select_ops("auto", torch.device("cpu"), D, None).engine_decode:
        pytest.skip("no C decode")
    cfg = CacheConfig(sink_tokens=3, recent_tokens=40, bits=4, block_size=8, value_group_size=8)
    layout, pl = WindowLayout(cfg), PageLayout.of(cfg, Hkv, D)
    buf = torch.zeros(1 + 2 * (pl.pinned + 3), pl.page_bytes, dtype=torch.uint8)
    pools = pl.views(buf)
    ops = select_ops("c", torch.device("cpu"), D, None)
    g = torch.Generator().manual_seed(1)
    table = 1 + torch.arange(2 * (pl.pinned + 3)).view(2, -1)

    def step(held, lens, poison=None):
        qsl = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0)))
        N = int(qsl[-1])
        q, k, v = torch.randn(N, Hkv * G, D, generator=g), torch.randn(N, Hkv, D, generator=g), \
            torch.randn(N, Hkv, D, generator=g)
        if poison == "scale":   # row 1 completes a block at this step: a value beyond fp16 cannot be its zero
            k[1, 0, 0] = -1e6
        elif poison in ("k", "v", "q"):
            {"k": k, "v": v, "q": q}[poison][1, 0, 1] = float("nan")
        tables = step_tables(pl, table, held, lens)
        engine_step = EngineStep(layout, held, lens, tables)
        assert engine_step.fused(ops) == (poison is not None)
        out = torch.empty(q.shape, dtype=torch.float64) if poison == "out" else None
        sink_logits = torch.randn(Hkv * G, generator=g)
        if poison == "sink_logits":
            sink_logits[2] = float("nan")
        return engine_step.attend(ops, LayerPools(pools), q, k, v, out=out, sink_logits=sink_logits)

    step(torch.tensor([0, 0]), torch.tensor([12, 10]))   # prompts (row 1 completes a block with its next token)
    held = torch.tensor([12, 10])
    before = buf.clone()
    with trace.recording() as ran, \
            pytest.raises(ValueError, match={"scale": "overflow scale_dtype", "out": "out must be"}.get(bad, bad)):
        step(held, torch.tensor([1, 1]), poison=bad)
    assert torch.equal(buf, before)
    # (out and the sink logits: refused before the kernel; a value the C step refused: named by the value checks,
    # the backend's own)
    assert set(ran) == (set() if bad in ("out", "sink_logits") else {("engine_step", "c"), ("value_checks", "c")}), ran


@pytest.mark.parametrize("bits", [4, 8])
def test_one_decode_step_over_many_layers_equals_each_alone(bits):
    """One ``EngineStep`` for every layer of a step, as the vLLM backend runs it: the C structs of the first layer
    are kept and a later layer changes only their pointers. Each layer (its own pages, q, k, v; q
    and k, v also as strided views of one fused qkv row, and two layers' q copied because their rows are not
    contiguous) must give, bit for bit, what ``attend_packed`` gives on a copy of that layer alone, and write
    the same bytes."""
    if not select_ops("auto", torch.device("cpu"), D, None).engine_decode:
        pytest.skip("no C decode")
    cfg = CacheConfig(sink_tokens=3, recent_tokens=40, bits=bits, block_size=8, value_group_size=8,
                      sink_dtype=torch.bfloat16, window_dtype=torch.bfloat16, scale_dtype=torch.float16)
    layout, pl = WindowLayout(cfg), PageLayout.of(cfg, Hkv, D)
    B, L, per = 3, 4, 12
    ops = select_ops("c", torch.device("cpu"), D, None)
    g = torch.Generator().manual_seed(bits)
    per += pl.pinned
    bufs = [torch.zeros(1 + B * per, pl.page_bytes, dtype=torch.uint8) for _ in range(L)]
    layers = [LayerPools(pl.views(buf)) for buf in bufs]  # once, as an engine makes them
    table = 1 + torch.arange(B * per).view(B, per)
    held = torch.zeros(B, dtype=torch.int64)
    fused = 0
    for lens in [torch.tensor([13, 6, 9])] + [torch.ones(B, dtype=torch.int64)] * 20:
        qsl = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0)))
        N = int(qsl[-1])
        tables = step_tables(pl, table, held, lens)
        engine_step = EngineStep(layout, held, lens, tables)
        for layer in range(L):
            qkv = torch.randn(N, (Hkv * G + 2 * Hkv) * D, generator=g, dtype=torch.bfloat16)
            q = qkv[:, :Hkv * G * D].view(N, Hkv * G, D)
            k = qkv[:, Hkv * G * D:(Hkv * G + Hkv) * D].view(N, Hkv, D)
            v = qkv[:, (Hkv * G + Hkv) * D:].view(N, Hkv, D)
            if layer >= 2:  # rows not contiguous: these layers read a copy of q and keep no structs
                q = torch.randn(N, D, Hkv * G, generator=g, dtype=torch.bfloat16).transpose(1, 2)
            copy = bufs[layer].clone()
            read, store = storages(LayerPools(pl.views(copy)), layout, tables, held)
            expect = attend_packed(ops, read, store, q, k, v, qsl, scale=0.3)
            with trace.recording() as ran:
                out = engine_step.attend(ops, layers[layer], q, k, v, scale=0.3)
            fused += ran == [("engine_step", "c")]
            assert torch.equal(out, expect), f"layer {layer}, lens {lens.tolist()}"
            assert torch.equal(bufs[layer], copy)
        held = held + lens
    assert fused == 20 * L


@pytest.mark.parametrize("through", ["attend_packed", "EngineStep"])
@pytest.mark.parametrize("backend", ["torch", "c"])
def test_a_block_table_past_the_pool_is_refused_before_any_page_is_touched(through, backend):
    """The probe's table ``[[1, 20]]`` over 16 pages, a 12-token prompt that completes a block: the C writer wrote
    508 bytes past the pool (ASan: SEGV in qsinkkv_complete_blocks). Refused by name, every page byte and length
    as it was; a negative page is refused by ``step_tables`` itself, and with the pool's size too."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=60, bits=4, block_size=8, value_group_size=8)
    layout, pl = WindowLayout(cfg), PageLayout.of(cfg, Hkv, D)
    raw = torch.zeros(17, pl.page_bytes, dtype=torch.uint8)            # one row more: the bytes past the pool
    buf = raw[:16]
    layer = LayerPools(pl.views(buf))
    ops = select_ops(backend, torch.device("cpu"), D, None)
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(12, Hkv * G, D, generator=g), torch.randn(12, Hkv, D, generator=g), \
        torch.randn(12, Hkv, D, generator=g)
    held, lens = torch.tensor([0]), torch.tensor([12])
    floats = list(range(2, 2 + pl.float_pages))
    tables = step_tables(pl, torch.tensor([[1, *floats, 20]]), held, lens)
    before = raw.clone()
    with pytest.raises(ValueError, match=r"quant_store \(from the engine's block_table\) must name blocks of this "
                                         r"layer's pages in \[0, 16\); got \[20\]"):
        if through == "EngineStep":
            EngineStep(layout, held, lens, tables).attend(ops, layer, q, k, v)
        else:
            attend_packed(ops, *storages(layer, layout, tables, held), q, k, v, torch.tensor([0, 12]))
    assert torch.equal(raw, before)
    with pytest.raises(ValueError, match=r"block_table must name blocks of the engine's pool in \[0, 16\)"):
        step_tables(pl, torch.tensor([[1, *floats, 20]]), held, lens, num_pages=16)
    with pytest.raises(ValueError, match=r"block_table must name blocks .*\[-3\]"):
        step_tables(pl, torch.tensor([[-3, *floats, 2]]), held, lens)
    # a decode step (fused on the C backend) whose table names a page past this layer's pool
    last = 2 + pl.float_pages
    tables = step_tables(pl, torch.tensor([[1, *floats, last]]), held, lens)
    attend_packed(ops, *storages(layer, layout, tables, held), q, k, v, torch.tensor([0, 12]))
    written = raw.clone()
    held = torch.tensor([19])                                          # its next token completes block 1 (page 30)
    tables = step_tables(pl, torch.tensor([[1, *floats, last, 30]]), held, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"must name blocks of this layer's pages in \[0, 16\); got \[30\]"):
        EngineStep(layout, held, torch.tensor([1]), tables).attend(ops, layer, q[:1], k[:1], v[:1])
    assert torch.equal(raw, written)


def test_the_triton_decode_reads_float_pages_of_another_size():
    """An engine's float pages hold fewer rows than a block: the Triton decode reads them through their strides (as
    the C and torch decodes do), equal to the reference (tests/test_kernels_pages.py covers the layouts in depth)."""
    from qsinkkv.decode import decode_attention_reference
    from qsinkkv.kernels.decode_attention import decode_attention
    cfg = CacheConfig(sink_tokens=3, recent_tokens=40, bits=4, block_size=8, value_group_size=8)
    layout, pl = WindowLayout(cfg), PageLayout.of(cfg, Hkv, D)
    assert pl.float_block_rows < cfg.block_size
    buf = torch.zeros(1 + pl.pinned + 3, pl.page_bytes, dtype=torch.uint8)
    held, lens = torch.tensor([0]), torch.tensor([12])
    tables = step_tables(pl, 1 + torch.arange(pl.pinned + 3).view(1, -1), held, lens)
    read, store = storages(LayerPools(pl.views(buf)), layout, tables, held)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(12, h, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
    attend_packed(select_ops("torch", torch.device("cpu"), D, None), read, store, q, k, v, torch.tensor([0, 12]))
    with trace.recording() as ran:
        out = decode_attention(q[:1], store)
    assert ran == [("decode", "triton")]
    assert rel(out, decode_attention_reference(q[:1], store)) < 1e-5
