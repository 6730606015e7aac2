"""vLLM with the qsinkkv plugin vs stock CPU_ATTN on the default model, one engine per process:
tokens/s at a batch (greedy, enforce_eager, float32), the KV tokens vLLM's pool holds for the same
VLLM_CPU_KVCACHE_SPACE, and the real blocks a request holds while it streams 4x past the capacity.

Run it with the vLLM venv's python (``make vllm-demo``); the model folder comes from the main
venv (``qsinkkv.models.default_model_dir()``, which ``make vllm-demo`` calls first). vLLM itself is imported
only by ``tests_vllm/engine.py``, in the engines this starts: ``--help`` works without it.

    python benchmarks/vllm_serve.py [--batch 8] [--tokens 128] [--sink-tokens 4] [--recent-tokens 252 | --capacity 256]
                                    [--block 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import add_window_options, recent_tokens, save_json, table_header

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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8, help="prompts per engine run (default 8)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    add_window_options(ap, 256, old_sinks=("--sink", "--sinks"), old_recent=("--recent",))
    ap.add_argument("--block", type=int, default=32, help="qsinkkv's block size (default 32)")
    ap.add_argument("--json", help="write the configuration and results here")
    args = ap.parse_args(argv)
    S, W = args.sink_tokens, recent_tokens(args)
    args.recent_tokens, args.capacity = W, S + W  # the window that ran, in the JSON's config
    cfg = {"sink_tokens": S, "recent_tokens": W, "bits": 16, "block_size": args.block}
    prompts = [[(7 * i + 13 * j) % 5000 + 100 for j in range(24 + 4 * i)] for i in range(args.batch)]
    result = {"config": vars(args), "rows": []}
    for name, qcfg in (("stock CPU_ATTN", None), ("qsinkkv bits=16", cfg)):
        r = run({"prompts": prompts, "max_tokens": args.tokens, "qsinkkv": qcfg, "warmup": True})
        if "error" in r:
            raise RuntimeError(f"{name}: {r['error']}")
        result["rows"].append(dict(engine=name, **r))
        save_json(args.json, result)
    C = S + W
    stream = run({"prompts": prompts[:2], "max_tokens": 4 * C, "qsinkkv": cfg, "step": True,
                  "max_model_len": 4 * C + 64})
    rows = result["rows"]
    base = rows[0]["tokens_per_s"]
    print(f"vLLM {args.batch} prompts x {args.tokens} greedy tokens, float32, enforce_eager, "
          f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '1')} GiB; qsinkkv S={S} "
          f"W={W} block {args.block}")
    table_header(["engine", "tokens/s", "x stock", "KV tokens", "block"], left=1)
    for r in rows:
        print(f"| {r['engine']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} | {r['kv_tokens']} | "
              f"{r['block_size']} |")
    bound = -(-S // args.block) + -(-W // args.block) + 1
    full = -(-(4 * C + 24) // args.block)
    print(f"streaming {4 * C} tokens (4x the capacity {C}): real blocks held per request, most "
          f"{stream['held_blocks']['most']} (bound {bound}), at the end {stream['held_blocks']['at_end']}; "
          f"a full-attention request would hold {full}")
    result["stream"] = dict(tokens=4 * C, held_blocks=stream["held_blocks"], bound=bound, full_attention_blocks=full)
    save_json(args.json, result)

if __name__ == "__main__":
    main()
