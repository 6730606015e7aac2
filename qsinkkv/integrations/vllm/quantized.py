"""bits 8/4 inside vLLM: vLLM's pages hold qsinkkv's storage and qsinkkv's ops run over vLLM's block table.

A vLLM block of one layer is a page of opaque bytes (``qsinkkv.engine_pages.PageLayout``): a request's
logical block 0 is its sink page (its first ``sink_tokens`` K/V in ``sink_dtype``), logical blocks 1 ..
``float_pages`` its filling block (bf16, bigger than a page: ``float_block_rows`` rows a page), logical block
``pinned + b`` holds block b of its window as int8/int4 codes + scales; the spec's manager (``spec.py``)
allocates exactly those and hands back the blocks that leave the window. Every byte a request uses is in
vLLM's pool: finish, abort and preemption free it with the rest, through vLLM's own block pool.

Per step the metadata builder (once, for all layers) turns vLLM's block table into the tables of
``engine_pages.step_tables`` (planned from vLLM's host copies of the lengths, the pages gathered where the block
table lives: no host copy of a device tensor), held by the step's ``engine_pages.EngineStep``; per
layer the forward runs it over the layer's pools (``engine_pages.LayerPools``, made once): ``attend_packed``
(qsinkkv's checks, write (quantize-once as a block completes), prefill and decode -- the code ``PagedCache``
runs, so one layer's output equals ``PagedCache`` fed the same K/V), or for a decode step on the CPU the same
checks, write and decode in two C calls, the same bits. A layer with learned sinks (gpt-oss's ``sinks``) passes
them as the ops' ``sink_logits``: ``exp(s_h)`` joins head h's softmax denominator, as in ``PagedCache``.
The ops: on the CPU ``select_ops("auto")``, the C decode where it compiles (it steps through the pools by
their strides, so it reads vLLM's block-major pages in place), else torch, and a fresh prompt's attention through
vLLM's own CPU kernel in the model's dtype (``cpu_prefill.py``: what stock vLLM runs); on CUDA
``select_ops("triton")``: the Triton write, prefill and decode over the pages (each pool through its strides), with
the step's checks on the device (no host read in the forward); refused at start where Triton cannot serve (no
triton, head_dim % 4).
Untested with vLLM on a GPU: tested layer by layer under Triton's interpreter (``tests_vllm/test_vllm_layer.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from ...config import CacheConfig
from ...engine_pages import EngineStep, LayerPools, PageLayout, step_tables
from ...layout import WindowLayout
from ...ops import select_ops
from ...policy import window_config
from . import state
from .config import decode_variant, raw_config
from .spec import QSinkKVSpec


@dataclass
class QuantMetadata:
    num_actual_tokens: int
    step: EngineStep  # the step's tables; runs each layer (a decode step fused, prepared once for every layer)


class QuantMetadataBuilder(AttentionMetadataBuilder[QuantMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if not isinstance(kv_cache_spec, QSinkKVSpec) or kv_cache_spec.bits == 16:
            raise TypeError(f"qsinkkv's quantized backend needs its own KV cache spec, got {kv_cache_spec!r}")
        cfg = spec_config(kv_cache_spec)  # the group's layer type: the engine's config, or a window layer's
        self.layout = WindowLayout(cfg)  # one for every layer of the group: its visible-bias memo serves them all
        self.pages = PageLayout.of(cfg, kv_cache_spec.num_kv_heads, kv_cache_spec.head_size)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> QuantMetadata:
        common = common_attn_metadata
        B = common.num_reqs
        qsl = common.query_start_loc_cpu[:B + 1].long()
        lens = qsl[1:] - qsl[:-1]
        held = host_seq_lens(common) - lens
        # (the pages gathered where vLLM's block table lives: nothing is copied to the host)
        tables = step_tables(self.pages, common.block_table_tensor[:B], held, lens, null_page=0)
        return QuantMetadata(common.num_actual_tokens, EngineStep(self.layout, held, lens, tables))


class QuantImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: Tensor | None = None) -> None:
        cfg = impl_config(alibi_slopes, sliding_window, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                          sinks, num_heads)
        self.sinks = sinks  # [H] the layer's learned sink logits (gpt-oss), or None
        vllm_config = state.current_vllm_config()
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, float(scale), num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.layout = WindowLayout(cfg)
        self.pages = PageLayout.of(cfg, num_kv_heads, head_size)
        device = torch.device(vllm_config.device_config.device)
        # the CPU: the C kernels where they compile (else torch); CUDA: qsinkkv's Triton kernels over the pages, or a
        # refusal naming what is missing (select_ops: the triton package, head_dim % 4), never the torch ops
        backend = "auto" if device.type == "cpu" else "triton"
        dtype = vllm_config.model_config.dtype
        # the decode's body (the plugin's "decode_variant"; the CPU's C decode refuses any but the default, by name)
        variant = decode_variant(raw_config(vllm_config.additional_config) or {}, cfg, head_size)
        self.ops = select_ops(backend, device, head_size, None, variant, config=cfg, dtype=dtype)
        if device.type == "cpu":  # a fresh prompt through the kernel stock vLLM runs on the CPU, in the model's dtype
            from .cpu_prefill import CpuAttnPrefill  # (vLLM's CPU attention module: imported on the CPU only)
            self.ops = replace(self.ops, prefill_causal=CpuAttnPrefill(num_heads, num_kv_heads, head_size, dtype),
                               kernels={**self.ops.kernels, "prefill_causal": "vllm_cpu"})
        self._layer = None  # (the kv_cache tensor, its place and shape, the LayerPools over it)

    def forward(self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor,
                attn_metadata: QuantMetadata | None, output: Tensor, output_scale: Tensor | None = None,
                output_block_scale: Tensor | None = None, output_block_scale_swizzled: bool = False) -> Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by qsinkkv's backend")
        if attn_metadata is None:  # warm-up
            return output
        n = attn_metadata.num_actual_tokens
        H, D = self.num_heads, self.head_size
        if output.shape == (n, H, D) and query.shape == (n, H, D) and key.shape[0] == n and output.is_contiguous():
            # (vLLM's own call: [tokens, heads, head_size] views, no padding rows: taken as they lie, since every
            # view op costs a layer call its Python overhead, with the caches cold after the model's matmuls)
            q, k, v, into = query, key, value, output
        else:
            q, k, v = query[:n].view(n, H, D), key[:n], value[:n]
            into = output.view(-1, H, D)[:n]
            into = into if into.is_contiguous() else None
        out = attn_metadata.step.attend(self.ops, self._pools(kv_cache), q, k, v, scale=self.scale,
                                        sink_logits=sink_logits(self.sinks), out=into)
        if into is None:
            output.view(-1, H, D)[:n] = out.to(output.dtype)
        return output

    def _pools(self, kv_cache: Tensor) -> LayerPools:
        """This layer's pools: over its pages (``kv_cache [num_blocks, 1, 1, page_bytes]`` uint8), made once, again
        only if vLLM hands the layer another tensor (another address, shape, strides or dtype: the views are of the
        one they were made over)."""
        if self._layer is not None and self._layer[0] is kv_cache:  # (vLLM binds one tensor to a layer for good)
            return self._layer[2]
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_cache.dtype)
        if self._layer is None or self._layer[1] != key:
            self._layer = (kv_cache, key, LayerPools(self.pages.views(kv_cache[:, 0, 0])))
        else:
            self._layer = (kv_cache, key, self._layer[2])
        return self._layer[2]


def impl_config(alibi_slopes, sliding_window, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                sinks, num_heads: int) -> CacheConfig:
    """The engine's qsinkkv config for a layer's attention impl (bits 16 or 8/4; a layer with a trained
    ``sliding_window``: its ``window_config``); refuses, by name, what the layer asks for that the backend does not
    serve. ``sinks``: the layer's learned sink logits (gpt-oss), one per
    query head of this rank (``num_heads``), or None."""
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.shape != (num_heads,)
                              or not sinks.is_floating_point()):
        raise ValueError(f"qsinkkv's vLLM backend takes learned sinks as a float tensor of shape [num_heads="
                         f"{num_heads}] (this rank's query heads), got {getattr(sinks, 'dtype', type(sinks).__name__)} "
                         f"{tuple(getattr(sinks, 'shape', ()))}")
    refused = {"alibi_slopes": alibi_slopes is not None, "logits_soft_cap": bool(logits_soft_cap),
               "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
               f"attn_type={attn_type}": attn_type != AttentionType.DECODER}
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ValueError(f"qsinkkv's vLLM backend does not support {', '.join(bad)} (a decoder with full-attention "
                         "and trained sliding-window layers is what it serves)")
    cfg = state.active()
    if cfg is None or state.current_vllm_config() is None:
        raise RuntimeError("qsinkkv's vLLM backend was selected for an engine without additional_config['qsinkkv']")
    # a trained window layer keeps exactly its window, no sinks (qsinkkv.policy), as its spec does (customize_spec)
    return cfg if sliding_window is None else window_config(cfg, sliding_window)


def spec_config(spec) -> CacheConfig:
    """The CacheConfig of a KV cache group's layers: the engine's, with the spec's sinks, window and bits (a trained
    window layer's: ``window_config``)."""
    return replace(state.active(), sink_tokens=spec.sink_tokens, recent_tokens=spec.recent_tokens, bits=spec.bits)


def host_seq_lens(common: CommonAttentionMetadata) -> Tensor:
    """Each request's tokens after the step ``[num_reqs]`` int64, on the host, as vLLM's runner keeps them
    (``seq_lens_cpu_upper_bound``: exact but under asynchronous speculative decoding, which the plugin refuses at
    start), never a device-to-host copy of ``seq_lens`` (a sync per step on a GPU)."""
    host = common.seq_lens_cpu_upper_bound
    if host is None:
        raise RuntimeError("qsinkkv's vLLM backend plans a step from CommonAttentionMetadata.seq_lens_cpu_upper_bound "
                           "(vLLM's host copy of the lengths), which this vLLM did not set")
    return host[:common.num_reqs].long()


def sink_logits(sinks: Tensor | None) -> Tensor | None:
    """A layer's learned sinks as the ops take them (float32 ``[H]`` on its device; a float32 parameter as it is),
    read at every forward: vLLM loads the weights into the parameter after the impl is made, through ``.data``
    (which no version counter sees), so no copy is kept between steps."""
    return None if sinks is None else sinks.detach().float()
