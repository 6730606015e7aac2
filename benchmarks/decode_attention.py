"""Decode attention: qsinkkv (bits 16/8/4) vs scaled_dot_product_attention over a bf16 cache.

    python benchmarks/decode_attention.py                 # GPU if present, else a small CPU table
    python benchmarks/decode_attention.py --json out.json --lengths 1024 8192 --batches 1 32

One new query per sequence attends over ``L`` visible tokens (4 sinks + L-4 recent). The
baselines hold the same L tokens in bf16: SDPA with K/V already expanded to all query heads,
and SDPA's GQA-native form (``enable_gqa=True``): ``x sdpa`` and (GPU) ``x gqa`` are their
times / ours. On a GPU, times are medians of
``triton.testing.do_bench`` in one run; GB/s counts the bytes our kernel must read (the
visible blocks' codes, scales and zeros, the bf16 sinks and filling block, from
``qsinkkv.layout``), and ``%copy`` compares it with this device's copy bandwidth measured
in the same run. On a CPU it times both CPU decode ops against SDPA, with wall-clock medians:
the C one (``qsinkkv.decode_c``, the "c" backend's, what ``auto`` runs on a CPU: ``intN ms``)
and the PyTorch one (``qsinkkv.decode.decode_attention_torch``, the "torch" backend's:
``intN torch ms``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from qsinkkv import CacheConfig, SinkQuantCache

SHAPES = {"llama": (32, 8, 128), "smollm2": (9, 3, 64)}  # H, Hkv, D
SINKS, BLOCK = 4, 64


def kernel_bytes(cache: SinkQuantCache, L: int, B: int) -> int:
    """Bytes the decode kernel reads for one step: whole visible blocks of the recent window."""
    cfg, lay, D, Hkv = cache.config, cache.layout, cache.head_dim, cache.num_kv_heads
    m = lay.recent_count(L)
    blk_lo, blk_end, qb = lay.first_kept_block(m), lay.end_block(m), lay.quantized_blocks(m)
    quant_blocks = max(qb - blk_lo, 0)
    float_blocks = blk_end - blk_lo - quant_blocks
    fbytes = torch.finfo(cfg.window_dtype).bits // 8
    sbytes = torch.finfo(cfg.scale_dtype).bits // 8
    per_quant_block = 0
    if cfg.bits != 16:
        per_quant_block = (2 * BLOCK * D * cfg.bits // 8                              # K and V codes
                           + 2 * D * sbytes                                          # key scale + zero
                           + 2 * BLOCK * (D // cfg.value_group_size) * sbytes)       # value scale + zero
    per_float_block = 2 * BLOCK * D * fbytes
    sinks = 2 * min(L, SINKS) * D * (torch.finfo(cfg.sink_dtype).bits // 8)
    return B * Hkv * (quant_blocks * per_quant_block + float_blocks * per_float_block + sinks)


def make_cache(bits, B, L, H, Hkv, D, device, backend):
    cfg = CacheConfig(sink_tokens=SINKS, recent_tokens=L - SINKS, bits=bits, block_size=BLOCK,
                      value_group_size=min(64, D))
    cache = SinkQuantCache(cfg, 1, B, Hkv, D, device=device, dtype=torch.bfloat16, backend=backend)
    k = torch.randn(B, Hkv, L, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, L, D, device=device, dtype=torch.bfloat16)
    cache.append(0, k, v)
    return cache, k, v


def bench_gpu(args):
    import triton
    from triton.testing import do_bench

    from qsinkkv.kernels import decode_attention

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    x = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy_ms = do_bench(lambda x=x, y=y: y.copy_(x), warmup=10, rep=50, return_mode="median")
    copy_gbs = 2 * x.numel() / copy_ms / 1e6
    del x, y
    print(f"# {name}: copy bandwidth {copy_gbs:,.0f} GB/s (read + write)")
    print_header(gpu=True)
    rows = []
    result = dict(device=name, copy_gbs=copy_gbs, triton=triton.__version__, rows=rows)
    for shape in args.shapes:
        H, Hkv, D = SHAPES[shape]
        for L in args.lengths:
            for B in args.batches:
                if B * L * Hkv * D * 2 * 2 * (1 + H // Hkv) > args.max_gb * 2**30:
                    continue  # bf16 baselines (plus the expanded copy) would not fit
                q = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16)
                row = dict(shape=shape, H=H, Hkv=Hkv, D=D, L=L, B=B)
                _, k, v = make_cache(16, B, L, H, Hkv, D, dev, "triton")
                k_exp, v_exp = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
                row["sdpa_ms"] = do_bench(lambda k=k_exp, v=v_exp: F.scaled_dot_product_attention(q, k, v),
                                          return_mode="median")
                del k_exp, v_exp
                try:
                    row["sdpa_gqa_ms"] = do_bench(
                        lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                        return_mode="median")
                except (RuntimeError, TypeError):
                    row["sdpa_gqa_ms"] = None
                del k, v
                for bits in (16, 8, 4):
                    cache, _, _ = make_cache(bits, B, L, H, Hkv, D, dev, "triton")
                    layer, q3 = cache.layers[0], q[:, :, 0]
                    ms = do_bench(lambda layer=layer: decode_attention(q3, layer), return_mode="median")
                    nbytes = kernel_bytes(cache, L, B)
                    row[f"int{bits}_ms"] = ms
                    row[f"int{bits}_gbs"] = nbytes / ms / 1e6
                    row[f"int{bits}_copy_pct"] = 100 * nbytes / ms / 1e6 / copy_gbs
                    del cache, layer
                torch.cuda.empty_cache()
                rows.append(row)
                print_row(row, gpu=True)
                save(args.json, result)  # a run stopped by a timeout keeps its rows
    return result


def wall_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_cpu(args):
    from qsinkkv import decode_c
    c_ok, why = decode_c.available()
    print(f"# CPU, {torch.get_num_threads()} threads: the decode ops of the 'c' backend (qsinkkv.decode_c"
          f"{'' if c_ok else ': not available, ' + why}) and of the 'torch' backend "
          "(qsinkkv.decode.decode_attention_torch); wall-clock medians")
    print_header(gpu=False)
    rows = []
    for shape in args.shapes:
        H, Hkv, D = SHAPES[shape]
        for L in args.lengths:
            for B in args.batches:
                q = torch.randn(B, H, 1, D, dtype=torch.bfloat16)
                row = dict(shape=shape, H=H, Hkv=Hkv, D=D, L=L, B=B)
                _, k, v = make_cache(16, B, L, H, Hkv, D, "cpu", "torch")
                k_exp, v_exp = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
                row["sdpa_ms"] = wall_ms(lambda: F.scaled_dot_product_attention(q, k_exp, v_exp), args.reps)
                row["sdpa_gqa_ms"] = wall_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                             args.reps)
                for bits in (16, 8, 4):
                    cache, _, _ = make_cache(bits, B, L, H, Hkv, D, "cpu", "torch")
                    layer, q3 = cache.layers[0], q[:, :, 0]
                    row[f"int{bits}_torch_ms"] = wall_ms(lambda: cache.ops.decode(q3, layer), args.reps)
                    row[f"int{bits}_ms"] = (wall_ms(lambda: decode_c.decode_attention_c(q3, layer), args.reps)
                                            if c_ok else None)
                rows.append(row)
                print_row(row, gpu=False)
    return dict(device="cpu", threads=torch.get_num_threads(), rows=rows)


def print_header(gpu):
    cols = ["shape", "L", "B", "sdpa ms", "sdpa-gqa ms"]
    for bits in (16, 8, 4):
        cols += [f"int{bits} ms", f"int{bits} x sdpa"] + ([f"int{bits} x gqa"] if gpu and bits != 16 else [])
        cols += [f"int{bits} GB/s", f"int{bits} %copy"] if gpu else [f"int{bits} torch ms"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))


def print_row(r, gpu):
    cells = [r["shape"], f"{r['L']:,}", str(r["B"]), f"{r['sdpa_ms']:.3f}",
             "-" if r["sdpa_gqa_ms"] is None else f"{r['sdpa_gqa_ms']:.3f}"]
    for bits in (16, 8, 4):
        ms = r[f"int{bits}_ms"]
        cells += ["-", "-"] if ms is None else [f"{ms:.3f}", f"{r['sdpa_ms'] / ms:.2f}"]
        if not gpu:
            cells.append(f"{r[f'int{bits}_torch_ms']:.3f}")
        if gpu and bits != 16:
            cells.append("-" if r["sdpa_gqa_ms"] is None else f"{r['sdpa_gqa_ms'] / ms:.2f}")
        if gpu:
            cells += [f"{r[f'int{bits}_gbs']:,.0f}", f"{r[f'int{bits}_copy_pct']:.0f}"]
    print("| " + " | ".join(cells) + " |", flush=True)


def save(path, result):
    if path:
        with open(path, "w") as f:
            json.dump(dict(result, date=time.strftime("%Y-%m-%d")), f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--lengths", nargs="+", type=int,
                    default=[1024, 8192, 32768, 131072] if gpu else [1024, 4096])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32, 64] if gpu else [1, 4])
    ap.add_argument("--reps", type=int, default=5, help="CPU only: timed repetitions")
    ap.add_argument("--max-gb", type=float, default=48.0,
                    help="GPU only: skip configs whose bf16 baselines exceed this")
    ap.add_argument("--json")
    args = ap.parse_args()
    print(f"# decode attention, {SINKS} sinks + (L-4) recent, block {BLOCK}; "
          f"'x sdpa' = SDPA (expanded K/V) time / ours" + ("; 'x gqa' = SDPA-GQA time / ours" if gpu else ""))
    save(args.json, bench_gpu(args) if gpu else bench_cpu(args))


if __name__ == "__main__":
    main()
