"""Time per generated token and cache bytes: QSinkKVCache (bits 16/8/4) vs DynamicCache vs
transformers' QuantizedCache (quanto backend, when optimum-quanto is installed).

    python benchmarks/generate.py [--context 512 2048 8192] [--new 32] [--capacity N | --recent-tokens W]
                                  [--sink-tokens 4] [--backend auto] [--json out.json]
    TRITON_INTERPRET=1 python benchmarks/generate.py --context 16 --new 1 --backend triton --bits 4 --baselines \
                                  --interpret   # the Triton path on the CPU, interpreted: a smoke test

For each context length, a prompt of that many tokens of real text (CPython's pydoc topics)
is prefilled, then ``--new`` tokens are decoded greedily one forward at a time; the table
gives the median time per decoded token, its ratio to DynamicCache, and the bytes each cache
holds at the end. The caches decode in turn, one step each (interleaved), so that a host that
slows down for a while slows them alike. ``--capacity`` sets QSinkKVCache's capacity (``--sink-tokens``, default 4,
+ the rest recent; or ``--recent-tokens``); by default it holds the whole stream, so every cache attends over the
same tokens. ``--backend``:
the QSinkKVCache backends to time (``auto``, ``c``, ``torch``, ``triton``), each row naming the one
that ran.
Runs on the default model in float32 on CPU, or on CUDA with --device cuda.

On the CPU (not ``--interpret``) a second time is split out: ``attn ms`` is what a step spends in every layer's cache
update and attention call (the part a cache changes: DynamicCache's concatenation and SDPA, the
quantized caches' writes, checks and attention), with its own ratio to DynamicCache; the rest of
the step (projections, MLP, norms, RoPE) is the same work for every cache. It moves less with a
noisy host than the whole step does.
"""
from __future__ import annotations

import argparse
import functools
import pydoc_data.topics
import statistics
import time

import torch
from common import add_device_options, add_window_options, gpu_path, option, save_json, sync
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
        sync(nxt.device)
        return time.perf_counter() - t0, _IN_ATTENTION[0], nxt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    option(ap, "--context", "--contexts", nargs="+", type=int, default=[512, 2048, 8192], help="prompt lengths")
    ap.add_argument("--new", type=int, default=32)
    add_window_options(ap, capacity=None)
    add_device_options(ap, default="cpu")
    option(ap, "--backend", "--backends", nargs="+", default=["auto"], choices=["auto", "c", "torch", "triton"],
           help="the QSinkKVCache backends to time")
    ap.add_argument("--bits", nargs="+", type=int, default=[16, 8, 4], choices=[16, 8, 4])
    ap.add_argument("--baselines", nargs="*", default=["quanto"], choices=["quanto"],
                    help="besides DynamicCache (always: the base of the ratios): quanto's QuantizedCache int4, "
                         "when optimum-quanto is installed (default)")
    ap.add_argument("--json")
    a = ap.parse_args()
    gpu = gpu_path(a)  # CUDA, or --interpret (its code path on the CPU: TRITON_INTERPRET=1 set here)
    model, tok = load_model(dtype=torch.float32, device=a.device)
    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    all_ids = tok(text[: 8 * max(a.context)], return_tensors="pt").input_ids.to(a.device)
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache
        has_quanto = True
    except ImportError:
        has_quanto = False
    rows = []
    split = not gpu  # on a GPU the wall clock of a call counts its launches only
    if split:
        for impl in ("sdpa", "qsinkkv"):  # the attention functions the model looks up at every call
            ALL_ATTENTION_FUNCTIONS[impl] = timed(ALL_ATTENTION_FUNCTIONS[impl])
    print(f"# {torch.get_num_threads()} threads, device {a.device}, float32 model; ms per decoded token (median "
          f"of {a.new}); 'x dyn' = time / DynamicCache time" + ("; 'attn ms': of which in cache updates and "
                                                              "attention calls (every layer)" if split else ""))
    print("| context | cache | ms/token | x dyn | attn ms | attn x dyn | cache bytes |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    S = a.sink_tokens
    for ctx in a.context:
        ids = all_ids[:, :ctx]
        cap = S + a.recent_tokens if a.recent_tokens is not None else a.capacity or ctx + a.new + 1
        configs = [("DynamicCache", "sdpa", lambda: DynamicCache(config=model.config))]
        if has_quanto and "quanto" in a.baselines:
            configs.append(("QuantizedCache quanto int4", "sdpa",
                            lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4)))
        for backend in a.backend:
            for bits in a.bits:
                cfg = CacheConfig(sink_tokens=S, recent_tokens=cap - S, bits=bits, block_size=64, value_group_size=64)
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

    save_json(a.json, dict(device=a.device, rows=rows))


if __name__ == "__main__":
    main()
