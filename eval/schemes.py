"""The KV-cache schemes the eval compares, each defined once and used by every subcommand.

A scheme is what a cache *stores* for each token. ``stored_view`` turns one layer's real keys
and values of the whole text into what that cache would serve at decode time:

    stored_view(scheme, k, v, sink_tokens) -> StoredKV(k, v, ready)

``k, v [B, Hkv, T, D]`` are the layer's K/V (post-RoPE, as the model computes them).
``StoredKV.k, .v`` are the dequantized stored values (float32), and ``ready [T]`` gives, per
token j, the first query position whose decode step reads that stored form; before it the
token is still held in bf16 (the filling block, or a KIVI residual). ``None`` means the
scheme stores bf16 (the reference). ``qsinkkv.eval.replay`` turns a view into attention.

How each family stores (B: blocks of ``block_size`` tokens, G: ``group_size`` channels):

* ``bf16``: the reference cache.
* ``per-tensor``: symmetric int8/int4 with one scale per layer for all of K (and one for V):
  the absmax over every stored token, heads and channels, measured on the evaluated text
  itself (a static scale, as FP8/INT8 serving caches use, calibrated with hindsight: the
  most favourable case for this baseline). Quantized on write.
* ``group`` / ``qsinkkv``: the real ``qsinkkv.SinkQuantCache`` (keys per channel within
  blocks, values per token in channel groups, fp16 scales); ``group`` quantizes the sinks
  like the rest (sink_tokens=0), ``qsinkkv`` keeps them in bf16 (ours).
* ``kivi``: the same cache configured as KIVI: group 32, residual 128 tokens in bf16, no
  sink protection.
* ``bnb-nf4`` / ``bnb-fp4`` / ``bnb-dyn8``: bitsandbytes blockwise (absmax per 64 values of a
  token: one head's channels when head_dim=64) NF4, FP4 and 8-bit dynamic. Quantized on write.
* ``quanto``: transformers' ``QuantizedCache(backend="quanto")`` (int4, group 64, residual
  128; it re-quantizes the whole history at every flush). ``ppl`` streams it token by token
  through the real cache (its residual holds the model's dtype, not bf16); ``kv`` reads its
  storage after the last flush. It has no window: both skip it when one is set.

A ``+sinks`` variant keeps the first ``sink_tokens`` tokens in bf16 (for qsinkkv this is the
design itself, so it is named ``qsinkkv-int*``; its sinks-quantized twin is ``group-int*``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from qsinkkv import CacheConfig, SinkQuantCache, gather, quant

BF16 = torch.bfloat16  # what an unquantized token is held in (sinks, filling block, residual)
BLOCK_SIZE = 64
GROUP_SIZE = 64
KIVI = dict(block_size=32, value_group_size=32, residual_tokens=128)
BNB_BLOCK = 64
QUANTO = dict(q_group_size=64, residual_length=128)

FAMILIES = ("bf16", "per-tensor", "group", "qsinkkv", "kivi", "bnb-nf4", "bnb-fp4", "bnb-dyn8", "quanto")


@dataclass(frozen=True)
class Scheme:
    family: str       # one of FAMILIES
    bits: int         # 16, 8 or 4
    bf16_sinks: bool  # the first sink_tokens tokens are stored in bf16

    @property
    def name(self) -> str:
        if self.family == "bf16":
            return "bf16"
        if self.family in ("bnb-nf4", "bnb-fp4", "bnb-dyn8"):
            base = self.family
        elif self.family == "qsinkkv":
            return f"qsinkkv-int{self.bits}"
        else:
            base = f"{self.family}-int{self.bits}"
        return base + ("+sinks" if self.bf16_sinks else "")

    @property
    def description(self) -> str:
        sinks = "bf16 sinks" if self.bf16_sinks else "sinks quantized like the rest"
        return {
            "bf16": "bf16 cache (the reference)",
            "per-tensor": f"per-tensor symmetric int{self.bits}, one scale per layer for K and for V; {sinks}",
            "group": f"qsinkkv per-channel-group int{self.bits} (block {BLOCK_SIZE}, group {GROUP_SIZE}); {sinks}",
            "qsinkkv": f"qsinkkv per-channel-group int{self.bits} with bf16 sinks (ours)",
            "kivi": f"KIVI-style int{self.bits}: group 32, bf16 residual of 128 tokens, no sink protection",
            "bnb-nf4": f"bitsandbytes NF4, blockwise absmax per {BNB_BLOCK} values; {sinks}",
            "bnb-fp4": f"bitsandbytes FP4, blockwise absmax per {BNB_BLOCK} values; {sinks}",
            "bnb-dyn8": f"bitsandbytes 8-bit dynamic, blockwise absmax per {BNB_BLOCK} values; {sinks}",
            "quanto": "transformers QuantizedCache (optimum-quanto int4, group 64, residual 128)",
        }[self.family]

    @property
    def requires(self) -> str | None:
        """The package this scheme needs, or None."""
        return {"bnb-nf4": "bitsandbytes", "bnb-fp4": "bitsandbytes", "bnb-dyn8": "bitsandbytes",
                "quanto": "optimum.quanto"}.get(self.family)

    def available(self) -> bool:
        need = self.requires
        if need is None:
            return True
        try:
            return importlib.util.find_spec(need) is not None
        except ModuleNotFoundError:  # a parent package (optimum) is missing
            return False


REFERENCE = Scheme("bf16", 16, True)


def schemes_for(bits: int) -> list[Scheme]:
    """Every scheme compared at ``bits`` (8 or 4), the bf16 reference excluded."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    out = [Scheme("per-tensor", bits, False), Scheme("per-tensor", bits, True),
           Scheme("group", bits, False), Scheme("qsinkkv", bits, True)]
    bnb = ("bnb-dyn8",) if bits == 8 else ("bnb-nf4", "bnb-fp4")
    out += [Scheme(f, bits, s) for f in bnb for s in (False, True)]
    out.append(Scheme("kivi", bits, False))
    if bits == 4:  # quanto's QuantizedCache offers int2 and int4 only
        out.append(Scheme("quanto", 4, False))
    return out


