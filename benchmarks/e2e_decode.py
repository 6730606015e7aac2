"""End-to-end decode step of a Llama-3-8B-shaped model: QSinkKVCache int4 vs bf16 StaticCache / DynamicCache.

    python benchmarks/e2e_decode.py [--batch 64] [--context 8192] [--json out.json]   # CUDA, bf16
    python benchmarks/e2e_decode.py --tiny --device cpu                                # seconds, a smoke test
    TRITON_INTERPRET=1 python benchmarks/e2e_decode.py --tiny --device cpu --interpret --backend triton
                                                   # the GPU path (Triton kernels interpreted): a smoke test

The model has random weights (speed does not depend on them): ``LlamaConfig`` with hidden 4096,
32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256, rope_theta 500000, built
directly on the device in bf16. ``--tiny``: hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256,
B 2, context 128, float32 (for the CPU).

Each cache is filled WITHOUT running the model over a prompt (too slow at B 64 x 8k): every
layer gets the same random K/V ``[B, Hkv, context, D]`` (regenerated from one seed per cache):

* ``StaticCache`` / ``DynamicCache`` (``attn_implementation="sdpa"``): ``cache.update(k, v, layer)``;
  StaticCache has ``max_cache_len = context + new``.
* ``QSinkKVCache`` int4 (``CacheConfig(sink_tokens=4, recent_tokens=context + new, bits=4,
  block_size=64, value_group_size=64)``, ``attn_implementation="qsinkkv"``): its inner
  ``SinkQuantCache`` is built as the first forward would build it (``QSinkKVCache._storage``:
  batch, KV heads, head_dim, device and dtype of the K/V, the cache's rotary and backend) and set
  as ``cache.inner``; ``inner.append(layer, k, v)`` fills it and ``cache.width = context`` records
  the columns fed, as a forward over the prompt would.

Then one token per sequence per step (the same random token ids for every cache, explicit
``position_ids`` context + i): ``--warmup`` steps, then the median wall-clock ms of ``--steps``
steps (CUDA synchronized around each). Every cache holds the whole stream, so all attend over the
same tokens. Memory: KV bytes per sequence holding ``context`` tokens (bf16:
2 * layers * Hkv * D * 2 bytes per token; ours: ``nbytes()`` of a cache of exactly that capacity),
and how many such sequences fit in ``--budget-gb`` GiB of KV. A check line compares the first
step's logits of each cache with StaticCache's (DynamicCache should agree to rounding; int4
differs by its quantization error).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import traceback

import torch
from common import add_device_options, device_name, empty_cache, gpu_path, peak_gib, reset_peak, save_json, sync
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from qsinkkv import CacheConfig, SinkQuantCache
from qsinkkv.hf import QSinkKVCache

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, rope_theta=500000.0, max_position_embeddings=4096)
CACHES = ("static", "dynamic", "qsinkkv")  # StaticCache first: the baseline of every ratio
NAMES = {"static": "StaticCache (sdpa)", "dynamic": "DynamicCache (sdpa)", "qsinkkv": "QSinkKVCache int4"}


def build_model(model_kw: dict, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Random weights, allocated directly on ``device`` in ``dtype`` (no float32 copy first)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**model_kw))
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def dims(model) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of the model."""
    c = model.config
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_key_value_heads, D


def qsinkkv_config(tokens: int, D: int) -> CacheConfig:
    """4 bf16 sinks + an int4 window of ``tokens`` (holds the whole stream)."""
    return CacheConfig(sink_tokens=4, recent_tokens=tokens, bits=4, block_size=64, value_group_size=min(64, D))


def make_cache(kind: str, model, B: int, context: int, new: int, backend: str, seed: int):
    """A cache of ``kind`` holding ``context`` random tokens per sequence in every layer (same K/V
    for every kind: ``[B, Hkv, context, D]`` per layer from ``seed``)."""
    n_layers, Hkv, D = dims(model)
    device, dtype = model.device, model.dtype
    if kind == "qsinkkv":
        model.set_attn_implementation("qsinkkv")
        cache = QSinkKVCache(qsinkkv_config(context + new, D), model.config, backend=backend)
        # what QSinkKVCache._storage builds from the first forward's K/V
        cache.inner = SinkQuantCache(cache.config, n_layers, B, Hkv, D, device=device, dtype=dtype,
                                     rotary=cache.rotary, backend=backend)
        fill = cache.inner.append
    else:
        model.set_attn_implementation("sdpa")
        cache = (StaticCache(config=model.config, max_cache_len=context + new) if kind == "static"
                 else DynamicCache(config=model.config))
        fill = lambda layer, k, v: cache.update(k, v, layer)  # noqa: E731
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in range(n_layers):
        k, v = (torch.randn(B, Hkv, context, D, generator=g, device=device, dtype=dtype) for _ in range(2))
        fill(layer, k, v)
        del k, v
    if kind == "qsinkkv":
        cache.width = context  # the columns a forward over the prompt would have recorded
    return cache


@torch.inference_mode()
def time_decode(model, cache, tokens: torch.Tensor, context: int, warmup: int) -> tuple[list[float], torch.Tensor]:
    """Feed ``tokens [steps, B, 1]`` one step at a time; ms of each step after ``warmup``, and the
    first step's last-token logits ``[B, vocab]`` (float32)."""
    times, first = [], None
    B = tokens.shape[1]
    for i, ids in enumerate(tokens):
        pos = torch.full((B, 1), context + i, device=ids.device, dtype=torch.long)
        sync(ids.device)
        t0 = time.perf_counter()
        logits = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).logits
        sync(ids.device)
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
        if first is None:
            first = logits[:, -1].float()
    return times, first


