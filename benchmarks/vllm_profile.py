"""Where a vLLM step's attention time goes: one in-process engine (stock CPU_ATTN, or the qsinkkv plugin at bits
16/8/4) on the default model, greedy, with timers around the attention forward (the prefill step's calls apart
from the decode steps'), the metadata build and, for qsinkkv, its C calls (the decode, the fused write). One
torch thread by default, as vLLM's CPU worker runs (``VLLM_CPU_OMP_THREADS_BIND`` gives it one core of two).
Run it with the vLLM venv's python; the timers add a few microseconds a call.

    python benchmarks/vllm_profile.py [--engine stock|16|8|4 ...] [--batch 32] [--tokens 128] [--threads 1]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def profile(engine: str, batch: int, tokens: int) -> tuple[float, dict]:
    """Tokens/s of one generate and {timer: (seconds, calls)}; a fresh engine per call of this function."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    sys.path.insert(0, str(ROOT / "tests_vllm"))
    from engine import default_model

    seconds, calls = collections.defaultdict(float), collections.Counter()

    def timed(owner, name, key, split_prefill=False):
        f = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = f(*args, **kwargs)
            k = key
            if split_prefill:  # the first step of the run is its prefill (one call per layer)
                k = f"{key} (prefill step)" if calls[f"{key} (prefill step)"] < layers else f"{key} (decode steps)"
            seconds[k] += time.perf_counter() - t0
            calls[k] += 1
            return out
        setattr(owner, name, wrapper)

    kwargs = dict(model=default_model(), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
                  max_model_len=1024, seed=0, max_num_seqs=64)
    if engine == "stock":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder as Builder
    else:
        kwargs["additional_config"] = {"qsinkkv": {"sink_tokens": 4, "recent_tokens": 252, "block_size": 32,
                                                   "value_group_size": 32, "bits": int(engine)}}
        from qsinkkv import decode_c
        from qsinkkv.integrations.vllm import backend, quantized
        Impl, Builder = (quantized.QuantImpl, quantized.QuantMetadataBuilder) if engine != "16" else \
            (backend.QSinkKVImpl, backend.QSinkKVMetadataBuilder)
        if decode_c.available()[0]:
            lib = decode_c._lib

            class Timed:  # the C library's functions, each timed
                def __getattr__(self, name):
                    f = getattr(lib, name)
                    if not name.startswith("qsinkkv_"):
                        return f

                    def call(*args):
                        t0 = time.perf_counter()
                        out = f(*args)
                        seconds[f"C {name}"] += time.perf_counter() - t0
                        calls[f"C {name}"] += 1
                        return out
                    return call
            decode_c._lib = Timed()
    llm = LLM(**kwargs)
    layers = llm.llm_engine.vllm_config.model_config.hf_config.num_hidden_layers  # read by the timers
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 13 * j) % 5000 + 100 for j in range(24 + 4 * i)])
               for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    timed(Impl, "forward", "attention forward", split_prefill=True)
    timed(Builder, "build", "metadata build")
    if engine == "stock":  # stock writes its pages outside the forward: its layer call is both
        timed(Impl, "do_kv_cache_update", "stock's page write", split_prefill=True)
    if engine == "16":  # the forward's parts: the write into vLLM's pages, the decode rows' call
        timed(Impl, "_write", "bits16 write")
        timed(Impl, "_decode", "bits16 decode rows")
    seconds.clear()
    calls.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall, {k: (seconds[k], calls[k]) for k in seconds}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", nargs="+", default=["stock", "4"], help="stock, 16, 8, 4 (default: stock 4)")
    ap.add_argument("--batch", type=int, default=32, help="prompts (default 32)")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per prompt (default 128)")
    ap.add_argument("--threads", default="1", help="OMP_NUM_THREADS of the engine (default 1, as vLLM's worker)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (internal: run one engine in this process)
    args = ap.parse_args(argv)
    if args.one:
        tps, timers = profile(args.one, args.batch, args.tokens)
        print(f"| {args.one} | {tps:.1f} | | | |")
        for key, (s, n) in sorted(timers.items()):
            print(f"| | | {key} | {s:.3f} | {n} | {s / n * 1e6:.0f} |")
        return
    import subprocess
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=args.threads)
    env.setdefault("VLLM_CACHE_ROOT", "/tmp/qsinkkv-vllm-cache")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"vLLM in one process, {args.batch} prompts x {args.tokens} greedy tokens, bf16, OMP_NUM_THREADS="
          f"{args.threads}; qsinkkv S=4 W=252 block 32")
    print("| engine | tokens/s | timer | seconds | calls | us / call |\n|---|---:|---|---:|---:|---:|")
    for engine in args.engine:  # one process each: vLLM keeps per-process state
        p = subprocess.run([sys.executable, __file__, "--one", engine, "--batch", str(args.batch), "--tokens",
                            str(args.tokens)], env=env, capture_output=True, text=True)
        rows = [line for line in p.stdout.splitlines() if line.startswith("|")]
        if p.returncode or not rows:
            raise RuntimeError(f"engine {engine} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
