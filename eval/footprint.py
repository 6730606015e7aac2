"""Bytes each scheme's cache holds, from its real storage, at a run's capacity.

    footprint.of_scheme(scheme, geometry, sink_tokens, capacity) -> Footprint
    footprint.of_config(config, geometry) -> Footprint

A cache holding ``capacity`` tokens (sinks included) of every layer of a model of
``geometry`` (layers, KV heads, head_dim). Every figure is read from tensors a real cache or
quantizer allocates, never from a formula:

* qsinkkv configurations (``group``, ``qsinkkv``, ``kivi`` and every frontier point): a real
  ``SinkQuantCache`` of the config, ``nbytes()`` (sinks, codes, scales and zeros, and the float
  ring: the filling block plus any residual, rounded up to whole blocks as allocated).
* ``bf16``: transformers' ``DynamicLayer`` holding the capacity's K and V in bf16, per layer.
* ``per-tensor``: the codes ``quant.quantize_per_tensor_symmetric`` returns (int4 packed two
  per byte with ``quant.pack``, as a real int4 cache would hold them) and the one float32 scale
  of K and of V per layer; ``+sinks``: the sinks in bf16.
* ``bnb-*``: the packed codes and the float32 absmax per 64-value block that bitsandbytes
  returns (its 256-entry code table is one constant per process, not per cache: not counted).
* ``quanto``: transformers' ``QuantoQuantizedLayer`` fed the capacity's tokens in the model's
  dtype (its residual holds that dtype, float32 by default), counted as it stands afterwards:
  the packed codes, scales and shifts, and the residual.

Layers of one model are identical in shape, so the baselines are measured on one layer and
multiplied by the layer count; the qsinkkv cache is built with all its layers.

A model with trained window layers (``Geometry.window_layers``; Gemma 3, gpt-oss, ...) keeps two caches, as
``QSinkKVCache``'s ``LayerPolicy`` does: its full-attention layers hold ``capacity`` tokens under the scheme, its
window layers ``Geometry.window_held`` tokens (their trained window, at most the stream's tokens) under the same
scheme with no sinks (``qsinkkv.policy.window_config``), however small the capacity. ``Footprint.by_type`` gives each
type's bytes; the bf16 cache is the model's own: transformers' ``DynamicSlidingWindowLayer`` on a window layer.

Two figures per cache (``Footprint.total`` and ``Footprint.ideal``):

* **allocated** (``total``): what the real cache holds, as above. For a qsinkkv cache this is its
  ring: whole blocks, the bf16 filling block included, more slots than the window's tokens.
* **ideal**: exactly ``capacity`` tokens in the cache's storage formats, nothing else: for qsinkkv,
  the sinks in bf16, the residual (``residual_tokens``; the whole window with ``bits=16``) in bf16
  and every other recent token at its quantized block's bytes per token (codes and scales, read
  off one block of the storage's own allocation, ``qsinkkv.paged.block_bytes``), with no ring
  slack and no filling block. The other families store exactly the tokens they hold (bf16,
  per-tensor, bitsandbytes, quanto as counted), so their ideal is what they allocate.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from qsinkkv import CacheConfig, SinkQuantCache, quant
from qsinkkv.layout import WindowLayout
from qsinkkv.paged import block_bytes
from qsinkkv.policy import FULL, SLIDING, trained_windows, window_config
from qsinkkv.storage import LayerStorage

from .schemes import BF16, BNB_BLOCK, QUANTO, Scheme, cache_config


@dataclass(frozen=True)
class Geometry:
    """The K/V shape of a model: what every cache's bytes depend on."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32  # the model's compute dtype (quanto's residual holds it)
    window_layers: int = 0    # of num_layers: trained window layers (the rest are full attention)
    window: int = 0           # their trained window (sliding_window)
    tokens: int | None = None  # the stream's length, which caps what a window layer holds (None: past its window)

    def __post_init__(self) -> None:
        if not 0 <= self.window_layers <= self.num_layers or (self.window_layers > 0) != (self.window > 0):
            raise ValueError(f"Geometry: window_layers={self.window_layers} of {self.num_layers} layers with "
                             f"window={self.window}: both 0, or 1..num_layers layers of a window >= 1")

    @classmethod
    def of(cls, model, tokens: int | None = None) -> Geometry:
        """``model``'s geometry; ``tokens``: the stream's length (None: a stream past every window)."""
        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        windows = trained_windows(cfg)
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, model.dtype, len(windows),
                   max(windows.values(), default=0), tokens)

    @property
    def stream(self) -> int:
        """Tokens the stream has fed a window layer (``tokens``; when None, one past its window)."""
        return self.tokens if self.tokens is not None else self.window + 1

    @property
    def window_held(self) -> int:
        """Tokens a window layer's cache holds (``window_config``): its window, at most the stream's tokens."""
        return self.window if self.tokens is None else min(self.window, self.tokens)

    def split(self) -> list[tuple[str, Geometry]]:
        """``(layer type, a geometry of its layers alone)`` for each layer type present: the full-attention layers,
        then the window layers."""
        full = self.num_layers - self.window_layers
        one = dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)
        return ([(FULL, Geometry(full, **one))] if full else []) + \
            ([(SLIDING, Geometry(self.window_layers, **one))] if self.window_layers else [])

    @property
    def bf16_bytes_per_token(self) -> int:
        """K and V of one token in bf16, all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class Footprint:
    """Bytes a cache holds for ``capacity`` tokens, all layers."""
    capacity: int
    total: int                 # bytes
    bf16_total: int            # bytes of a bf16 cache of the same capacity (K and V, nothing else)
    parts: dict[str, int] = field(default_factory=dict)  # sinks, codes, scales, float (filling block, residual)
    ideal: float | None = None  # bytes of exactly ``capacity`` tokens in the cache's formats (None: = total)
    by_type: dict[str, int] = field(default_factory=dict)  # layer type -> its bytes (a model with window layers)

    @property
    def per_token(self) -> float:
        """Allocated bytes per token held."""
        return self.total / self.capacity

    @property
    def ideal_total(self) -> float:
        return self.total if self.ideal is None else self.ideal

    @property
    def fraction(self) -> float:
        """Of the bf16 cache's bytes."""
        return self.total / self.bf16_total

    def to_dict(self) -> dict:
        out = dict(capacity=self.capacity, bytes=self.total, bytes_per_token=self.per_token,
                   bf16_fraction=self.fraction, ideal_bytes=self.ideal_total,
                   ideal_bytes_per_token=self.ideal_total / self.capacity, parts=dict(self.parts))
        return out | (dict(by_type=dict(self.by_type)) if self.by_type else {})


