"""The Triton decode kernel over pools that are not the cache's own contiguous ones: an engine's pages
(``qsinkkv/engine_pages.py``: every pool a strided view of one uint8 page tensor, the float ring in pages of
``float_block_rows`` rows that need not divide ``block_size``) and strided views of a cache's own pools (a slice of
a bigger tensor, a float ring regrouped in blocks of 2 x block_size rows). On the same storage it must equal the C
decode, the PyTorch reference and the float64 oracle on the K/V the storage holds, at the tolerances of
tests/test_kernels.py; a pool whose blocks are not contiguous is refused by name before any launch. The prefill too:
the reference, the torch ops' and the Triton kernel over an engine's pages, each asserting that it ran (``trace``)."""
import dataclasses
import importlib
import math

import pytest
import torch
from conftest import DEVICE, KERNEL_TOL
from helpers import filled_layer, rel_max, rel_rms
from oracle import attention_oracle, bf16_exact, stored_history
from test_kernels import check_decode, decode, decode_or_refused, tol

from qsinkkv import CacheConfig, Rotary, decode_c, trace
from qsinkkv.decode import decode_attention_reference
from qsinkkv.engine_pages import LayerPools, PageLayout, attend_packed, first_page, pages_needed, step_tables, storages
from qsinkkv.kernels.api import prefill_attention
from qsinkkv.ops import select_ops
from qsinkkv.prefill import prefill_attention_reference, prefill_attention_torch
from qsinkkv.storage import STORAGE_TENSORS

decode_mod = importlib.import_module("qsinkkv.kernels.decode_attention")  # the module, not the function
HKV, D = 2, 16
C_OK = decode_c.available()[0]


# --- an engine's pages, filled through a stream -------------------------------------------------------------

def chunks(n, steps=8):
    """Row of ``n`` tokens over ``steps`` steps: two prefill chunks then decode steps (0: the row waits), the
    last step one token for every row."""
    if n <= steps - 2:
        return [0] * (steps - n) + [1] * n
    p = n - (steps - 2)
    return [p - p // 2, p // 2] + [1] * (steps - 2)


def page_tensor(num_pages, page_bytes, shape, g):
    """The engine's pool: ``(raw, pages)``, pages ``[num_pages, page_bytes]`` uint8 a view of raw, full of random
    bytes (NaN and inf patterns included) but the null page 0 (zeros). shape: "plain", "padded" (rows 48 bytes
    wider than a page) or "vllm" (``[num_blocks, 1, 1, page_bytes]`` sliced ``[:, 0, 0]``)."""
    wide = {"plain": page_bytes, "padded": page_bytes + 48, "vllm": page_bytes}[shape]
    raw = torch.randint(0, 256, (num_pages, wide), dtype=torch.uint8, generator=g)
    raw[0] = 0
    if shape == "vllm":
        raw = raw.view(num_pages, 1, 1, wide)
    return raw, as_pages(raw, page_bytes)


def as_pages(raw, page_bytes):
    return (raw[:, 0, 0] if raw.dim() == 4 else raw)[:, :page_bytes]


def stream_into_pages(cfg, lengths, G, shape, seed):
    """Rows streamed into an engine's pages by the torch ops (``attend_packed``, as tests/test_engine_pages.py
    drives it): pages taken as ``pages_needed`` says, those no query sees any more handed back and overwritten
    with random bytes, fresh bf16-exact K/V at every step, the last step a decode step of every row.
    Returns the page layout, the raw pool, the last step's storage (``store``: what its decode read), its queries
    ``[B, H, D]``, the torch ops' decode of them, and each row's K/V ``[Hkv, n, D]``."""
    pl = PageLayout.of(cfg, HKV, D)
    layout, pinned = pl.layout, pl.pinned
    g = torch.Generator().manual_seed(seed)
    plan = [chunks(n) for n in lengths]
    num_pages = 1 + sum(pages_needed(layout, pinned, n) for n in lengths)
    raw, pages = page_tensor(num_pages, pl.page_bytes, shape, g)
    layer = LayerPools(pl.views(pages))
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    ops = select_ops("torch", torch.device("cpu"), D, None)
    tables, held = [[] for _ in lengths], [0] * len(lengths)
    history = [(torch.empty(HKV, 0, D), torch.empty(HKV, 0, D)) for _ in lengths]
    for step in range(len(plan[0])):
        rows = [b for b in range(len(lengths)) if plan[b][step]]
        for b in rows:
            table = tables[b]
            gone = range(pinned, min(first_page(layout, pinned, held[b]), len(table)))
            for j in gone:
                if table[j]:
                    pages[table[j]] = torch.randint(0, 256, (pl.page_bytes,), dtype=torch.uint8, generator=g)
                    free.append(table[j])
                    table[j] = 0
            while len(table) < pages_needed(layout, pinned, held[b] + plan[b][step]):
                table.append(free.pop(0))
        width = max(len(tables[b]) for b in rows)
        block_table = torch.zeros(len(rows), width, dtype=torch.int32)
        for i, b in enumerate(rows):
            block_table[i, :len(tables[b])] = torch.tensor(tables[b], dtype=torch.int32)
        before = torch.tensor([held[b] for b in rows], dtype=torch.int64)
        lens = torch.tensor([plan[b][step] for b in rows], dtype=torch.int64)
        read, store = storages(layer, layout, step_tables(pl, block_table, before, lens, num_pages=num_pages),
                               before)
        N = int(lens.sum())
        q = torch.randn(N, HKV * G, D, generator=g)
        k, v = bf16_exact(N, HKV, D, generator=g), bf16_exact(N, HKV, D, generator=g)
        qsl = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0)))
        out = attend_packed(ops, read, store, q, k, v, qsl)
        for i, b in enumerate(rows):
            t = slice(int(qsl[i]), int(qsl[i + 1]))
            history[b] = tuple(torch.cat((h, x[t].transpose(0, 1)), dim=1) for h, x in zip(history[b], (k, v)))
            held[b] += plan[b][step]
    assert rows == list(range(len(lengths))) and store.seq_lens.tolist() == lengths
    return pl, raw, store, q, out, history


