"""vLLM with the qsinkkv plugin vs stock CPU_ATTN on the default model, one engine per process:
tokens/s at a batch (greedy, enforce_eager, float32), the KV tokens vLLM's pool holds for the same
VLLM_CPU_KVCACHE_SPACE, and the real blocks a request holds while it streams 4x past the capacity.

Run it with the vLLM venv's python (``make vllm-demo``); the model folder comes from the main
venv (``qsinkkv.models.default_model_dir()``, which ``make vllm-demo`` calls first).

    python benchmarks/vllm_serve.py [--batch 8] [--tokens 128] [--sink 4] [--recent 252] [--block 32]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "tests_vllm" / "engine.py"


def run(spec: dict) -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CACHE_ROOT", "/tmp/qsinkkv-vllm-cache")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    p = subprocess.run([sys.executable, str(ENGINE), json.dumps(spec)], capture_output=True, text=True, env=env)
    for line in p.stdout.splitlines():
        if line.startswith("QSINKKV_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"engine.py failed (rc {p.returncode}):\n{p.stderr[-3000:]}")


def main(argv=None) -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--batch", type=int, default=8)
    a.add_argument("--tokens", type=int, default=128)
    a.add_argument("--sink", type=int, default=4)
    a.add_argument("--recent", type=int, default=252)
    a.add_argument("--block", type=int, default=32)
    args = a.parse_args(argv)
    cfg = {"sink_tokens": args.sink, "recent_tokens": args.recent, "bits": 16, "block_size": args.block}
    prompts = [[(7 * i + 13 * j) % 5000 + 100 for j in range(24 + 4 * i)] for i in range(args.batch)]
    rows = []
    for name, qcfg in (("stock CPU_ATTN", None), ("qsinkkv bits=16", cfg)):
        r = run({"prompts": prompts, "max_tokens": args.tokens, "qsinkkv": qcfg, "warmup": True})
        if "error" in r:
            raise RuntimeError(f"{name}: {r['error']}")
        rows.append((name, r))
    C = args.sink + args.recent
    stream = run({"prompts": prompts[:2], "max_tokens": 4 * C, "qsinkkv": cfg, "step": True,
                  "max_model_len": 4 * C + 64})
    base = rows[0][1]["tokens_per_s"]
    print(f"vLLM {args.batch} prompts x {args.tokens} greedy tokens, float32, enforce_eager, "
          f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '1')} GiB; qsinkkv S={args.sink} "
          f"W={args.recent} block {args.block}")
    print(f"{'engine':<18} {'tokens/s':>9} {'x stock':>8} {'KV tokens':>10} {'block':>6}")
    for name, r in rows:
        print(f"{name:<18} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / base:8.2f} {r['kv_tokens']:>10} "
              f"{r['block_size']:>6}")
    bound = -(-args.sink // args.block) + -(-args.recent // args.block) + 1
    print(f"streaming {4 * C} tokens (4x the capacity {C}): real blocks held per request, most "
          f"{stream['held_blocks']['most']} (bound {bound}), at the end {stream['held_blocks']['at_end']}; "
          f"a full-attention request would hold {-(-(4 * C + 24) // args.block)}")


if __name__ == "__main__":
    main()
