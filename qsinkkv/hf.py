"""Short import path: ``from qsinkkv.hf import QSinkKVCache`` (needs transformers)."""
from .integrations.transformers import ATTN_IMPLEMENTATION, QSinkKVCache, qsinkkv_attention, rotary_from_config

__all__ = ["QSinkKVCache", "ATTN_IMPLEMENTATION", "qsinkkv_attention", "rotary_from_config"]
