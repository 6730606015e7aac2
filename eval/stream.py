"""``qsinkkv-eval stream``: perplexity against position over a long text, at a small capacity.

Configurations (capacity C = sink_tokens + recent_tokens):

* ``full cache``: every token visible, bf16 (through SDPA: long texts stay fast);
* ``window, no sinks``: a plain sliding window of the newest C tokens, bf16;
* ``sinks + bf16 window``: StreamingLLM, S sinks + W recent, bf16;
* ``sinks + int8`` / ``sinks + int4``: qsinkkv, bf16 sinks + an int8 / int4 window.

Every windowed run is a decode-time replay (``replay.py``) under the exact sink + window set,
positions ``absolute``. Windowed perplexity is taken over consecutive windows of ``window``
tokens; ``after_fill`` is the perplexity of the tokens predicted once the cache is full.
"""
from __future__ import annotations

import math

from . import replay
from .progress import bar
from .schemes import REFERENCE, Scheme, store_of


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


def run(model, ids, sink_tokens: int, recent_tokens: int, window: int = 256) -> dict:
    T = ids.shape[1]
    C = sink_tokens + recent_tokens
    rows, curves = [], {}
    for cfg in bar(configs(sink_tokens, recent_tokens), "stream"):
        S, W, scheme = cfg["sink_tokens"], cfg["recent_tokens"], cfg["scheme"]
        W = T if W is None else W
        with replay.replay(store_of(scheme, S), S, W, fused_causal=cfg["recent_tokens"] is None):
            logp, _, _ = replay.token_logprobs(model, ids)
        nll = -logp  # nll[t]: predicting token t + 1 from tokens 0..t
        starts = list(range(0, T - 1, window))
        curve = [math.exp(nll[a:a + window].mean().item()) for a in starts]
        after = nll[C:]  # queries at C and later: the first ones that cannot see every token
        rows.append(dict(config=cfg["name"], sink_tokens=S, recent_tokens=W if cfg["recent_tokens"] else None,
                         bits=scheme.bits, ppl=math.exp(nll.mean().item()),
                         after_fill=math.exp(after.mean().item()) if len(after) else None))
        curves[cfg["name"]] = dict(position=[a + window // 2 for a in starts], ppl=curve)
    return dict(tokens=T, sink_tokens=sink_tokens, recent_tokens=recent_tokens, capacity=C, window=window,
                rows=rows, curves=curves)
