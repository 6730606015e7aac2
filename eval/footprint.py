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

from dataclasses import dataclass, field

import torch
from torch import Tensor

from qsinkkv import CacheConfig, SinkQuantCache, quant
from qsinkkv.layout import WindowLayout
from qsinkkv.paged import block_bytes
from qsinkkv.storage import LayerStorage

from .schemes import BF16, BNB_BLOCK, QUANTO, Scheme, cache_config


@dataclass(frozen=True)
class Geometry:
    """The K/V shape of a model: what every cache's bytes depend on."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32  # the model's compute dtype (quanto's residual holds it)

    @classmethod
    def of(cls, model) -> Geometry:
        cfg = model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, model.dtype)

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
        return dict(capacity=self.capacity, bytes=self.total, bytes_per_token=self.per_token,
                    bf16_fraction=self.fraction, ideal_bytes=self.ideal_total,
                    ideal_bytes_per_token=self.ideal_total / self.capacity, parts=dict(self.parts))


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
    """A real ``SinkQuantCache`` of ``config`` (capacity S + W), every layer, batch 1."""
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
    one = LayerStorage.allocate(WindowLayout(config), 1, geo.num_kv_heads, geo.head_dim, torch.device("meta"))
    return geo.num_layers * one.nbytes()


def ideal(config: CacheConfig, geo: Geometry) -> float:
    """Exactly ``config.capacity`` tokens in ``config``'s formats, every layer (see the module doc)."""
    sizes, layout = block_bytes(config, geo.num_kv_heads, geo.head_dim), WindowLayout(config)
    U = min(layout.unquantized_tokens, config.recent_tokens)
    bs = config.block_size
    per_layer = sizes["sink"] + U * sizes["float"] / bs + (config.recent_tokens - U) * sizes["quant"] / bs
    return geo.num_layers * per_layer


def bf16(geo: Geometry, capacity: int, device: str = "cpu") -> Footprint:
    """transformers' ``DynamicLayer`` holding ``capacity`` tokens of K and V in bf16 (``device="meta"``:
    the same bytes, nothing allocated)."""
    from transformers.cache_utils import DynamicLayer

    layer = DynamicLayer()
    kv = torch.zeros(1, geo.num_kv_heads, capacity, geo.head_dim, dtype=BF16, device=device)
    layer.update(kv, kv.clone())
    return _make(geo, capacity, dict(float=_nbytes(layer.keys) + _nbytes(layer.values)))


def of_scheme(scheme: Scheme, geo: Geometry, sink_tokens: int, capacity: int) -> Footprint:
    """The cache ``scheme`` keeps for ``capacity`` tokens whose first ``sink_tokens`` are the sinks."""
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
