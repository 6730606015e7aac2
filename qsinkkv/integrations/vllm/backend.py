"""The attention backend: qsinkkv's visible set (bf16/fp32 sinks + the recent window, bits=16: the
StreamingLLM baseline) over vLLM's own paged KV cache and block table.

Pages are vLLM's standard layout for this increment (``[num_blocks, Hkv, bs, 2 * D]``, keys then
values per head, in the model's dtype); tokens are rounded through ``sink_dtype`` /
``window_dtype`` on the way in, as qsinkkv's storage rounds them. Per step, the metadata builder
computes (once, for all layers, on the host) the blocks each request's queries can see -- its
sink blocks and its window's blocks -- and the visible-set mask of ``qsinkkv.layout.visible_mask``.
Per layer, the forward writes the new K/V at vLLM's slot mapping and attends:

* every request with one new token (the decodes) in one call, over each row's sink and window blocks
  (``dec_blocks``) with the visible set as ``dec_bias``: on the CPU qsinkkv's C decode reads the pages in place
  (``decode_c.BlocksDecode``, prepared once per step for every layer), on CUDA the Triton one
  (``qsinkkv.kernels.decode_blocks``); their reference, ``qsinkkv.decode.decode_blocks_torch`` (one batched gather
  + three large ops), serves a CPU without a C compiler. No loop over requests; the kernels are chosen once
  (``bits16_kernels``: never the torch ops on a GPU); the new K/V go in by the same family's row writer;
* each request with a longer chunk (a prefill, chunked or not) with SDPA under the sink + window
  mask over its sink blocks and the blocks its chunk's windows span (a loop over the prefill rows
  of the step only).

Keys arrive rotated at their absolute positions: qsinkkv's ``positions="absolute"`` contract. A layer with
learned sinks (gpt-oss's ``sinks [H]``) adds ``exp(s_h)`` to head h's softmax denominator in both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheLayout, SlidingWindowSpec

from ... import checks, decode_c, trace, write
from ...decode import decode_blocks_torch
from ...engine_pages import PageLayout
from ...layout import token_positions, visible_mask
from ...ops import resolve_backend
from ...policy import window_config
from . import state
from .quantized import QuantImpl, QuantMetadataBuilder, host_seq_lens, impl_config, sink_logits
from .spec import QSinkKVSpec


class QSinkKVBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        if isinstance(kv_cache_spec, QSinkKVSpec) and kv_cache_spec.bits != 16:
            return [kv_cache_spec.block_size]  # a page is one whole block: never split into kernel blocks
        return [MultipleOf(16)]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the member it is registered under (vLLM looks the layer's member up by this name)

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # learned sink logits (gpt-oss): one more term in each head's softmax

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # a trained window layer keeps exactly its window (customize_spec: window_config)

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # a connector would move vLLM's pages, which hold qsinkkv's blocks

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        return False  # the builders plan a step off vLLM's host query lengths

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return QuantImpl if state.required().bits != 16 else QSinkKVImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return QuantMetadataBuilder if state.required().bits != 16 else QSinkKVMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Full attention becomes qsinkkv's spec, with a manager that frees what leaves the window: vLLM's own
        pages (bits=16), or qsinkkv's (bits 8/4: one opaque uint8 page per block, ``engine_pages.PageLayout``). A
        trained sliding-window layer (Gemma 2/3, gpt-oss, Mistral ...) becomes qsinkkv's spec of its
        ``window_config``: exactly its window, no sinks, the same bits; every layer type's pages are one size (the
        largest of their layouts: vLLM's hybrid allocator shares one page size across its groups)."""
        cfg = state.required()
        if isinstance(spec, QSinkKVSpec) or type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
            return spec
        layer = cfg if type(spec) is FullAttentionSpec else window_config(cfg, spec.sliding_window)
        fields = {f: getattr(spec, f) for f in FullAttentionSpec.__dataclass_fields__ if hasattr(spec, f)}
        # (qsinkkv's manager frees what leaves the window itself; a window layer's block is the engine's, whatever
        # block vLLM's probe of a sliding-window layer's bytes per token starts from)
        fields.update(sliding_window=None, block_size=cfg.block_size)
        if layer.bits != 16:
            page = PageLayout.of(layer, spec.num_kv_heads, spec.head_size)
            page_bytes = max(PageLayout.of(c, spec.num_kv_heads, spec.head_size).page_bytes
                             for c in (layer, *state.layer_configs()))
            # one state of page_bytes per block: vLLM's page size is then exactly qsinkkv's page
            fields.update(dtype=torch.uint8, num_head_slots=1, tokens_per_state=spec.block_size,
                          state_content_bytes=page_bytes, page_size_padded=None)
        return QSinkKVSpec(**fields, sink_tokens=layer.sink_tokens, recent_tokens=layer.recent_tokens,
                           in_flight_tokens=state.in_flight_tokens(), bits=layer.bits,
                           pinned_pages=page.pinned if layer.bits != 16 else 1)


