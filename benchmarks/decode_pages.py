"""The plugin's engine path on a GPU: qsinkkv's Triton decode over an engine's pages (vLLM's blocks holding
qsinkkv's int8/int4 pages, ``engine_pages.PageLayout``), and one decode step of a model stack at equal KV memory.

    python benchmarks/decode_pages.py [--batch 8 32 64] [--context 4096 16384 32768] [--e2e-batch 16] [--json F]
                                      [--decode-variant fp16] [--skip-e2e]
    TRITON_INTERPRET=1 python benchmarks/decode_pages.py --tiny --device cpu --interpret   # a smoke test

1. ``pages``: one decode step of every row (``ops.decode`` of the Triton backend over a ``LayerStorage`` whose pools
   are views of one uint8 page tensor, as ``QuantImpl`` runs it in vLLM), Llama-3-8B's attention shape (32 heads,
   8 KV heads, head_dim 128), ``L`` visible tokens (S = 4 sinks + the window), block 16 (vLLM's default), against,
   in the same run: SDPA over a bf16 cache of the same L tokens (the flash kernel, GQA-native where it takes it)
   and qsinkkv's bits=16 decode over vLLM's own bf16 pages (``kernels/decode_blocks.py``, the plugin's bits=16 on
   CUDA). ``x SDPA`` / ``x bits16``: their time over ours. GB/s counts the bytes a step reads (ours: the pages
   each row's visible set lies in; SDPA: the bf16 K and V), ``%copy`` against this device's copy bandwidth
   measured in the same run.
2. ``e2e``: one decode step (every row one token) of a stack of Llama-3-8B-shaped layers with random weights
   (q/k/v/o projections, SwiGLU MLP; no norms or RoPE: they cost the same in both), context L: bf16 K/V
   (SDPA over a preallocated cache) at batch B against int4 pages at 3B rows (the engine step as the plugin runs
   it: ``engine_pages.step_tables`` and ``EngineStep`` once per step, then each layer's write + decode), with each
   side's KV bytes; tokens/s = rows / step time.
``--decode-variant``: the body of the Triton decode that reads the quantized blocks (kernels/decode_attention.py;
the plugin's CUDA path runs "dequantize" unless its config picks another), for both tables. Times: medians of
``triton.testing.do_bench`` on CUDA; on the CPU (``--interpret``) a smoke test, meaningless.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import add_device_options, bench_ms, device_name, empty_cache, gpu_path, save_json, table_header

from qsinkkv import CacheConfig
from qsinkkv.engine_pages import EngineStep, LayerPools, PageLayout, step_tables
from qsinkkv.ops import DECODE_VARIANTS

LLAMA = dict(H=32, Hkv=8, D=128, hidden=4096, inter=14336, layers=32)
TINY = dict(H=4, Hkv=2, D=32, hidden=64, inter=128, layers=2)


def fill_pages(pages: PageLayout, num_pages: int, device) -> torch.Tensor:
    """An engine's page tensor with finite random contents in every region (codes any byte, scales positive)."""
    buf = torch.empty(num_pages, pages.page_bytes, dtype=torch.uint8, device=device)
    pools = pages.views(buf)
    for name in ("key_codes", "value_codes"):
        pools[name].random_(0, 256)
    for name in ("key_scale", "value_scale"):
        pools[name].uniform_(0.01, 0.1)
    for name in ("key_zero", "value_zero"):
        pools[name].uniform_(-1.0, 0.0)
    for name in ("sink_k", "sink_v", "float_k", "float_v"):  # (the float ring's pages last: they overlap the rest)
        pools[name].normal_()
    return buf


def page_tables(pages: PageLayout, rows: int) -> torch.Tensor:
    """A block table ``[rows, pinned + quant_slots]``: each row its own pages (page 0: the null page), its ring's
    quantized blocks at logical ``pinned ..``."""
    per_row = pages.pinned + pages.layout.quant_slots
    return 1 + torch.arange(rows * per_row).view(rows, per_row)


