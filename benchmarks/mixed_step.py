"""A mixed step's cost against its batch size: one row prefills a long prompt chunk while the other B - 1 rows
decode one token each (what continuous batching does whenever a prompt joins the decoders).

    python benchmarks/mixed_step.py [--batch 2 4 8 16] [--context 2048] [--bits 4] [--reps 3] [--json out.json]
                                    [--sink-tokens 4] [--recent-tokens 252 | --capacity 256]

One layer of the default model's shape (``SHAPES["smollm2"]`` of benchmarks/common.py: 9 heads, 3 KV heads,
head_dim 64), float32 on the CPU, capacity 256 (4 sinks + 252 recent, by default), the decoding rows 300 tokens
into their streams. Times ``SinkQuantCache.attend`` on the padded ``[B, H, T, D]`` chunk with ``lengths`` and
``PagedCache.attend_packed`` on the same tokens packed, each on a fresh copy of the cache (the copy untimed;
``wall_ms``' median of ``--reps`` calls after an untimed one). ``x B=first`` is the time over the first batch size's:
the step's tokens grow by (B - first) / (context + first - 1), so a cost that follows the tokens stays near 1.
"""
from __future__ import annotations

import argparse
import copy

import torch
from common import SHAPES, add_window_options, recent_tokens, save_json, table_header, wall_ms

from qsinkkv import CacheConfig, SinkQuantCache, WindowLayout
from qsinkkv.paged import PagedCache

H, HKV, D = SHAPES["smollm2"]
HISTORY = 300


def timed(cache, call, reps: int) -> float:
    """Median ms of ``call(copy)`` over ``reps`` fresh copies of ``cache`` (after one untimed call; the copies
    untimed)."""
    fresh = lambda: copy.deepcopy(cache, {id(cache.ops): cache.ops})  # noqa: E731  (the ops are shared)
    return wall_ms(call, reps, setup=fresh)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[2, 4, 8, 16], help="batch sizes B")
    ap.add_argument("--context", type=int, default=2048, help="the prefilling row's chunk")
    ap.add_argument("--bits", type=int, default=4, choices=[16, 8, 4])
    add_window_options(ap, 256)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per cell (median)")
    ap.add_argument("--backend", default="auto", choices=["auto", "c", "torch", "triton"],
                    help="the caches' backend (default auto)")
    ap.add_argument("--json", help="write the configuration and rows here")
    a = ap.parse_args(argv)
    a.recent_tokens = recent_tokens(a)  # the window that ran, in the JSON's config
    a.capacity = a.sink_tokens + a.recent_tokens
    cfg = CacheConfig(sink_tokens=a.sink_tokens, recent_tokens=a.recent_tokens, bits=a.bits, block_size=32,
                      value_group_size=32)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    print(f"# one layer, H {H}, Hkv {HKV}, D {D}, float32, int{a.bits}, capacity {cfg.capacity}; row 0 prefills "
          f"{a.context} tokens, the other rows decode 1 each ({HISTORY} tokens in); torch threads "
          f"{torch.get_num_threads()}")
    table_header(["B", "step tokens", "attend ms", "x B=first", "attend_packed ms", "x B=first"])
    rows, first = [], None
    for B in a.batch:
        dense = SinkQuantCache(cfg, 1, B, HKV, D, dtype=torch.float32, backend=a.backend)
        rings = WindowLayout(cfg)  # every row's full rings fit (bits 16 too: its float ring is the window)
        pool = PagedCache(cfg, 1, HKV, D, max_seqs=B, float_blocks=max(rings.float_slots, 2) * B,
                          quant_blocks=rings.quant_slots * B + 64, dtype=torch.float32, backend=a.backend)
        for _ in range(B):
            pool.admit()
        history = [0] + [HISTORY] * (B - 1)
        k, v = rnd(B, HKV, HISTORY, D), rnd(B, HKV, HISTORY, D)
        for c in (dense, pool):
            c.append(0, k, v, history)
        lens = [a.context] + [1] * (B - 1)
        T = max(lens)
        q, k, v = rnd(B, H, T, D), rnd(B, HKV, T, D), rnd(B, HKV, T, D)
        real = torch.arange(T) < torch.tensor(lens).unsqueeze(1)
        pack = lambda x: x.transpose(1, 2)[real].contiguous()  # noqa: E731
        qp, kp, vp = pack(q), pack(k), pack(v)
        qsl = torch.tensor([0, *lens]).cumsum(0)
        row = {"B": B, "tokens": sum(lens),
               "attend_ms": timed(dense, lambda c: c.attend(0, q, k, v, lens), a.reps),
               "packed_ms": timed(pool, lambda c: c.attend_packed(0, qp, kp, vp, qsl), a.reps)}
        first = first or row
        rows.append(row)
        print(f"| {B} | {row['tokens']:,} | {row['attend_ms']:.1f} | {row['attend_ms'] / first['attend_ms']:.2f} | "
              f"{row['packed_ms']:.1f} | {row['packed_ms'] / first['packed_ms']:.2f} |", flush=True)
        save_json(a.json, {"config": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
