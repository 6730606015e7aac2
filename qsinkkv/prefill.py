"""Prefill attention over a ``LayerStorage``: a chunk of T new tokens per sequence attends over what
the storage held before the chunk plus the chunk's own full-precision K/V, under the exact sink +
window mask (as KIVI does); the caller stores the chunk afterwards.

Both PyTorch versions dequantize every stored slot once (``gather``) and go in tiles of queries,
each over those slots and only the chunk keys the tile can see:

* ``prefill_attention_reference``: the dense ``sink_window_attention`` per tile (the oracle's
  rule, in float32; every contract, sink logits);
* ``prefill_attention_torch`` (the torch backend's path, absolute contract): the same tiles
  through ``scaled_dot_product_attention`` with the visible set as a boolean mask, PyTorch's
  fused CPU kernel (``benchmarks/prefill.py`` times it).

The Triton backend's is the flash-style kernel ``qsinkkv.kernels.prefill_attention`` (the same
``gather``, no score matrix; both position contracts).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import sink_window_attention
from .layout import query_tiles, visible_mask
from .rope import Rotary
from .storage import LayerStorage, gather


def prefill_attention_reference(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, *,
                                scale: float | None = None, rotary: Rotary | None = None,
                                sink_logits: Tensor | None = None) -> Tensor:
    """q ``[B, H, T, D]``, the chunk's k, v ``[B, Hkv, T, D]`` of which row b holds ``lengths[b]``
    tokens (the rest is padding) at positions ``seq_lens[b] ..`` -> ``[B, H, T, D]`` in q's dtype,
    zero at padding.

    Queries go in tiles; a tile reads the stored slots (at most the capacity plus a block) and
    only the chunk keys it can see: the chunk's sinks and the W before the tile. Time and memory
    grow linearly with T at a fixed capacity."""
    cfg = layer.layout.config
    attend = functools.partial(sink_window_attention, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens,
                               scale=scale, rotary=rotary, sink_logits=sink_logits)
    return _in_tiles(q, k, v, layer, lengths, attend)


def prefill_attention_torch(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, *,
                            scale: float | None = None, sink_logits: Tensor | None = None) -> Tensor:
    """``prefill_attention_reference`` (absolute contract) with each tile through PyTorch's fused
    ``scaled_dot_product_attention`` under the visible set as a boolean mask, in float32 (float64 for
    float64 inputs). Learned sink logits (an extra softmax term SDPA has no place for) take the
    reference."""
    if sink_logits is not None:
        return prefill_attention_reference(q, k, v, layer, lengths, scale=scale, sink_logits=sink_logits)
    cfg = layer.layout.config
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if q.shape[0] and q.shape[2] <= cfg.sink_tokens + cfg.recent_tokens and int(layer.seq_lens.max()) == 0:
        return _fresh_causal(q, k, v, lengths, scale, work)

    def attend(q_t, k_t, v_t, q_pos, k_pos):
        seen = visible_mask(q_pos, k_pos, cfg.sink_tokens, cfg.recent_tokens).unsqueeze(1)  # [B, 1, t, N]
        # a padding query may see nothing (SDPA then gives NaN): its row is zeroed at the end
        out = F.scaled_dot_product_attention(q_t.to(work), k_t.to(work), v_t.to(work), attn_mask=seen, scale=scale,
                                             enable_gqa=q_t.shape[1] != k_t.shape[1])
        return out.to(q_t.dtype)
    return _in_tiles(q, k, v, layer, lengths, attend)


def _fresh_causal(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float | None, work: torch.dtype) -> Tensor:
    """A chunk into rows that hold nothing yet, no longer than S + W: every query sees all the chunk keys up to
    its own (the window of query t, ``(t - W, t]``, reaches back past the sinks), so the visible set is the
    causal mask and nothing stored is read. SDPA's causal kernel per row, on its real tokens only (a step of
    ragged prompts costs the sum of their squares, not B x T_max^2; padding is never read); rows of one
    length go in one call."""
    B, _, T, _ = q.shape
    sizes = lengths.tolist()
    out = q.new_zeros(q.shape)

    def attend(rows: slice, t: int) -> None:
        out[rows, :, :t] = _causal(*(y[rows, :, :t] for y in (q, k, v)), scale, work)
    if all(t == T for t in sizes):
        attend(slice(0, B), T)
    else:
        for b, t in enumerate(sizes):
            if t:
                attend(slice(b, b + 1), t)
    return out


def prefill_fresh_packed(q: Tensor, k: Tensor, v: Tensor, starts: list[int], lens: list[int], *,
                         scale: float | None = None) -> Tensor:
    """``_fresh_causal`` on a packed step's tokens where they lie (``q [N, H, D]``, ``k, v [N, Hkv, D]``, row i's at
    ``[starts[i], starts[i] + lens[i])``; every row holds nothing yet and brings at most S + W tokens): no padding,
    no gather -> ``[sum(lens), H, D]`` in q's dtype, the rows' tokens in order."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty((sum(lens), *q.shape[1:]))
    at = 0
    for s, t in zip(starts, lens):
        rows = [y[s:s + t].transpose(0, 1).unsqueeze(0) for y in (q, k, v)]  # [1, heads, t, D] views
        out[at:at + t] = _causal(*rows, scale, work)[0].transpose(0, 1)
        at += t
    return out


def _causal(q: Tensor, k: Tensor, v: Tensor, scale: float | None, work: torch.dtype) -> Tensor:
    """Causal SDPA in ``work`` precision: ``[b, H, t, D]`` (k, v ``[b, Hkv, t, D]``) -> ``[b, H, t, D]``, q's dtype."""
    return F.scaled_dot_product_attention(q.to(work), k.to(work), v.to(work), is_causal=True, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1]).to(q.dtype)


def _in_tiles(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, attend) -> Tensor:
    """The tiling both versions share: ``attend(q_tile, k, v, q_pos, k_pos)`` for each tile of queries
    over the stored slots and the chunk keys it can see; padding rows zeroed."""
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
    for t0, t1, idx in query_tiles(T, chunk_sinks, W, q.device):  # a tile reads at most S + W + QUERY_TILE chunk keys
        out[:, :, t0:t1] = attend(
            q[:, :, t0:t1], torch.cat((stored_k, k[:, :, idx]), dim=2), torch.cat((stored_v, v[:, :, idx]), dim=2),
            q_pos[:, t0:t1], torch.cat((stored_pos, chunk_pos[:, idx]), dim=1))
    return out.masked_fill(~real.view(B, 1, T, 1), 0)
