"""``qsinkkv-eval ppl``: perplexity and mean per-token KL against the bf16 cache, for every scheme.

Each scheme's run is one decode-time replay (``replay.py``): every token is predicted from
exactly the K/V that scheme's cache would serve at that decode step, errors compounding
through the layers as in generation. ``quanto`` (whose cache re-quantizes its history)
streams token by token through the real ``transformers.QuantizedCache`` instead.

Every row carries ``memory`` (``footprint.py``): the bytes that scheme's real cache holds at
the run's capacity (``min(S + W, tokens)``), per token and as a fraction of bf16's.
``positions="cache_index"`` replays the StreamingLLM contract (the bf16 reference too);
``quanto`` stores post-RoPE keys and is skipped there.
"""
from __future__ import annotations

import math

import torch

from . import footprint, replay
from .progress import bar
from .schemes import REFERENCE, schemes_for, store_of

QUANTO_ABSOLUTE_ONLY = "skipped: QuantizedCache stores post-RoPE keys (absolute positions only)"
QUANTO_NO_WINDOW_LAYERS = "skipped: QuantizedCache keeps every token of every layer (the model has window layers)"


def run(model, ids, bits: list[int], sink_tokens: int, recent_tokens: int, only: list[str] | None = None,
        positions: str = "absolute") -> dict:
    T = ids.shape[1]
    W = recent_tokens
    capacity = min(sink_tokens + W, T)
    geo = footprint.Geometry.of(model, tokens=T)
    rotary = replay.positions_rotary(model, positions)
    todo = [s for b in bits for s in schemes_for(b) if only is None or s.name in only]
    with replay.replay(store_of(REFERENCE), sink_tokens, W, rotary=rotary):
        ref_logp, _, ref_rows = replay.token_logprobs(model, ids, keep_rows=True)
    ref_nll = -ref_logp.mean().item()
    rows = [dict(scheme=REFERENCE.name, bits=16, description=REFERENCE.description, ppl=math.exp(ref_nll),
                 nll=ref_nll, delta_pct=0.0, kl=0.0, status="ok",
                 memory=footprint.of_scheme(REFERENCE, geo, sink_tokens, capacity).to_dict())]
    for scheme in bar(todo, "ppl"):
        row = dict(scheme=scheme.name, bits=scheme.bits, description=scheme.description)
        if not scheme.available():
            rows.append(dict(row, status=f"skipped: {scheme.requires} is not installed"))
            continue
        if scheme.family == "quanto":
            skip = quanto_skip(sink_tokens + W, T, rotary, geo)
            if skip:
                rows.append(dict(row, status=skip))
                continue
            logp, kl = _quanto_stream(model, ids, ref_rows)
        else:
            with replay.replay(store_of(scheme), sink_tokens, W, rotary=rotary):
                logp, kl, _ = replay.token_logprobs(model, ids, ref_rows=ref_rows)
        nll = -logp.mean().item()
        rows.append(dict(row, ppl=math.exp(nll), nll=nll, delta_pct=100 * math.expm1(nll - ref_nll),
                         kl=kl.mean().item(), status="ok",
                         memory=footprint.of_scheme(scheme, geo, sink_tokens, capacity).to_dict()))
    return dict(tokens=T, sink_tokens=sink_tokens, recent_tokens=W, capacity=capacity, positions=positions,
                rows=rows)


def quanto_skip(capacity: int, tokens: int, rotary, geo: footprint.Geometry) -> str | None:
    """Why transformers' QuantizedCache cannot be measured here, or None."""
    if geo.window_layers:
        return QUANTO_NO_WINDOW_LAYERS
    if capacity < tokens:
        return "skipped: QuantizedCache keeps every token (no window)"
    if rotary is not None:
        return QUANTO_ABSOLUTE_ONLY
    return None


def _quanto_stream(model, ids, ref_rows):
    """Token by token through transformers' own QuantizedCache (quanto int4), as generate() runs it."""
    from transformers import QuantizedCache

    from .schemes import QUANTO

    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, **QUANTO)
        logp, kl = [], []
        with torch.no_grad():
            for t in bar(range(ids.shape[1] - 1), "quanto stream", leave=False):
                ls = torch.log_softmax(model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float(), -1)
                logp.append(ls[ids[0, t + 1]])
                kl.append((ref_rows[t].exp() * (ref_rows[t] - ls)).sum())
    finally:
        model.set_attn_implementation(impl)
    return torch.stack(logp), torch.stack(kl)
