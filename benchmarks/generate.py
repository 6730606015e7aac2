"""Time per generated token and cache bytes: QSinkKVCache (bits 16/8/4) vs DynamicCache vs
transformers' QuantizedCache (quanto backend, when optimum-quanto is installed).

    python benchmarks/generate.py [--contexts 512 2048 8192] [--new 32] [--capacity N] [--backends auto]
                                  [--json out.json]

For each context length, a prompt of that many tokens of real text (CPython's pydoc topics)
is prefilled, then ``--new`` tokens are decoded greedily one forward at a time; the table
gives the median time per decoded token, its ratio to DynamicCache, and the bytes each cache
holds at the end. The caches decode in turn, one step each (interleaved), so that a host that
slows down for a while slows them alike. ``--capacity`` sets QSinkKVCache's capacity (4 sinks + the rest recent);
by default it holds the whole stream, so every cache attends over the same tokens. ``--backends``:
the QSinkKVCache backends to time (``auto``, ``c``, ``torch``, ``triton``), each row naming the one
that ran.
Runs on the default model in float32 on CPU, or on CUDA with --device cuda.

On the CPU a second time is split out: ``attn ms`` is what a step spends in every layer's cache
update and attention call (the part a cache changes: DynamicCache's concatenation and SDPA, the
quantized caches' writes, checks and attention), with its own ratio to DynamicCache; the rest of
the step (projections, MLP, norms, RoPE) is the same work for every cache. It moves less with a
noisy host than the whole step does.
"""
from __future__ import annotations

import argparse
import functools
import json
import pydoc_data.topics
import statistics
import time

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from qsinkkv import CacheConfig
from qsinkkv.hf import QSinkKVCache
from qsinkkv.models import load_model


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return cache.nbytes()
    seen, total = set(), 0
    for layer in cache.layers:  # DynamicCache / QuantizedCache: every tensor the layers hold
        for t in vars(layer).values():
            for x in (t if isinstance(t, (list, tuple)) else [t]):
                if isinstance(x, torch.Tensor) and x.data_ptr() not in seen:
                    seen.add(x.data_ptr())
                    total += x.numel() * x.element_size()
                elif hasattr(x, "_data") and isinstance(getattr(x, "_data", None), torch.Tensor):  # quanto tensors
                    for y in (x._data, getattr(x, "_scale", None), getattr(x, "_shift", None)):
                        if isinstance(y, torch.Tensor):
                            total += y.numel() * y.element_size()
    return total


def prefill(model, ids, cache):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)


_IN_ATTENTION = [0.0]  # seconds of the current step spent in cache updates and attention calls


def timed(fn):
    """``fn`` with its time added to ``_IN_ATTENTION`` (wall clock: on a GPU it would count launches only)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _IN_ATTENTION[0] += time.perf_counter() - t0
    return wrapper


def step_s(model, nxt, cache):
    """One greedy decode step: (seconds, seconds in cache updates and attention, next token)."""
    with torch.no_grad():
        _IN_ATTENTION[0] = 0.0
        t0 = time.perf_counter()
        nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if nxt.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, _IN_ATTENTION[0], nxt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--capacity", type=int)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", nargs="+", default=["auto"], choices=["auto", "c", "torch", "triton"])
    ap.add_argument("--json")
    a = ap.parse_args()
    model, tok = load_model(dtype=torch.float32, device=a.device)
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    all_ids = tok(text[: 8 * max(a.contexts)], return_tensors="pt").input_ids.to(a.device)
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache
        has_quanto = True
    except ImportError:
        has_quanto = False
    rows = []
    split = a.device == "cpu"
    if split:
        for impl in ("sdpa", "qsinkkv"):  # the attention functions the model looks up at every call
            ALL_ATTENTION_FUNCTIONS[impl] = timed(ALL_ATTENTION_FUNCTIONS[impl])
    print(f"# {torch.get_num_threads()} threads, device {a.device}, float32 model; ms per decoded token (median "
          f"of {a.new}); 'x dyn' = time / DynamicCache time" + ("; 'attn ms': of which in cache updates and "
                                                              "attention calls (every layer)" if split else ""))
    print("| context | cache | ms/token | x dyn | attn ms | attn x dyn | cache bytes |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for ctx in a.contexts:
        ids = all_ids[:, :ctx]
        cap = a.capacity or ctx + a.new + 1
        configs = [("DynamicCache", "sdpa", lambda: DynamicCache(config=model.config))]
        if has_quanto:
            configs.append(("QuantizedCache quanto int4", "sdpa",
                            lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4)))
        for backend in a.backends:
            for bits in (16, 8, 4):
                cfg = CacheConfig(sink_tokens=4, recent_tokens=cap - 4, bits=bits, block_size=64, value_group_size=64)
                configs.append((f"QSinkKVCache int{bits} (C={cap}", "qsinkkv",
                                lambda cfg=cfg, backend=backend: QSinkKVCache(cfg, model.config, backend=backend)))
        # prefill every cache, then decode them in turn, one step each: a machine that slows
        # down for a while slows every cache alike, so the ratios hold on a noisy host
        runs = []
        for name, impl, make in configs:
            model.set_attn_implementation(impl)
            cache = make()
            nxt = prefill(model, ids, cache)
            if isinstance(cache, QSinkKVCache):  # the backend that ran
                name = f"{name}, {cache.inner.backend})"
            if split:
                cache.update = timed(cache.update)  # DynamicCache's concatenation, quanto's quantization
            runs.append(dict(name=name, impl=impl, cache=cache, nxt=nxt, times=[], attn=[]))
        for _ in range(a.new):
            for r in runs:
                model.set_attn_implementation(r["impl"])
                dt, attn, r["nxt"] = step_s(model, r["nxt"], r["cache"])
                r["times"].append(dt)
                r["attn"].append(attn)
        base = 1e3 * statistics.median(runs[0]["times"])
        base_attn = 1e3 * statistics.median(runs[0]["attn"])
        for r in runs:
            ms = 1e3 * statistics.median(r["times"])
            row = dict(context=ctx, cache=r["name"], ms_per_token=ms, vs_dynamic=ms / base,
                       bytes=cache_bytes(r["cache"]))
            attn = "- | -"
            if split:
                row["attn_ms_per_token"] = 1e3 * statistics.median(r["attn"])
                row["attn_vs_dynamic"] = row["attn_ms_per_token"] / base_attn
                attn = f"{row['attn_ms_per_token']:.1f} | {row['attn_vs_dynamic']:.2f}"
            rows.append(row)
            print(f"| {ctx:,} | {r['name']} | {ms:.1f} | {ms / base:.2f} | {attn} | {row['bytes']:,} |", flush=True)
        del runs

    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), device=a.device, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
