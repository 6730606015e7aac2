"""How many sequences a paged pool of fixed bytes holds at capacity: int8 / int4 against a bf16 pool.

Each pool gets the same bytes (what ``--bf16-seqs`` bf16-window sequences need at the capacity),
sized by ``PagedCache.for_bytes`` (its sequence slots from the bytes too). Sequences are admitted
and streamed past the capacity (a prompt of C + 64 tokens, then decode steps) until the pool
refuses one (``PoolExhausted``); the table counts the sequences that reached the capacity and the
bytes they hold. Bytes scale with the layer count, so one layer is measured (the ratio is the
same for any number of layers). The model shapes are benchmarks/common.py's ``SHAPES``.

    python benchmarks/pool.py [--capacity 4096 | --recent-tokens W] [--sink-tokens 4] [--bf16-seqs 8]
                              [--shapes smollm2 llama] [--json out.json]
"""
from __future__ import annotations

import argparse

import torch
from common import SHAPE_NAMES, SHAPES, add_window_options, recent_tokens, save_json, table_header

from qsinkkv import CacheConfig
from qsinkkv.paged import PagedCache, PoolExhausted, sequence_bytes


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_window_options(p, 4096)
    p.add_argument("--bf16-seqs", type=int, default=8, help="the pool's bytes: this many bf16 sequences at capacity")
    p.add_argument("--shapes", nargs="+", default=["smollm2", "llama"], choices=list(SHAPES),
                   help="model shapes (benchmarks/common.py's SHAPES; default smollm2 llama)")
    p.add_argument("--json", help="write the configuration and rows here")
    args = p.parse_args(argv)
    S, W = args.sink_tokens, recent_tokens(args)
    capacity = args.capacity = S + W  # the window that ran, in the JSON's config
    args.recent_tokens = W
    schemes = [("bf16 window", dict(bits=16)), ("int8", dict(bits=8)), ("int4", dict(bits=4))]
    print(f"Sequences held at capacity {capacity} ({S} bf16 sinks + {W} recent, block 64, "
          f"group 64) by pools of equal bytes (one layer; {args.bf16_seqs} bf16 sequences' worth)\n")
    table_header(["model shape", "cache", "bytes / token", "sequences at capacity", "vs bf16", "bytes held / pool"],
                 left=2)
    rows = []
    for shape in args.shapes:
        _, heads, head_dim = SHAPES[shape]
        label = f"{SHAPE_NAMES[shape]} (Hkv {heads}, D {head_dim})"
        configs = {name: CacheConfig(sink_tokens=S, recent_tokens=W, block_size=64, value_group_size=64, **kw)
                   for name, kw in schemes}
        pool_bytes = args.bf16_seqs * sequence_bytes(configs["bf16 window"], 1, heads, head_dim)
        base = None
        for name, cfg in configs.items():
            seqs, held, total = fill(cfg, heads, head_dim, pool_bytes)
            base = base or seqs
            per_token = held / max(seqs, 1) / capacity
            rows.append(dict(shape=shape, Hkv=heads, D=head_dim, cache=name, bytes_per_token=per_token,
                             sequences=seqs, vs_bf16=seqs / base, held_bytes=held, pool_bytes=total))
            print(f"| {label} | {name} | {per_token:.0f} | {seqs} | {seqs / base:.2f}x | "
                  f"{held / total:.2f} |", flush=True)
            save_json(args.json, {"config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