def _by_type(geo: Geometry, capacity: int, of_one) -> Footprint:
    """The footprint of every layer type of ``geo`` summed: ``of_one(layer type, its geometry, its tokens)`` for
    each (module doc: the full-attention layers hold ``capacity`` tokens, the window layers ``geo.window_held``); the
    bf16 reference of a model with window layers is its own cache (``stock_layer_bytes``)."""
    pieces = {kind: of_one(kind, sub, capacity if kind == FULL else geo.window_held) for kind, sub in geo.split()}
    if geo.window_layers:  # against the model's own bf16 cache: a window layer's DynamicSlidingWindowLayer
        pieces = {kind: replace(fp, bf16_total=sub.num_layers * (
            stock_layer_bytes(sub, capacity, BF16) if kind == FULL else
            stock_layer_bytes(sub, geo.stream, BF16, geo.window)))
            for (kind, sub), fp in zip(geo.split(), pieces.values())}
    parts: dict[str, int] = {}
    for fp in pieces.values():
        for name, n in fp.parts.items():
            parts[name] = parts.get(name, 0) + n
    ideal = None if all(fp.ideal is None for fp in pieces.values()) else \
        sum(fp.ideal_total for fp in pieces.values())
    return Footprint(capacity, sum(fp.total for fp in pieces.values()),
                     sum(fp.bf16_total for fp in pieces.values()), parts, ideal,
                     {k: fp.total for k, fp in pieces.items()} if geo.window_layers else {})


