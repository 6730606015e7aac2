"""The reference the vLLM tests compare against, made in the MAIN venv (transformers >= 5.24, which
the vLLM venv cannot have): token-id prompts cut from CPython's ``pydoc_data.topics`` prose, and the
greedy tokens HF ``generate`` gives on the default model with ``QSinkKVCache`` (one left-padded batch).

    python tests_vllm/make_reference.py OUT.json [--prompts 8] [--max-new-tokens 128] [--config NAME=JSON ...]

The default configs are the tests' past-the-window cases: ``bits16`` (float32 sinks and window, S=4,
W=60, block 32: capacity 64, every row streams past it) and ``int4`` (the same window, int4 blocks of
32 with value groups of 32, float32 scales). OUT.json holds ``{"runs": {name: reference}}``. It also
converts the default model to the safetensors folder vLLM loads (``qsinkkv.models.default_model_dir``)
and writes its path.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from qsinkkv import CacheConfig
from qsinkkv.integrations.vllm.config import parse_config, to_jsonable
from qsinkkv.models import default_model_dir

DEFAULTS = {"bits16": {"sink_tokens": 4, "recent_tokens": 60, "bits": 16, "block_size": 32,
                       "sink_dtype": "float32", "window_dtype": "float32"},
            "int4": {"sink_tokens": 4, "recent_tokens": 60, "bits": 4, "block_size": 32, "value_group_size": 32,
                     "sink_dtype": "float32", "window_dtype": "float32", "scale_dtype": "float32"}}


def prompts(tokenizer, n: int, lengths=(17, 23, 31, 40)) -> list[list[int]]:
    from pydoc_data.topics import topics
    text = " ".join(topics[k] for k in sorted(topics))
    words = text.split()
    out = []
    for i in range(n):
        chunk = " ".join(words[400 * i: 400 * i + 80])
        ids = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        out.append(ids[:lengths[i % len(lengths)]])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--config", action="append", metavar="NAME=JSON",
                   help="a named CacheConfig as JSON (dtype names); default: the tests' bits16 and int4")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qsinkkv.hf import QSinkKVCache
    configs = dict(c.split("=", 1) for c in args.config) if args.config else \
        {name: json.dumps(raw) for name, raw in DEFAULTS.items()}
    path = default_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation("qsinkkv")  # the fused path: qsinkkv's own prefill and decode ops
    ids = prompts(tok, args.prompts)
    tok.padding_side = "left"  # each row's sinks are its first real tokens
    runs = {}
    for name, text in configs.items():
        raw = json.loads(text)
        cfg: CacheConfig = parse_config(raw)
        t0 = time.perf_counter()
        with torch.no_grad():
            batch = tok.pad({"input_ids": ids}, return_tensors="pt")
            out = model.generate(**batch, cache=QSinkKVCache(cfg, model), max_new_tokens=args.max_new_tokens,
                                 min_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        tokens = out[:, batch["input_ids"].shape[1]:].tolist()
        runs[name] = {"model": str(path), "config": raw, "config_resolved": to_jsonable(cfg), "prompts": ids,
                      "tokens": tokens, "max_new_tokens": args.max_new_tokens, "seconds": time.perf_counter() - t0}
        print(f"{name}: {len(ids)} prompts x {args.max_new_tokens} tokens in {runs[name]['seconds']:.1f}s ({path})")
    with open(args.out, "w") as f:
        json.dump({"runs": runs}, f)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
