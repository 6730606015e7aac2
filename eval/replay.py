"""Decode-time replay: one forward over the whole text in which every query attends exactly
what a cache would serve it at its own decode step.

At decode step i the cache holds tokens 0..i; the query sees the sink + window set
``visible(i)`` (``qsinkkv.layout.visible_mask``), and token j is read in its stored form
(``StoredKV``) once ``i >= ready[j]``, in bf16 before that (a block still filling, a residual).
None of that depends on later tokens, so all T queries are computed in parallel from the
layer's real K/V. ``tests/test_eval.py`` checks this against a token-by-token stream through
the real ``QSinkKVCache``.

Two position contracts (``CacheConfig.positions``):

* ``absolute``: keys are stored as the model rotated them (their true positions);
* ``cache_index`` (StreamingLLM): the model's RoPE is undone, keys are stored pre-RoPE (the
  store quantizes those) and rotated by their index in the cache at every step: sinks at
  0..S-1, the visible recent tokens after them, the query at ``min(i, C-1)``. RoPE scores
  depend only on (query index - key index), and a recent key's index is its position minus the
  same offset as the query's, so recent keys keep their true distance; only the sinks move: a
  query at ``i >= C`` sees sink ``j`` at distance ``C-1-j`` instead of ``i-j``.
  ``tests/test_eval_frontier.py`` checks it against a token-by-token stream through
  ``QSinkKVCache(CacheConfig(positions="cache_index"))``.

The model runs with ``attn_implementation="qsinkkv_eval"``; ``replay(...)`` sets what the
attention function does for the duration of one forward.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from qsinkkv import Rotary, sink_window_attention
from qsinkkv.layout import query_tiles

from .schemes import BF16, StoredKV

ATTN_IMPLEMENTATION = "qsinkkv_eval"


@dataclass
class Replay:
    store: Callable[[int, Tensor, Tensor], StoredKV | None]  # (layer, k, v) -> stored view
    sink_tokens: int
    recent_tokens: int
    captured: dict[int, tuple[Tensor, Tensor, Tensor]] | None = field(default=None)  # layer -> (q, k, v)
    fused_causal: bool = False  # plain causal attention through SDPA (a no-limit bf16 cache only)
    rotary: Rotary | None = None  # the model's RoPE: the cache_index contract (None: absolute)


_ACTIVE: list[Replay] = []


@contextlib.contextmanager
def replay(store, sink_tokens: int, recent_tokens: int, capture: bool = False, fused_causal: bool = False,
           rotary: Rotary | None = None):
    """While active, the model's attention replays decode steps under ``store``; with ``capture``
    the yielded Replay collects every layer's (q, k, v) in ``captured`` (as the model computed
    them: post-RoPE). ``fused_causal`` lets a bf16 cache that sees everything use SDPA (fast on
    long texts; it sums in another order, so a reference that schemes are compared against must
    not use it). ``rotary`` (the model's schedule, ``positions_rotary``) selects the
    ``cache_index`` contract: ``store`` then receives pre-RoPE keys."""
    rp = Replay(store, sink_tokens, recent_tokens, {} if capture else None, fused_causal, rotary)
    _ACTIVE.append(rp)
    try:
        yield rp
    finally:
        _ACTIVE.pop()


def attend(q: Tensor, k: Tensor, v: Tensor, view: StoredKV | None, sink_tokens: int, recent_tokens: int,
           scale: float | None = None, want_probs: bool = False, fused_causal: bool = False,
           rotary: Rotary | None = None) -> tuple[Tensor, Tensor | None]:
    """Decode-time attention of queries at positions ``0..T-1``: ``qsinkkv.sink_window_attention`` (the
    reference every path shares) per tile of queries over the keys the tile can see (``query_tiles``).

    q ``[B, H, T, D]``; k, v ``[B, Hkv, T, D]`` (the layer's K/V); view: the stored form, or None
    for a bf16 cache. With ``rotary`` (the ``cache_index`` contract) q, k and ``view.k`` are
    pre-RoPE and are rotated by their cache index. Returns the output ``[B, H, T, D]``
    float32 and, with ``want_probs``, the attention probabilities ``[B, H, T, T]`` (zero where
    not visible).
    """
    B, H, T, D = q.shape
    pos = torch.arange(T, device=q.device)
    qf = q.float()
    kf, vf = k.to(BF16).float(), v.to(BF16).float()
    if fused_causal and view is None and not want_probs and recent_tokens >= T:
        if rotary is not None:  # every index is the position: no sink's index is moved
            qf, kf = rotary.rotate(qf, pos), rotary.rotate(kf, pos)
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale,
                                                               enable_gqa=True)
        return out, None
    out = torch.empty(B, H, T, D, device=q.device)
    probs = torch.zeros(B, H, T, T, device=q.device) if want_probs else None
    attention = functools.partial(sink_window_attention, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                  scale=scale, rotary=rotary, return_probs=want_probs)
    for t0, t1, idx in query_tiles(T, sink_tokens, recent_tokens, q.device):  # the tiling the references use
        if view is None:
            o = attention(qf[:, :, t0:t1], kf[:, :, idx], vf[:, :, idx], pos[t0:t1], idx)
        else:
            # each token twice: as held first (bf16) and as stored; a query sees the form its decode step reads
            stored = view.ready[idx].unsqueeze(0) <= pos[t0:t1].unsqueeze(1)     # [t, n]
            o = attention(qf[:, :, t0:t1], torch.cat((kf[:, :, idx], view.k[:, :, idx]), dim=2),
                          torch.cat((vf[:, :, idx], view.v[:, :, idx]), dim=2), pos[t0:t1], torch.cat((idx, idx)),
                          key_mask=torch.cat((~stored, stored), dim=1))
        o, p = o if want_probs else (o, None)
        out[:, :, t0:t1] = o
        if p is not None:
            probs[:, :, t0:t1, idx] = p if view is None else p[..., :idx.numel()] + p[..., idx.numel():]
    return out, probs


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query [B, H, T, D]``, ``key/value [B, Hkv, T, D]`` of
    positions 0..T-1 (one forward from an empty cache) -> ``([B, T, H, D], None)``."""
    if not _ACTIVE:
        raise RuntimeError("attn_implementation='qsinkkv_eval' runs only inside qsinkkv.eval.replay.replay()")
    rp = _ACTIVE[-1]
    layer = module.layer_idx
    if rp.captured is not None:
        rp.captured[layer] = (query.detach(), key.detach(), value.detach())
    q, k = (query, key) if rp.rotary is None else (unrotate(rp.rotary, query), unrotate(rp.rotary, key))
    view = rp.store(layer, k, value)
    out, _ = attend(q, k, value, view, rp.sink_tokens, rp.recent_tokens, scaling, fused_causal=rp.fused_causal,
                    rotary=rp.rotary)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def positions_rotary(model, positions: str) -> Rotary | None:
    """The model's fixed RoPE schedule for ``positions="cache_index"`` (as ``QSinkKVCache`` reads it);
    None for ``"absolute"``."""
    if positions == "absolute":
        return None
    if positions != "cache_index":
        raise ValueError(f"positions must be 'absolute' or 'cache_index', got {positions!r}")
    from qsinkkv.hf import rotary_from_config

    return rotary_from_config(model.config.get_text_config(decoder=True))


def unrotate(rotary: Rotary, x: Tensor) -> Tensor:
    """Undo the model's RoPE of ``x [B, H, T, D]`` at positions ``0..T-1`` (``Rotary.unrotate``, as
    ``QSinkKVCache`` recovers it)."""
    return rotary.unrotate(x, torch.arange(x.shape[2], device=x.device))


def _no_mask(*args, **kwargs):
    return None  # the replay applies the sink + window mask itself


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def token_logprobs(model, ids: Tensor, ref_rows: Tensor | None = None, keep_rows: bool = False, chunk: int = 512):
    """One forward over ``ids [1, T]`` from an empty cache.

    Returns ``logp [T-1]`` (log-probability of each next token), ``kl [T-1]`` (KL from
    ``ref_rows`` to this run's next-token distribution, if given) and, with ``keep_rows``, the
    log-softmax rows ``[T-1, V]`` (float32). The LM head runs in chunks: long texts never hold
    all logits at once.
    """
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        return _score(model.get_output_embeddings(), hidden, ids[0, 1:], ref_rows, keep_rows, chunk)


def _score(head, hidden: Tensor, target: Tensor, ref_rows, keep_rows: bool, chunk: int = 512):
    logp, kl, rows = [], [], []
    for t0 in range(0, hidden.shape[0], chunk):
        ls = torch.log_softmax(head(hidden[t0:t0 + chunk]).float(), dim=-1)
        logp.append(ls.gather(1, target[t0:t0 + chunk, None])[:, 0])
        if ref_rows is not None:
            ref = ref_rows[t0:t0 + chunk]
            kl.append((ref.exp() * (ref - ls)).sum(-1))
        if keep_rows:
            rows.append(ls)
    return (torch.cat(logp), torch.cat(kl) if kl else None, torch.cat(rows) if rows else None)
