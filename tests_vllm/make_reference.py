"""The reference the vLLM tests compare against, made in the MAIN venv (transformers >= 5.24, which
the vLLM venv cannot have): token-id prompts cut from CPython's ``pydoc_data.topics`` prose, and the
greedy tokens HF ``generate`` gives on the default model with ``QSinkKVCache`` (one left-padded batch).

    python tests_vllm/make_reference.py OUT.json [--prompts 8] [--max-new-tokens 128] [--config NAME=JSON ...]

The default configs are the tests' past-the-window cases: ``bits16`` (float32 sinks and window, S=4,
W=60, block 32: capacity 64, every row streams past it) and ``int4`` (the same window, int4 blocks of
32 with value groups of 32, float32 scales). OUT.json holds ``{"runs": {name: reference}}``. It also
converts the default model to the safetensors folder vLLM loads (``qsinkkv.models.default_model_dir``)
and writes its path.

Models with trained window layers: ``gemma3_bits16`` / ``gemma3_int4`` and ``gptoss_bits16`` /
``gptoss_int4`` run the same configs on a tiny random Gemma 3 (``tiny_gemma3``: layers 2 and 5 global, the rest a
trained window of 24 tokens) and a tiny random gpt-oss (``tiny_gpt_oss``: a window layer and a global one, learned
sinks, experts), each saved beside OUT.json with the default model's tokenizer, under QSinkKVCache's per-layer-type
policy: the global layers S=4 + W=60, the window layers exactly their 24 tokens, no sinks.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

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


GEMMA_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]


def tiny_gemma3(out: Path) -> Path:
    """A tiny random Gemma 3 (seeded) with the default model's tokenizer, saved as a model folder vLLM loads."""
    import transformers

    cfg = transformers.Gemma3TextConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=64, num_hidden_layers=6,
                                        layer_types=GEMMA_TYPES, sliding_window=24, max_position_embeddings=1024)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return _save(cfg, out)


def tiny_gpt_oss(out: Path) -> Path:
    """A tiny random gpt-oss (seeded; layer 0 a trained window of 24 tokens, layer 1 global; learned sinks drawn,
    zeros at init; 4 experts, 2 a token; unquantized) with the default model's tokenizer."""
    import transformers

    cfg = transformers.GptOssConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, num_hidden_layers=2, sliding_window=24,
                                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024)
    cfg.architectures = ["GptOssForCausalLM"]
    return _save(cfg, out, sinks=True)


def _save(cfg, out: Path, sinks: bool = False) -> Path:
    import shutil

    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if sinks:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_()
    model.save_pretrained(out)
    for f in default_model_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


TINY_MODELS = {"gemma3": tiny_gemma3, "gptoss": tiny_gpt_oss}  # the lane's models with window layers


def generate(path, configs: dict, n_prompts: int, max_new_tokens: int) -> dict:
    """{name: reference}: HF generate with QSinkKVCache of each config on the model at ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qsinkkv.hf import QSinkKVCache
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation("qsinkkv")  # the fused path: qsinkkv's own prefill and decode ops
    ids = prompts(tok, n_prompts)
    tok.padding_side = "left"  # each row's sinks are its first real tokens
    runs = {}
    for name, text in configs.items():
        raw = json.loads(text)
        cfg: CacheConfig = parse_config(raw)
        t0 = time.perf_counter()
        with torch.no_grad():
            batch = tok.pad({"input_ids": ids}, return_tensors="pt")
            out = model.generate(**batch, cache=QSinkKVCache(cfg, model), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        tokens = out[:, batch["input_ids"].shape[1]:].tolist()
        runs[name] = {"model": str(path), "config": raw, "config_resolved": to_jsonable(cfg), "prompts": ids,
                      "tokens": tokens, "max_new_tokens": max_new_tokens, "seconds": time.perf_counter() - t0}
        print(f"{name}: {len(ids)} prompts x {max_new_tokens} tokens in {runs[name]['seconds']:.1f}s ({path})")
    return runs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--config", action="append", metavar="NAME=JSON",
                   help="a named CacheConfig as JSON (dtype names); default: the tests' bits16 and int4")
    args = p.parse_args(argv)
    configs = dict(c.split("=", 1) for c in args.config) if args.config else \
        {name: json.dumps(raw) for name, raw in DEFAULTS.items()}
    runs = generate(default_model_dir(), configs, args.prompts, args.max_new_tokens)
    if not args.config:  # the window models' references (tests_vllm/test_vllm_hybrid.py)
        for model, build in TINY_MODELS.items():
            path = build(Path(args.out).absolute().with_name(f"qsinkkv-vllm-tiny-{model}"))
            runs.update({f"{model}_{name}": run for name, run in generate(path, configs, args.prompts,
                                                                           args.max_new_tokens).items()})
    with open(args.out, "w") as f:
        json.dump({"runs": runs}, f)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
