"""vLLM with the qsinkkv plugin (bits 16, 8, 4) vs stock CPU_ATTN on the default model, one engine per
process: tokens/s at a batch (greedy, enforce_eager), the KV tokens vLLM's pool holds for the same
VLLM_CPU_KVCACHE_SPACE (every byte of bits 8/4 is in it: each request's filling block takes pages of the pool),
the requests that fit at capacity per stock request (arithmetic from the page sizes), and the real blocks a
request holds while it streams 4x past the capacity.

Run it with the vLLM venv's python (``make vllm-demo``); the model folder comes from the main
venv (``qsinkkv.models.default_model_dir()``, which ``make vllm-demo`` calls first). vLLM itself is imported
only by ``tests_vllm/engine.py``, in the engines this starts: ``--help`` works without it.

    python benchmarks/vllm_serve.py [--batch 8] [--tokens 128] [--sink-tokens 4] [--recent-tokens 252 | --capacity 256]
                                    [--block 32] [--dtype bfloat16] [--max-num-seqs 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import add_window_options, recent_tokens, save_json, table_header

from qsinkkv.engine_pages import PageLayout, max_pages, pages_needed
from qsinkkv.integrations.vllm.config import parse_config
from qsinkkv.layout import WindowLayout

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
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype, stock vLLM's pages too (default bfloat16)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="vLLM's max_num_seqs (default 64)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each engine, in turn (the table gives the median tokens/s; default 1)")
    ap.add_argument("--json", help="write the configuration and results here")
    args = ap.parse_args(argv)
    S, W = args.sink_tokens, recent_tokens(args)
    args.recent_tokens, args.capacity = W, S + W  # the window that ran, in the JSON's config
    base_cfg = {"sink_tokens": S, "recent_tokens": W, "block_size": args.block, "value_group_size": args.block}
    model_dir, (L, Hkv, D) = model_shape()
    pool = int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) * 2**30)
    prompts = [[(7 * i + 13 * j) % 5000 + 100 for j in range(24 + 4 * i)] for i in range(args.batch)]
    llm = {"max_num_seqs": args.max_num_seqs}
    result = {"config": vars(args), "rows": []}
    engines = [("stock CPU_ATTN", None)] + [(f"qsinkkv bits={b}", {**base_cfg, "bits": b}) for b in (16, 8, 4)]
    runs = {name: [] for name, _ in engines}
    for _ in range(args.repeats):  # engines in turn, so that a slow spell of the host slows them alike
        for name, qcfg in engines:
            r = run({"prompts": prompts, "max_tokens": args.tokens, "qsinkkv": qcfg, "warmup": True,
                     "dtype": args.dtype, "llm": llm})
            if "error" in r:
                raise RuntimeError(f"{name}: {r['error']}")
            runs[name].append(r)
    for name, _ in engines:
        r = dict(runs[name][0])
        speeds = sorted(x["tokens_per_s"] for x in runs[name])
        r["tokens_per_s_runs"] = speeds
        r["tokens_per_s"] = speeds[len(speeds) // 2]
        r["kv_tokens_equal_memory"] = r["kv_tokens"]  # every byte is in vLLM's pool (the float ring: its pages)
        result["rows"].append(dict(engine=name, **r))
        save_json(args.json, result)
    C = S + W
    stream = run({"prompts": prompts[:2], "max_tokens": 4 * C, "qsinkkv": {**base_cfg, "bits": 4}, "step": True,
                  "max_model_len": 4 * C + 64, "dtype": args.dtype, "llm": llm})
    rows = result["rows"]
    base, base_kv = rows[0]["tokens_per_s"], rows[0]["kv_tokens"]
    print(f"vLLM {args.batch} prompts x {args.tokens} greedy tokens (tokens/s: median of {args.repeats} runs, in "
          f"turn), {args.dtype}, enforce_eager, max_num_seqs "
          f"{args.max_num_seqs}, VLLM_CPU_KVCACHE_SPACE={pool / 2**30:g} GiB; qsinkkv S={S} W={W} block "
          f"{args.block} (value groups of {args.block}); {model_dir.name}: {L} layers, {Hkv} KV heads, head_dim {D}")
    # vLLM's own count: blocks x block_size (bits 8/4: the sink and float pages count too, though they hold no
    # window token; the requests-per-stock table below is the one to compare memory by)
    table_header(["engine", "tokens/s", "x stock", "pool blocks x block size", "x stock"], left=1)
    for r in rows:
        print(f"| {r['engine']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} | "
              f"{r['kv_tokens_equal_memory']} | {r['kv_tokens_equal_memory'] / base_kv:.2f} |")
    elem = 4 if args.dtype == "float32" else 2
    per_request = {name: request_bytes(C, bits, base_cfg, args.block, (L, Hkv, D), elem)
                   for name, bits in (("stock CPU_ATTN", None), ("qsinkkv bits=16", 16), ("qsinkkv bits=8", 8),
                                      ("qsinkkv bits=4", 4))}
    print(f"a request at the capacity ({C} tokens), all layers (arithmetic, from the page sizes):")
    table_header(["engine", "bytes / request", "requests in 1 GiB", "x stock"], left=1)
    for name, nbytes in per_request.items():
        print(f"| {name} | {nbytes} | {2**30 // nbytes} | {per_request['stock CPU_ATTN'] / nbytes:.2f} |")
    result["per_request_bytes_at_capacity"] = per_request
    # the same at longer capacities: the sink page and the bf16 filling block's pages weigh less as the window grows
    sweep = {}
    print("requests at capacity per stock request (the same arithmetic, S and block as above, W = capacity - S):")
    table_header(["capacity", "bits=8", "bits=4"], left=0)
    for cap in sorted({C, 1024, 2048, 4096}):
        cfg_cap = {**base_cfg, "recent_tokens": cap - S}
        stock = request_bytes(cap, None, cfg_cap, args.block, (L, Hkv, D), elem)
        sweep[cap] = {b: stock / request_bytes(cap, b, cfg_cap, args.block, (L, Hkv, D), elem) for b in (8, 4)}
        print(f"| {cap} | {sweep[cap][8]:.2f} | {sweep[cap][4]:.2f} |")
    result["requests_x_stock_by_capacity"] = sweep
    cfg4 = parse_config({**base_cfg, "bits": 4})
    bound = max_pages(WindowLayout(cfg4), PageLayout.of(cfg4, Hkv, D).pinned, 1 + max(map(len, prompts[:2])))
    full = -(-(4 * C + 24) // args.block)
    print(f"int4, streaming {4 * C} tokens (4x the capacity {C}): real blocks held per request, most "
          f"{stream['held_blocks']['most']} (bound {bound}), at the end {stream['held_blocks']['at_end']}; "
          f"a full-attention request would hold {full}")
    result["stream"] = dict(tokens=4 * C, held_blocks=stream["held_blocks"], bound=bound, full_attention_blocks=full)
    save_json(args.json, result)


def request_bytes(C: int, bits: int | None, base_cfg: dict, block: int, shape: tuple, elem: int) -> int:
    """Bytes one request of ``C`` tokens holds over every layer: stock pages (``bits`` None) and bits=16 keep
    vLLM's own pages; bits 8/4 hold their pages (the sink page, the float ring's and the window's blocks)."""
    L, Hkv, D = shape
    if bits in (None, 16):
        return L * -(-C // block) * block * Hkv * D * 2 * elem
    qc = parse_config({**base_cfg, "bits": bits})
    pages = PageLayout.of(qc, Hkv, D)
    return L * pages_needed(WindowLayout(qc), pages.pinned, C) * pages.page_bytes


def model_shape():
    """The default model's folder (converted by the main venv) and its (layers, KV heads, head_dim)."""
    sys.path.insert(0, str(ENGINE.parent))
    from engine import default_model
    path = Path(default_model())
    c = json.loads((path / "config.json").read_text())
    return path, (c["num_hidden_layers"], c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"])

if __name__ == "__main__":
    main()
