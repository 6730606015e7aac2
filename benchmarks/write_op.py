"""The write op alone (``qsinkkv.write.append``): microseconds per call for a decode step (one token per
row) at equal lengths, at different lengths (a left-padded batch), and a 64-token chunk per row, on a
dense int4 storage of SmolLM2's shape (Hkv 3, D 64), B rows, one thread. The store runs ``--reps`` times
per case over a fresh copy of the same storage, so every call writes the same positions.

    python benchmarks/write_op.py [--batch 8] [--reps 300] [--writer torch|c] [--json out.json]

``--writer``: how the blocks and rows are written, ``torch`` (``write.WRITER_TORCH``, the reference and
``write.append``'s default) or ``c`` (``decode_c.WRITER_C``, what a cache on the CPU's "c" backend writes with).
With ``torch`` it uses only ``LayerStorage.allocate`` and ``write.append``, so the same file times an older checkout
(its ``qsinkkv`` imported first: with an editable install, whose finder comes before ``PYTHONPATH``, take that finder
off ``sys.meta_path``): the before/after of a change to the write.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from qsinkkv import CacheConfig, quant, write
from qsinkkv.layout import WindowLayout
from qsinkkv.storage import LayerStorage


def case(cfg, B, lengths, T, reps, writer, seed=0):
    g = torch.Generator().manual_seed(seed)
    layout = WindowLayout(cfg)
    s = LayerStorage.allocate(layout, B, 3, 64, torch.device("cpu"))
    for b, n in enumerate(lengths):  # fill each row to its length first
        if n:
            k = torch.randn(1, 3, n, 64, generator=g)
            write.append(s.rows(b), k, torch.randn(1, 3, n, 64, generator=g), [n], quant)
    k = torch.randn(B, 3, T, 64, generator=g)
    v = torch.randn(B, 3, T, 64, generator=g)
    base = s.seq_lens.clone()
    times = []
    for _ in range(reps):
        s.seq_lens.copy_(base)
        t0 = time.perf_counter()
        write.append(s, k, v, [T] * B, quant, **writer)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--writer", choices=["torch", "c"], default="torch")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = CacheConfig(sink_tokens=4, recent_tokens=252, bits=4, block_size=32, value_group_size=32)
    B = args.batch
    cases = {"decode, equal lengths": ([150] * B, 1), "decode, different lengths": ([150 + 5 * b for b in range(B)], 1),
             "decode completing a block": ([4 + 31] * B, 1), "64-token chunk per row": ([150] * B, 64)}
    writer = {}
    if args.writer == "c":
        from qsinkkv import decode_c
        ok, why = decode_c.available()  # (loads the library; without it WRITER_C would run the PyTorch path)
        if not ok:
            raise SystemExit(f"--writer c: no C library here: {why}")
        writer = {"writer": decode_c.WRITER_C}
    rows = {name: case(cfg, B, lengths, T, args.reps, writer) for name, (lengths, T) in cases.items()}
    print(f"write.append ({args.writer} writer), int4 (S 4, W 252, block 32), B {B}, Hkv 3, D 64, 1 thread; "
          f"median of {args.reps}")
    print("| case | us / call |\n|---|---:|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": B, "reps": args.reps, "writer": args.writer,
                       "rows": [{"case": name, "us": us} for name, us in rows.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
