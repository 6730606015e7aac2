"""Prefill time against the prompt length at a fixed capacity: qsinkkv vs causal SDPA.

    python benchmarks/prefill.py [--lengths 8192 16384 32768] [--capacity 1024] [--bits 4] [--json out.json]

One layer of the default model's shape (9 query heads, 3 KV heads, head_dim 64), float32 on
the CPU (or --device cuda): ``SinkQuantCache.attend`` of a T-token prompt into an empty cache
(attention under the sink + window mask, then the chunk stored and its blocks quantized),
against ``scaled_dot_product_attention(is_causal=True)`` over the same T tokens (the full
cache's attention). A prefill that reads only what each query tile can see grows linearly
with T: its ms per 1k tokens stays flat while causal SDPA's grows.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from qsinkkv import CacheConfig, SinkQuantCache

H, HKV, D = 9, 3, 64


def wall_ms(fn, reps: int, device: str) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--bits", type=int, default=4, choices=[16, 8, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    a = ap.parse_args()
    cfg = CacheConfig(sink_tokens=4, recent_tokens=a.capacity - 4, bits=a.bits, block_size=64, value_group_size=64)
    print(f"# {a.device}, {torch.get_num_threads()} threads, float32; capacity {a.capacity} (4 sinks), int{a.bits}; "
          f"median of {a.reps}")
    print("| T | qsinkkv ms | qsinkkv ms / 1k tokens | causal SDPA ms | SDPA ms / 1k tokens |")
    print("|---:|---:|---:|---:|---:|")
    rows = []
    for T in a.lengths:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, h, T, D, generator=g).to(a.device) for h in (H, HKV, HKV))

        def ours():
            cache = SinkQuantCache(cfg, 1, 1, HKV, D, device=a.device, dtype=torch.float32)
            cache.attend(0, q, k, v)

        ms = wall_ms(ours, a.reps, a.device)
        sdpa = wall_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                       a.reps, a.device)
        row = dict(T=T, capacity=a.capacity, bits=a.bits, qsinkkv_ms=ms, sdpa_causal_ms=sdpa)
        rows.append(row)
        print(f"| {T:,} | {ms:.0f} | {ms / T * 1e3:.1f} | {sdpa:.0f} | {sdpa / T * 1e3:.1f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), device=a.device, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
