"""Reference sink + window attention in plain PyTorch (the CPU path; the kernels' oracle).

Keys carry their logical positions; the visible-set rule is one mask (``layout.visible_mask``):
``visible(i, p) = 0 <= p <= i and (p < S or p > i - W)`` — which is ``[0..i]`` while
``i < S + W`` and ``[0..S-1] ∪ [i-W+1 .. i]`` after. Empty slots have position -1.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .layout import QUERY_TILE, visible_mask
from .rope import Rotary

__all__ = ["sink_window_attention"]


def sink_window_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, *,
                          sink_tokens: int, recent_tokens: int, scale: float | None = None,
                          rotary: Rotary | None = None, sink_logits: Tensor | None = None,
                          key_mask: Tensor | None = None, return_probs: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of queries at ``q_pos`` over keys at ``k_pos`` under the sink + window rule.

    q: ``[B, H, T, D]``; k, v: ``[B, Hkv, N, D]`` with ``H % Hkv == 0`` (GQA: query head h
    reads kv head ``h // (H // Hkv)``); q_pos ``[T]`` or ``[B, T]``, k_pos ``[N]`` or ``[B, N]``
    int64 (-1 = empty slot; per-sequence positions let sequences hold different lengths).
    rotary: if given (``cache_index`` contract), q and k are pre-RoPE and are rotated by their
      index in the cache: sinks keep 0..S-1, the visible recent tokens follow contiguously, so
      a query at i has index min(i, S+W-1) and a recent key keeps its distance to the query.
    sink_logits: optional ``[H]`` learned per-head logits (gpt-oss) adding ``exp(s_h)`` to the
      softmax denominator with no value.
    key_mask: optional bool ``[T, N]`` or ``[B, T, N]``: a query sees a key only where it is True (and the rule
      allows it). The eval's replay holds each token twice, as the cache first holds it and as it is stored
      later, and lets each query see the one its decode step reads.
    return_probs: also return the attention probabilities ``[B, H, T, N]`` (float32, float64 for float64 q;
      zero where not visible).
    Returns ``[B, H, T, D]`` in q's dtype (and the probabilities); computes in float32 (float64 if q is float64).
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = D ** -0.5 if scale is None else scale
    kf = k.to(work)
    vf = v.to(work)
    qg = q.to(work).reshape(B, Hkv, G, T, D)
    q_pos = q_pos.expand(B, T) if q_pos.ndim == 1 else q_pos
    k_pos = k_pos.expand(B, k.shape[2]) if k_pos.ndim == 1 else k_pos
    if rotary is not None:
        # Relative-position form of the cache-index rotation: scores depend only on
        # (query index - key index). Recent keys keep their true distance to the query,
        # so both are rotated relative to a common base that keeps the angles small;
        # sink keys sit at index p, the query at min(i, C-1).
        base = torch.clamp(q_pos.amin(dim=1, keepdim=True) - recent_tokens + 1, min=0)  # [B, 1]
        k_recent = rotary.rotate(kf, (k_pos - base).unsqueeze(1))
        k_sink = rotary.rotate(kf, k_pos.clamp(min=0).unsqueeze(1))
        is_sink = (k_pos < sink_tokens).view(B, 1, 1, 1, -1)
    out = torch.empty(B, Hkv, G, T, D, dtype=work, device=q.device)
    probs_out = torch.empty(B, Hkv, G, T, k.shape[2], dtype=work, device=q.device) if return_probs else None
    for t0 in range(0, T, QUERY_TILE):  # bounds the [t, N] score matrix of long prefills
        t1 = min(t0 + QUERY_TILE, T)
        qc, pc = qg[:, :, :, t0:t1], q_pos[:, t0:t1]
        if rotary is None:
            scores = torch.einsum("bhgtd,bhnd->bhgtn", qc, kf)
        else:
            q_recent = rotary.rotate(qc, (pc - base).view(B, 1, 1, -1))
            q_sink = rotary.rotate(qc, pc.clamp(max=sink_tokens + recent_tokens - 1).view(B, 1, 1, -1))
            scores = torch.where(is_sink, torch.einsum("bhgtd,bhnd->bhgtn", q_sink, k_sink),
                                 torch.einsum("bhgtd,bhnd->bhgtn", q_recent, k_recent))
        scores = scores * scale
        visible = visible_mask(pc, k_pos, sink_tokens, recent_tokens)
        if key_mask is not None:
            visible = visible & key_mask[..., t0:t1, :]
        visible = visible.view(B, 1, 1, t1 - t0, -1)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sink_logits is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            s = sink_logits.to(work).reshape(1, Hkv, G, 1, 1).expand(B, Hkv, G, t1 - t0, 1)
            probs = torch.softmax(torch.cat((scores, s), dim=-1), dim=-1)[..., :-1]
        out[:, :, :, t0:t1] = torch.einsum("bhgtn,bhnd->bhgtd", probs, vf)
        if probs_out is not None:
            probs_out[:, :, :, t0:t1] = probs
    out = out.reshape(B, H, T, D).to(q.dtype)
    return out if probs_out is None else (out, probs_out.reshape(B, H, T, -1))
