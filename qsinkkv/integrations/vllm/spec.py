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


@dataclass(frozen=True, kw_only=True)
class QSinkKVSpec(FullAttentionSpec):
    """A full-attention spec whose requests keep ``sink_tokens`` + the newest ``recent_tokens``."""

    sink_tokens: int = 4
    recent_tokens: int = 252
    in_flight_tokens: int = 0  # the most tokens one step may add to a request (max_num_batched_tokens)

    def sink_blocks(self) -> int:
        return cdiv(self.sink_tokens, self.block_size)

    def max_blocks_per_request(self) -> int:
        """Blocks one request holds at most, however long it streams."""
        window = cdiv(self.recent_tokens - 1 + max(self.in_flight_tokens, 1), self.block_size) + 1
        return self.sink_blocks() + window

    def max_memory_usage_bytes(self, vllm_config) -> int:
        full = cdiv(vllm_config.model_config.max_model_len, self.block_size)
        return min(full, self.max_blocks_per_request()) * self.page_size_bytes

    @classmethod
    def merge(cls, specs):
        base = FullAttentionSpec.merge(specs)
        ours = {(s.sink_tokens, s.recent_tokens, s.in_flight_tokens) for s in specs}
        if len(ours) != 1:
            raise AssertionError(f"qsinkkv: every layer of a KV cache group must share one window, got {ours}")
        S, W, T = ours.pop()
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return cls(**fields, sink_tokens=S, recent_tokens=W, in_flight_tokens=T)


class QSinkKVManager(FullAttentionManager):
    """``FullAttentionManager`` that frees the blocks no query will see again: those wholly between
    the last sink block and the window of the next token (``[cdiv(S, bs), (n - W + 1) // bs)``)."""

    def __init__(self, kv_cache_spec: QSinkKVSpec, **kwargs) -> None:
        if kwargs.get("max_admission_blocks_per_request") is None:
            # the scheduler reserves (and admits) by this cap: what a request can hold at its peak
            kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_blocks_per_request()
        super().__init__(kv_cache_spec, **kwargs)
        self.sink_tokens = kv_cache_spec.sink_tokens
        self.recent_tokens = kv_cache_spec.recent_tokens

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        bs = self.block_size
        first = cdiv(self.sink_tokens, bs)                       # the first block holding no sink
        window_start = max(self.sink_tokens, processed_computed_tokens - self.recent_tokens + 1)
        self._remove_blocks_in_range(request_id, first, window_start // bs)

    def held_blocks(self, request_id: str) -> int:
        """Real (non-null) blocks the request holds now."""
        return sum(b is not self._null_block for b in self.req_to_blocks.get(request_id, ()))


def register() -> None:
    KVCacheSpecRegistry._ensure_registered()  # the built-in specs first: registering ours would skip them
    KVCacheSpecRegistry.register(QSinkKVSpec, QSinkKVManager, uniform_type_base_spec=FullAttentionSpec)


register()
