"""How many sequences a paged pool of fixed bytes holds at capacity: int8 / int4 against a bf16 pool.

Each pool gets the same bytes (what ``--bf16-seqs`` bf16-window sequences need at the capacity),
sized by ``PagedCache.for_bytes`` (its sequence slots from the bytes too). Sequences are admitted
and streamed past the capacity (a prompt of C + 64 tokens, then decode steps) until the pool
refuses one (``PoolExhausted``); the table counts the sequences that reached the capacity and the
bytes they hold. Bytes scale with the layer count, so one layer is measured (the ratio is the
same for any number of layers).

    python benchmarks/pool.py [--capacity 4096] [--bf16-seqs 8]
"""
from __future__ import annotations

import argparse

import torch

from qsinkkv import CacheConfig
from qsinkkv.paged import PagedCache, PoolExhausted, sequence_bytes

SHAPES = {"SmolLM2-135M (Hkv 3, D 64)": (3, 64), "Llama-3-8B (Hkv 8, D 128)": (8, 128)}


def fill(config: CacheConfig, heads: int, head_dim: int, pool_bytes: int) -> tuple[int, int, int]:
    """(sequences at capacity, their bytes in use, pool bytes)."""
    pool = PagedCache.for_bytes(config, 1, heads, head_dim, pool_bytes, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    T = config.capacity + 64
    while True:
        try:
            seq = pool.admit()
        except PoolExhausted:
            break
        lens = [0] * (pool.batch_size - 1) + [T]
        kv = lambda t: torch.randn(pool.batch_size, heads, t, head_dim, generator=g).to(torch.bfloat16)  # noqa
        try:
            pool.append(0, kv(T), kv(T), lens)
            for _ in range(3):  # decode steps past the capacity hold no more blocks
                pool.append(0, kv(1), kv(1), [0] * (pool.batch_size - 1) + [1])
        except PoolExhausted:
            pool.release(seq)
            break
    return pool.batch_size, pool.nbytes_in_use(), pool.nbytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--bf16-seqs", type=int, default=8, help="the pool's bytes: this many bf16 sequences at capacity")
    args = p.parse_args()
    S = 4
    schemes = [("bf16 window", dict(bits=16)), ("int8", dict(bits=8)), ("int4", dict(bits=4))]
    print(f"Sequences held at capacity {args.capacity} (4 bf16 sinks + {args.capacity - S} recent, block 64, "
          f"group 64) by pools of equal bytes (one layer; {args.bf16_seqs} bf16 sequences' worth)\n")
    print("| model shape | cache | bytes / token | sequences at capacity | vs bf16 | bytes held / pool |")
    print("|---|---|---:|---:|---:|---:|")
    for shape, (heads, head_dim) in SHAPES.items():
        configs = {name: CacheConfig(sink_tokens=S, recent_tokens=args.capacity - S, block_size=64,
                                     value_group_size=64, **kw) for name, kw in schemes}
        pool_bytes = args.bf16_seqs * sequence_bytes(configs["bf16 window"], 1, heads, head_dim)
        base = None
        for name, cfg in configs.items():
            seqs, held, total = fill(cfg, heads, head_dim, pool_bytes)
            base = base or seqs
            per_token = held / max(seqs, 1) / args.capacity
            print(f"| {shape} | {name} | {per_token:.0f} | {seqs} | {seqs / base:.2f}x | "
                  f"{held / total:.2f} |")


if __name__ == "__main__":
    main()