def window_config(bits: int, L: int, D: int, block: int) -> CacheConfig:
    return CacheConfig(sink_tokens=4, recent_tokens=L - 4, bits=bits, block_size=block, value_group_size=min(64, D))


def engine_step(pages: PageLayout, rows: int, L: int, device) -> EngineStep:
    """A decode step's tables (every row holds ``L - 1`` tokens and brings one), as the plugin's builder makes them."""
    held, lens = torch.full((rows,), L - 1), torch.ones(rows, dtype=torch.long)
    table = page_tables(pages, rows)
    # the ring's logical pages as a stream of L tokens names them: logical pinned + b for quantized block b
    layout = pages.layout
    blocks = layout.quantized_blocks(layout.recent_count(L))
    logical = torch.zeros(rows, pages.pinned + blocks, dtype=torch.long)
    logical[:, :pages.pinned] = table[:, :pages.pinned]
    slots = torch.arange(blocks) % layout.quant_slots
    logical[:, pages.pinned:] = table[:, pages.pinned + slots]
    return EngineStep(layout, held, lens, step_tables(pages, logical.to(device), held, lens))


def copy_gbs(device) -> float:
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench_ms(lambda: dst.copy_(src), device) / 1e6


def sdpa(q, k, v):
    """SDPA's flash kernel where it applies (GQA-native), else its default choice."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except RuntimeError:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def time_sdpa(B, L, q, shape, device) -> float:
    k = torch.randn(B, shape["Hkv"], L, shape["D"], dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    return bench_ms(lambda: sdpa(q.unsqueeze(2), k, v), device)


def time_bits16(B, L, q, shape, block, device) -> float:
    """qsinkkv's bits=16 decode over vLLM's own pages, as the plugin runs it on CUDA (``kernels/decode_blocks.py``):
    each row's ``cdiv(L, block)`` position-aligned bf16 blocks, all seen."""
    from qsinkkv.kernels.decode_blocks import decode_blocks
    Hkv, D = shape["Hkv"], shape["D"]
    nb = -(-L // block)
    pages = torch.randn(1 + B * nb, Hkv, 2 * block, D, dtype=torch.bfloat16, device=device)  # [blocks, Hkv, 2 bs, D]
    k_pool, v_pool = (x.transpose(0, 1) for x in pages.chunk(2, dim=2))
    table = (1 + torch.arange(B * nb, device=device)).view(B, nb)
    bias = torch.zeros(B, nb * block, device=device)
    bias[:, L:] = float("-inf")
    return bench_ms(lambda: decode_blocks(q, k_pool, v_pool, table, bias, scale=shape["D"] ** -0.5), device)


def time_pages(bits, B, L, q, shape, ops, block, device) -> tuple[float, int]:
    """The Triton decode over an engine's int8/int4 pages (L stored tokens a row): (ms, bytes of the pages read)."""
    pages = PageLayout.of(window_config(bits, L, shape["D"], block), shape["Hkv"], shape["D"])
    buf = fill_pages(pages, 1 + B * (pages.pinned + pages.layout.quant_slots), device)
    store = engine_step(pages, B, L + 1, device).records(LayerPools(pages.views(buf)))[1]
    store.seq_lens.fill_(L)
    return bench_ms(lambda: ops.decode(q, store), device), B * (pages.pinned + pages.layout.quant_slots) * \
        pages.page_bytes


def bench_pages(args, shape, ops_for, device, gbs) -> list[dict]:
    H, Hkv, D = shape["H"], shape["Hkv"], shape["D"]
    ops = ops_for(D)
    rows = []
    for L in args.context:
        for B in args.batch:
            q = torch.randn(B, H, D, dtype=torch.bfloat16, device=device)
            t_sdpa = time_sdpa(B, L, q, shape, device)
            t16 = time_bits16(B, L, q, shape, args.block, device)
            empty_cache(device)
            for bits in (8, 4):
                t, read = time_pages(bits, B, L, q, shape, ops, args.block, device)
                empty_cache(device)
                row = dict(bits=bits, B=B, L=L, ms=t, sdpa_ms=t_sdpa, bits16_ms=t16, x_sdpa=t_sdpa / t,
                           x_bits16=t16 / t, gbs=read / t / 1e6, copy_pct=100 * read / t / 1e6 / gbs,
                           sdpa_copy_pct=100 * 2 * B * Hkv * L * D * 2 / t_sdpa / 1e6 / gbs)
                rows.append(row)
                print(f"| {bits} | {B} | {L} | {t:.3f} | {t_sdpa:.3f} | {t16:.3f} | {row['x_sdpa']:.2f} | "
                      f"{row['x_bits16']:.2f} | {row['gbs']:.0f} | {row['copy_pct']:.0f}% | "
                      f"{row['sdpa_copy_pct']:.0f}% |", flush=True)
    return rows


class Stack:
    """``layers`` decoder layers with random bf16 weights (no norms, no RoPE)."""

    def __init__(self, shape, device):
        g = dict(dtype=torch.bfloat16, device=device)
        h, H, Hkv, D, inter = shape["hidden"], shape["H"], shape["Hkv"], shape["D"], shape["inter"]
        self.shape = shape
        self.layers = [dict(qkv=torch.randn(h, (H + 2 * Hkv) * D, **g) * h ** -0.5,
                            o=torch.randn(H * D, h, **g) * (H * D) ** -0.5,
                            gate_up=torch.randn(h, 2 * inter, **g) * h ** -0.5,
                            down=torch.randn(inter, h, **g) * inter ** -0.5) for _ in range(shape["layers"])]

    def step(self, x, attend):
        """x ``[rows, hidden]``; ``attend(i, q [rows, H, D], k, v [rows, Hkv, D]) -> [rows, H, D]``."""
        H, Hkv, D = self.shape["H"], self.shape["Hkv"], self.shape["D"]
        for i, w in enumerate(self.layers):
            q, k, v = (x @ w["qkv"]).split([H * D, Hkv * D, Hkv * D], dim=1)
            a = attend(i, q.view(-1, H, D), k.view(-1, Hkv, D), v.view(-1, Hkv, D))
            x = x + a.reshape(x.shape[0], H * D) @ w["o"]
            gate, up = (x @ w["gate_up"]).chunk(2, dim=1)
            x = x + (F.silu(gate) * up) @ w["down"]
        return x


def time_bf16_step(stack, shape, B, L, device) -> tuple[float, int]:
    """bf16: a preallocated cache of L + 1 tokens a layer (the new token at L), SDPA over it: (ms, KV bytes)."""
    Hkv, D, layers = shape["Hkv"], shape["D"], shape["layers"]
    k_cache = [torch.randn(B, Hkv, L + 1, D, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    v_cache = [torch.randn_like(k) for k in k_cache]

    def attend(i, q, k, v):
        k_cache[i][:, :, L] = k
        v_cache[i][:, :, L] = v
        return sdpa(q.unsqueeze(2), k_cache[i], v_cache[i]).squeeze(2)

    x = torch.randn(B, shape["hidden"], dtype=torch.bfloat16, device=device)
    return bench_ms(lambda: stack.step(x, attend), device), 2 * layers * B * Hkv * (L + 1) * D * 2


def time_int4_step(stack, shape, rows, L, ops, block, device) -> tuple[float, int]:
    """int4 pages: one engine step per model step (its tables, as the plugin's builder makes them), then each
    layer's write + decode (``EngineStep.attend``): (ms, KV bytes). The same positions are rewritten at every
    step: a step's cost, not a stream's."""
    pages = PageLayout.of(window_config(4, L + 1, shape["D"], block), shape["Hkv"], shape["D"])
    bufs = [fill_pages(pages, 1 + rows * (pages.pinned + pages.layout.quant_slots), device)
            for _ in range(shape["layers"])]
    pools = [LayerPools(pages.views(b)) for b in bufs]

    def model_step(x):
        step = engine_step(pages, rows, L + 1, device)
        return stack.step(x, lambda i, q, k, v: step.attend(ops, pools[i], q, k, v))

    x = torch.randn(rows, shape["hidden"], dtype=torch.bfloat16, device=device)
    return bench_ms(lambda: model_step(x), device), sum(b.numel() for b in bufs)


def bench_e2e(args, shape, ops_for, device) -> list[dict]:
    L, B = args.e2e_context, args.e2e_batch
    stack = Stack(shape, device)
    t, kv = time_bf16_step(stack, shape, B, L, device)
    rows = [dict(cache="bf16", rows=B, L=L, kv_gib=kv / 2**30, ms=t, tokens_per_s=B / t * 1e3)]
    empty_cache(device)
    t, kv = time_int4_step(stack, shape, 3 * B, L, ops_for(shape["D"]), args.block, device)
    rows.append(dict(cache="int4 pages", rows=3 * B, L=L, kv_gib=kv / 2**30, ms=t, tokens_per_s=3 * B / t * 1e3))
    for r in rows:
        print(f"| {r['cache']} | {r['rows']} | {r['L']} | {r['kv_gib']:.2f} | {r['ms']:.2f} | "
              f"{r['tokens_per_s']:.0f} |")
    print(f"\nint4 at 3x the rows: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x bf16's tokens/s, "
          f"{rows[1]['kv_gib'] / rows[0]['kv_gib']:.2f}x its KV bytes")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_options(ap)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--block", type=int, default=16, help="block size (vLLM's default: 16)")
    ap.add_argument("--e2e-batch", type=int, default=16, help="bf16 rows of the model step (int4: 3x)")
    ap.add_argument("--e2e-context", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and sizes (a smoke test)")
    ap.add_argument("--decode-variant", default="dequantize", choices=DECODE_VARIANTS)
    ap.add_argument("--skip-e2e", action="store_true", help="the pages table only")
    ap.add_argument("--json")
    args = ap.parse_args()
    gpu_path(args)  # (sets TRITON_INTERPRET=1 for --interpret, before the kernels are imported)
    from qsinkkv.ops import select_ops
    device = torch.device(args.device)
    shape = TINY if args.tiny else LLAMA
    if args.tiny:
        args.batch, args.context, args.e2e_batch, args.e2e_context = [2], [64], 1, 48
    ops_for = lambda D: select_ops("triton", device, D, None, args.decode_variant)  # noqa: E731
    gbs = copy_gbs(device)
    print(f"# decode over an engine's pages, {device_name(device)}, H {shape['H']} / Hkv {shape['Hkv']} / "
          f"D {shape['D']}, block {args.block}, decode variant {args.decode_variant}, copy {gbs:.0f} GB/s\n")
    table_header(["bits", "B", "L", "ours ms", "SDPA ms", "bits16 ms", "x SDPA", "x bits16", "GB/s", "%copy",
                  "SDPA %copy"])
    result = dict(device=device_name(device), shape=shape, block=args.block, copy_gbs=gbs,
                  decode_variant=args.decode_variant)
    result["pages"] = bench_pages(args, shape, ops_for, device, gbs)
    save_json(args.json, result)
    if args.skip_e2e:
        return
    print(f"\n# one decode step of {shape['layers']} layers (hidden {shape['hidden']}), random weights\n")
    table_header(["cache", "rows", "L", "KV GiB", "step ms", "tokens/s"], left=1)
    result["e2e"] = bench_e2e(args, shape, ops_for, device)
    save_json(args.json, result)


if __name__ == "__main__":
    main()
