"""One attention layer of the plugin driven in this process, without an engine: the metadata builder and the impl
over vLLM-shaped pages and ``CommonAttentionMetadata`` made here by a tiny engine (a block table per request, pages
from a free list, a slot mapping for the new tokens), against the core's ``PagedCache`` fed the same K/V.

What a model with learned sinks (gpt-oss's ``sinks``) needs is tested here (the default model has none), and that
the builders plan a step without reading a device tensor on the host (``gpu_rules.py``)."""
from __future__ import annotations

from dataclasses import replace
from math import inf
from types import SimpleNamespace

import pytest
import torch
from conftest import CUDA_BUILD
from gpu_rules import GpuRules, HostSync, on_gpu, values
from vllm.v1.attention.backend import CommonAttentionMetadata

from qsinkkv import CacheConfig, trace
from qsinkkv.engine_pages import PageLayout, pages_needed
from qsinkkv.integrations.vllm import backend as backend_module
from qsinkkv.integrations.vllm import state
from qsinkkv.integrations.vllm.backend import QSinkKVBackend
from qsinkkv.layout import WindowLayout, visible_mask
from qsinkkv.paged import PagedCache
from qsinkkv.prefill import prefill_causal_packed

Hkv, G, D = 2, 3, 32
H = Hkv * G
NUM_PAGES = 96