def find_scheme(name: str) -> Scheme:
    for s in [REFERENCE] + schemes_for(8) + schemes_for(4):
        if s.name == name:
            return s
    known = ", ".join(s.name for s in [REFERENCE] + schemes_for(8) + schemes_for(4))
    raise ValueError(f"unknown scheme {name!r}; known: {known}")


@dataclass
class StoredKV:
    k: Tensor      # [B, Hkv, T, D] float32: what the cache serves once a token is quantized
    v: Tensor
    ready: Tensor  # [T] int64: first query position that reads the stored form


def stored_view(scheme: Scheme, k: Tensor, v: Tensor, sink_tokens: int) -> StoredKV | None:
    """What ``scheme`` stores for one layer's ``k, v [B, Hkv, T, D]`` (see the module doc)."""
    T = k.shape[2]
    S = min(sink_tokens, T) if scheme.bf16_sinks else 0
    fam = scheme.family
    if fam == "bf16":
        return None
    config = cache_config(scheme, sink_tokens, T)
    if config is not None:
        return _real_cache_view(k, v, config)
    if fam == "quanto":
        return _quanto_final_view(k, v)
    # quantized on write: token j's stored form is read from its own decode step on
    ready = torch.arange(T, device=k.device)
    ready[:S] = T  # bf16 sinks are never read in another form
    if fam == "per-tensor":
        kq, vq = _per_tensor(k, S, scheme.bits), _per_tensor(v, S, scheme.bits)
    else:
        kq, vq = _bnb(k, fam), _bnb(v, fam)
    kq[:, :, :S] = k[:, :, :S].to(BF16).float()
    vq[:, :, :S] = v[:, :, :S].to(BF16).float()
    return StoredKV(kq, vq, ready)


def cache_config(scheme: Scheme, sink_tokens: int, capacity: int) -> CacheConfig | None:
    """The ``CacheConfig`` a ``group`` / ``qsinkkv`` / ``kivi`` scheme is, holding ``capacity`` tokens
    (sinks included) with nothing evicted; None for the families that are not a qsinkkv cache."""
    if scheme.family not in ("group", "qsinkkv", "kivi"):
        return None
    S = min(sink_tokens, capacity) if scheme.bf16_sinks else 0
    W = max(capacity - S, 1)
    if scheme.family == "kivi":  # a text shorter than the residual: all bf16
        return CacheConfig(sink_tokens=S, recent_tokens=W, bits=scheme.bits,
                           **dict(KIVI, residual_tokens=min(KIVI["residual_tokens"], W)))
    return CacheConfig(sink_tokens=S, recent_tokens=W, bits=scheme.bits, block_size=BLOCK_SIZE,
                       value_group_size=GROUP_SIZE)


def config_view(k: Tensor, v: Tensor, config: CacheConfig) -> StoredKV:
    """What a qsinkkv cache of ``config`` stores for one layer's ``k, v [B, Hkv, T, D]``: the same
    config holding the whole text (blocks are quantized the same whatever the window; a residual
    longer than the text keeps it all in bf16)."""
    T = k.shape[2]
    S = min(config.sink_tokens, T)
    W = max(T - S, 1)
    return _real_cache_view(k, v, dataclasses.replace(config, sink_tokens=S, recent_tokens=W,
                                                      residual_tokens=min(config.residual_tokens, W),
                                                      positions="absolute"))


