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

``run_memory`` (``--memory-of``): the same configurations, each at the largest capacity whose
allocated bytes fit each budget (``memory.py``), compared over the same positions: the
perplexity of every prediction, and ``after_fill``: of the predictions at positions >=
``after_fill_from``, the largest capacity of any row of the run (every row's cache is full there).
``gap_closed``: of the perplexity gap between the bf16 window with sinks at the same memory and
the full cache, the share a row closes (1: at the full cache; 0: no better than that window).
"""
from __future__ import annotations

import math

from . import footprint, memory, replay
from .progress import bar
from .schemes import REFERENCE, Scheme, store_of

POSITIONS = ("absolute", "cache_index")


FULL = "full cache"
# the windowed configurations: name -> (scheme, keeps sinks)
WINDOWED = {"window, no sinks": (REFERENCE, False), "sinks + bf16 window": (REFERENCE, True),
            "sinks + int8": (Scheme("qsinkkv", 8, True), True), "sinks + int4": (Scheme("qsinkkv", 4, True), True)}
GAP_BASE = "sinks + bf16 window"  # gap_closed is measured from this row at the same memory


def configs(sink_tokens: int, recent_tokens: int) -> list[dict]:
    C = sink_tokens + recent_tokens
    out = [dict(name=FULL, sink_tokens=0, recent_tokens=None, scheme=REFERENCE)]
    for name, (scheme, sinks) in WINDOWED.items():
        out.append(dict(name=name, sink_tokens=sink_tokens if sinks else 0,
                        recent_tokens=recent_tokens if sinks else C, scheme=scheme))
    return out


def curve_name(config: str, positions: str) -> str:
    return config if positions == "absolute" else f"{config} [{positions}]"


def run(model, ids, sink_tokens: int, recent_tokens: int, window: int = 256,
        positions: tuple[str, ...] = POSITIONS) -> dict:
    """Each row: ``ppl``/``after_fill`` under the first contract of ``positions``, and under every one
    of them in ``by_positions[contract]``."""
    T = ids.shape[1]
    C = sink_tokens + recent_tokens
    geo = footprint.Geometry.of(model, tokens=T)
    rows, curves = [], {}
    for cfg in bar(configs(sink_tokens, recent_tokens), "stream"):
        S, W, scheme = cfg["sink_tokens"], cfg["recent_tokens"], cfg["scheme"]
        W = T if W is None else W
        by = {}
        for contract in positions:
            nll = _nll(model, ids, scheme, S, W, cfg["recent_tokens"] is None, contract)
            after = nll[C:]  # queries at C and later: the first ones that cannot see every token
            by[contract] = dict(ppl=math.exp(nll.mean().item()),
                                after_fill=math.exp(after.mean().item()) if len(after) else None)
            curves[curve_name(cfg["name"], contract)] = _curve(nll, window)
        memory = footprint.of_scheme(scheme, geo, S, min(S + W, T))
        rows.append(dict(config=cfg["name"], sink_tokens=S, recent_tokens=W if cfg["recent_tokens"] else None,
                         bits=scheme.bits, **by[positions[0]], by_positions=by, memory=memory.to_dict()))
    return dict(tokens=T, sink_tokens=sink_tokens, recent_tokens=recent_tokens, capacity=C, window=window,
                positions=list(positions), rows=rows, curves=curves)


def _nll(model, ids, scheme: Scheme, S: int, W: int, full: bool, contract: str):
    """``nll[t]``: predicting token t + 1 from tokens 0..t, under the replay of ``scheme``."""
    with replay.replay(store_of(scheme), S, W, fused_causal=full, rotary=replay.positions_rotary(model, contract)):
        logp, _, _ = replay.token_logprobs(model, ids)
    return -logp


def _curve(nll, window: int) -> dict:
    starts = list(range(0, len(nll), window))
    return dict(position=[a + window // 2 for a in starts],
                ppl=[math.exp(nll[a:a + window].mean().item()) for a in starts])


# --- --memory-of: every configuration at the largest capacity its cache fits in each budget ---------

def plan_memory(geo: footprint.Geometry, budgets: list[memory.Budget], sink_tokens: int, tokens: int) -> dict:
    """Each budget's capacity for every windowed configuration, found on the meta device (no model
    run). Raises ValueError naming ``--memory-of`` for a budget a configuration's smallest cache does
    not fit, or when the largest capacity leaves no prediction after every cache fills."""
    text = memory.text_of(budgets)
    plans = []
    for b in budgets:
        limit = b.nbytes(geo)
        fits = {}
        for name, (scheme, sinks) in WINDOWED.items():
            fits[name] = memory.largest_fit(limit, scheme, sink_tokens if sinks else 0, geo, name, b.text)
        try:  # qsinkkv's own bits=16 ring, for the report's note (not a row: a budget it misses is no error)
            ring = memory.largest_fit(limit, Scheme("qsinkkv", 16, True), sink_tokens, geo)
        except ValueError:
            ring = None
        plans.append(dict(budget=b, limit=limit, fits=fits, bf16_ring=ring))
    largest = max(f.capacity for p in plans for f in p["fits"].values())
    if largest >= tokens - 1:
        name, b = next((n, p["budget"]) for p in plans for n, f in p["fits"].items() if f.capacity == largest)
        raise ValueError(f"{memory.FLAG} {text}: at {b.text} '{name}' holds {largest:,} tokens; --tokens ({tokens}) "
                         f"must be at least {largest + 2} so that some predictions come after every cache fills "
                         "(raise --tokens or lower the budget)")
    return dict(text=text, sink_tokens=sink_tokens, budgets=plans, after_fill_from=largest)


def run_memory(model, ids, plan: dict, window: int = 256, positions: tuple[str, ...] = ("absolute",)) -> dict:
    """Every windowed configuration at each budget's capacity and the full cache, over the same
    positions (module doc). A configuration at a capacity another budget also gives runs once."""
    T = ids.shape[1]
    geo = footprint.Geometry.of(model, tokens=T)
    F = plan["after_fill_from"]
    done: dict = {}

    def measure(scheme, S, W, full):
        key = (scheme, S, W, full)
        if key not in done:
            done[key] = {c: _nll(model, ids, scheme, S, W, full, c) for c in positions}
        return done[key]

    def scores(nll: dict) -> dict:
        return {c: dict(ppl=math.exp(x.mean().item()), after_fill=math.exp(x[F:].mean().item()))
                for c, x in nll.items()}

    todo = [(p, name, fit) for p in plan["budgets"] for name, fit in p["fits"].items()]
    full_nll = measure(REFERENCE, 0, T, True)
    full = dict(config=FULL, capacity=T, by_positions=scores(full_nll),
                memory=footprint.of_scheme(REFERENCE, geo, 0, T).to_dict(),
                curves={c: _curve(x, window) for c, x in full_nll.items()})
    full.update(full["by_positions"][positions[0]])
    results = {}
    for p, name, fit in bar(todo, "stream --memory-of"):
        scheme = WINDOWED[name][0]
        results[p["budget"], name] = measure(scheme, fit.sink_tokens, fit.recent_tokens, False)
    budgets = []
    for p in plan["budgets"]:
        b, rows = p["budget"], []
        base = scores(results[b, GAP_BASE])
        for name, fit in p["fits"].items():
            scheme = WINDOWED[name][0]
            real = footprint.of_scheme(scheme, geo, fit.sink_tokens, fit.capacity)
            if real.total != fit.bytes:  # the meta-device search and the real cache must agree
                raise RuntimeError(f"{name} at capacity {fit.capacity}: a real cache holds {real.total:,} bytes, "
                                   f"the search computed {fit.bytes:,}")
            by = scores(results[b, name])
            for c, s in by.items():
                for key in ("ppl", "after_fill"):
                    gap = base[c][key] - full["by_positions"][c][key]
                    s[f"gap_closed{'' if key == 'ppl' else '_after_fill'}"] = \
                        (base[c][key] - s[key]) / gap if abs(gap) > 1e-9 else None
            rows.append(dict(config=name, scheme=scheme.name, bits=scheme.bits, sink_tokens=fit.sink_tokens,
                             recent_tokens=fit.recent_tokens, capacity=fit.capacity, step=fit.step,
                             bytes=fit.bytes, next_step_bytes=fit.next_bytes, budget_fraction=fit.bytes / p["limit"],
                             memory=real.to_dict(), **by[positions[0]], by_positions=by,
                             curves={c: _curve(x, window) for c, x in results[b, name].items()}))
        ring = p["bf16_ring"]  # sized, not measured: it attends like the bf16 window at its capacity
        budgets.append(dict(text=b.text, dtype=b.dtype, tokens=b.tokens, bytes=p["limit"], rows=rows,
                            bf16_ring=ring and dict(capacity=ring.capacity, bytes=ring.bytes, step=ring.step)))
    return dict(mode="memory_of", memory_of=plan["text"], tokens=T, sink_tokens=plan["sink_tokens"], window=window,
                positions=list(positions), after_fill_from=F, gap_base=GAP_BASE,
                bf16_bytes_per_token=geo.bf16_bytes_per_token, full=full, budgets=budgets,
                replays=len(done) * len(positions))