def _nbytes(t: Tensor) -> int:
    """Bytes of a tensor, or of the inner tensors of a tensor subclass (optimum-quanto's packed ones)."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None:
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _make(geo: Geometry, capacity: int, parts: dict[str, int], layers: int = 1) -> Footprint:
    """``parts`` of ``layers`` layers (1: one layer, scaled to the model)."""
    scale = geo.num_layers // layers
    parts = {k: v * scale for k, v in parts.items()}
    return Footprint(capacity, sum(parts.values()), geo.bf16_bytes_per_token * capacity, parts)


def of_config(config: CacheConfig, geo: Geometry) -> Footprint:
    """A real ``SinkQuantCache`` of ``config`` (capacity S + W), every layer, batch 1 (a window layer's: its
    ``window_config``)."""
    return _by_type(geo, config.capacity, lambda kind, sub, n: _of_config(_typed(config, kind, n), sub))


def _typed(config: CacheConfig, kind: str, window: int) -> CacheConfig:
    return config if kind == FULL else window_config(config, window)


def _of_config(config: CacheConfig, geo: Geometry) -> Footprint:
    cache = SinkQuantCache(config, geo.num_layers, 1, geo.num_kv_heads, geo.head_dim, device="cpu", dtype=BF16,
                           backend="torch")
    groups = dict(sinks=("sink_k", "sink_v"), codes=("key_codes", "value_codes"),
                  scales=("key_scale", "key_zero", "value_scale", "value_zero"), float=("float_k", "float_v"))
    parts = {name: sum(_nbytes(t) for layer in cache.layers for n, t in layer.tensors().items() if n in members)
             for name, members in groups.items()}
    assert sum(parts.values()) == cache.nbytes()  # every tensor of the storage in exactly one part
    fp = _make(geo, config.capacity, parts, layers=geo.num_layers)
    return Footprint(fp.capacity, fp.total, fp.bf16_total, fp.parts, ideal=ideal(config, geo))


def allocated(config: CacheConfig, geo: Geometry) -> int:
    """The bytes a ``SinkQuantCache`` of ``config`` (batch 1, every layer) allocates, read off the
    storage's own allocation on the meta device: equal to ``of_config(config, geo).total`` without
    building the cache."""
    config.check_head_dim(geo.head_dim)
    total = 0
    for kind, sub in geo.split():
        layout = WindowLayout(_typed(config, kind, geo.window_held))
        one = LayerStorage.allocate(layout, 1, geo.num_kv_heads, geo.head_dim, torch.device("meta"))
        total += sub.num_layers * one.nbytes()
    return total


def ideal(config: CacheConfig, geo: Geometry) -> float:
    """Exactly ``config.capacity`` tokens in ``config``'s formats, every layer (see the module doc)."""
    total = 0.0
    for kind, sub in geo.split():
        c = _typed(config, kind, geo.window_held)
        sizes, layout = block_bytes(c, geo.num_kv_heads, geo.head_dim), WindowLayout(c)
        U = min(layout.unquantized_tokens, c.recent_tokens)
        bs = c.block_size
        per_layer = sizes["sink"] + U * sizes["float"] / bs + (c.recent_tokens - U) * sizes["quant"] / bs
        total += sub.num_layers * per_layer
    return total


def bf16(geo: Geometry, capacity: int, device: str = "cpu") -> Footprint:
    """transformers' ``DynamicLayer`` holding ``capacity`` tokens of K and V in bf16 (``device="meta"``:
    the same bytes, nothing allocated); a window layer: its ``DynamicSlidingWindowLayer`` fed the tokens it holds."""
    def one(kind, sub, n):
        held = stock_layer_bytes(sub, n, BF16, device=device) if kind == FULL else \
            stock_layer_bytes(sub, geo.stream, BF16, geo.window, device)
        return _make(sub, n, dict(float=held))
    return _by_type(geo, capacity, one)


