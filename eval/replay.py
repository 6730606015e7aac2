"""Decode-time replay: one forward over the whole text in which every query attends exactly
what a cache would serve it at its own decode step.

At decode step i the cache holds tokens 0..i; the query sees the sink + window set
``visible(i)`` (``qsinkkv.layout.visible_mask``), and token j is read in its stored form
(``StoredKV``) once ``i >= ready[j]``, in bf16 before that (a block still filling, a residual).
None of that depends on later tokens, so all T queries are computed in parallel from the
layer's real K/V. ``tests/test_eval.py`` checks this against a token-by-token stream through
the real ``QSinkKVCache``.

Each layer replays as the model was trained (``qsinkkv.policy``): a trained window layer (Gemma 2/3, gpt-oss,
Mistral with ``sliding_window``, ...) sees exactly its window, ``sink_tokens=0, recent_tokens=sliding_window``, its
tokens stored by the same scheme with no sinks, as ``QSinkKVCache``'s ``LayerPolicy`` keeps it; a full-attention
layer sees the run's sinks + window. Learned sink logits (gpt-oss's ``s_aux``) join every query's softmax. With
``recent_tokens`` at least the text, the replay is the model itself (``tests/test_eval_hybrid.py``: stock's
perplexity).

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
from qsinkkv.policy import trained_windows

from .schemes import BF16, StoredKV

ATTN_IMPLEMENTATION = "qsinkkv_eval"


@dataclass
class Replay:
    store: Callable[[int, Tensor, Tensor, int], StoredKV | None]  # (layer, k, v, sink_tokens) -> stored view
    sink_tokens: int
    recent_tokens: int
    captured: dict[int, tuple] | None = field(default=None)  # layer -> (q, k, v, learned sink logits or None)
    fused_causal: bool = False  # plain causal attention through SDPA (a no-limit bf16 cache only)
    rotary: Rotary | None = None  # the model's RoPE: the cache_index contract (None: absolute)


_ACTIVE: list[Replay] = []


@contextlib.contextmanager
def replay(store, sink_tokens: int, recent_tokens: int, capture: bool = False, fused_causal: bool = False,
           rotary: Rotary | None = None):
    """While active, the model's attention replays decode steps under ``store`` (``(layer, k, v, sink_tokens)``:
    ``sink_tokens`` is the layer's, 0 on a trained window layer); with ``capture``
    the yielded Replay collects every layer's (q, k, v, learned sink logits or None) in ``captured`` (as the model
    computed them: post-RoPE). ``fused_causal`` lets a bf16 cache that sees everything use SDPA (fast on
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
           rotary: Rotary | None = None, sink_logits: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Decode-time attention of queries at positions ``0..T-1``: ``qsinkkv.sink_window_attention`` (the
    reference every path shares) per tile of queries over the keys the tile can see (``query_tiles``).

    q ``[B, H, T, D]``; k, v ``[B, Hkv, T, D]`` (the layer's K/V); view: the stored form, or None
    for a bf16 cache. With ``rotary`` (the ``cache_index`` contract) q, k and ``view.k`` are
    pre-RoPE and are rotated by their cache index. ``sink_logits [H]``: learned per-head sink logits (gpt-oss),
    in every query's softmax denominator. Returns the output ``[B, H, T, D]``
    float32 and, with ``want_probs``, the attention probabilities ``[B, H, T, T]`` (zero where
    not visible).
    """
    B, H, T, D = q.shape
    pos = torch.arange(T, device=q.device)
    qf = q.float()
    kf, vf = k.to(BF16).float(), v.to(BF16).float()
    if fused_causal and view is None and not want_probs and recent_tokens >= T and sink_logits is None:
        if rotary is not None:  # every index is the position: no sink's index is moved
            qf, kf = rotary.rotate(qf, pos), rotary.rotate(kf, pos)
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale,
                                                               enable_gqa=True)
        return out, None
    out = torch.empty(B, H, T, D, device=q.device)
    probs = torch.zeros(B, H, T, T, device=q.device) if want_probs else None
    attention = functools.partial(sink_window_attention, sink_tokens=sink_tokens, recent_tokens=recent_tokens,
                                  scale=scale, rotary=rotary, return_probs=want_probs, sink_logits=sink_logits)
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
        sinks = kwargs.get("s_aux")
        rp.captured[layer] = (query.detach(), key.detach(), value.detach(), None if sinks is None else sinks.detach())
    S, W = layer_visible(module.config, layer, rp.sink_tokens, rp.recent_tokens)
    if rp.rotary is not None and (S, W) != (rp.sink_tokens, rp.recent_tokens):
        raise ValueError("positions='cache_index' on a model with trained window layers: only 'absolute' replays "
                         "there (qsinkkv.policy)")
    q, k = (query, key) if rp.rotary is None else (unrotate(rp.rotary, query), unrotate(rp.rotary, key))
    view = rp.store(layer, k, value, S)
    out, _ = attend(q, k, value, view, S, W, scaling, fused_causal=rp.fused_causal, rotary=rp.rotary,
                    sink_logits=kwargs.get("s_aux"))
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def layer_visible(config, layer: int, sink_tokens: int, recent_tokens: int) -> tuple[int, int]:
    """``(sink_tokens, recent_tokens)`` layer ``layer`` of a model of ``config`` (``model.config`` or its text config)
    sees in a run of ``sink_tokens + recent_tokens``: a trained window layer its window and no sinks
    (``qsinkkv.policy.trained_windows``), a full-attention layer the run's."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = trained_windows(text).get(layer)
    return (sink_tokens, recent_tokens) if window is None else (0, window)


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
        return _score(functools.partial(head_logits, model), hidden, ids[0, 1:], ref_rows, keep_rows, chunk)


def head_logits(model, hidden: Tensor) -> Tensor:
    """The model's logits of ``hidden [..., hidden_size]``: its output embedding and what its ``forward`` does
    after it (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma 2's ``final_logit_softcapping``).
    ``check_head`` holds every model the eval loads to its own ``forward``, so a head this misses is refused, never
    scored wrongly."""
    logits = model.get_output_embeddings()(hidden)
    cfg = model.config.get_text_config(decoder=True)
    if getattr(model, "logit_scale", None) is not None:
        logits = logits * model.logit_scale
    if getattr(cfg, "logits_scaling", None):
        logits = logits / cfg.logits_scaling
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def check_head(model, tokens: int = 8) -> None:
    """A ValueError unless ``head_logits`` gives the model's own logits (its ``forward``) on ``tokens`` tokens."""
    ids = torch.arange(tokens, device=model.device).unsqueeze(0) % model.config.get_text_config(decoder=True).vocab_size
    with replay(lambda layer, k, v, sinks: None, 0, tokens), torch.no_grad():
        own = model(input_ids=ids, use_cache=False).logits.float()
        ours = head_logits(model, model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state).float()
    if not torch.allclose(ours, own, rtol=1e-4, atol=1e-4 * own.abs().max().item()):
        raise ValueError(f"{type(model).__name__} changes its logits after the output embedding in a way the eval "
                         f"does not reproduce (largest difference {(ours - own).abs().max().item():.3g}): refused "
                         "rather than scored wrongly")


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