def on_device(pl, raw, store):
    """``store`` over a copy of the raw pool on the test device (the same strides: ``LayerStorage.to`` would copy
    each pool contiguous)."""
    if DEVICE == "cpu":
        return store
    views = pl.views(as_pages(raw.to(DEVICE), pl.page_bytes))
    tables = {name: getattr(store, name).to(DEVICE) for name in ("sink_table", "float_table", "quant_table")}
    return dataclasses.replace(store, **views, **tables)


def oracle(q, history, cfg):
    """float64 attention of each row's last query over the K/V it stored (``tests/oracle.py``)."""
    rows = []
    for b, (k, v) in enumerate(history):
        n = k.shape[1]
        stored = stored_history(k.unsqueeze(0), v.unsqueeze(0), n, cfg)
        rows.append(attention_oracle(q[b:b + 1].unsqueeze(2), lambda i: stored, cfg.sink_tokens, cfg.recent_tokens,
                                     [n - 1])[0, :, 0])
    return torch.stack(rows)


PAGE_CASES = [
    # bits, S, W, bs, group, G, lengths, page tensor
    # float ring in 2 pages of 8 rows; rows wrapped many times, holding only sinks (3), exactly the sinks (4)
    (8, 4, 40, 16, 8, 2, [130, 3, 57, 4], "plain"),
    # no sinks; 3 float pages of 6 rows (6 does not divide 16: a block's rows span pages); a row of 1 token
    (4, 0, 40, 16, 8, 3, [101, 1, 23, 64], "vllm"),
    # 3 float pages of 11 rows (the last one part-used); a row of 2 tokens, only sinks
    (4, 4, 40, 32, 8, 2, [150, 2, 77], "padded"),
    # value groups inside the halves: "folded" and "fp16" refused by name (they fold a group per half); GQA 4
    (8, 0, 40, 32, 4, 4, [99, 33, 5], "plain"),
    # sinks as large as a block: the float ring in one page (its rows the block's), read through the strides
    (8, 16, 40, 16, 8, 2, [90, 12, 30], "vllm"),
]


@pytest.mark.parametrize("case", PAGE_CASES, ids=lambda c: f"int{c[0]}-S{c[1]}-bs{c[3]}-g{c[4]}-G{c[5]}-{c[7]}")
def test_decode_over_engine_pages(case):
    """The kernel reads an engine's pages in place, every variant and split count: equal to the C decode, the
    reference and the torch ops' own decode on the same pages, and to the float64 oracle on the K/V they hold."""
    bits, S, W, bs, group, G, lengths, shape = case
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=group)
    pl, raw, store, q, step_out, history = stream_into_pages(cfg, lengths, G, shape, seed=bits * 100 + S + bs)
    fr = pl.float_block_rows
    assert store.float_k.shape[2] == fr and store.float_table.shape[1] == pl.float_pages
    assert (pl.float_pages > 1) == (S < bs)   # a float ring of several pages, but in the case of big sinks
    assert not any(t.is_contiguous() for t in store.tensors().values() if t.numel())
    with trace.recording() as ran:
        ref = decode_attention_reference(q, store)
    assert ran == [("decode", "reference")], ran
    assert rel_rms(step_out, ref) < 1e-5  # the engine's own decode of that step
    exact = oracle(q, history, cfg)
    assert rel_max(ref, exact) < 1e-5
    if C_OK:
        with trace.recording() as ran:
            c_out = decode_c.decode_attention_c(q, store)
        assert ran == [("decode", "c")], ran
        assert rel_rms(c_out, ref) < 1e-5
    dev = on_device(pl, raw, store)
    for variant in decode_mod.VARIANTS:
        with trace.recording() as ran:
            outs = check_decode(q, dev, ref, variant)
        assert ran and set(ran) == {("decode", "triton")}, ran  # (a refused variant is the Triton kernel's refusal)
        for splits, out in zip((1, 3), outs):
            assert rel_max(out, exact) < tol(variant), f"{variant}, splits={splits}: {rel_max(out, exact):.2e}"
            if C_OK:
                assert rel_rms(out, c_out) < tol(variant)


