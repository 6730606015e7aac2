"""Where a vLLM step's attention time goes: one in-process engine (stock CPU_ATTN, or the qsinkkv plugin at bits
16/8/4) on the default model, greedy, with timers around the attention forward (the prefill steps' calls apart
from the decode steps'), the metadata build and, for qsinkkv, its C calls (the decode, the fused write). One
torch thread by default, as vLLM's CPU worker runs (``VLLM_CPU_OMP_THREADS_BIND`` gives it one core of two).
Run it with the vLLM venv's python; the timers add a few microseconds a call.

    python benchmarks/vllm_profile.py [--engine stock|16|8|4 ...] [--batch 32] [--tokens 128] [--threads 1]
                                      [--prompt-tokens N] [--capacity 256]

``--prompt-tokens 4096 --capacity 4352 --batch 8``: the long-context case without eviction (every token in the
window), where a decode step reads the whole prompt: int4 reads about a third of stock's bytes.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def profile(engine: str, batch: int, tokens: int, prompt_tokens: int | None = None,
            capacity: int = 256) -> tuple[float, dict]:
    """Tokens/s of one generate and {timer: (seconds, calls)}; a fresh engine per call of this function."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    sys.path.insert(0, str(ROOT / "tests_vllm"))
    from engine import default_model

    seconds, calls = collections.defaultdict(float), collections.Counter()

    def timed(owner, name, key, tokens=None):
        """``tokens(args)``, if given: the call's new tokens -- a step of at most ``batch`` (every running row one
        token) is a decode step, a longer one a prefill step (a long prompt's chunks are several)."""
        f = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = f(*args, **kwargs)
            k = key
            if tokens is not None:
                k = f"{key} (decode steps)" if tokens(args, kwargs) <= batch else f"{key} (prefill steps)"
            seconds[k] += time.perf_counter() - t0
            calls[k] += 1
            return out
        setattr(owner, name, wrapper)

    longest = prompt_tokens or 24 + 4 * (batch - 1)
    kwargs = dict(model=default_model(), dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
                  max_model_len=max(1024, longest + tokens + 64), seed=0, max_num_seqs=64)
    if engine == "stock":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder as Builder
    else:
        kwargs["additional_config"] = {"qsinkkv": {"sink_tokens": 4, "recent_tokens": capacity - 4, "block_size": 32,
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
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 13 * j) % 5000 + 100
                                              for j in range(prompt_tokens or 24 + 4 * i)]) for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    timed(Impl, "forward", "attention forward",
          tokens=lambda args, kw: (args[6] if len(args) > 6 else kw["attn_metadata"]).num_actual_tokens)
    timed(Builder, "build", "metadata build")
    if engine == "stock":  # stock writes its pages outside the forward: its layer call is both
        timed(Impl, "do_kv_cache_update", "stock's page write",
              tokens=lambda args, kw: (args[2] if len(args) > 2 else kw["key"]).shape[0])
    if engine in ("8", "4"):  # the forward's parts: the step's own call, and in it the fused C step's
        from qsinkkv.decode_c import EngineDecode
        from qsinkkv.engine_pages import EngineStep
        timed(EngineStep, "attend", "EngineStep.attend")
        timed(EngineDecode, "run", "EngineDecode.run")
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
    ap.add_argument("--prompt-tokens", type=int, help="every prompt this long (default: 24 + 4 i for prompt i)")
    ap.add_argument("--capacity", type=int, default=256, help="qsinkkv's S + W, S = 4 (default 256)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (internal: run one engine in this process)
    args = ap.parse_args(argv)
    if args.one:
        tps, timers = profile(args.one, args.batch, args.tokens, args.prompt_tokens, args.capacity)
        print(f"| {args.one} | {tps:.1f} | | | |")
        for key, (s, n) in sorted(timers.items()):
            print(f"| | | {key} | {s:.3f} | {n} | {s / n * 1e6:.0f} |")
        return
    import subprocess
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=args.threads)
    env.setdefault("VLLM_CACHE_ROOT", "/tmp/qsinkkv-vllm-cache")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    prompts = f"{args.prompt_tokens}-token" if args.prompt_tokens else f"24-{24 + 4 * (args.batch - 1)}-token"
    print(f"vLLM in one process, {args.batch} {prompts} prompts x {args.tokens} greedy tokens, bf16, OMP_NUM_THREADS="
          f"{args.threads}; qsinkkv S=4 W={args.capacity - 4} block 32")
    print("| engine | tokens/s | timer | seconds | calls | us / call |\n|---|---:|---|---:|---:|---:|")
    for engine in args.engine:  # one process each: vLLM keeps per-process state
        extra = ["--prompt-tokens", str(args.prompt_tokens)] if args.prompt_tokens else []
        p = subprocess.run([sys.executable, __file__, "--one", engine, "--batch", str(args.batch), "--tokens",
                            str(args.tokens), "--capacity", str(args.capacity), *extra], env=env, capture_output=True,
                           text=True)
        rows = [line for line in p.stdout.splitlines() if line.startswith("|")]
        if p.returncode or not rows:
            raise RuntimeError(f"engine {engine} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
