"""The KV cache spec and manager: each request keeps its sink blocks for life and gives back every
block that leaves the window, so a stream of any length holds a constant number of blocks.

vLLM's block table stays position-aligned (logical block j of a request holds positions
``j*bs .. j*bs+bs-1``): the manager only replaces the blocks between the sinks and the window with
vLLM's null block (as vLLM's own R-SWA manager frees its middle gap), and the backend reads only
the sink blocks and the window's blocks. At most ``cdiv(S, bs) + cdiv(W - 1 + in_flight, bs) + 1``
blocks are held by one request (the in-flight tokens: a prefill chunk is allocated before the
blocks it pushes out of the window are freed).

Imported in every vLLM process that unpickles the spec (the engine core's scheduler builds the
manager from it): registration happens at import and is idempotent.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ...config import CacheConfig
from ...engine_pages import first_page, max_pages, pages_needed
from ...layout import WindowLayout


@dataclass(frozen=True, kw_only=True)
class QSinkKVSpec(FullAttentionSpec):
    """A full-attention spec whose requests keep ``sink_tokens`` + the newest ``recent_tokens``."""

    sink_tokens: int = 4
    recent_tokens: int = 252
    in_flight_tokens: int = 0  # the most tokens one step may add to a request (max_num_batched_tokens)
    bits: int = 16             # 16: vLLM's own pages, position-aligned; 8/4: qsinkkv's pages (engine_pages)
    pinned_pages: int = 1      # bits 8/4: pages a request holds for life, its sink page and float ring's
                               # (``engine_pages.PageLayout.pinned``)

    def layout(self) -> WindowLayout:
        """The window's layout (its counts only: value_group_size plays no part in them)."""
        return WindowLayout(CacheConfig(sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens,
                                        bits=self.bits, block_size=self.block_size, value_group_size=1))

    def sink_blocks(self) -> int:
        """Blocks a request holds for its life (bits 8/4: the sink page and the float ring's pages)."""
        return self.pinned_pages if self.bits != 16 else cdiv(self.sink_tokens, self.block_size)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens is given (some may have been handed back since)."""
        if self.bits == 16:
            return cdiv(num_tokens, self.block_size)
        return pages_needed(self.layout(), self.pinned_pages, num_tokens)

    def max_blocks_per_request(self) -> int:
        """Blocks one request holds at most, however long it streams."""
        if self.bits != 16:
            return max_pages(self.layout(), self.pinned_pages, self.in_flight_tokens)
        window = cdiv(self.recent_tokens - 1 + max(self.in_flight_tokens, 1), self.block_size) + 1
        return self.sink_blocks() + window

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return max(super().max_num_blocks_per_req(vllm_config, max_len), self.blocks_needed(max_len))

    def max_memory_usage_bytes(self, vllm_config) -> int:
        full = self.blocks_needed(vllm_config.model_config.max_model_len)
        return min(full, self.max_blocks_per_request()) * self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        """One KV cache group only with the same window (a model's full-attention and trained window layers keep
        two: vLLM's hybrid allocator gives each its own group and manager)."""
        mine = (self.sink_tokens, self.recent_tokens, self.bits, self.pinned_pages)
        return all(isinstance(s, QSinkKVSpec) and (s.sink_tokens, s.recent_tokens, s.bits, s.pinned_pages) == mine
                   for s in kv_cache_specs.values())

    @classmethod
    def merge(cls, specs):
        base = FullAttentionSpec.merge(specs)
        ours = {(s.sink_tokens, s.recent_tokens, s.in_flight_tokens, s.bits, s.pinned_pages) for s in specs}
        if len(ours) != 1:
            raise AssertionError(f"qsinkkv: every layer of a KV cache group must share one window, got {ours}")
        S, W, T, bits, pinned = ours.pop()
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return cls(**fields, sink_tokens=S, recent_tokens=W, in_flight_tokens=T, bits=bits, pinned_pages=pinned)


class QSinkKVManager(FullAttentionManager):
    """``FullAttentionManager`` that frees the blocks no query will see again: those wholly between
    the last sink block and the window of the next token (``[cdiv(S, bs), (n - W + 1) // bs)``)."""

    def __init__(self, kv_cache_spec: QSinkKVSpec, **kwargs) -> None:
        if kwargs.get("max_admission_blocks_per_request") is None:
            # the scheduler reserves (and admits) by this cap: what a request can hold at its peak
            kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_blocks_per_request()
        super().__init__(kv_cache_spec, **kwargs)
        self.spec = kv_cache_spec
        self.sink_tokens = kv_cache_spec.sink_tokens
        self.recent_tokens = kv_cache_spec.recent_tokens
        self.window = kv_cache_spec.layout() if kv_cache_spec.bits != 16 else None

    # vLLM counts a request's blocks as cdiv(num_tokens, block_size) (position-aligned pages); qsinkkv's pages
    # (bits 8/4) are a sink page and the window's quantized blocks: the two methods that count get the token
    # count whose cdiv is that
    def _as_tokens(self, num_tokens: int) -> int:
        return num_tokens if self.window is None else self.spec.blocks_needed(num_tokens) * self.block_size

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._as_tokens(num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        return super().allocate_new_blocks(request_id, self._as_tokens(num_tokens),
                                           self._as_tokens(num_tokens_main_model))

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if self.window is not None:  # the window's pages that no later query sees
            pinned = self.spec.pinned_pages
            self._remove_blocks_in_range(request_id, pinned, first_page(self.window, pinned, processed_computed_tokens))
            return
        bs = self.block_size
        first = cdiv(self.sink_tokens, bs)                       # the first block holding no sink
        window_start = max(self.sink_tokens, processed_computed_tokens - self.recent_tokens + 1)
        self._remove_blocks_in_range(request_id, first, window_start // bs)

    def held_blocks(self, request_id: str) -> int:
        """Real (non-null) blocks the request holds now."""
        return sum(b is not self._null_block for b in self.req_to_blocks.get(request_id, ()))


def register() -> None:
    # vLLM registers its built-in specs on first use, only while the registry is empty: registering ours first would
    # skip them. Its public check of a (here empty) layer table runs that first use.
    KVCacheSpecRegistry.check_kv_cache_spec_registry({})
    KVCacheSpecRegistry.register(QSinkKVSpec, QSinkKVManager, uniform_type_base_spec=FullAttentionSpec)


register()
