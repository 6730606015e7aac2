"""HybridCache: a model's layers under a ``LayerPolicy``, one ``SinkQuantCache`` per layer type.

Each layer type's layers share one ``SinkQuantCache`` (one config, one layout, one block manager, the ops chosen once
for it): a Gemma 3 model's 15 window layers one, its 3 global layers another. This class routes model layer i to
its type's cache and keeps the layers of a model step in step across the types: a call refused in layer i rolls the
step back on every layer of every type that already took it (the types' own ``SinkQuantCache`` rolls back its
layers; this one the others'), and a crop is checked on every layer before any changes. Same interface as
``SinkQuantCache`` for what a model's cache calls (``attend``, ``append``, lengths, ``crop_to``, ``select_batch``,
``reset``, ``nbytes``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .cache import SinkQuantCache
from .policy import LayerPolicy


class HybridCache:
    """``HybridCache(policy, batch_size, num_kv_heads, head_dim, device, dtype, backend="auto",
    decode_variant="dequantize")``: ``SinkQuantCache``'s arguments, a ``LayerPolicy`` for its config."""

    def __init__(self, policy: LayerPolicy, batch_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, backend: str = "auto",
                 decode_variant: str = "dequantize"):
        if not isinstance(policy, LayerPolicy):
            raise TypeError(f"policy must be a qsinkkv.policy.LayerPolicy, got {type(policy).__name__}")
        self.policy = policy
        groups = policy.groups()
        self.caches = {kind: SinkQuantCache(config, len(groups[kind]), batch_size, num_kv_heads, head_dim, device,
                                            dtype, backend=backend, decode_variant=decode_variant)
                       for kind, config in policy.configs}
        # model layer i -> (its type's cache, its index there)
        self._where = [None] * len(policy.layer_types)
        for kind, layers in groups.items():
            for local, i in enumerate(layers):
                self._where[i] = (self.caches[kind], local)

    # --- what the model's cache reads -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self._where)

    def _first(self) -> SinkQuantCache:
        return next(iter(self.caches.values()))

    @property
    def batch_size(self) -> int:
        return self._first().batch_size

    @property
    def num_kv_heads(self) -> int:
        return self._first().num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._first().head_dim

    @property
    def device(self) -> torch.device:
        return self._first().device

    @property
    def dtype(self) -> torch.dtype:
        return self._first().dtype

    def cache_of(self, layer: int) -> tuple[SinkQuantCache, int]:
        """``(the SinkQuantCache holding model layer `layer`, its index there)``."""
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return self._where[layer]

    def seq_lens(self, layer: int = 0) -> Tensor:
        cache, local = self.cache_of(layer)
        return cache.seq_lens(local)

    def get_seq_length(self, layer: int = 0) -> int:
        cache, local = self.cache_of(layer)
        return cache.get_seq_length(local)

    def layer_lengths(self) -> list[int]:
        """The longest sequence of every model layer, in model order."""
        return [cache.get_seq_length(local) for cache, local in self._where]

    def in_step(self) -> bool:
        """Every layer of every type holds the same length for every sequence."""
        caches = list(self.caches.values())
        first = caches[0].layers[0].seq_lens
        return all(c.in_step() and torch.equal(c.layers[0].seq_lens, first) for c in caches)

    def nbytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches.values())

    def nbytes_by_type(self) -> dict[str, int]:
        return {kind: cache.nbytes() for kind, cache in self.caches.items()}

    # --- a model step ---------------------------------------------------------------------------
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, lengths=None, *, scale: float | None = None,
               sink_logits: Tensor | None = None) -> Tensor:
        """``SinkQuantCache.attend`` on model layer ``layer``, under its type's config."""
        return self._step(layer, lambda cache, local: cache.attend(local, q, k, v, lengths, scale=scale,
                                                                    sink_logits=sink_logits))

    def append(self, layer: int, k: Tensor, v: Tensor, lengths=None) -> None:
        self._step(layer, lambda cache, local: cache.append(local, k, v, lengths))

    def _step(self, layer: int, call):
        cache, local = self.cache_of(layer)
        before = cache.layers[local].seq_lens.clone()
        try:
            return call(cache, local)
        except BaseException as e:  # (its own type's layers are rolled back by its cache)
            for other in self.caches.values():
                if other is not cache:
                    other._roll_back_step(-1, before, e)
            raise

    # --- changing what is held ------------------------------------------------------------------
    def reset(self, seqs=None) -> None:
        for cache in self.caches.values():
            cache.reset(seqs)

    def crop_to(self, lengths) -> None:
        """Every layer of every type to ``lengths``; refused, nothing changed, where any layer refuses (a window
        layer that already evicted what the shorter stream would see)."""
        cuts = {}
        for kind, cache in self.caches.items():
            try:
                cuts[kind] = cache.crop_cuts(lengths)
            except ValueError as e:
                raise ValueError(f"{kind} layers: {e}") from None
        for kind, cache in self.caches.items():
            cache._crop(cuts[kind])

    def select_batch(self, index) -> None:
        for cache in self.caches.values():
            cache.select_batch(index)
