"""``qsinkkv-eval recall``: does the window still hold a fact from ``distance`` tokens ago?

Perplexity after the window fills says a cache stays fluent; it does not say what it remembers. Here
each trial hides a random pass key at an exact distance before the question (``passkey.py``), runs the
prompt through a real cache as ``generate`` would (one prefill, the sink + window mask applied to it,
then greedy decoding of ``passkey.ANSWER_TOKENS`` tokens, which read the stored, quantized window) and
counts the answer correct when it contains the key. Every configuration answers the same prompts.

Rows (``stream.WINDOWED``'s names): the full cache (transformers' ``DynamicCache`` under SDPA: every
token visible), and, each through ``qsinkkv.hf.QSinkKVCache`` under ``attn_implementation="qsinkkv"``:

* ``window, no sinks``: a plain sliding window of C tokens (``sink_tokens=0, bits=16``);
* ``sinks + bf16 window``: StreamingLLM, S sinks + W recent in bf16 (``bits=16``);
* ``sinks + int8`` / ``sinks + int4``: qsinkkv (block 64, value group 64, as ``stream``).

Sizes: ``--memory-of`` gives every windowed row the largest capacity whose *allocated* bytes fit each
budget (``memory.largest_fit``, as ``stream --memory-of``: the bf16 windows as a bf16 K/V tensor of
exactly their tokens, qsinkkv as its ring of whole blocks with the bf16 filling block); ``--capacity``
gives them all one capacity. The full cache's bytes are those of a bf16 cache of each prompt.

``farthest``: the largest measured distance at which the full cache answers at all and this row answers
at least ``MATCH`` (80%) as often as it, doing so at every shorter distance too: how far back a
configuration remembers what the model itself can. Against bytes, over budgets, it is the memory curve.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from . import footprint, memory, passkey
from .progress import bar
from .schemes import REFERENCE, cache_config
from .stream import FULL, WINDOWED

MATCH = 0.8
# --schemes: the short name of each windowed row
SCHEME_NAMES = {"window": "window, no sinks", "bf16": "sinks + bf16 window", "int8": "sinks + int8",
                "int4": "sinks + int4"}
HAYSTACK_CHARS = 400_000  # of the text, tokenized once: ~100k tokens of the default text to draw slices from
DISTANCE_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)  # default distances, x the largest capacity


@dataclasses.dataclass(frozen=True)
class Row:
    config: str         # a WINDOWED name
    sink_tokens: int
    recent_tokens: int
    bytes: int          # what the cache allocates (all layers)
    bits: int

    @property
    def capacity(self) -> int:
        return self.sink_tokens + self.recent_tokens

    def cache_config(self, positions: str):
        scheme, _ = WINDOWED[self.config]
        if scheme.family == "bf16":  # the bf16 windows: a bits=16 ring (exactly the same visible set and values)
            from qsinkkv import CacheConfig
            return CacheConfig(sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens, bits=16,
                               positions=positions)
        return dataclasses.replace(cache_config(scheme, self.sink_tokens, self.capacity), positions=positions)


def plan(geo: footprint.Geometry, sink_tokens: int, names: list[str], budgets: list[memory.Budget] | None = None,
         capacity: int | None = None) -> list[dict]:
    """[{text, bytes, rows: [Row]}]: one entry per budget (or one for ``capacity``). Raises ValueError naming
    ``--memory-of`` for a budget a row's smallest cache does not fit."""
    out = []
    if budgets is None:
        rows = []
        for name in names:
            scheme, sinks = WINDOWED[name]
            S = sink_tokens if sinks else 0
            rows.append(Row(name, S, capacity - S, footprint.of_scheme(scheme, geo, S, capacity).total, scheme.bits))
        return [dict(text=f"capacity {capacity}", bytes=None, rows=rows)]
    for b in budgets:
        limit = b.nbytes(geo)
        rows = []
        for name in names:
            scheme, sinks = WINDOWED[name]
            fit = memory.largest_fit(limit, scheme, sink_tokens if sinks else 0, geo, name, b.text)
            rows.append(Row(name, fit.sink_tokens, fit.recent_tokens, fit.bytes, scheme.bits))
        out.append(dict(text=b.text, bytes=limit, rows=rows))
    return out