def store_of(scheme: Scheme):
    """The replay's per-layer store for ``scheme``: ``(layer, k, v, sink_tokens) -> StoredKV | None`` (the replay
    passes each layer's sinks: 0 on a trained window layer)."""
    return lambda layer, k, v, sink_tokens: stored_view(scheme, k, v, sink_tokens)


def _per_tensor(x: Tensor, skip: int, bits: int) -> Tensor:
    """Symmetric per-tensor round trip of tokens ``skip:``, scale from their absmax."""
    out = x.to(BF16).float()
    codes, scale = quant.quantize_per_tensor_symmetric(x[:, :, skip:].to(BF16), bits)
    out[:, :, skip:] = quant.dequantize_per_tensor_symmetric(codes, scale)
    return out


def _bnb(x: Tensor, family: str) -> Tensor:
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a CPU-kernel notice on import
    import bitsandbytes.functional as bnbf

    B, H, T, D = x.shape
    if (H * D) % BNB_BLOCK:
        raise ValueError(f"bitsandbytes blocks of {BNB_BLOCK} values would straddle tokens: "
                         f"num_kv_heads * head_dim = {H * D} is not a multiple of {BNB_BLOCK}")
    flat = x.to(BF16).float().transpose(1, 2).contiguous().reshape(-1)  # token-major: a block never spans tokens
    if family == "bnb-dyn8":
        codes, state = bnbf.quantize_blockwise(flat, blocksize=BNB_BLOCK)
        y = bnbf.dequantize_blockwise(codes, state)
    else:
        codes, state = bnbf.quantize_4bit(flat, blocksize=BNB_BLOCK, quant_type=family[4:])
        y = bnbf.dequantize_4bit(codes, state)
    return y.reshape(B, T, H, D).transpose(1, 2).float()


def _real_cache_view(k: Tensor, v: Tensor, config: CacheConfig) -> StoredKV:
    """Store the whole text in a real ``SinkQuantCache`` (no eviction) and read its storage back.
    Blocks are quantized once, from their bf16 values, whatever evicts them later, so every token's
    stored form is the one a windowed cache of the same config holds while the token is visible."""
    B, H, T, D = k.shape
    cache = SinkQuantCache(config, 1, B, H, D, device=k.device, dtype=BF16, backend="torch")
    cache.append(0, k.to(BF16), v.to(BF16))
    keys, values, pos = gather(cache.layers[0], torch.float32)
    kq = k.to(BF16).float()
    vq = v.to(BF16).float()
    p = pos[0]
    kq[:, :, p[p >= 0]] = keys[:, :, p >= 0]
    vq[:, :, p[p >= 0]] = values[:, :, p >= 0]
    S = config.sink_tokens
    ready = torch.full((T,), T, dtype=torch.long, device=k.device)  # sinks: never read in another form
    # the query at position i has stored m = i + 1 - S recent tokens
    ready[S:] = S + cache.layout.quantized_from(torch.arange(T - S, device=k.device)) - 1
    return StoredKV(kq, vq, ready.clamp_(max=T))


def _quanto_final_view(k: Tensor, v: Tensor) -> StoredKV:
    """Storage of transformers' quanto QuantizedCache layer after a token-by-token stream of the
    text, reproduced with its own ``update`` fed in chunks that end where its flushes happen."""
    from transformers.cache_utils import QuantoQuantizedLayer

    T = k.shape[2]
    R = QUANTO["residual_length"]
    layer = QuantoQuantizedLayer(nbits=4, **QUANTO)
    kb, vb = k.to(BF16), v.to(BF16)
    # token 0 alone (quantized on the first update), then flushes as token R, 2R, ... arrives
    bounds = [0, 1] + [b for f in range(R, T, R) for b in (f, f + 1)] + [T]
    bounds = sorted(set(b for b in bounds if b <= T))
    ready = torch.full((T,), T, dtype=torch.long, device=k.device)
    last_flush = 0
    for a, b in zip(bounds, bounds[1:]):
        layer.update(kb[:, :, a:b], vb[:, :, a:b])
        if a == 0 or a % R == 0:  # a flush: the query at a still read bf16, the next reads codes
            ready[last_flush:b] = b
            last_flush = b
    nq = layer._quantized_keys.shape[-2]
    kq = kb.float()
    vq = vb.float()
    kq[:, :, :nq] = layer._dequantize(layer._quantized_keys).float()
    vq[:, :, :nq] = layer._dequantize(layer._quantized_values).float()
    ready[nq:] = T
    return StoredKV(kq, vq, ready)