@dataclass
class QSinkKVMetadata:
    num_actual_tokens: int
    # where the new K/V go (vLLM's slot mapping without its padding)
    write_at: Tensor             # [n] int64 host: the tokens written (the step's real ones), increasing
    write_slots: Tensor          # [n] int64 their slots (block * bs + row), on vLLM's device
    write_seqs: Tensor           # [n] int64 zeros: a slot is read as a row of one table of every block
    is_sink: Tensor | None       # [N] bool: the token is one of its sequence's first S (None: none is)
    # the rows with one new token, batched
    dec_tokens: Tensor           # [Bd] their packed token index
    dec_blocks: Tensor           # [Bd, nb] the physical blocks their query reads (sinks, then window)
    dec_bias: Tensor             # [Bd, nb * bs] float32: 0 visible, -inf not
    dec_c: decode_c.BlocksDecode | None  # the C decode of these rows, prepared once for every layer (None: no rows)
    all_decode: bool             # every token is a decode row's, in row order (the step's q and output as they lie)
    # the rows with longer chunks: (first token, end token, blocks [nb], mask [T, nb * bs])
    prefills: list[tuple[int, int, Tensor, Tensor]]


class QSinkKVMetadataBuilder(AttentionMetadataBuilder[QSinkKVMetadata]):
    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if not isinstance(kv_cache_spec, QSinkKVSpec):
            raise TypeError(f"qsinkkv's backend needs its own KV cache spec, got {type(kv_cache_spec).__name__}")
        self.S, self.W, self.bs = kv_cache_spec.sink_tokens, kv_cache_spec.recent_tokens, kv_cache_spec.block_size
        self.sink_blocks = -(-self.S // self.bs)              # blocks the sinks span
        self.window_blocks = -(-self.W // self.bs) + 1        # blocks a window of W tokens can span
        self.offsets = torch.arange(self.bs)
        # the kernels the impls take (chosen alike in each): the C decode prepares once per step here
        self.c_decode = bits16_kernels(vllm_config, kv_cache_spec.head_size) == "c"

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> QSinkKVMetadata:
        """The step's metadata: planned on the host from vLLM's host copies of the lengths (``query_start_loc_cpu``,
        ``seq_lens_cpu_upper_bound``); the blocks gathered where vLLM's block table lives and the host plan moved
        there (host-to-device); nothing is copied back to the host (no device sync per step on a GPU)."""
        common = common_attn_metadata
        S, W, bs, sink_blocks, window_blocks = self.S, self.W, self.bs, self.sink_blocks, self.window_blocks
        B = common.num_reqs
        qsl = common.query_start_loc_cpu[:B + 1].long()
        seq_lens = host_seq_lens(common)
        qlen = qsl[1:] - qsl[:-1]
        N = int(qsl[-1]) if B else 0                     # the step's real tokens (past them: vLLM's padding)
        table = common.block_table_tensor[:B]            # [B, blocks] on vLLM's device
        on = table.device
        held = seq_lens - qlen                           # tokens each row held before the step
        is_sink = None
        if S and B and int(held.min()) < S:
            is_sink = torch.zeros(common.num_actual_tokens, dtype=torch.bool)   # (vLLM's padding: none)
            is_sink[:N] = token_positions(held, qlen) < S
            is_sink = is_sink.to(on, non_blocking=True)

        dec = (qlen == 1).nonzero().squeeze(1)
        dec_lens = seq_lens[dec]
        last = (dec_lens - 1) // bs
        window = last.unsqueeze(1) - window_blocks + 1 + torch.arange(window_blocks)  # [Bd, window_blocks] logical
        logical = torch.cat((torch.arange(sink_blocks).expand(dec.shape[0], sink_blocks), window), dim=1)
        dec_blocks = table[dec.to(on)].gather(1, logical.clamp(min=0).to(on)).long()
        valid = torch.cat((torch.ones(dec.shape[0], sink_blocks, dtype=torch.bool), window >= sink_blocks), dim=1)
        pos = (logical.unsqueeze(2) * bs + self.offsets).flatten(1)                # [Bd, nb * bs]
        pos = torch.where(valid.repeat_interleave(bs, dim=1) & (pos < dec_lens.unsqueeze(1)), pos, -1)
        seen = visible_mask((dec_lens - 1).unsqueeze(1), pos, S, W)               # [Bd, 1, nb * bs]
        dec_bias = torch.zeros(seen.shape, dtype=torch.float32).masked_fill_(~seen, float("-inf")).flatten(1)

        prefills = []
        for b in (qlen > 1).nonzero().squeeze(1).tolist():
            p0, p1 = int(held[b]), int(seq_lens[b])
            lo = max(sink_blocks, max(p0 - W + 1, 0) // bs)
            logical = torch.cat((torch.arange(sink_blocks), torch.arange(lo, (p1 - 1) // bs + 1)))
            kpos = (logical.unsqueeze(1) * bs + self.offsets).flatten()
            kpos = torch.where(kpos < p1, kpos, -1)
            mask = visible_mask(torch.arange(p0, p1), kpos, S, W)                  # [T, nb * bs]
            prefills.append((int(qsl[b]), int(qsl[b + 1]), table[b][logical.to(on)].long(), mask.to(on)))
        dec_c = None
        if self.c_decode and dec.shape[0]:  # (the C decode reads host tables: the CPU's)
            dec_c = decode_c.BlocksDecode(dec_blocks, dec_bias)
        write_at = torch.arange(N)
        return QSinkKVMetadata(common.num_actual_tokens, write_at, common.slot_mapping[:N].long(),
                               torch.zeros(N, dtype=torch.long, device=on), is_sink, qsl[:-1][dec].to(on),
                               dec_blocks, dec_bias.to(on), dec_c, 0 < dec.shape[0] == common.num_actual_tokens,
                               prefills)


class QSinkKVImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: Tensor | None = None) -> None:
        cfg = impl_config(alibi_slopes, sliding_window, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                          sinks, num_heads)
        self.sinks = sinks  # [H] the layer's learned sink logits (gpt-oss), or None
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype = num_kv_heads, kv_cache_dtype
        self.group = num_heads // num_kv_heads
        self.sink_dtype, self.window_dtype = cfg.sink_dtype, cfg.window_dtype
        # the decode and the row writer (chosen once, as the builder chose: bits16_kernels)
        vllm_config = state.current_vllm_config()
        self.kernels = bits16_kernels(vllm_config, head_size)
        self.c_decode = self.kernels == "c"
        if self.kernels == "triton":
            from ...kernels import decode_blocks
            from ...kernels import write as triton_write
            self.store_rows, self.decode_blocks = triton_write.store_rows, decode_blocks.decode_blocks
        else:  # (the C and torch writers: the same bits)
            self.store_rows = decode_c.store_rows_c if self.c_decode else write.store_rows
            self.decode_blocks = decode_blocks_torch
        self.every_block = None

    def forward(self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor,
                attn_metadata: QSinkKVMetadata | None, output: Tensor, output_scale: Tensor | None = None,
                output_block_scale: Tensor | None = None, output_block_scale_swizzled: bool = False) -> Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by qsinkkv's backend")
        if attn_metadata is None:  # warm-up
            return output
        md = attn_metadata
        n = md.num_actual_tokens
        nblocks, Hkv, bs, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(nblocks, Hkv, 2 * bs, -1).chunk(2, dim=2)   # [nb, Hkv, bs, D] each
        logits = sink_logits(self.sinks)
        if logits is not None:  # (before anything is written; on a GPU a device-side assert, no host read)
            checks.condition_in_step(checks.sink_logits_ok(logits), lambda: ValueError(checks.SINK_LOGITS_REFUSED))
        self._write(key[:n], value[:n], key_cache, value_cache, md, bs)
        out = output.view(-1, self.num_heads, self.head_size)
        if md.all_decode:  # vLLM's common step: q and the output as they lie, no gather, no scatter
            self._decode(query[:n], key_cache, value_cache, md, logits, out=out[:n])
        elif md.dec_tokens.numel():
            out[md.dec_tokens] = self._decode(query[md.dec_tokens], key_cache, value_cache, md, logits).to(out.dtype)
        for t0, t1, blocks, mask in md.prefills:
            out[t0:t1] = self._prefill(query[t0:t1], key_cache, value_cache, blocks, mask, logits).to(out.dtype)
        return output

    def _write(self, k: Tensor, v: Tensor, key_cache: Tensor, value_cache: Tensor, md: QSinkKVMetadata,
               bs: int) -> None:
        dtype = key_cache.dtype
        if self.window_dtype != dtype or (md.is_sink is not None and self.sink_dtype != dtype):
            # the storage's precision: sinks in sink_dtype, the window in window_dtype (qsinkkv's rounding)
            def rounded(x):
                r = x.to(self.window_dtype).to(dtype)
                if md.is_sink is not None:
                    r = torch.where(md.is_sink[:x.shape[0]].view(-1, 1, 1), x.to(self.sink_dtype).to(dtype), r)
                return r
            k, v = rounded(k), rounded(v)
        nblocks = key_cache.shape[0]
        if (self.every_block is None or self.every_block.shape[1] != nblocks
                or self.every_block.device != key_cache.device):
            # [1, blocks]: slot // bs is its block (on the pages' device, where the torch writer indexes it)
            self.every_block = torch.arange(nblocks, device=key_cache.device).unsqueeze(0)
        self.store_rows(key_cache.transpose(0, 1), value_cache.transpose(0, 1), self.every_block, k, v, md.write_at,
                        md.write_seqs, md.write_slots, bs)

    def _decode(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, md: QSinkKVMetadata,
                logits: Tensor | None, out: Tensor | None = None) -> Tensor:
        """The decode rows' attention ``[Bd, H, D]`` (C: in q's dtype; Triton, torch: float32), or written into ``out``
        (the engine's output rows, rounded as ``.to()`` rounds) and returned. ``logits [H]``: learned sinks, or None."""
        k_pool, v_pool = key_cache.transpose(0, 1), value_cache.transpose(0, 1)        # [Hkv, blocks, bs, D]
        if self.c_decode:  # (q in one of supported_dtypes: the C decode reads each)
            return md.dec_c.run(q, k_pool, v_pool, scale=self.scale, out=out, sink_logits=logits)
        result = self.decode_blocks(q.view(q.shape[0], self.num_heads, self.head_size), k_pool, v_pool,
                                    md.dec_blocks, md.dec_bias, scale=self.scale, sink_logits=logits)
        return result if out is None else out.copy_(result)

    def _prefill(self, q: Tensor, key_cache: Tensor, value_cache: Tensor, blocks: Tensor, mask: Tensor,
                 logits: Tensor | None) -> Tensor:
        trace.ran("prefill", "torch")
        D = self.head_size
        # a row no query of the chunk sees (past its length: what a reused page's earlier request left there, unchecked
        # at bits=16) reads as zeros in k and v, never left to the mask: 0 x inf is NaN, and so is inf + -inf
        # (in place: the gather's own copies)
        unseen = ~mask.any(0).view(1, -1, 1)
        k, v = (cache[blocks].transpose(0, 1).reshape(self.num_kv_heads, -1, D).float().masked_fill_(unseen, 0)
                for cache in (key_cache, value_cache))
        if logits is not None:  # an extra key and value of zeros per KV head, its score each query head's logit
            k, v = (torch.cat((x, x.new_zeros(x.shape[0], 1, D)), dim=1) for x in (k, v))
            T = q.shape[0]
            bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
            mask = torch.cat((bias.expand(self.num_heads, T, -1), logits.view(-1, 1, 1).expand(-1, T, 1)), dim=-1)
        out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.group > 1)
        return out.transpose(0, 1)


def bits16_kernels(vllm_config, head_size: int) -> str:
    """The kernels of bits=16 over vLLM's own pages, chosen once for the engine (the builder and every impl alike):
    on the CPU "c" (qsinkkv's C decode and row writer) where it compiles, else "torch"; on CUDA "triton"
    (``kernels/decode_blocks.py``, ``kernels/write.py``), or a refusal naming what is missing (``resolve_backend``:
    the triton package, head_dim % 4) -- never the torch ops on a GPU."""
    device = torch.device(vllm_config.device_config.device)
    dtype = vllm_config.model_config.dtype
    if device.type == "cpu":
        return "c" if resolve_backend("auto", device, head_size, None, dtype) == "c" else "torch"
    return resolve_backend("triton", device, head_size, None, dtype)
