"""Decode attention: qsinkkv (bits 16/8/4) vs scaled_dot_product_attention over a bf16 cache.

    python benchmarks/decode_attention.py                 # GPU if present, else a small CPU table
    python benchmarks/decode_attention.py --json out.json --context 1024 8192 --batch 1 32 [--decode-variant folded]
    TRITON_INTERPRET=1 python benchmarks/decode_attention.py --device cpu --interpret --context 128 --batch 1
                                                          # the GPU path on the CPU, interpreted: a smoke test

One new query per sequence attends over ``L`` visible tokens (``--sink-tokens`` S, default 4, + L-S
recent). The
baselines hold the same L tokens in bf16: SDPA with K/V already expanded to all query heads,
and SDPA's GQA-native form (``enable_gqa=True``): ``x sdpa`` and (GPU) ``x gqa`` are their
times / ours. On a GPU, times are medians of
``triton.testing.do_bench`` in one run; GB/s counts the bytes our kernel must read (the
visible blocks' codes, scales and zeros, the bf16 sinks and filling block, from
``qsinkkv.layout``), and ``%copy`` compares it with this device's copy bandwidth measured
in the same run; ``--decode-variant`` picks the kernel's body for quantized blocks (kernels/decode_attention.py).
On a CPU it times both CPU decode ops against SDPA, with wall-clock medians:
the C one (``qsinkkv.decode_c``, the "c" backend's, what ``auto`` runs on a CPU: ``intN ms``)
and the PyTorch one (``qsinkkv.decode.decode_attention_torch``, the "torch" backend's:
``intN torch ms``).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import SHAPES, add_device_options, bench_ms, device_name, empty_cache, gpu_path, option, save_json, wall_ms

from qsinkkv import CacheConfig, SinkQuantCache
from qsinkkv.layout import cdiv
from qsinkkv.ops import DECODE_VARIANTS

BLOCK = 64


def kernel_bytes(cache: SinkQuantCache, L: int, B: int) -> int:
    """Bytes the decode kernel reads for one step: whole visible blocks of the recent window."""
    cfg, lay, D, Hkv = cache.config, cache.layout, cache.head_dim, cache.num_kv_heads
    m = lay.recent_count(L)
    blk_lo, blk_end, qb = lay.first_kept_block(m), cdiv(m, lay.block_size), lay.quantized_blocks(m)
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
    sinks = 2 * min(L, cfg.sink_tokens) * D * (torch.finfo(cfg.sink_dtype).bits // 8)
    return B * Hkv * (quant_blocks * per_quant_block + float_blocks * per_float_block + sinks)


def make_cache(bits, B, L, H, Hkv, D, device, backend, sinks, decode_variant="dequantize"):
    cfg = CacheConfig(sink_tokens=sinks, recent_tokens=L - sinks, bits=bits, block_size=BLOCK,
                      value_group_size=min(64, D))
    cache = SinkQuantCache(cfg, 1, B, Hkv, D, device=device, dtype=torch.bfloat16, backend=backend,
                           decode_variant=decode_variant)
    k = torch.randn(B, Hkv, L, D, device=device, dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, L, D, device=device, dtype=torch.bfloat16)
    cache.append(0, k, v)
    return cache, k, v


def bench_gpu(args):
    """The GPU table (CUDA; or ``--interpret``: the same code on CPU tensors, the kernel interpreted)."""
    import triton

    dev = torch.device(args.device)
    name = device_name(dev)
    x = torch.empty((2 << 30) if dev.type == "cuda" else (16 << 20), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    copy_ms = bench_ms(lambda x=x, y=y: y.copy_(x), dev, warmup=10, rep=50)
    copy_gbs = 2 * x.numel() / copy_ms / 1e6
    del x, y
    print(f"# {name}: copy bandwidth {copy_gbs:,.0f} GB/s (read + write)")
    print_header(gpu=True)
    rows = []
    result = dict(device=name, copy_gbs=copy_gbs, triton=triton.__version__, decode_variant=args.decode_variant,
                  rows=rows)
    for shape in args.shapes:
        H, Hkv, D = SHAPES[shape]
        for L in args.context:
            for B in args.batch:
                if B * L * Hkv * D * 2 * 2 * (1 + H // Hkv) > args.max_gb * 2**30:
                    continue  # bf16 baselines (plus the expanded copy) would not fit
                q = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16)
                row = dict(shape=shape, H=H, Hkv=Hkv, D=D, L=L, B=B)
                _, k, v = make_cache(16, B, L, H, Hkv, D, dev, "triton", args.sink_tokens)
                k_exp, v_exp = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
                row["sdpa_ms"] = bench_ms(lambda k=k_exp, v=v_exp: F.scaled_dot_product_attention(q, k, v), dev)
                del k_exp, v_exp
                try:
                    row["sdpa_gqa_ms"] = bench_ms(
                        lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), dev)
                except (RuntimeError, TypeError):
                    row["sdpa_gqa_ms"] = None
                del k, v
                for bits in (16, 8, 4):
                    cache, _, _ = make_cache(bits, B, L, H, Hkv, D, dev, "triton", args.sink_tokens,
                                             args.decode_variant)
                    layer, q3 = cache.layers[0], q[:, :, 0]
                    ms = bench_ms(lambda layer=layer, decode=cache.ops.decode: decode(q3, layer), dev)
                    nbytes = kernel_bytes(cache, L, B)
                    row[f"int{bits}_ms"] = ms
                    row[f"int{bits}_gbs"] = nbytes / ms / 1e6
                    row[f"int{bits}_copy_pct"] = 100 * nbytes / ms / 1e6 / copy_gbs
                    del cache, layer
                empty_cache(dev)
                rows.append(row)
                print_row(row, gpu=True)
                save_json(args.json, result)  # a run stopped by a timeout keeps its rows
    return result


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
        for L in args.context:
            for B in args.batch:
                q = torch.randn(B, H, 1, D, dtype=torch.bfloat16)
                row = dict(shape=shape, H=H, Hkv=Hkv, D=D, L=L, B=B)
                _, k, v = make_cache(16, B, L, H, Hkv, D, "cpu", "torch", args.sink_tokens)
                k_exp, v_exp = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
                row["sdpa_ms"] = wall_ms(lambda: F.scaled_dot_product_attention(q, k_exp, v_exp), args.reps)
                row["sdpa_gqa_ms"] = wall_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                             args.reps)
                for bits in (16, 8, 4):
                    cache, _, _ = make_cache(bits, B, L, H, Hkv, D, "cpu", "torch", args.sink_tokens)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    add_device_options(ap)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    option(ap, "--context", "--lengths", nargs="+", type=int, default=[1024, 8192, 32768, 131072] if cuda else
           [1024, 4096], help="visible tokens L")
    option(ap, "--batch", "--batches", nargs="+", type=int, default=[1, 8, 16, 32, 64] if cuda else [1, 4])
    ap.add_argument("--sink-tokens", type=int, default=4, help="sink tokens S (default 4); L - S recent")
    ap.add_argument("--decode-variant", default="dequantize", choices=DECODE_VARIANTS,
                    help="GPU: the Triton decode kernel's body for quantized blocks (default dequantize)")
    ap.add_argument("--reps", type=int, default=5, help="CPU only: timed repetitions")
    ap.add_argument("--max-gb", type=float, default=48.0,
                    help="GPU only: skip configs whose bf16 baselines exceed this")
    ap.add_argument("--json")
    args = ap.parse_args()
    gpu = gpu_path(args)
    print(f"# decode attention, {args.sink_tokens} sinks + (L-{args.sink_tokens}) recent, block {BLOCK}; "
          f"'x sdpa' = SDPA (expanded K/V) time / ours" + ("; 'x gqa' = SDPA-GQA time / ours" if gpu else ""))
    save_json(args.json, bench_gpu(args) if gpu else bench_cpu(args))


if __name__ == "__main__":
    main()
