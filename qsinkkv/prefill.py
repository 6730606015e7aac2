"""Prefill attention over a ``LayerStorage``: a chunk of T new tokens per sequence attends over what
the storage held before the chunk plus the chunk's own full-precision K/V, under the exact sink +
window mask (as KIVI does); the caller stores the chunk afterwards.

The reference (the torch backend's path): dequantize every slot, then the dense
``sink_window_attention`` per tile of queries over those slots and the chunk keys the tile can
see. The fast version is the flash-style Triton kernel ``qsinkkv.kernels.prefill_attention``
(the same ``gather``, no score matrix; both position contracts).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .attention import sink_window_attention
from .rope import Rotary
from .storage import LayerStorage, gather

_QUERY_TILE = 256  # queries per tile: a tile reads the stored slots and at most S + W + 256 chunk keys


def prefill_attention_reference(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, *,
                                scale: float | None = None, rotary: Rotary | None = None,
                                sink_logits: Tensor | None = None) -> Tensor:
    """q ``[B, H, T, D]``, the chunk's k, v ``[B, Hkv, T, D]`` of which row b holds ``lengths[b]``
    tokens (the rest is padding) at positions ``seq_lens[b] ..`` -> ``[B, H, T, D]`` in q's dtype,
    zero at padding.

    Queries go in tiles; a tile reads the stored slots (at most the capacity plus a block) and
    only the chunk keys it can see: the chunk's sinks and the W before the tile. Time and memory
    grow linearly with T at a fixed capacity."""
    B, _, T, _ = q.shape
    cfg = layer.layout.config
    S, W = cfg.sink_tokens, cfg.recent_tokens
    n0 = layer.seq_lens.to(q.device).unsqueeze(1)                                  # [B, 1]
    t = torch.arange(T, device=q.device)
    real = t < lengths.to(q.device).unsqueeze(1)                                   # [B, T]
    q_pos = n0 + t
    chunk_pos = torch.where(real, q_pos, -1)                                       # padding is never seen
    if not bool(real.all()):  # nor read: a masked key still meets its value in p @ v, and 0 * NaN is NaN
        pad = ~real.view(B, 1, T, 1)
        k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
    stored_k, stored_v, stored_pos = gather(layer, k.dtype)
    chunk_sinks = max(S - int(layer.seq_lens.min()), 0)   # chunk tokens that are some sequence's sinks
    out = torch.empty_like(q)
    for t0 in range(0, T, _QUERY_TILE):
        t1 = min(t0 + _QUERY_TILE, T)
        lo = max(t0 - W + 1, 0)                            # older chunk keys are outside every window here
        idx = torch.cat((torch.arange(min(chunk_sinks, lo), device=q.device), torch.arange(lo, t1, device=q.device)))
        out[:, :, t0:t1] = sink_window_attention(
            q[:, :, t0:t1], torch.cat((stored_k, k[:, :, idx]), dim=2), torch.cat((stored_v, v[:, :, idx]), dim=2),
            q_pos[:, t0:t1], torch.cat((stored_pos, chunk_pos[:, idx]), dim=1), sink_tokens=S, recent_tokens=W,
            scale=scale, rotary=rotary, sink_logits=sink_logits)
    return out.masked_fill(~real.view(B, 1, T, 1), 0)
