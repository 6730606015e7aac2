"""qsinkkv: a quantized KV cache that keeps the attention sinks in bf16.

The first ``sink_tokens`` tokens stay in bf16; the newest ``recent_tokens`` are stored as
int8/int4 per-channel-group blocks; a query sees exactly the sinks plus the window.
"""
from .attention import sink_window_attention
from .cache import SinkQuantCache
from .config import CacheConfig
from .hybrid import HybridCache
from .layout import WindowLayout, visible_mask
from .policy import LayerPolicy, policy_for
from .rope import Rotary
from .storage import LayerStorage, gather

__all__ = ["CacheConfig", "SinkQuantCache", "LayerPolicy", "policy_for", "HybridCache", "LayerStorage",
           "WindowLayout", "Rotary", "sink_window_attention", "visible_mask", "gather"]
__version__ = "0.1.0"