@pytest.mark.parametrize("case", PAGE_CASES[:3], ids=lambda c: f"int{c[0]}-S{c[1]}-bs{c[3]}-g{c[4]}-G{c[5]}-{c[7]}")
def test_prefill_over_engine_pages(case):
    """A ragged chunk prefilled over what an engine's pages hold (each row its own length, one row idle): the
    reference, the torch ops' prefill and the Triton kernel, each on the same pages and each the kernel it means
    (``trace``), equal to the float64 oracle on the K/V the pages hold plus the chunk, zero at padding."""
    bits, S, W, bs, group, G, lengths, shape = case
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=group)
    pl, raw, store, *_, history = stream_into_pages(cfg, lengths, G, shape, seed=bits * 100 + S + bs + 1)
    g = torch.Generator().manual_seed(7)
    B, T = len(lengths), 21
    chunk = torch.tensor([T, 0, 9, 1][:B])
    q = torch.randn(B, HKV * G, T, D, generator=g)
    k, v = bf16_exact(B, HKV, T, D, generator=g), bf16_exact(B, HKV, T, D, generator=g)
    rows = []
    for b, (hk, hv) in enumerate(history):
        n, t = lengths[b], int(chunk[b])
        stored = stored_history(hk.unsqueeze(0), hv.unsqueeze(0), n, cfg)
        kv = tuple(torch.cat((x, y[b:b + 1].double()), 2) for x, y in zip(stored, (k, v)))
        row = torch.zeros(1, HKV * G, T, D, dtype=torch.float64)
        if t:
            row[:, :, :t] = attention_oracle(q[b:b + 1, :, :t], lambda i, kv=kv: kv, S, W, range(n, n + t))
        rows.append(row)
    exact = torch.cat(rows)
    dev = on_device(pl, raw, store)
    kernels = {"reference": (prefill_attention_reference, store, 1e-5),
               "torch": (prefill_attention_torch, store, 1e-5),
               "triton": (prefill_attention, dev, KERNEL_TOL)}
    for kernel, (prefill, layer, tolerance) in kernels.items():
        with trace.recording() as ran:
            on = layer.device
            out = prefill(q.to(on), k.to(on), v.to(on), layer, chunk).cpu()
        assert ran == [("prefill", kernel)], ran
        pad = (torch.arange(T).view(1, 1, T, 1) >= chunk.view(B, 1, 1, 1)).expand_as(out)
        assert torch.count_nonzero(out[pad]) == 0, kernel
        assert rel_max(out, exact) < tolerance, f"{kernel}: {rel_max(out, exact):.2e}"
    assert store.seq_lens.tolist() == lengths  # a prefill reads: nothing advanced


