"""Where int4 under vLLM's tensor parallel parts from one process, and how close the two best candidates were there.

The plugin's int4 layer on each rank equals ``PagedCache`` over that rank's KV heads bit for bit
(``tests_vllm/test_vllm_plugin.py``); its tokens need not equal one process's: the all-reduce sums the heads'
outputs in another order, and an int4 code can move with a key's last bit. This runs the default model (float32,
greedy) once alone and once over ``--tp`` ranks with vLLM's ``logprobs`` and prints, per prompt, the first token
where the two part and each run's top two candidates there (log-probabilities). Run it with the vLLM venv's python
(``VLLM_CPU_OMP_THREADS_BIND=nobind`` is set: several CPU workers on one NUMA node start only with it).

    python benchmarks/vllm_tp_parting.py [--tp 3] [--batch 4] [--tokens 96] [--sink-tokens 4] [--recent-tokens 60]
                                         [--block 32] [--reference FILE]

``--reference``: the prompts of the int4 run in the JSON ``tests_vllm/make_reference.py`` writes (the vLLM lane's
reference, ``$QSINKKV_VLLM_REFERENCE``), its first ``--batch``; else prompts of 17 + 6i made-up token ids.
"""
from __future__ import annotations

import argparse
import json
import os

from vllm_serve import run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=3, help="tensor_parallel_size (default 3: the default model's KV heads)")
    ap.add_argument("--batch", type=int, default=4, help="prompts (default 4)")
    ap.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt (default 96)")
    ap.add_argument("--sink-tokens", type=int, default=4)
    ap.add_argument("--recent-tokens", type=int, default=60)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--reference", help="the lane's reference JSON: take its int4 run's prompts")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cfg = {"sink_tokens": args.sink_tokens, "recent_tokens": args.recent_tokens, "bits": 4, "block_size": args.block,
           "value_group_size": 32, "sink_dtype": "float32", "window_dtype": "float32", "scale_dtype": "float32"}
    if args.reference:
        with open(args.reference) as f:
            prompts = json.load(f)["runs"]["int4"]["prompts"][:args.batch]
    else:
        prompts = [[(7 * i + 13 * j) % 5000 + 100 for j in range(17 + 6 * i)] for i in range(args.batch)]
    spec = {"prompts": prompts, "max_tokens": args.tokens, "qsinkkv": cfg, "max_model_len": 256, "logprobs": 3}
    alone = run(spec)
    ranks = run({**spec, "llm": {"tensor_parallel_size": args.tp}})
    print(f"int4 S={args.sink_tokens} W={args.recent_tokens} block {args.block}, float32, {args.batch} prompts x "
          f"{args.tokens} greedy tokens: one process vs tensor_parallel_size={args.tp}")
    print("| prompt | tokens | parts at token | one process: top two (id: logprob) | ranks: top two |")
    print("|---:|---:|---:|---|---|")
    for i, (a, b) in enumerate(zip(alone["tokens"], ranks["tokens"])):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            print(f"| {i} | {len(prompts[i])} | - (identical) | | |")
            continue
        top = [", ".join(f"{t}: {p:.3f}" for t, p in run_[first][:2])
               for run_ in (alone["logprobs"][i], ranks["logprobs"][i])]
        print(f"| {i} | {len(prompts[i])} | {first + 1} | {top[0]} | {top[1]} |")


if __name__ == "__main__":
    main()