def kv_bytes_per_seq(kind: str, model, context: int) -> int:
    """KV bytes one sequence of ``context`` tokens holds in all layers (StaticCache/DynamicCache in the
    model's dtype)."""
    n_layers, Hkv, D = dims(model)
    if kind != "qsinkkv":
        return 2 * n_layers * Hkv * D * model.dtype.itemsize * context
    one = SinkQuantCache(qsinkkv_config(context - 4, D), 1, 1, Hkv, D, device="cpu", dtype=torch.bfloat16)
    return n_layers * one.nbytes()  # every layer holds the same


def run_one(kind: str, model, tokens: torch.Tensor, context: int, a) -> tuple[dict, torch.Tensor]:
    """Fill a cache of ``kind``, time its decode steps: (row, first-step logits)."""
    device = model.device
    reset_peak(device)
    cache = make_cache(kind, model, tokens.shape[1], context, a.new, a.backend, a.seed)
    times, logits = time_decode(model, cache, tokens, context, a.warmup)
    row = dict(cache=kind, ms_per_step=statistics.median(times), step_ms=times)
    if kind == "qsinkkv":
        row["held_bytes"] = cache.nbytes()  # capacity context + new + 4 sinks, all B sequences
    if peak_gib(device) is not None:
        row["peak_gib"] = peak_gib(device)  # the model's weights included
    return row, logits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model, B 2, context 128, float32: a smoke test")
    add_device_options(ap)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--context", type=int)
    ap.add_argument("--new", type=int, default=16, help="room for new tokens (>= warmup + steps)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 3; --tiny 1)")
    ap.add_argument("--steps", type=int, help="timed steps (default 10; --tiny 3)")
    ap.add_argument("--budget-gb", type=float, default=40.0, help="KV memory budget, GiB")
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "c", "torch"], help="QSinkKVCache backend")
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=CACHES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    gpu_path(a)  # --interpret: TRITON_INTERPRET=1 before any kernel is built
    device = torch.device(a.device)
    B = a.batch or (2 if a.tiny else 64)
    context = a.context or (128 if a.tiny else 8192)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 3)
    a.steps = a.steps if a.steps is not None else (3 if a.tiny else 10)
    if a.warmup < 1 or a.steps < 1 or a.warmup + a.steps > a.new:
        ap.error(f"need warmup >= 1, steps >= 1 and warmup + steps <= new, got {a.warmup}, {a.steps}, {a.new}")
    if context < 8:
        ap.error(f"--context must be >= 8, got {context}")
    dtype = torch.float32 if a.tiny or device.type == "cpu" else torch.bfloat16
    model = build_model(TINY if a.tiny else LLAMA3_8B, device, dtype)
    n_layers, Hkv, D = dims(model)
    g = torch.Generator().manual_seed(a.seed + 1)
    tokens = torch.randint(model.config.vocab_size, (a.warmup + a.steps, B, 1), generator=g).to(device)
    budget = a.budget_gb * 2**30
    print(f"# {device_name(device)}, {dtype}; "
          f"{'tiny' if a.tiny else 'Llama-3-8B-shaped'} model, random weights ({n_layers} layers, Hkv {Hkv}, D {D}); "
          f"B {B}, context {context:,}; median of {a.steps} steps after {a.warmup}; KV budget {a.budget_gb:g} GiB")
    rows, logits = [], {}
    for kind in a.caches:  # one failing cache (e.g. out of memory) does not lose the others' rows
        try:
            row, logits[kind] = run_one(kind, model, tokens, context, a)
        except Exception as e:  # noqa: BLE001 - reported in the table and the exit status
            traceback.print_exc()
            row = dict(cache=kind, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        row["kv_bytes_per_seq"] = kv_bytes_per_seq(kind, model, context)
        row["seqs_in_budget"] = int(budget // row["kv_bytes_per_seq"])
        rows.append(row)
        gc.collect()  # the cache is gone with run_one's frame (QSinkKVCache holds a cycle)
        empty_cache(device)
    base = next((r for r in rows if r["cache"] == "static" and "error" not in r), None)
    short = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    cols = ["cache", "ms/step", "x StaticCache", "KV bytes/seq", f"seqs in {a.budget_gb:g} GiB", f"x {short}"]
    print("| " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * (len(cols) - 1))
    bf16_seqs = int(budget // kv_bytes_per_seq("static", model, context))
    for r in rows:
        ms = r.get("ms_per_step")
        speed = "-" if base is None or ms is None else f"{base['ms_per_step'] / ms:.2f}"
        print(f"| {NAMES[r['cache']]} | {'failed' if ms is None else f'{ms:.2f}'} | {speed} | "
              f"{r['kv_bytes_per_seq']:,} | {r['seqs_in_budget']:,} | {r['seqs_in_budget'] / max(bf16_seqs, 1):.2f} |")
    for r in rows:
        if "error" in r:
            print(f"# {r['cache']} failed: {r['error']}")
    if "static" in logits:
        ref = logits["static"]
        for kind, lg in logits.items():
            if kind != "static":
                agree = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
                diff = (lg - ref).abs().max().item()
                print(f"# check, first step vs StaticCache: {kind} max |logit diff| {diff:.3g}, "
                      f"top-1 agreement {100 * agree:.0f}%")
    save_json(a.json, dict(device=str(device), dtype=str(dtype), tiny=a.tiny, batch=B, context=context,
                           steps=a.steps, warmup=a.warmup, budget_gib=a.budget_gb, torch=torch.__version__,
                           transformers=__import__("transformers").__version__, rows=rows))
    sys.exit(1 if any("error" in r for r in rows) else 0)


if __name__ == "__main__":
    main()