class Layer:
    """One layer of the plugin (builder + impl, as vLLM makes them for ``cfg``) over a pool of ``NUM_PAGES`` pages,
    with a tiny engine's block tables: every logical block of a request gets a page of its own (none is handed back:
    the builder reads only the sink and window blocks)."""

    def __init__(self, cfg: CacheConfig, monkeypatch, sinks: torch.Tensor | None, backend: str = "auto",
                 device: str = "cpu", plugin: dict | None = None):
        """``plugin``: the plugin's own fields of ``additional_config["qsinkkv"]`` (``decode_variant``)."""
        vllm_config = SimpleNamespace(device_config=SimpleNamespace(device=device),
                                      model_config=SimpleNamespace(dtype=torch.float32),
                                      additional_config={"qsinkkv": plugin or {}}, scheduler_config=SimpleNamespace())
        monkeypatch.setattr(state, "active", lambda: cfg)
        monkeypatch.setattr(state, "current_vllm_config", lambda: vllm_config)
        monkeypatch.setattr(state, "in_flight_tokens", lambda: 64)
        if backend != "auto":  # the bits=16 impl's decode, chosen once at construction
            monkeypatch.setattr(backend_module, "resolve_backend", lambda *args, **kwargs: backend)
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        spec = QSinkKVBackend.customize_spec(FullAttentionSpec(block_size=cfg.block_size, num_kv_heads=Hkv,
                                                               head_size=D, dtype=torch.float32))
        self.cfg, self.bs = cfg, cfg.block_size
        self.builder = QSinkKVBackend.get_builder_cls()(spec, ["layer.0"], vllm_config, torch.device("cpu"))
        self.impl = QSinkKVBackend.get_impl_cls()(H, D, D ** -0.5, Hkv, None, None, "auto", sinks=sinks)
        g = torch.Generator().manual_seed(3)
        if cfg.bits == 16:  # vLLM's own pages: [blocks, Hkv, bs, 2 D] (a block's keys, then its values, per head)
            self.kv_cache = torch.randn(NUM_PAGES, Hkv, cfg.block_size, 2 * D, generator=g)
            self.kv_cache[0] = 0  # the null block
        else:  # qsinkkv's pages: one opaque page per block
            self.pages = PageLayout.of(cfg, Hkv, D)
            self.kv_cache = torch.randint(0, 256, (NUM_PAGES, 1, 1, self.pages.page_bytes), dtype=torch.uint8,
                                          generator=g)
            self.kv_cache[0] = 0
        self.free = list(range(1, NUM_PAGES))
        self.tables: list[list[int]] = []
        self.held: list[int] = []

    def blocks_needed(self, tokens: int) -> int:
        if self.cfg.bits == 16:
            return -(-tokens // self.bs)
        return pages_needed(WindowLayout(self.cfg), self.pages.pinned, tokens)

    def metadata(self, rows: list[int], lens: list[int]) -> CommonAttentionMetadata:
        """The step's metadata, as vLLM's runner hands it to the builder: rows ``rows`` bring ``lens`` tokens."""
        for r, t in zip(rows, lens):
            while len(self.tables) <= r:
                self.tables.append([])
                self.held.append(0)
            while len(self.tables[r]) < self.blocks_needed(self.held[r] + t):
                self.tables[r].append(self.free.pop(0))
        width = max(len(self.tables[r]) for r in rows) + 1
        table = torch.zeros(len(rows), width, dtype=torch.int32)
        slots = []
        for i, (r, t) in enumerate(zip(rows, lens)):
            table[i, :len(self.tables[r])] = torch.tensor(self.tables[r], dtype=torch.int32)
            for p in range(self.held[r], self.held[r] + t):  # (bits=16: where each new token goes)
                slots.append(self.tables[r][p // self.bs] * self.bs + p % self.bs if self.cfg.bits == 16 else -1)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([self.held[r] + t for r, t in zip(rows, lens)], dtype=torch.int32)
        for r, t in zip(rows, lens):
            self.held[r] += t
        return CommonAttentionMetadata(
            query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq_lens.clone(), num_reqs=len(rows),
            num_actual_tokens=int(qsl[-1]), max_query_len=max(lens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq_lens)

    def step(self, rows: list[int], lens: list[int], q, k, v) -> torch.Tensor:
        md = self.builder.build(0, self.metadata(rows, lens))
        out = torch.full((q.shape[0], H * D), float("nan"))
        return self.impl.forward(None, q, k, v, self.kv_cache, md, out).view(-1, H, D)


def _schedule():
    """(rows, lens) per step: prompts, a prompt's later chunk within the capacity beside a decode, decodes past the
    capacity, a chunk beside decoding rows, a late prompt."""
    steps = [([0, 1], [20, 7]), ([1, 0], [1, 6])]
    steps += [([0, 1], [1, 1])] * 29
    steps += [([1, 0, 2], [1, 9, 13])]            # a chunk past the capacity beside a decode and a new prompt
    steps += [([0, 1, 2], [1, 1, 1])] * 12
    return steps


def _drive(layer: Layer, sinks: torch.Tensor | None, tol: float, steps=None, also=None) -> list[tuple[str, str]]:
    """Every step (``steps``, default ``_schedule()``) through the plugin's layer and through ``PagedCache`` (the
    same K/V and sink logits), equal to ``tol`` (0: bit for bit); ``also(rows, lens, q, k, v, out)`` after each
    step, if given. Returns the kernels the layer ran (``trace``)."""
    ref = PagedCache(layer.cfg, 1, Hkv, D, max_seqs=4, float_blocks=16, quant_blocks=32, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    ran = []
    for rows, lens in steps or _schedule():
        while len(ref.seq_ids) <= max(rows):
            ref.admit()
        N = sum(lens)
        q, k, v = torch.randn(N, H, D, generator=g), torch.randn(N, Hkv, D, generator=g), \
            torch.randn(N, Hkv, D, generator=g)
        with trace.recording() as layer_ran:
            got = layer.step(rows, lens, q, k, v)
        ran += layer_ran
        # PagedCache's rows are its admission order: the same tokens, reordered
        starts = dict(zip(rows, torch.tensor([0, *lens]).cumsum(0).tolist()))
        ref_lens = [lens[rows.index(r)] if r in rows else 0 for r in range(len(ref.seq_ids))]
        order = torch.cat([torch.arange(starts[r], starts[r] + lens[rows.index(r)]) for r in sorted(rows)])
        ref_qsl = torch.tensor([0, *torch.tensor(ref_lens).cumsum(0).tolist()])
        expect = ref.attend_packed(0, q[order], k[order], v[order], ref_qsl, sink_logits=sinks)
        if not tol:
            assert torch.equal(got[order], expect), \
                f"rows {rows} lens {lens}: max diff {(got[order] - expect).abs().max()}"
        else:
            torch.testing.assert_close(got[order], expect, rtol=tol, atol=tol)
        if also is not None:
            also(rows, lens, q, k, v, got)
    return ran


def _sinks(g: torch.Generator) -> torch.Tensor:
    sinks = torch.randn(H, generator=g) + 1.5  # (enough to take much of the mass)
    sinks[2] = float("-inf")                    # a head with no sink
    return sinks


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("learned_sinks", [False, True])
@pytest.mark.parametrize("fresh", ["vllm_cpu", "torch"])
def test_a_quantized_layer_equals_paged_cache(monkeypatch, bits, learned_sinks, fresh):
    """bits 8/4 (qsinkkv's pages, the C engine step for the decode steps): every step's output equals
    ``PagedCache`` fed the same K/V (and learned sink logits, one head's -inf), bit for bit with ``PagedCache``'s own
    fresh-prompt prefill (SDPA); with the one the plugin runs on the CPU (vLLM's kernel, ``cpu_prefill.py``), to
    float32 rounding (a layer with learned sinks prefills through qsinkkv's prefill either way)."""
    if fresh == "vllm_cpu" and CUDA_BUILD:
        pytest.skip("vLLM's CPU attention kernel is in vLLM's CPU build only")
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=bits, block_size=8, value_group_size=16,
                      sink_dtype=torch.float32, window_dtype=torch.float32, scale_dtype=torch.float32)
    sinks = _sinks(torch.Generator().manual_seed(bits)) if learned_sinks else None
    layer = Layer(cfg, monkeypatch, sinks)
    assert layer.impl.ops.served_by()["prefill_causal"] == "vllm_cpu"
    if fresh == "torch":
        layer.impl.ops = replace(layer.impl.ops, prefill_causal=prefill_causal_packed,
                                 kernels={**layer.impl.ops.kernels, "prefill_causal": "torch"})
    ran = _drive(layer, sinks, tol=0 if fresh == "torch" else 1e-5)
    assert ("engine_step", "c") in ran and ("prefill", "torch") in ran
    # the prompts, then the chunk that continues one within the capacity (after what it held); never past it
    assert sum(op == "prefill_causal" for op, _ in ran) == (0 if learned_sinks else 2), ran
    assert {kernel for op, kernel in ran if op == "prefill_causal"} <= {fresh}, ran


@pytest.mark.parametrize("decode", ["c", "torch", "triton"])
@pytest.mark.parametrize("learned_sinks", [False, True])
def test_a_bits16_layer_equals_paged_cache(monkeypatch, decode, learned_sinks):
    """bits=16 (vLLM's own pages; the C decode on the CPU, the Triton one on CUDA -- interpreted here --, the torch
    reference on a CPU without a C compiler; SDPA's prefill): every step's output equals ``PagedCache`` fed the same
    K/V (and learned sink logits), to float32 rounding; the decode and row writer of the one family ran, and the
    prefill through SDPA."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=16, block_size=16, sink_dtype=torch.float32,
                      window_dtype=torch.float32)
    sinks = _sinks(torch.Generator().manual_seed(16)) if learned_sinks else None
    if decode == "triton":
        layer = Layer(cfg, monkeypatch, sinks, device="cuda")
    else:
        layer = Layer(cfg, monkeypatch, sinks, backend=decode)
    assert layer.impl.kernels == decode
    ran = _drive(layer, sinks, tol=2e-5)
    assert {kernel for op, kernel in ran if op in ("decode", "write_rows")} == {decode}, ran
    assert {kernel for op, kernel in ran if op.startswith("prefill")} == {"torch"}, ran  # (SDPA, on every device)


@pytest.mark.parametrize("bits", [16, 4])
def test_nan_sink_logits_are_refused_with_every_page_as_it_was(monkeypatch, bits):
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=bits, block_size=16 if bits == 16 else 8,
                      value_group_size=16)
    sinks = torch.zeros(H)
    layer = Layer(cfg, monkeypatch, sinks)
    g = torch.Generator().manual_seed(0)
    layer.step([0], [10], torch.randn(10, H, D, generator=g), torch.randn(10, Hkv, D, generator=g),
               torch.randn(10, Hkv, D, generator=g))
    sinks[1] = float("nan")  # (vLLM loads the weights in place: the impl reads them at every forward)
    before = layer.kv_cache.clone()
    with pytest.raises(ValueError, match="sink_logits must be free of NaN"):
        layer.step([0], [1], torch.randn(1, H, D, generator=g), torch.randn(1, Hkv, D, generator=g),
                   torch.randn(1, Hkv, D, generator=g))
    assert torch.equal(layer.kv_cache.view(torch.uint8), before.view(torch.uint8))


def test_the_pools_are_made_again_for_another_tensor_at_the_same_address(monkeypatch):
    """The impl keeps its pools' views between forwards; a kv_cache at the same address with another shape (vLLM
    re-viewing its buffer) gets views of its own, never the old ones."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=4, block_size=8, value_group_size=16)
    layer = Layer(cfg, monkeypatch, None)
    pools = layer.impl._pools(layer.kv_cache)
    assert layer.impl._pools(layer.kv_cache) is pools
    fewer = layer.kv_cache[:NUM_PAGES // 2]  # (same data_ptr)
    assert fewer.data_ptr() == layer.kv_cache.data_ptr()
    assert layer.impl._pools(fewer).num_pages == NUM_PAGES // 2 != pools.num_pages


def test_sinks_of_another_shape_are_refused_by_name(monkeypatch):
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=4, block_size=8, value_group_size=16)
    with pytest.raises(ValueError, match=r"learned sinks as a float tensor of shape \[num_heads=6\]"):
        Layer(cfg, monkeypatch, torch.zeros(H + 1))


def _on_gpu(md: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """``md`` with the fields vLLM keeps on its GPU standing for CUDA tensors (the ``*_cpu`` ones stay on the host)."""
    return md.replace(query_start_loc=on_gpu(md.query_start_loc), seq_lens=on_gpu(md.seq_lens),
                      block_table_tensor=on_gpu(md.block_table_tensor), slot_mapping=on_gpu(md.slot_mapping))


def _same(a, b, path="metadata") -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert torch.equal(values(a), values(b)), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif hasattr(a, "__dataclass_fields__"):
        for name in a.__dataclass_fields__:
            _same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif hasattr(a, "__dict__") and type(a).__module__.startswith("qsinkkv"):
        for name, x in vars(a).items():
            _same(x, vars(b)[name], f"{path}.{name}")
    else:
        assert a == b, path


@pytest.mark.parametrize("bits", [16, 4])
def test_a_step_is_planned_without_reading_a_device_tensor_on_the_host(monkeypatch, bits):
    """On a GPU, ``build`` runs once per step before every layer's forward: a device-to-host copy or ``.item()`` there
    would stall the step. Every step of the schedule (prompts, decodes past the capacity, a chunk beside decoding
    rows, a late prompt) is built from metadata whose device fields stand for CUDA tensors, under ``GpuRules``: no
    host read of them, no host tensor mixed into a device op; the metadata equals the build from host tensors."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=bits, block_size=16 if bits == 16 else 8,
                      value_group_size=16)
    layer = Layer(cfg, monkeypatch, None, device="cuda")
    for rows, lens in _schedule():
        md = layer.metadata(rows, lens)
        plain = layer.builder.build(0, md)
        with GpuRules():
            built = layer.builder.build(0, _on_gpu(md))
        _same(built, plain)
    # the rules catch what build must not do
    with GpuRules(), pytest.raises(HostSync):
        _on_gpu(md).seq_lens.cpu()
    with GpuRules(), pytest.raises(HostSync):
        int(_on_gpu(md).block_table_tensor.max())
    with GpuRules(), pytest.raises(HostSync):
        _on_gpu(md).slot_mapping.tolist()
    with GpuRules(), pytest.raises(HostSync):
        _on_gpu(md).block_table_tensor[torch.tensor([0])]


class Oracle:
    """Every row's K/V as it came, and each step's attention over the visible set (``layout.visible_mask``, with the
    learned sinks' logits in the softmax) in float64: ``[N, H, D]``."""

    def __init__(self, cfg: CacheConfig, sinks: torch.Tensor | None):
        self.S, self.W, self.sinks = cfg.sink_tokens, cfg.recent_tokens, sinks
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def step(self, rows: list[int], lens: list[int], q, k, v, scale: float) -> torch.Tensor:
        out, t0 = [], 0
        for r, t in zip(rows, lens):
            held = self.k[r].shape[0] if r in self.k else 0
            self.k[r] = torch.cat([self.k.get(r, k[:0]), k[t0:t0 + t]]).double()
            self.v[r] = torch.cat([self.v.get(r, v[:0]), v[t0:t0 + t]]).double()
            n = held + t
            seen = visible_mask(torch.arange(held, n), torch.arange(n), self.S, self.W)      # [t, n]
            kk, vv = (x.repeat_interleave(G, dim=1).transpose(0, 1) for x in (self.k[r], self.v[r]))  # [H, n, D]
            scores = (q[t0:t0 + t].double().transpose(0, 1) @ kk.transpose(1, 2) * scale).masked_fill(~seen, -inf)
            if self.sinks is not None:  # one more logit per head, no value
                scores = torch.cat([scores, self.sinks.double().view(H, 1, 1).expand(H, t, 1)], dim=2)
            p = scores.softmax(-1)[..., :n]
            out.append((p @ vv).transpose(0, 1))
            t0 += t
        return torch.cat(out)


@pytest.mark.parametrize("learned_sinks", [False, True])
def test_a_bits16_forward_reads_no_device_tensor_on_the_host(monkeypatch, learned_sinks):
    """bits=16 on a GPU (the Triton decode and row writer, SDPA's prefill, over vLLM's pages): the forward of every
    step, its q, k, v, pages, output and learned sinks standing for CUDA tensors, runs under ``GpuRules`` (no host
    read, no host tensor in a device op) and writes the pages the same forward writes on host tensors, bit for bit
    (the same row writer). The outputs are each held to the float64 oracle (2e-5): under the dispatch mode SDPA takes
    its math path, on host tensors it may take its CPU flash kernel (torch 2.14 does), which sums in another order."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=16, block_size=16, sink_dtype=torch.float32,
                      window_dtype=torch.float32)
    sinks = _sinks(torch.Generator().manual_seed(5)) if learned_sinks else None
    layer = Layer(cfg, monkeypatch, sinks, device="cuda")
    assert layer.impl.kernels == "triton"  # (Triton's interpreter here)
    oracle = Oracle(cfg, sinks)
    host_pages = layer.kv_cache.clone()
    g = torch.Generator().manual_seed(2)
    for rows, lens in _schedule():
        N = sum(lens)
        q, k, v = torch.randn(N, H, D, generator=g), torch.randn(N, Hkv, D, generator=g), \
            torch.randn(N, Hkv, D, generator=g)
        md = layer.metadata(rows, lens)
        on_host = torch.full((N, H * D), float("nan"))
        layer.impl.sinks = sinks
        layer.impl.forward(None, q, k, v, host_pages, layer.builder.build(0, md), on_host)
        layer.impl.sinks = None if sinks is None else on_gpu(sinks)
        out = on_gpu(torch.full((N, H * D), float("nan")))
        with GpuRules():
            built = layer.builder.build(0, _on_gpu(md))
            layer.impl.forward(None, on_gpu(q), on_gpu(k), on_gpu(v), on_gpu(layer.kv_cache), built, out)
        expect = oracle.step(rows, lens, q, k, v, layer.impl.scale)
        for got in (values(out), on_host):
            torch.testing.assert_close(got.view(N, H, D).double(), expect, rtol=2e-5, atol=2e-5)
    assert torch.equal(layer.kv_cache, host_pages)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("learned_sinks", [False, True])
def test_a_quantized_layer_on_cuda_runs_the_triton_kernels_with_no_host_read(monkeypatch, bits, learned_sinks):
    """bits 8/4 on a GPU: the impl takes qsinkkv's Triton ops (write, prefill, decode over vLLM's pages; here in
    Triton's interpreter), never the torch ops. Every step equals ``PagedCache`` fed the same K/V (to the kernels'
    float32 rounding), and the same forward with q, k, v, the pages, the output and the sinks standing for CUDA
    tensors runs under ``GpuRules`` -- the build and the forward read nothing back to the host -- with the same
    bits as on host tensors."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=bits, block_size=8, value_group_size=16,
                      sink_dtype=torch.float32, window_dtype=torch.float32, scale_dtype=torch.float32)
    sinks = _sinks(torch.Generator().manual_seed(bits)) if learned_sinks else None
    on_host = Layer(cfg, monkeypatch, sinks, device="cuda")
    on_device = Layer(cfg, monkeypatch, sinks, device="cuda")
    assert on_host.impl.ops.backend == "triton"
    on_device.impl.sinks = None if sinks is None else on_gpu(sinks)

    def under_gpu_rules(rows, lens, q, k, v, got):
        md = on_device.metadata(rows, lens)
        out = on_gpu(torch.full((q.shape[0], H * D), float("nan")))
        with GpuRules():
            built = on_device.builder.build(0, _on_gpu(md))
            on_device.impl.forward(None, on_gpu(q), on_gpu(k), on_gpu(v), on_gpu(on_device.kv_cache), built, out)
        assert torch.equal(values(out).view(-1, H, D), got)

    # (the interpreter is slow: prompts, decodes past the capacity)
    ran = set(_drive(on_host, sinks, tol=1e-4, steps=_schedule()[:24], also=under_gpu_rules))
    # (the value checks are the backend's: on these host tensors torch's reduction; on a device, in the step)
    assert {kernel for op, kernel in ran if op != "value_checks"} == {"triton"}, ran
    assert ran <= set(on_host.impl.ops.served_by().items()), ran
    assert {op for op, _ in ran} == {"write_rows", "write_blocks", "prefill", "decode", "value_checks"}, ran


def test_the_fp16_decode_body_is_the_configs_choice_on_cuda_and_refused_on_the_cpu(monkeypatch):
    """``decode_variant="fp16"`` in the plugin's config: on CUDA (Triton's interpreter here) the decode over the
    pages runs that body and every step equals ``PagedCache`` to fp16's operand rounding (3e-3; 3e-4 seen); on the
    CPU, whose C decode has one body, the impl refuses it by name at construction."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=4, block_size=8, value_group_size=16,
                      sink_dtype=torch.float32, window_dtype=torch.float32)
    layer = Layer(cfg, monkeypatch, None, device="cuda", plugin={"decode_variant": "fp16"})
    assert layer.impl.ops.backend == "triton" and layer.impl.ops.decode.keywords["variant"] == "fp16"
    ran = set(_drive(layer, None, tol=3e-3, steps=_schedule()[:24]))
    assert ("decode", "triton") in ran, ran
    with pytest.raises(ValueError, match=r"decode_variant='fp16' selects a body of the Triton decode kernel; "
                                         r"backend='c' has one decode"):
        Layer(cfg, monkeypatch, None, plugin={"decode_variant": "fp16"})


@pytest.mark.parametrize("decode", ["c", "torch", "triton"])
@pytest.mark.parametrize("learned_sinks", [False, True])
@pytest.mark.parametrize("stale", ["inf", "nan", "finite"])
def test_a_stale_row_of_a_reused_page_never_reaches_the_next_request(monkeypatch, decode, learned_sinks, stale):
    """bits=16 stores K/V unchecked: an earlier request's overflowed key and value (fp16's 1e38 is inf) or NaN stay in
    its page when the page is handed to the next request. A row the new request does not hold (past its length) is
    zeroed or skipped, never left to the mask (0 x inf is NaN): its prefill chunks (SDPA over whole blocks) and decodes
    give, bit for bit, what they give with that row zero, and are finite; a finite stale row changes no bit either."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=16, block_size=16, sink_dtype=torch.float32,
                      window_dtype=torch.float32)
    sinks = _sinks(torch.Generator().manual_seed(16)) if learned_sinks else None

    def run(bad: float | None) -> list[torch.Tensor]:
        layer = Layer(cfg, monkeypatch, sinks, device="cuda") if decode == "triton" else \
            Layer(cfg, monkeypatch, sinks, backend=decode)
        g = torch.Generator().manual_seed(7)
        new = lambda n: (torch.randn(n, H, D, generator=g), torch.randn(n, Hkv, D, generator=g),  # noqa: E731
                         torch.randn(n, Hkv, D, generator=g))
        q, k, v = new(30)
        if bad is not None:  # the earlier request's token 25: row 9 of its second page
            k[25], v[25] = bad, bad
        layer.step([0], [30], q, k, v)
        layer.free[:0] = layer.tables[0]  # it finishes: its pages go to the next request, which stops short of 25
        outs = [layer.step([1], [n], *new(n)) for n in (20, 2, 1, 1)]
        assert layer.tables[1] == layer.tables[0]
        return outs

    got = run({"inf": float("inf"), "nan": float("nan"), "finite": None}[stale])
    for a, b in zip(got, run(0.0)):
        assert torch.isfinite(b).all()
        assert torch.equal(a, b), (a - b).abs().max()
