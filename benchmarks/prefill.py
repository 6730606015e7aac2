"""Prefill time against the prompt length at a fixed capacity: qsinkkv vs causal SDPA.

    python benchmarks/prefill.py [--context 8192 16384 32768] [--capacity 1024] [--bits 4] [--json out.json]
    python benchmarks/prefill.py --device cuda --shape llama --dtype bfloat16 --context 4096 8192 16384 32768
    TRITON_INTERPRET=1 python benchmarks/prefill.py --device cpu --interpret --context 64 --capacity 32 --reps 1
                                                          # the GPU path on the CPU, interpreted: a smoke test

One layer of the default model's shape (9 query heads, 3 KV heads, head_dim 64; ``--shape llama``:
32, 8, 128), float32 on the CPU (or ``--device cuda``, ``--dtype``): ``SinkQuantCache.attend``
of a T-token prompt into an empty cache (attention under the sink + window mask, then the
chunk stored and its blocks quantized), against ``scaled_dot_product_attention(is_causal=True)``
over the same T tokens (the full cache's attention); ``--sink-tokens`` S (default 4),
``--capacity`` S + W or ``--recent-tokens`` W. A prefill that reads only what each
query tile can see grows linearly with T: its ms per 1k tokens stays flat while causal
SDPA's grows. On CUDA the cache runs the Triton backend (the prefill kernel), and the table adds
``x sdpa`` (SDPA time / ours), the same cache on the torch backend (the PyTorch reference
prefill: ``torch ms`` and ``x torch``, its time / ours) and the peak memory each allocates
beyond its inputs (``torch.cuda.max_memory_allocated`` over one call, reset before it; ours
includes the cache storage it fills). ``--interpret`` takes that path on the CPU (peak memory "-").
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import (
    DTYPES,
    SHAPES,
    add_device_options,
    add_window_options,
    gpu_path,
    option,
    peak_mib,
    recent_tokens,
    save_json,
    wall_ms,
)

from qsinkkv import CacheConfig, SinkQuantCache


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    option(ap, "--context", "--lengths", nargs="+", type=int, default=[8192, 16384, 32768], help="prompt lengths T")
    add_window_options(ap, capacity=1024)
    ap.add_argument("--bits", type=int, default=4, choices=[16, 8, 4])
    ap.add_argument("--reps", type=int, default=3)
    add_device_options(ap, default="cpu")
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--json")
    a = ap.parse_args()
    cuda = gpu_path(a)  # CUDA, or its code path interpreted on the CPU
    H, HKV, D = SHAPES[a.shape]
    dtype = DTYPES[a.dtype]
    W = recent_tokens(a)
    capacity = a.sink_tokens + W
    cfg = CacheConfig(sink_tokens=a.sink_tokens, recent_tokens=W, bits=a.bits, block_size=64, value_group_size=64)
    shape = "" if a.shape == "smollm2" else f", {a.shape} (H {H}, Hkv {HKV}, D {D})"
    print(f"# {a.device}, {torch.get_num_threads()} threads, {a.dtype}{shape}; capacity {capacity} "
          f"({a.sink_tokens} sinks), int{a.bits}; median of {a.reps}")
    cols = "| T | qsinkkv ms | qsinkkv ms / 1k tokens | causal SDPA ms | SDPA ms / 1k tokens |"
    if cuda:
        cols += " x sdpa | torch ms | x torch | qsinkkv peak MiB | SDPA peak MiB |"
    print(cols)
    print("|" + "---:|" * (cols.count("|") - 1))
    rows = []
    for T in a.context:
        g = torch.Generator().manual_seed(T)
        q, k, v = (torch.randn(1, h, T, D, generator=g).to(a.device, dtype) for h in (H, HKV, HKV))

        def ours(backend="triton" if cuda else "auto"):
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
        row = dict(T=T, capacity=capacity, sink_tokens=a.sink_tokens, bits=a.bits, qsinkkv_ms=ms, sdpa_causal_ms=sdpa)
        if not cuda:
            print(f"| {T:,} | {ms:.0f} | {ms / T * 1e3:.1f} | {sdpa:.0f} | {sdpa / T * 1e3:.1f} |", flush=True)
        else:
            torch_ms = wall_ms(lambda: ours("torch"), a.reps, a.device)
            row.update(sdpa_form=sdpa_form, torch_backend_ms=torch_ms, qsinkkv_peak_mib=peak_mib(ours, a.device),
                       sdpa_peak_mib=peak_mib(sdpa_fn, a.device))
            print(f"| {T:,} | {ms:.2f} | {ms / T * 1e3:.2f} | {sdpa:.2f} | {sdpa / T * 1e3:.2f} | {sdpa / ms:.2f} | "
                  f"{torch_ms:.2f} | {torch_ms / ms:.2f} | {mib(row['qsinkkv_peak_mib'])} | "
                  f"{mib(row['sdpa_peak_mib'])} |", flush=True)
        rows.append(row)
        save_json(a.json, dict(device=a.device, shape=a.shape, dtype=a.dtype, rows=rows))
    if cuda:
        print(f"# causal SDPA form: {', '.join(sorted({r['sdpa_form'] for r in rows}))} (enable_gqa: a fused GQA "
              "kernel on the Hkv heads; expanded: no fused kernel took it, K/V repeated to all heads beforehand)")


if __name__ == "__main__":
    main()
