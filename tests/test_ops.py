"""The op registry (qsinkkv/ops.py, qsinkkv/trace.py): each backend's kernels, chosen once, are the ones that run.

For every backend (torch, c, triton under the interpreter) and every op a step runs (the write's blocks and rows,
the quantizer, prefill, decode, an engine's fused decode step), on a cache's own pools and on an engine's pages:
the kernels recorded are exactly ``Ops.served_by()``'s for the ops the step needs, the pools' bytes after the write
are the reference write's bit for bit, and the attention equals the reference (``decode_attention_reference``,
``prefill_attention_reference``) run on a copy of the same storage. A kernel that handed a call to another, or a
parity test that compared torch with torch, fails here."""
import functools
from dataclasses import replace

import pytest
import torch
from conftest import KERNEL_TOL
from helpers import rel

from qsinkkv import CacheConfig, Rotary, SinkQuantCache, decode_c, quant, trace
from qsinkkv.decode import decode_attention_reference
from qsinkkv.engine_pages import EngineStep, LayerPools, PageLayout, attend_packed, step_tables, storages
from qsinkkv.layout import WindowLayout
from qsinkkv.ops import Ops, select_ops
from qsinkkv.paged import PagedCache
from qsinkkv.prefill import prefill_attention_reference

Hkv, G, D = 2, 2, 16
BACKENDS = ["torch", pytest.param("c", marks=pytest.mark.skipif(not decode_c.available()[0], reason="no C compiler")),
            "triton"]
# rows (lengths each step brings): prompts, decodes, a mixed step (one row prefills a chunk), decodes past a
# block's completion and the ring's wrap
STEPS = [[12, 5, 9]] + [[1, 1, 1]] * 3 + [[1, 7, 1]] + [[1, 1, 1]] * 9
CFG = CacheConfig(sink_tokens=3, recent_tokens=20, bits=4, block_size=4, value_group_size=8)
TOL = {"torch": 1e-5, "c": 1e-5, "triton": KERNEL_TOL}

REFERENCE = Ops("reference", dict(write_blocks="torch", write_rows="torch", quantize="torch", decode="reference",
                                  prefill="reference"), quant, decode_attention_reference, prefill_attention_reference)


def _needs(lens, engine_decode):
    """The ops a step of ``lens`` runs (every step writes rows; this schedule completes blocks at most steps)."""
    if engine_decode and set(lens) == {1}:
        return {"engine_step"}
    return {"write_rows"} | ({"decode"} if 1 in lens else set()) | ({"prefill"} if max(lens) > 1 else set())


def _check_ran(ran, ops, lens, engine_decode=False):
    served = set(ops.served_by().items())
    assert set(ran) <= served, f"kernels outside {ops.backend}'s: {set(ran) - served}"
    done = {"prefill" if op == "prefill_causal" else op for op, _ in ran}  # (fresh rows: prefill's shortcut)
    assert _needs(lens, engine_decode) <= done, (lens, ran)


