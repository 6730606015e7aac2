"""One prefill step's attention layer calls outside the engine, with where their time goes: qsinkkv's (bits 8/4,
``EngineStep.attend`` over an engine's pages: checks, new rows' pages zeroed, vLLM's CPU kernel on a scratch, the
write) against stock's work on the same tokens (vLLM's page write and the same kernel: ``CpuAttnPrefill`` alone),
as ``benchmarks/vllm_profile.py``'s prefill step runs them (32 prompts of 24-148 tokens, the default model's 9 query
and 3 KV heads of 64, bf16, 30 layers, one thread). A large buffer is written between layer calls, and the step's
fused qkv rewritten, as the model's matmuls do in the engine (its Python and pages run cold in the caches). Run it
with the vLLM venv's python:

    python benchmarks/vllm_prefill_layer.py [--bits 4 8] [--steps 5] [--profile]

``--profile``: cProfile's cumulative times of one more step (the profiler adds to each Python call).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from dataclasses import replace

import torch

H, HKV, D, LAYERS = 9, 3, 64, 30
LENS = [24 + 4 * i for i in range(32)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--steps", type=int, default=5, help="timed steps (median; default 5)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:  # (a bare process must ask the kernel for the AMX tiles vLLM's bf16 kernel may use; vLLM's worker does)
        torch._C._cpu._init_amx()
    except (AttributeError, RuntimeError):
        pass
    from qsinkkv.config import CacheConfig
    from qsinkkv.engine_pages import EngineStep, LayerPools, PageLayout, step_tables
    from qsinkkv.integrations.vllm.cpu_prefill import CpuAttnPrefill
    from qsinkkv.layout import WindowLayout
    from qsinkkv.ops import select_ops

    N, B = sum(LENS), len(LENS)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(N, (H + 2 * HKV) * D, generator=g).to(torch.bfloat16)
    q = qkv[:, :H * D].view(N, H, D)
    k, v = qkv[:, H * D:(H + HKV) * D].view(N, HKV, D), qkv[:, (H + HKV) * D:].view(N, HKV, D)
    out = torch.empty(N, H, D, dtype=torch.bfloat16)
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    held, lens = torch.zeros(B, dtype=torch.int64), torch.tensor(LENS)
    qsl = [0, *torch.tensor(LENS).cumsum(0).tolist()]
    kernel = CpuAttnPrefill(H, HKV, D, torch.bfloat16)

    def timed(call) -> float:
        """us per layer call of one step (each call after the caches are flushed)."""
        total = 0.0
        for layer in range(LAYERS):
            flush.add_(1)
            qkv.mul_(1)
            t0 = time.perf_counter()
            call(layer)
            total += time.perf_counter() - t0
        return total / LAYERS * 1e6

    def median(call) -> float:
        for _ in range(2):
            timed(call)
        return statistics.median(timed(call) for _ in range(args.steps))

    print(f"{B} prompts of {LENS[0]}-{LENS[-1]} tokens, {H}/{HKV} heads of {D}, bf16, {LAYERS} layers, 1 thread; us "
          f"per layer call, median of {args.steps} steps")
    print("| engine | layer call (us) | x stock's work |\n|---|---:|---:|")
    stock = median(lambda layer: kernel(q, k, v, qsl[:-1], LENS, None, out=out))
    print(f"| stock's work (vLLM's page write + kernel) | {stock:.0f} | 1.00 |")
    for bits in args.bits:
        cfg = CacheConfig(sink_tokens=4, recent_tokens=252, block_size=32, value_group_size=32, bits=bits)
        layout, pages = WindowLayout(cfg), PageLayout.of(cfg, HKV, D)
        per_row = pages.pinned + 8
        num_pages = 1 + B * per_row
        bufs = [torch.randint(0, 256, (num_pages, pages.page_bytes), dtype=torch.uint8, generator=g)
                for _ in range(LAYERS)]  # (a former owner's bytes: the new rows' pages are zeroed)
        layers = [LayerPools(pages.views(buf)) for buf in bufs]
        table = (1 + torch.arange(B * per_row)).view(B, per_row)
        ops = select_ops("auto", torch.device("cpu"), D, None, config=cfg, dtype=torch.bfloat16)
        ops = replace(ops, prefill_causal=kernel)
        steps = []

        def layer_call(layer: int) -> None:
            if layer == 0:  # a step: its tables and plan, made once for its layers (as the metadata builder does)
                steps.append(EngineStep(layout, held, lens, step_tables(pages, table, held, lens,
                                                                        num_pages=num_pages)))
            steps[-1].attend(ops, layers[layer], q, k, v, scale=D ** -0.5, out=out)

        ours = median(layer_call)
        print(f"| qsinkkv bits={bits} | {ours:.0f} | {ours / stock:.2f} |", flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            timed(layer_call)
            profiler.disable()
            print(f"cProfile of one step, bits={bits} (cumulative seconds over {LAYERS} layer calls):")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(r"qsinkkv|_C\.|index_fill|tensor", 25)


if __name__ == "__main__":
    main()