def parse_distances(text: str) -> list[int]:
    """argparse ``type`` of ``--distances`` (the eval's and ``benchmarks/vllm_recall.py``'s): ``N[,N...]`` ->
    ascending, each once."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item.lstrip("+-").isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not a whole number of tokens; expected "
                                             "N[,N...] (e.g. 128,256,512)")
        if int(item) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a distance must be >= 1 token, got {int(item)}")
        out.append(int(item))
    return sorted(set(out))


def default_distances(plans: list[dict]) -> list[int]:
    largest = max(r.capacity for p in plans for r in p["rows"])
    return sorted({max(1, round(f * largest)) for f in DISTANCE_FACTORS})


def prompts(tokenizer, haystack: list[int], distances: list[int], trials: int, seed: int) -> dict:
    """{distance: [Prompt] * trials}, every one built before any model work (a distance too short or too long
    for the text raises ValueError here)."""
    pk = passkey.Passkey.of(tokenizer)
    return {d: [pk.build(haystack, d, passkey.trial_rng(seed, d, t)) for t in range(trials)] for d in distances}


def greedy(model, ids: list[int], cache, steps: int, stop: set[int]) -> list[int]:
    """Greedy decoding after one prefill of ``ids`` into ``cache`` (None: a ``DynamicCache``)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if cache is None else cache
    x = torch.tensor([ids], device=model.device)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=x, cache=cache, use_cache=True).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            if token in stop:
                break
            x = torch.tensor([[token]], device=model.device)
    return out


def stop_tokens(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


def run(model, tokenizer, todo: dict, plans: list[dict], seed: int, positions: str = "absolute") -> dict:
    """Every row of every plan and the full cache on the same prompts ``todo`` (``prompts``: built before this,
    with ``seed``; module doc). A row at a capacity another budget also gives runs once."""
    from qsinkkv.hf import QSinkKVCache  # registers attn_implementation="qsinkkv"

    geo = footprint.Geometry.of(model)
    distances = list(todo)
    trials = len(todo[distances[0]])
    stop = stop_tokens(model, tokenizer)
    unique = list(dict.fromkeys(r for p in plans for r in p["rows"]))
    runs = [None, *unique]  # None: the full cache
    answers: dict = {}
    attention = None
    steps = bar([(r, d, p) for r in runs for d in distances for p in todo[d]], "recall")
    for row, d, prompt in steps:
        wanted = "sdpa" if row is None else "qsinkkv"
        if wanted != attention:  # once per row (the rows run one after another)
            model.set_attn_implementation(wanted)
            attention = wanted
        cache = None if row is None else QSinkKVCache(row.cache_config(positions), model)
        text = tokenizer.decode(greedy(model, prompt.ids, cache, passkey.ANSWER_TOKENS, stop))
        answers.setdefault((row, d), []).append(dict(key=prompt.key, answer=text,
                                                     correct=passkey.correct(text, prompt.key)))

    def cells(row) -> list[dict]:
        out = []
        for d in distances:
            got = answers[row, d]
            n = sum(a["correct"] for a in got)
            if row is None:
                T = len(todo[d][0].ids)
                size = dict(capacity=T, bytes=footprint.of_scheme(REFERENCE, footprint.Geometry.of(model, tokens=T), 0,
                                                                  T).total, bits=16, sink_tokens=0)
            else:
                size = dict(capacity=row.capacity, bytes=row.bytes, bits=row.bits, sink_tokens=row.sink_tokens)
            out.append(dict(distance=d, correct=n, trials=len(got), accuracy=n / len(got), **size,
                            answers=[a["answer"] for a in got]))
        return out

    full_cells = cells(None)
    full = dict(config=FULL, by_distance=full_cells, farthest=farthest(full_cells, full_cells))
    budgets = []
    for p in plans:
        rows = []
        for r in p["rows"]:
            c = cells(r)
            rows.append(dict(config=r.config, bits=r.bits, sink_tokens=r.sink_tokens, recent_tokens=r.recent_tokens,
                             capacity=r.capacity, bytes=r.bytes, by_distance=c, farthest=farthest(c, full_cells)))
        budgets.append(dict(text=p["text"], bytes=p["bytes"], rows=rows))
    example = todo[distances[0]][0]
    return dict(distances=list(distances), trials=trials, seed=seed, positions=positions, match=MATCH,
                digits=passkey.DIGITS, answer_tokens=passkey.ANSWER_TOKENS, lead_tokens=passkey.LEAD_TOKENS,
                prompt_tokens={d: len(todo[d][0].ids) for d in distances},
                example_prompt=tokenizer.decode(example.ids), example_key=example.key,
                bf16_bytes_per_token=geo.bf16_bytes_per_token, full=full, budgets=budgets,
                runs=len(runs) * len(distances) * trials)


def farthest(cells: list[dict], full: list[dict]) -> int | None:
    """The largest distance at which the full cache answers (> 0) and ``cells`` answer >= MATCH as often, with
    ``cells`` >= MATCH x the full cache at every shorter distance (module doc); None if there is none."""
    best = None
    for mine, ref in zip(cells, full, strict=True):
        if mine["accuracy"] < MATCH * ref["accuracy"]:
            break
        if ref["accuracy"] > 0:
            best = mine["distance"]
    return best