def test_decode_over_engine_pages_with_sink_logits():
    """Learned sink logits over an engine's pages (the merge kernel's term), against the reference."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=40, bits=4, block_size=16, value_group_size=8)
    pl, raw, store, q, _, _ = stream_into_pages(cfg, [70, 2, 41], 2, "plain", seed=5)
    logits = torch.randn(HKV * 2, generator=torch.Generator().manual_seed(6)) * 2
    ref = decode_attention_reference(q, store, sink_logits=logits)
    assert rel_rms(ref, decode_attention_reference(q, store)) > 1e-3  # the logits change the output
    for variant in decode_mod.VARIANTS:
        out = decode_or_refused(q.to(DEVICE), on_device(pl, raw, store), variant, sink_logits=logits.to(DEVICE),
                                num_splits=2)
        assert out is None or rel_rms(out.cpu(), ref) < tol(variant)


# --- strided views of a cache's own pools ---------------------------------------------------------------------

def sliced(pool, g, pad):
    """``pool`` as a slice of a bigger tensor whose margins hold NaN (random bytes for codes): the same values, each
    block contiguous, ``pad`` elements between blocks and 3 more blocks a head (head and block strides of its own,
    ``pad`` differing between pools)."""
    H, P, inner = pool.shape[0], pool.shape[1], pool.shape[2:]
    E = math.prod(inner)
    if pool.dtype == torch.uint8:
        big = torch.randint(0, 256, (H + 1, P + 3, E + pad), dtype=torch.uint8, generator=g)
    else:
        big = torch.full((H + 1, P + 3, E + pad), float("nan"), dtype=pool.dtype)
    view = big[1:, 2:-1, :E].unflatten(2, inner)
    view.copy_(pool)
    return view


def regrouped(layer):
    """The float ring of a dense storage in blocks of 2 x block_size rows (``fr`` > ``block_size``): each sequence's
    float blocks 2i and 2i + 1 as one block (``float_slots`` even), its table halved."""
    fs = layer.float_table.shape[1]
    assert fs % 2 == 0 and layer.dense
    pools = {name: getattr(layer, name).unflatten(1, (-1, 2)).flatten(2, 3) for name in ("float_k", "float_v")}
    table = torch.arange(layer.batch_size * fs // 2, device=layer.float_table.device).view(-1, fs // 2)
    return dataclasses.replace(layer, **pools, float_table=table, dense=False)


# bits, residual: float_slots = cdiv(U + bs - 1, bs) is 4 at bits 16 (U = W = 13) and 2 with 5 residual tokens
OWN_CASES = [(16, 0), (8, 5), (4, 5)]


@pytest.mark.parametrize("how", ["sliced", "fr=2bs", "fr=2bs, sliced"])
@pytest.mark.parametrize("bits, residual", OWN_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("rope", [False, True], ids=["absolute", "cache_index"])
def test_decode_over_strided_own_pools(bits, residual, how, rope):
    """A cache's own pools as slices of bigger tensors (NaN in their margins: a read through the wrong strides
    shows), and its float ring regrouped in blocks of 2 x block_size rows (contiguous, or sliced too), both
    position contracts: equal to the reference (and the C decode, absolute) on the same storage."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=13, bits=bits, block_size=4, value_group_size=8,
                      residual_tokens=residual, positions="cache_index" if rope else "absolute")
    rotary = Rotary.from_schedule(D, base=1000.0) if rope else None
    layer, _ = filled_layer(cfg, [40, 2, 17, 3], HKV, seed=bits + residual, rotary=rotary)
    if how.startswith("fr=2bs"):
        layer = regrouped(layer)
        assert layer.float_k.shape[2] == 2 * cfg.block_size
    g = torch.Generator().manual_seed(bits)
    if how.endswith("sliced"):
        layer = dataclasses.replace(layer, **{name: sliced(t, g, pad) for pad, (name, t) in
                                              enumerate(layer.tensors().items(), 1)}, dense=False)
        strides = [t.stride()[:2] for t in layer.tensors().values() if t.numel()]
        assert len(set(strides)) == len(strides)  # every pool its own strides
        assert not any(t.is_contiguous() for t in layer.tensors().values() if t.numel())
    q = torch.randn(4, HKV * 3, D, generator=g)
    ref = decode_attention_reference(q, layer, rotary=rotary)
    assert torch.isfinite(ref).all()
    if C_OK and not rope:
        assert rel_rms(decode_c.decode_attention_c(q, layer), ref) < 1e-5
    dev = on_test_device(layer)
    for variant in decode_mod.VARIANTS:
        if rope and variant == "fp16":
            continue  # the absolute contract only (tests/test_kernels.py checks the refusal)
        check_decode(q, dev, ref, variant, rotary=rotary)


def on_test_device(layer):
    """``layer`` on the test device with each pool's strides as they are (``LayerStorage.to`` would copy a pool that
    is not dense as contiguous)."""
    if DEVICE == "cpu":
        return layer
    pools = {}
    for name, t in layer.tensors().items():
        base = t if t._base is None else t._base
        pools[name] = torch.as_strided(base.to(DEVICE), t.shape, t.stride(), t.storage_offset())
    tables = {name: getattr(layer, name).to(DEVICE) for name in ("sink_table", "float_table", "quant_table")}
    return dataclasses.replace(layer, **pools, **tables)


# --- refusals -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", STORAGE_TENSORS)
def test_a_pool_whose_blocks_are_not_contiguous_is_refused(name):
    """A pool whose block is not one contiguous run (every second element of a wider one) is refused with its name
    and the layout the kernel reads, before any launch."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=8, block_size=4, value_group_size=8)
    layer, _ = filled_layer(cfg, [23, 11], HKV, seed=1)
    pool = getattr(layer, name)
    wide = torch.zeros(*pool.shape[:-1], 2 * pool.shape[-1], dtype=pool.dtype)[..., ::2]
    wide.copy_(pool)
    bad = on_test_device(dataclasses.replace(layer, **{name: wide}))
    assert getattr(bad, name).stride(-1) == 2
    q = torch.randn(2, HKV, D, device=DEVICE)
    with pytest.raises(ValueError, match=rf"the Triton decode kernel reads {name} as \[Hkv, blocks, \.\.\.\] with "
                                         rf"each block contiguous \(any head and block strides\); got shape"):
        decode(q, bad)
