"""qsinkkv: a quantized KV cache that keeps the attention sinks in bf16.

The first ``sink_tokens`` tokens stay in bf16; the newest ``recent_tokens`` are stored as
int8/int4 per-channel-group blocks; a query sees exactly the sinks plus the window.
"""
from .attention import sink_window_attention, visible_mask
from .cache import LayerCache, SinkQuantCache
from .config import CacheConfig
from .layout import WindowLayout
from .rope import Rotary

__all__ = ["CacheConfig", "SinkQuantCache", "LayerCache", "WindowLayout", "Rotary",
           "sink_window_attention", "visible_mask"]
__version__ = "0.1.0"
