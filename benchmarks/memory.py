"""Bytes a qsinkkv cache holds vs a bf16 cache of the same capacity (ratio table).

    python benchmarks/memory.py [--capacity 4096 | --recent-tokens W] [--sink-tokens 4] [--block 64] [--group 64]
                                [--json out.json]

Counts every tensor the cache allocates (codes, scales, zeros, sinks, the unquantized
filling block) per sequence, layer and KV head, after streaming 2x the capacity.
"""
import argparse

import torch
from common import add_window_options, recent_tokens, save_json

from qsinkkv import CacheConfig, SinkQuantCache


def measure(bits, head_dim, capacity, sinks, block, group, residual=0):
    cfg = CacheConfig(sink_tokens=sinks, recent_tokens=capacity - sinks, bits=bits, block_size=block,
                      value_group_size=min(group, head_dim), residual_tokens=residual)
    cache = SinkQuantCache(cfg, 1, 1, 1, head_dim, dtype=torch.bfloat16)
    x = torch.randn(1, 1, 2 * capacity, head_dim, dtype=torch.bfloat16)
    cache.append(0, x, x)
    bf16 = 2 * capacity * head_dim * 2
    return dict(bits=bits, head_dim=head_dim, capacity=capacity, sink_tokens=sinks, block_size=block,
                value_group_size=cfg.value_group_size, residual_tokens=residual, nbytes=cache.nbytes(),
                bf16_nbytes=bf16, ratio=cache.nbytes() / bf16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_options(ap, capacity=4096)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    S, capacity = a.sink_tokens, a.sink_tokens + recent_tokens(a)
    rows = [measure(bits, d, capacity, S, a.block, a.group, residual)
            for d in (128, 64) for bits, residual in ((16, 0), (8, 0), (4, 0), (4, 128))]
    print(f"capacity {capacity} = {S} sinks + {capacity - S} recent, block {a.block}; "
          "bytes per sequence, layer and KV head")
    print("| head_dim | bits | residual | value group | qsinkkv bytes | bf16 bytes | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['head_dim']} | {r['bits']} | {r['residual_tokens']} | {r['value_group_size']} | "
              f"{r['nbytes']:,} | {r['bf16_nbytes']:,} | {r['ratio']:.3f} |")
    save_json(a.json, rows)


if __name__ == "__main__":
    main()