def stock_layer_bytes(geo: Geometry, tokens: int, dtype: torch.dtype, window: int | None = None,
                      device: str = "meta") -> int:
    """Bytes of K and V that one layer of transformers' own cache holds after ``tokens`` tokens in ``dtype``: a
    ``DynamicLayer`` (every token), or with ``window`` a ``DynamicSlidingWindowLayer`` (``window - 1`` tokens
    between steps), read off its tensors."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layer = DynamicLayer() if window is None else DynamicSlidingWindowLayer(sliding_window=window)
    kv = torch.zeros(1, geo.num_kv_heads, tokens, geo.head_dim, dtype=dtype, device=device)
    layer.update(kv, kv.clone())
    return _nbytes(layer.keys) + _nbytes(layer.values)


def of_scheme(scheme: Scheme, geo: Geometry, sink_tokens: int, capacity: int) -> Footprint:
    """The cache ``scheme`` keeps for ``capacity`` tokens whose first ``sink_tokens`` are the sinks (a window
    layer: its window, no sinks)."""
    if scheme.family == "quanto" and geo.window_layers:
        raise ValueError("quanto: transformers' QuantizedCache keeps every token of every layer, so it has no "
                         "footprint beside a model's trained window layers")
    if scheme.family == "bf16":
        return bf16(geo, capacity)
    return _by_type(geo, capacity, lambda kind, sub, n: _of_scheme(scheme, sub, sink_tokens if kind == FULL else 0,
                                                                   n))


def _of_scheme(scheme: Scheme, geo: Geometry, sink_tokens: int, capacity: int) -> Footprint:
    config = cache_config(scheme, sink_tokens, capacity)
    if config is not None:
        return of_config(config, geo)
    fam = scheme.family
    if fam == "bf16":
        return bf16(geo, capacity)
    if fam == "quanto":
        return _quanto(geo, capacity)
    S = min(sink_tokens, capacity) if scheme.bf16_sinks else 0
    x = torch.zeros(1, geo.num_kv_heads, capacity - S, geo.head_dim, dtype=BF16)  # one layer's K (or V)
    if fam == "per-tensor":
        codes, scale = quant.quantize_per_tensor_symmetric(x, scheme.bits)
        if scheme.bits == 4:  # codes in [-7, 7]: offset to [1, 15] and packed two per byte, as stored
            codes = quant.pack((codes + 8).to(torch.uint8), 4)
        one = dict(codes=_nbytes(codes), scales=_nbytes(scale))
    else:
        one = _bnb_storage(x, fam)
    sinks = _nbytes(torch.zeros(1, geo.num_kv_heads, S, geo.head_dim, dtype=BF16))  # one layer's K (or V) sinks
    return _make(geo, capacity, dict(sinks=2 * sinks, codes=2 * one["codes"], scales=2 * one["scales"]))


def _bnb_storage(x: Tensor, family: str) -> dict[str, int]:
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    import bitsandbytes.functional as bnbf

    flat = x.float().reshape(-1)
    if family == "bnb-dyn8":
        codes, state = bnbf.quantize_blockwise(flat, blocksize=BNB_BLOCK)
    else:
        codes, state = bnbf.quantize_4bit(flat, blocksize=BNB_BLOCK, quant_type=family[4:])
    return dict(codes=_nbytes(codes), scales=_nbytes(state.absmax))


def _quanto(geo: Geometry, capacity: int) -> Footprint:
    """One real quanto layer after ``capacity`` tokens, fed as a stream flushes them (see
    ``schemes._quanto_final_view``)."""
    from transformers.cache_utils import QuantoQuantizedLayer

    R = QUANTO["residual_length"]
    layer = QuantoQuantizedLayer(nbits=4, **QUANTO)
    kv = torch.zeros(1, geo.num_kv_heads, capacity, geo.head_dim, dtype=geo.dtype)
    bounds = sorted({b for b in [0, 1] + [b for f in range(R, capacity, R) for b in (f, f + 1)] + [capacity]
                     if b <= capacity})
    for a, b in zip(bounds, bounds[1:]):
        layer.update(kv[:, :, a:b], kv[:, :, a:b])
    parts = dict(codes=0, scales=0, float=_nbytes(layer.keys) + _nbytes(layer.values))
    for qt in (layer._quantized_keys, layer._quantized_values):  # codes in _data; _scale, _shift
        names, _ = qt.__tensor_flatten__()
        parts["codes"] += _nbytes(qt._data)
        parts["scales"] += sum(_nbytes(getattr(qt, n)) for n in names if n != "_data")
    return _make(geo, capacity, parts)
