"""Prefill time against the prompt length at a fixed capacity: qsinkkv vs causal SDPA.

    python benchmarks/prefill.py [--lengths 8192 16384 32768] [--capacity 1024] [--bits 4] [--json out.json]
    python benchmarks/prefill.py --device cuda --shape llama --dtype bfloat16 --lengths 4096 8192 16384 32768

One layer of the default model's shape (9 query heads, 3 KV heads, head_dim 64; ``--shape llama``:
32, 8, 128), float32 on the CPU (or ``--device cuda``, ``--dtype``): ``SinkQuantCache.attend``
of a T-token prompt into an empty cache (attention under the sink + window mask, then the
chunk stored and its blocks quantized), against ``scaled_dot_product_attention(is_causal=True)``
over the same T tokens (the full cache's attention). A prefill that reads only what each
query tile can see grows linearly with T: its ms per 1k tokens stays flat while causal
SDPA's grows. On CUDA the cache runs the Triton backend (the prefill kernel), and the table adds
``x sdpa`` (SDPA time / ours), the same cache on the torch backend (the PyTorch reference
prefill: ``torch ms`` and ``x torch``, its time / ours) and the peak memory each allocates
beyond its inputs (``torch.cuda.max_memory_allocated`` over one call, reset before it; ours
includes the cache storage it fills).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from qsinkkv import CacheConfig, SinkQuantCache

SHAPES = {"smollm2": (9, 3, 64), "llama": (32, 8, 128)}  # H, Hkv, D
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def wall_ms(fn, reps: int, device: str) -> float:
    fn()
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def peak_mib(fn) -> float:
    """CUDA memory ``fn`` allocates at its peak beyond what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768])
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--bits", type=int, default=4, choices=[16, 8, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--json")
    a = ap.parse_args()
    cuda = torch.device(a.device).type == "cuda"
    H, HKV, D = SHAPES[a.shape]
    dtype = DTYPES[a.dtype]
    cfg = CacheConfig(sink_tokens=4, recent_tokens=a.capacity - 4, bits=a.bits, block_size=64, value_group_size=64)
    shape = "" if a.shape == "smollm2" else f", {a.shape} (H {H}, Hkv {HKV}, D {D})"
    print(f"# {a.device}, {torch.get_num_threads()} threads, {a.dtype}{shape}; capacity {a.capacity} (4 sinks), "
          f"int{a.bits}; median of {a.reps}")
    cols = "| T | qsinkkv ms | qsinkkv ms / 1k tokens | causal SDPA ms | SDPA ms / 1k tokens |"
    if cuda:
        cols += " x sdpa | torch ms | x torch | qsinkkv peak MiB | SDPA peak MiB |"
    print(cols)
    print("|" + "---:|" * (cols.count("|") - 1))
    rows = []
    for T in a.lengths:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, h, T, D, generator=g).to(a.device, dtype) for h in (H, HKV, HKV))

        def ours(backend="auto"):
            cache = SinkQuantCache(cfg, 1, 1, HKV, D, device=a.device, dtype=dtype, backend=backend)
            cache.attend(0, q, k, v)

        def sdpa_gqa():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        sdpa_fn, sdpa_form = sdpa_gqa, "enable_gqa"
        if cuda:  # a fused kernel for GQA (never a silent fallback to the math path), else K/V expanded beforehand
            from torch.nn.attention import SDPBackend, sdpa_kernel
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                  SDPBackend.CUDNN_ATTENTION]):
                    sdpa_gqa()
            except RuntimeError:  # (torch.OutOfMemoryError is one)
                k_exp, v_exp = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
                sdpa_fn = lambda: F.scaled_dot_product_attention(q, k_exp, v_exp, is_causal=True)  # noqa: E731
                sdpa_form = "expanded"
        ms = wall_ms(ours, a.reps, a.device)
        sdpa = wall_ms(sdpa_fn, a.reps, a.device)
        row = dict(T=T, capacity=a.capacity, bits=a.bits, qsinkkv_ms=ms, sdpa_causal_ms=sdpa)
        if not cuda:
            print(f"| {T:,} | {ms:.0f} | {ms / T * 1e3:.1f} | {sdpa:.0f} | {sdpa / T * 1e3:.1f} |", flush=True)
        else:
            torch_ms = wall_ms(lambda: ours("torch"), a.reps, a.device)
            row.update(sdpa_form=sdpa_form, torch_backend_ms=torch_ms, qsinkkv_peak_mib=peak_mib(ours),
                       sdpa_peak_mib=peak_mib(sdpa_fn))
            print(f"| {T:,} | {ms:.2f} | {ms / T * 1e3:.2f} | {sdpa:.2f} | {sdpa / T * 1e3:.2f} | {sdpa / ms:.2f} | "
                  f"{torch_ms:.2f} | {torch_ms / ms:.2f} | {row['qsinkkv_peak_mib']:,.0f} | "
                  f"{row['sdpa_peak_mib']:,.0f} |", flush=True)
        rows.append(row)
        if a.json:  # after every row: a run stopped by a timeout keeps its rows
            with open(a.json, "w") as f:
                json.dump(dict(date=time.strftime("%Y-%m-%d"), device=a.device, shape=a.shape, dtype=a.dtype,
                               rows=rows), f, indent=1)
    if cuda:
        print(f"# causal SDPA form: {', '.join(sorted({r['sdpa_form'] for r in rows}))} (enable_gqa: a fused GQA "
              "kernel on the Hkv heads; expanded: no fused kernel took it, K/V repeated to all heads beforehand)")


if __name__ == "__main__":
    main()