@pytest.mark.parametrize("positions", ["absolute", "cache_index"])
@pytest.mark.parametrize("pooled", [False, True], ids=["own", "paged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cache_runs_its_backends_kernels_and_equals_the_reference(backend, pooled, positions):
    if backend == "c" and positions == "cache_index":
        pytest.skip("the c backend decodes absolute positions (refused at construction: test_decode_c.py)")
    cfg = replace(CFG, positions=positions)
    rotary = Rotary.from_schedule(D, base=1000.0) if positions == "cache_index" else None
    reference = REFERENCE if rotary is None else replace(
        REFERENCE, decode=functools.partial(decode_attention_reference, rotary=rotary),
        prefill=functools.partial(prefill_attention_reference, rotary=rotary))
    kw = dict(backend=backend, dtype=torch.float32, rotary=rotary)
    cache = PagedCache(cfg, 1, Hkv, D, max_seqs=3, float_blocks=12, quant_blocks=24, **kw) if pooled else \
        SinkQuantCache(cfg, 1, 3, Hkv, D, **kw)
    if pooled:
        for _ in range(3):
            cache.admit()
    assert cache.ops.backend == backend
    g = torch.Generator().manual_seed(1)
    completed = 0
    for lens in STEPS:
        qsl = torch.tensor([0] + lens).cumsum(0)
        N = int(qsl[-1])
        q, k, v = (torch.randn(N, h, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
        before = cache.layers[0].to("cpu")
        with trace.recording() as ran:
            out = cache.attend_packed(0, q, k, v, qsl)
        _check_ran(ran, cache.ops, lens)
        completed += ("write_blocks", cache.ops.kernels["write_blocks"]) in ran
        # the reference on a copy of the storage as it stood (a pool's tables as the step left them: it takes its
        # blocks before writing): the write's bytes, then the attention
        now = cache.layers[0]
        before = replace(before, sink_table=now.sink_table, float_table=now.float_table, quant_table=now.quant_table)
        expect = attend_packed(reference, before, before, q, k, v, qsl, check=False)
        for name, t in cache.layers[0].tensors().items():
            assert torch.equal(t.view(torch.uint8), before.tensors()[name].view(torch.uint8)), (lens, name)
        assert rel(out, expect) < TOL[backend], lens
    assert completed >= 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_engine_step_runs_its_backends_kernels_and_equals_the_reference(backend):
    """The same over an engine's block-major pages (``PageLayout.views``, rows padded wider than a page), through
    ``EngineStep`` as the vLLM backend calls it: the c backend's decode steps are its fused engine step."""
    layout, pl = WindowLayout(CFG), PageLayout.of(CFG, Hkv, D)
    per = pl.pinned + 8
    raw = torch.randint(0, 256, (1 + 3 * per, pl.page_bytes + 64), dtype=torch.uint8, generator=torch.Generator()
                        .manual_seed(2))
    raw[0] = 0  # the null page
    buf = raw[:, :pl.page_bytes]
    layer = LayerPools(pl.views(buf))
    table = 1 + torch.arange(3 * per).view(3, per)
    ops = select_ops(backend, torch.device("cpu"), D, None)
    g = torch.Generator().manual_seed(3)
    held = torch.zeros(3, dtype=torch.int64)
    for lens in map(torch.tensor, STEPS):
        qsl = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0)))
        N = int(qsl[-1])
        q, k, v = (torch.randn(N, h, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
        tables = step_tables(pl, table, held, lens)
        copy = buf.clone()
        with trace.recording() as ran:
            out = EngineStep(layout, held, lens, tables).attend(ops, layer, q, k, v)
        _check_ran(ran, ops, lens.tolist(), engine_decode=ops.engine_decode is not None)
        read, store = storages(LayerPools(pl.views(copy)), layout, tables, held)
        expect = attend_packed(REFERENCE, read, store, q, k, v, qsl)
        assert torch.equal(buf, copy), lens.tolist()
        assert rel(out, expect) < TOL[backend], lens.tolist()
        held += lens


def test_served_by_names_one_kernel_per_op():
    """``served_by`` per backend and contract; a copy (the record is the cache's for its life)."""
    cpu = torch.device("cpu")
    from qsinkkv.rope import Rotary
    torch_ops = select_ops("torch", cpu, D, None)
    assert torch_ops.served_by() == dict(write_blocks="torch", write_rows="torch", quantize="torch", decode="torch",
                                         prefill="torch", prefill_causal="torch", value_checks="torch")
    assert select_ops("torch", cpu, D, Rotary.from_schedule(D)).served_by()["decode"] == "reference"
    assert select_ops("triton", cpu, D, None).served_by() == dict(
        write_blocks="triton", write_rows="triton", decode="triton", prefill="triton", value_checks="torch")
    if decode_c.available()[0]:
        assert select_ops("c", cpu, D, None).served_by() == dict(write_blocks="c", write_rows="c", decode="c",
                                                                 prefill="torch", engine_step="c",
                                                                 prefill_causal="torch", value_checks="c")
    served = torch_ops.served_by()
    served["decode"] = "c"
    assert torch_ops.served_by()["decode"] == "torch"


@pytest.mark.skipif(not decode_c.available()[0], reason="no C compiler")
def test_the_c_writers_refuse_what_they_cannot_write_instead_of_handing_it_on():
    """Where the C writers do not apply they raise by name, writing nothing; before, they ran the torch writer."""
    from qsinkkv import write
    layer = SinkQuantCache(CFG, 1, 1, Hkv, D, backend="torch", dtype=torch.float32).layers[0]
    k = torch.randn(4, Hkv, D, dtype=torch.float64)
    idx = torch.zeros(1, dtype=torch.int64)
    with trace.recording() as ran, pytest.raises(ValueError, match="the C row write needs float32, bfloat16 or "
                                                                   "float16 pools and tokens"):
        decode_c.store_rows_c(layer.float_k, layer.float_v, layer.float_table, k, k, idx, idx, idx, 4)
    with pytest.raises(ValueError, match="the C block completion quantizes as qsinkkv.quant does"):
        from qsinkkv.kernels import api
        decode_c.complete_blocks_c(layer, k.float(), k.float(), idx, idx, idx, idx, api)
    with pytest.raises(ValueError, match="the C block completion needs float32, bfloat16 or float16 tokens"):
        write.append(layer, k.transpose(0, 1).unsqueeze(0)[:, :, :1].expand(1, Hkv, 12, D).contiguous(),
                     k.transpose(0, 1).unsqueeze(0)[:, :, :1].expand(1, Hkv, 12, D).contiguous(), [12], quant,
                     decode_c.WRITER_C)
    assert ran == [] and int(layer.seq_lens[0]) == 0
