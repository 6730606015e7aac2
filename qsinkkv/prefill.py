"""Prefill attention over a ``LayerStorage``: a chunk of T new tokens per sequence attends over what
the storage held before the chunk plus the chunk's own full-precision K/V, under the exact sink +
window mask (as KIVI does); the caller stores the chunk afterwards.

The reference (and today the only implementation, on every backend): dequantize every slot,
append the chunk with its positions, run the dense ``sink_window_attention`` in query tiles.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .attention import sink_window_attention
from .rope import Rotary
from .storage import LayerStorage, gather


def prefill_attention_reference(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, *,
                                scale: float | None = None, rotary: Rotary | None = None,
                                sink_logits: Tensor | None = None) -> Tensor:
    """q ``[B, H, T, D]``, the chunk's k, v ``[B, Hkv, T, D]`` of which row b holds ``lengths[b]``
    tokens (the rest is padding) at positions ``seq_lens[b] ..`` -> ``[B, H, T, D]`` in q's dtype,
    zero at padding."""
    B, _, T, _ = q.shape
    cfg = layer.layout.config
    n0 = layer.seq_lens.to(q.device).unsqueeze(1)                                  # [B, 1]
    t = torch.arange(T, device=q.device)
    real = t < lengths.to(q.device).unsqueeze(1)                                   # [B, T]
    q_pos = n0 + t
    keys, values, k_pos = gather(layer, k.dtype)
    keys, values = torch.cat((keys, k), dim=2), torch.cat((values, v), dim=2)
    k_pos = torch.cat((k_pos, torch.where(real, q_pos, -1)), dim=1)               # padding is never seen
    out = sink_window_attention(q, keys, values, q_pos, k_pos, sink_tokens=cfg.sink_tokens,
                                recent_tokens=cfg.recent_tokens, scale=scale, rotary=rotary, sink_logits=sink_logits)
    return out.masked_fill(~real.view(B, 1, T, 1), 0)
