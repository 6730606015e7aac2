"""``qsinkkv-eval stream``: perplexity against position over a long text, at a small capacity.

Configurations (capacity C = sink_tokens + recent_tokens):

* ``full cache``: every token visible, bf16 (through SDPA: long texts stay fast);
* ``window, no sinks``: a plain sliding window of the newest C tokens, bf16;
* ``sinks + bf16 window``: StreamingLLM, S sinks + W recent, bf16;
* ``sinks + int8`` / ``sinks + int4``: qsinkkv, bf16 sinks + an int8 / int4 window.

Every windowed run is a decode-time replay (``replay.py``) under the exact sink + window set,
under each position contract asked for (``absolute``, ``cache_index``: the StreamingLLM one,
keys rotated by their index in the cache; by default both, side by side). Windowed perplexity
is taken over consecutive windows of ``window`` tokens; ``after_fill`` is the perplexity of the
tokens predicted once the cache is full. ``memory``: the bytes each configuration's real cache
holds (``footprint.py``; the full cache holds the whole text, the others the capacity).
"""
from __future__ import annotations

import math

from . import footprint, replay
from .progress import bar
from .schemes import REFERENCE, Scheme, store_of

POSITIONS = ("absolute", "cache_index")


def configs(sink_tokens: int, recent_tokens: int) -> list[dict]:
    C = sink_tokens + recent_tokens
    return [
        dict(name="full cache", sink_tokens=0, recent_tokens=None, scheme=REFERENCE),
        dict(name="window, no sinks", sink_tokens=0, recent_tokens=C, scheme=REFERENCE),
        dict(name="sinks + bf16 window", sink_tokens=sink_tokens, recent_tokens=recent_tokens, scheme=REFERENCE),
        dict(name="sinks + int8", sink_tokens=sink_tokens, recent_tokens=recent_tokens,
             scheme=Scheme("qsinkkv", 8, True)),
        dict(name="sinks + int4", sink_tokens=sink_tokens, recent_tokens=recent_tokens,
             scheme=Scheme("qsinkkv", 4, True)),
    ]


def curve_name(config: str, positions: str) -> str:
    return config if positions == "absolute" else f"{config} [{positions}]"


def run(model, ids, sink_tokens: int, recent_tokens: int, window: int = 256,
        positions: tuple[str, ...] = POSITIONS) -> dict:
    """Each row: ``ppl``/``after_fill`` under the first contract of ``positions``, and under every one
    of them in ``by_positions[contract]``."""
    T = ids.shape[1]
    C = sink_tokens + recent_tokens
    geo = footprint.Geometry.of(model)
    rows, curves = [], {}
    for cfg in bar(configs(sink_tokens, recent_tokens), "stream"):
        S, W, scheme = cfg["sink_tokens"], cfg["recent_tokens"], cfg["scheme"]
        W = T if W is None else W
        by = {}
        for contract in positions:
            with replay.replay(store_of(scheme, S), S, W, fused_causal=cfg["recent_tokens"] is None,
                               rotary=replay.positions_rotary(model, contract)):
                logp, _, _ = replay.token_logprobs(model, ids)
            nll = -logp  # nll[t]: predicting token t + 1 from tokens 0..t
            starts = list(range(0, T - 1, window))
            curve = [math.exp(nll[a:a + window].mean().item()) for a in starts]
            after = nll[C:]  # queries at C and later: the first ones that cannot see every token
            by[contract] = dict(ppl=math.exp(nll.mean().item()),
                                after_fill=math.exp(after.mean().item()) if len(after) else None)
            curves[curve_name(cfg["name"], contract)] = dict(position=[a + window // 2 for a in starts], ppl=curve)
        memory = footprint.of_scheme(scheme, geo, S, min(S + W, T))
        rows.append(dict(config=cfg["name"], sink_tokens=S, recent_tokens=W if cfg["recent_tokens"] else None,
                         bits=scheme.bits, **by[positions[0]], by_positions=by, memory=memory.to_dict()))
    return dict(tokens=T, sink_tokens=sink_tokens, recent_tokens=recent_tokens, capacity=C, window=window,
                positions=list(positions), rows=rows, curves=curves)
