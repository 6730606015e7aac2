"""A bounded preemption stress of vLLM's OpenAI server with the plugin (issue 41): one server on 127.0.0.1 with a
pool too small for the load (the README's int4 config, ``--max-model-len 1024 --max-num-seqs 32
--num-gpu-blocks-override 64``), then ``--rounds`` rounds of ``--requests`` concurrent greedy completions of
``--tokens`` tokens. Per round: the requests that completed with all their tokens, vLLM's preemption counter
(``vllm:num_preemptions_total``, from /metrics), the KV usage once the round is over, whether the server lives.
Everything stays on 127.0.0.1 and is capped in count and time. Run it with the vLLM venv's python:

    python benchmarks/vllm_preempt_stress.py [--rounds 5] [--requests 24] [--tokens 400] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import save_json, table_header

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests_vllm"))
from test_vllm_server import PREEMPT_ARGS, PREEMPT_CONFIG, _get, _metric, _request, serving  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--deadline", type=float, default=900, help="seconds one round may take")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    with serving(PREEMPT_ARGS, PREEMPT_CONFIG, "stress") as running:
        port, model, proc = running["port"], running["model"], running["proc"]

        def complete(i: int) -> int:
            conn, r = _request(port, "POST", "/v1/completions",
                               {"model": model, "prompt": f"Chapter {i}. The old lighthouse keeper said",
                                "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True}, timeout=args.deadline)
            try:
                body = r.read().decode()
                return json.loads(body)["usage"]["completion_tokens"] if r.status == 200 else -r.status
            finally:
                conn.close()

        before = _metric(_get(port, "/metrics")[1], "vllm:num_preemptions_total")
        for k in range(args.rounds):
            t0 = time.monotonic()
            with ThreadPoolExecutor(args.requests) as pool:
                got = list(pool.map(complete, range(k * args.requests, (k + 1) * args.requests),
                                    timeout=args.deadline))
            for _ in range(40):  # the last requests' blocks go back as the engine core retires them
                text = _get(port, "/metrics")[1]
                if _metric(text, "vllm:num_requests_running") == 0 and _metric(text, "vllm:kv_cache_usage_perc") == 0:
                    break
                time.sleep(0.5)
            preemptions = _metric(text, "vllm:num_preemptions_total")
            usage = _metric(text, "vllm:kv_cache_usage_perc")
            rows.append({"round": k + 1, "completed": sum(n == args.tokens for n in got), "requests": args.requests,
                         "preemptions": int(preemptions - before), "kv_usage_after": usage,
                         "seconds": round(time.monotonic() - t0, 1), "server_alive": proc.poll() is None})
            before = preemptions
            save_json(args.json, {"config": vars(args), "rows": rows})
    print(f"vLLM OpenAI server + qsinkkv int4 ({PREEMPT_CONFIG}), 64 pages, max-num-seqs 32: {args.rounds} rounds of "
          f"{args.requests} concurrent greedy requests x {args.tokens} tokens, 127.0.0.1")
    table_header(["round", "completed / requests", "preemptions", "KV usage after", "seconds", "server alive"], left=0)
    for r in rows:
        print(f"| {r['round']} | {r['completed']} / {r['requests']} | {r['preemptions']} | {r['kv_usage_after']:.3f} | "
              f"{r['seconds']} | {r['server_alive']} |")


if __name__ == "__main__":
    main()
