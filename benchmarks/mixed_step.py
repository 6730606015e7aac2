"""A mixed step's cost against its batch size: one row prefills a long prompt chunk while the other B - 1 rows
decode one token each (what continuous batching does whenever a prompt joins the decoders).

    python benchmarks/mixed_step.py [--batch 2 4 8 16] [--context 2048] [--bits 4]

One layer of the default model's shape (9 heads, 3 KV heads, head_dim 64), float32 on the CPU, capacity 256
(4 sinks + 252 recent), the decoding rows 300 tokens into their streams. Times ``SinkQuantCache.attend`` on
the padded ``[B, H, T, D]`` chunk with ``lengths`` and ``PagedCache.attend_packed`` on the same tokens packed,
each on a fresh copy of the cache (the copy untimed). ``x B=first`` is the time over the first batch size's:
the step's tokens grow by (B - first) / (context + first - 1), so a cost that follows the tokens stays near 1.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import save_json, table_header  # noqa: E402

from qsinkkv import CacheConfig, SinkQuantCache  # noqa: E402
from qsinkkv.paged import PagedCache  # noqa: E402

H, HKV, D = 9, 3, 64
HISTORY = 300


def timed(cache, call, reps: int) -> float:
    """Median ms of ``call(copy)`` over ``reps`` fresh copies of ``cache`` (after one untimed call)."""
    times = []
    for i in range(reps + 1):
        c = copy.deepcopy(cache, {id(cache.ops): cache.ops})  # the ops (functions, modules) are shared
        t0 = time.perf_counter()
        call(c)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--context", type=int, default=2048, help="the prefilling row's chunk")
    ap.add_argument("--bits", type=int, default=4, choices=[16, 8, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = CacheConfig(sink_tokens=4, recent_tokens=252, bits=a.bits, block_size=32, value_group_size=32)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    print(f"# one layer, H {H}, Hkv {HKV}, D {D}, float32, int{a.bits}, capacity {cfg.capacity}; row 0 prefills "
          f"{a.context} tokens, the other rows decode 1 each ({HISTORY} tokens in); torch threads "
          f"{torch.get_num_threads()}")
    table_header(["B", "step tokens", "attend ms", "x B=first", "attend_packed ms", "x B=first"])
    rows, first = [], None
    for B in a.batch:
        dense = SinkQuantCache(cfg, 1, B, HKV, D, dtype=torch.float32, backend=a.backend)
        pool = PagedCache(cfg, 1, HKV, D, max_seqs=B, float_blocks=2 * B, quant_blocks=8 * B + 64,
                          dtype=torch.float32, backend=a.backend)
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
