"""SinkQuantCache: bf16 attention sinks + an int8/int4 quantized recent window, per layer.

Storage per layer (allocated once; see ``layout.py`` for which slot holds which token):

  sink_k, sink_v       [B, Hkv, S, D]              sink_dtype
  float_k, float_v     [B, Hkv, float_slots*bs, D] window_dtype   (filling block + residual)
  key_codes            [B, Hkv, quant_slots, bs, D/cpb] uint8     (cpb = 2 for int4, else 1)
  key_scale, key_zero  [B, Hkv, quant_slots, D]               scale_dtype, per block & channel
  value_codes          [B, Hkv, quant_slots, bs, D/cpb] uint8
  value_scale, value_zero [B, Hkv, quant_slots, bs, D/G]      scale_dtype, per token & group

Decode (one new token): the token is stored, then its query attends over the storage.
Prefill (a chunk of T > 1 tokens): each query attends over what the cache held before the
chunk plus the chunk's own full-precision K/V under the exact sink + window mask (as
KIVI does); then the chunk is stored. Blocks that are evicted before they could ever be
seen are never quantized.
"""
from __future__ import annotations

import math
import numbers
import os

import torch
from torch import Tensor

from . import quant
from .attention import sink_window_attention, visible_mask
from .config import CacheConfig
from .decode import decode_attention_reference, decode_attention_torch
from .layout import WindowLayout
from .rope import Rotary


# float8 model dtypes have no isfinite (and no way to refuse a NaN): not accepted
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_QUANT_TENSORS = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")


class LayerCache:
    """One layer's storage. Callers validate inputs; ``append`` commits nothing until every
    block it must quantize has been quantized successfully."""

    def __init__(self, config: CacheConfig, layout: WindowLayout, batch_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device, quantizer=quant):
        self.config, self.layout = config, layout
        self.quantizer = quantizer  # qsinkkv.quant or qsinkkv.kernels: same functions, bit-identical codes
        self.seq_len = 0
        self._undo: tuple[int, list] | None = None  # (length before the last append, what it overwrote)
        B, H, D, S, bs = batch_size, num_kv_heads, head_dim, config.sink_tokens, config.block_size
        zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        self.sink_k = zeros(B, H, S, D, dtype=config.sink_dtype)
        self.sink_v = zeros(B, H, S, D, dtype=config.sink_dtype)
        self.float_k = zeros(B, H, layout.float_slots * bs, D, dtype=config.window_dtype)
        self.float_v = zeros(B, H, layout.float_slots * bs, D, dtype=config.window_dtype)
        nq, Dc = layout.quant_slots, D // quant.codes_per_byte(config.bits)
        self.key_codes = zeros(B, H, nq, bs, Dc, dtype=torch.uint8)
        self.key_scale = zeros(B, H, nq, D, dtype=config.scale_dtype)
        self.key_zero = zeros(B, H, nq, D, dtype=config.scale_dtype)
        self.value_codes = zeros(B, H, nq, bs, Dc, dtype=torch.uint8)
        groups = D // config.value_group_size if config.bits != 16 else 0
        self.value_scale = zeros(B, H, nq, bs, groups, dtype=config.scale_dtype)
        self.value_zero = zeros(B, H, nq, bs, groups, dtype=config.scale_dtype)

    def tensors(self) -> dict[str, Tensor]:
        return {name: t for name, t in vars(self).items() if isinstance(t, Tensor)}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def reset(self) -> None:
        self.seq_len, self._undo = 0, None
        for t in self.tensors().values():
            t.zero_()

    # --- writing ------------------------------------------------------------------------------
    def append(self, k: Tensor, v: Tensor) -> None:
        """Store ``k, v [B, Hkv, T, D]`` at positions seq_len .. seq_len + T - 1.

        Keeps an undo record (``undo()``) that restores the state before this call: the storage it
        overwrote that the shorter stream still reads (a quantized ring slot when a block is completed,
        float-ring rows when a long chunk wraps the ring) is copied aside first; the common decode
        step overwrites nothing live and copies nothing."""
        L, cfg, bs = self.layout, self.config, self.config.block_size
        n0, T = self.seq_len, k.shape[2]
        n_sink = min(max(cfg.sink_tokens - n0, 0), T)
        m0, m1 = L.recent_count(n0), L.recent_count(n0 + T)
        q0, q1 = L.quantized_blocks(m0), L.quantized_blocks(m1)
        # Blocks before `first` are never visible again: neither quantize nor store them.
        first = max(q0, L.first_kept_block(m1))
        start = first * bs
        n_quant = (q1 - first) * bs
        if m1 > m0:
            # Recent tokens [start, m1) in window_dtype: the tail of the float ring, then the chunk.
            # Blocks are always quantized from their window_dtype values, however they arrived.
            seq_k, seq_v = [x[:, :, n_sink + max(start - m0, 0):].to(cfg.window_dtype) for x in (k, v)]
            if start < m0:
                idx = self._float_index(start, m0)
                seq_k = torch.cat((self.float_k[:, :, idx], seq_k), dim=2)
                seq_v = torch.cat((self.float_v[:, :, idx], seq_v), dim=2)
        if n_quant > 0:  # quantize first: a failure must leave the cache untouched
            B, H, _, D = seq_k.shape
            blocks = (B, H, q1 - first, bs, D)
            key = self.quantizer.quantize_key_blocks(seq_k[:, :, :n_quant].reshape(blocks), cfg.bits,
                                                     cfg.scale_dtype)
            value = self.quantizer.quantize_values(seq_v[:, :, :n_quant].reshape(blocks), cfg.bits,
                                                   cfg.value_group_size, cfg.scale_dtype)
        # --- what the shorter stream still reads and this call overwrites: saved for undo() ---
        saved = []
        if n_quant > 0 and q0 > L.first_kept_block(m0):  # live quantized blocks may share the slots
            slots = torch.arange(first, q1, device=k.device) % L.quant_slots
            saved += [(name, slots, getattr(self, name).index_select(2, slots)) for name in _QUANT_TENSORS]
        F = self.float_k.shape[2]
        if m1 > m0 and m1 - F > q0 * bs:  # new float rows land on rows holding live float tokens
            idx = self._float_index(max(q1 * bs, m0), m1)
            saved += [(name, idx, getattr(self, name).index_select(2, idx)) for name in ("float_k", "float_v")]
        self._undo = (n0, saved)
        # --- commit ---
        if n_sink:
            self.sink_k[:, :, n0:n0 + n_sink] = k[:, :, :n_sink].to(cfg.sink_dtype)
            self.sink_v[:, :, n0:n0 + n_sink] = v[:, :, :n_sink].to(cfg.sink_dtype)
        if n_quant > 0:
            slots = torch.arange(first, q1, device=k.device) % L.quant_slots
            for name, src in zip(_QUANT_TENSORS, key + value):
                getattr(self, name).index_copy_(2, slots, src)
        if m1 > m0 and m1 > q1 * bs:
            idx = self._float_index(q1 * bs, m1)
            self.float_k.index_copy_(2, idx, seq_k[:, :, n_quant:])
            self.float_v.index_copy_(2, idx, seq_v[:, :, n_quant:])
        self.seq_len = n0 + T

    def undo(self) -> None:
        """Return to the state before the last ``append`` (tokens past the old length are masked by
        their positions; what the old stream reads and the append overwrote is restored)."""
        if self._undo is None:
            raise RuntimeError("nothing to undo")
        n0, saved = self._undo
        for name, idx, old in saved:
            getattr(self, name).index_copy_(2, idx, old)
        self.seq_len, self._undo = n0, None

    @property
    def undo_length(self) -> int | None:
        """The length ``undo()`` returns to, or None."""
        return None if self._undo is None else self._undo[0]

    def crop(self, tokens: int) -> None:
        """Forget the newest ``tokens`` tokens (see ``check_crop``)."""
        self.check_crop(tokens)
        self.seq_len -= tokens
        self._undo = None

    def check_crop(self, tokens: int) -> None:
        """Raise unless the newest ``tokens`` can be forgotten: the shorter stream's storage must be
        intact (no block it needs was evicted, none it would hold unquantized was quantized)."""
        L, n = self.layout, self.seq_len
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= n:
            raise ValueError(f"tokens to crop must be an int in [0, {n}], got {tokens!r}")
        m, m_new = L.recent_count(n), L.recent_count(n - tokens)
        if L.quantized_blocks(m_new) != L.quantized_blocks(m):
            raise ValueError(f"cannot crop {tokens} tokens: a block they share with older tokens was already "
                             f"quantized (block_size={self.config.block_size}, residual_tokens={L.residual_tokens})")
        if m > L.recent_tokens and L.first_kept_block(m_new) != L.first_kept_block(m):
            raise ValueError(f"cannot crop {tokens} tokens: the shorter stream would see tokens that were already "
                             f"evicted from the window (recent_tokens={L.recent_tokens})")

    def map_batch(self, fn) -> None:
        """Apply ``fn`` (e.g. an index_select along dim 0) to every storage tensor."""
        for name, t in self.tensors().items():
            setattr(self, name, fn(t).contiguous())
        self._undo = None

    def seq_lens(self) -> Tensor:
        """``[B]`` int64: every sequence of this layer holds ``seq_len`` tokens."""
        return torch.full((self.sink_k.shape[0],), self.seq_len, device=self.sink_k.device)

    def _float_index(self, r0: int, r1: int) -> Tensor:
        """Float-ring rows of recent tokens r0 .. r1-1."""
        return torch.arange(r0, r1, device=self.float_k.device) % self.float_k.shape[2]

    # --- reading ------------------------------------------------------------------------------
    def gather(self, dtype: torch.dtype, seq_lens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Every stored token, dequantized: k, v ``[B, Hkv, N, D]`` in ``dtype`` and their positions
        ``[B, N]`` for sequences of lengths ``seq_lens [B]`` (default: all ``seq_len``)."""
        cfg = self.config
        seq_lens = self.seq_lens() if seq_lens is None else seq_lens
        sink_pos, quant_pos, float_pos = self.layout.slot_positions(seq_lens)
        ks, vs = [self.sink_k.to(dtype)], [self.sink_v.to(dtype)]
        if quant_pos.shape[1]:
            B, H, nq, bs, _ = self.key_codes.shape
            ks.append(quant.dequantize_key_blocks(self.key_codes, self.key_scale, self.key_zero, cfg.bits)
                      .reshape(B, H, nq * bs, -1).to(dtype))
            vs.append(quant.dequantize_values(self.value_codes, self.value_scale, self.value_zero, cfg.bits,
                                              cfg.value_group_size).reshape(B, H, nq * bs, -1).to(dtype))
        ks.append(self.float_k.to(dtype))
        vs.append(self.float_v.to(dtype))
        return torch.cat(ks, dim=2), torch.cat(vs, dim=2), torch.cat((sink_pos, quant_pos, float_pos), dim=1)


class SinkQuantCache:
    """A multi-layer KV cache with bf16 sinks and a quantized recent window.

    ``SinkQuantCache(config, num_layers, batch_size, num_kv_heads, head_dim, device, dtype,
    rotary=None, backend="auto")``

    dtype is the dtype of the K/V (and queries) the model passes in. With
    ``config.positions == "cache_index"`` pass ``rotary`` (a fixed ``Rotary`` schedule) and
    give pre-RoPE queries and keys: the cache rotates them by their index in the cache.
    backend: "torch" (the PyTorch reference), "triton" (block quantization and decode
    attention in Triton kernels: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1),
    or "auto" (Triton on CUDA when it is installed, else torch). Prefill chunks (T > 1)
    always attend with the PyTorch path.
    """

    def __init__(self, config: CacheConfig, num_layers: int, batch_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 rotary: Rotary | None = None, backend: str = "auto"):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        config.check_head_dim(head_dim)
        if dtype not in _MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, _MODEL_DTYPES))} (the K/V dtype), got {dtype!r}")
        if config.positions == "cache_index":
            if not isinstance(rotary, Rotary):
                raise ValueError("positions='cache_index' needs rotary=Rotary(...) (the model's fixed RoPE schedule) "
                                 f"and pre-RoPE queries/keys, got rotary={rotary!r}")
            if rotary.head_dim != head_dim:
                raise ValueError(f"rotary covers head_dim={rotary.head_dim}, the cache has head_dim={head_dim}")
        elif rotary is not None:
            raise ValueError("rotary is only used with positions='cache_index'; with 'absolute' pass "
                             "keys already rotated at their true positions and rotary=None")
        self.config = config
        self.layout = WindowLayout.from_config(config)
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.device = torch.empty(0, device=device).device
        self.dtype = dtype
        self.rotary = rotary
        self.backend = _resolve_backend(backend, self.device, head_dim)
        ops = quant
        if self.backend == "triton":
            from . import kernels as ops
        self._ops = ops  # qsinkkv.quant, or qsinkkv.kernels on the Triton backend
        self.layers = [LayerCache(config, self.layout, batch_size, num_kv_heads, head_dim, self.device, ops)
                       for _ in range(num_layers)]

    # --- the small interface ----------------------------------------------------------------
    @property
    def seq_length(self) -> int:
        """Tokens seen by layer 0."""
        return self.layers[0].seq_len

    def get_seq_length(self, layer: int = 0) -> int:
        self._check_layer(layer)
        return self.layers[layer].seq_len

    def nbytes(self) -> int:
        """Bytes held by all layers: codes, scales, zeros, sinks and unquantized blocks."""
        return sum(layer.nbytes() for layer in self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def undo(self) -> None:
        """Return to the state before the last ``append`` (tokens past the old length are masked by
        their positions; what the old stream reads and the append overwrote is restored)."""
        if self._undo is None:
            raise RuntimeError("nothing to undo")
        n0, saved = self._undo
        for name, idx, old in saved:
            getattr(self, name).index_copy_(2, idx, old)
        self.seq_len, self._undo = n0, None

    @property
    def undo_length(self) -> int | None:
        """The length ``undo()`` returns to, or None."""
        return None if self._undo is None else self._undo[0]

    def crop(self, tokens: int) -> None:
        """Forget the newest ``tokens`` tokens of every layer (refused, with nothing changed, when it
        would need tokens that were evicted or blocks that were quantized)."""
        for layer in self.layers:  # check all before changing any
            layer.check_crop(tokens)
        for layer in self.layers:
            layer.crop(tokens)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens of every layer (layers holding fewer are left as they are):
        transformers' ``crop(max_length)``. Refused, with nothing changed, under the same rule as crop."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"length must be an int >= 0, got {length!r}")
        cut = [max(layer.seq_len - length, 0) for layer in self.layers]
        for layer, tokens in zip(self.layers, cut):  # check all before changing any
            layer.check_crop(tokens)
        for layer, tokens in zip(self.layers, cut):
            layer.crop(tokens)

    def select_batch(self, index) -> None:
        """Keep (or reorder, or repeat) sequences: storage ``[B, ...] -> [len(index), ...]``.

        index: a non-empty 1-D int tensor (or list) of rows in ``[0, B)``, or a bool mask of length B."""
        index = self._batch_index(index)
        for layer in self.layers:
            layer.map_batch(lambda t: t.index_select(0, index))
        self.batch_size = len(index)

    def append(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Store new tokens ``k, v [B, Hkv, T, D]`` of ``layer`` (any T >= 1)."""
        self._check_layer(layer)
        n0 = self.layers[layer].seq_len
        try:
            self._check_kv(layer, k, v)
            self.layers[layer].append(k, v)
        except BaseException as e:
            self._roll_back_step(layer, n0, e)
            raise

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
               sink_logits: Tensor | None = None) -> Tensor:
        """Store the new tokens' ``k, v [B, Hkv, T, D]`` and return the attention output of their
        queries ``q [B, H, T, D]`` (``H`` a multiple of ``Hkv``): ``[B, H, T, D]`` in q's dtype.

        scale defaults to ``D ** -0.5``; sink_logits ``[H]`` are optional learned per-head sink
        logits (gpt-oss) adding ``exp(s_h)`` to the softmax denominator.
        """
        self._check_layer(layer)
        n0 = self.layers[layer].seq_len
        try:
            self._check_kv(layer, k, v, q=q, scale=scale, sink_logits=sink_logits)
            return self._attend(self.layers[layer], q, k, v, scale, sink_logits)
        except BaseException as e:
            self._roll_back_step(layer, n0, e)
            raise

    def _attend(self, cache: LayerCache, q: Tensor, k: Tensor, v: Tensor, scale, sink_logits) -> Tensor:
        cfg, n0, T = self.config, cache.seq_len, k.shape[2]
        if T == 1:  # decode: store, then attend over exactly what is stored
            cache.append(k, v)
            if self.backend == "triton":  # fused kernel over the quantized storage
                out = self._ops.decode_attention(q[:, :, 0], cache, scale=scale, rotary=self.rotary,
                                                 sink_logits=sink_logits)
            elif self.rotary is None:  # from the codes: the dequantization folds into the products
                out = decode_attention_torch(q[:, :, 0], cache, scale=scale, sink_logits=sink_logits)
            else:  # cache_index: dequantize, rotate by cache index, attend
                out = decode_attention_reference(q[:, :, 0], cache, scale=scale, rotary=self.rotary,
                                                 sink_logits=sink_logits)
            return out.unsqueeze(2)
        # prefill: what was stored before + this chunk in full precision; the chunk is stored after
        keys, values, k_pos = cache.gather(k.dtype)
        keys, values = torch.cat((keys, k), dim=2), torch.cat((values, v), dim=2)
        k_pos = torch.cat((k_pos, torch.arange(n0, n0 + T, device=k.device).expand(len(k_pos), T)), dim=1)
        out = sink_window_attention(q, keys, values, torch.arange(n0, n0 + T, device=q.device), k_pos,
                                    sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens, scale=scale,
                                    rotary=self.rotary, sink_logits=sink_logits)
        cache.append(k, v)
        return out

    def _roll_back_step(self, layer: int, n0: int, error: BaseException) -> None:
        """A call on ``layer`` (which held ``n0`` tokens) failed: undo that layer's own store, if it
        happened, and the same step on every layer that already took it (a model's forward runs the
        layers in order, so a refusal in layer 5 finds layers 0-4 one step ahead). Layers that are
        ahead by anything but their last append cannot be restored; the error then says so."""
        stuck = []
        for i, other in enumerate(self.layers):
            if other.seq_len == n0:
                continue
            if other.undo_length == n0:
                other.undo()
            elif other.seq_len > n0 or i == layer:
                stuck.append(i)
        if stuck:
            error.add_note(f"qsinkkv: layers {stuck} could not be rolled back to {n0} tokens; the cache's layers "
                           f"hold {self.layer_lengths()} tokens: crop or reset() it before the next step")

    def layer_lengths(self) -> list[int]:
        """Tokens held by every layer (all equal between model steps)."""
        return [layer.seq_len for layer in self.layers]

    def visible_positions(self, layer: int = 0) -> list[int]:
        """Logical positions a query at the newest position of ``layer`` sees, read from storage."""
        self._check_layer(layer)
        cache = self.layers[layer]
        n = torch.tensor([cache.seq_len], device=self.device)
        pos = torch.cat(self.layout.slot_positions(n), dim=1)[0]
        seen = visible_mask(n - 1, pos, self.config.sink_tokens, self.config.recent_tokens)[0]
        return sorted(pos[seen].tolist())

    # --- validation: everything is checked before any state changes ------------------------
    def _check_layer(self, layer) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _check_tensor(self, name: str, x, shape: str) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dims {shape}, got shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name}.dtype must be the cache dtype {self.dtype}, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"{name}.device must be the cache device {self.device}, got {x.device}")

    def _check_kv(self, layer, k, v, *, q=None, scale=None, sink_logits=None) -> None:
        """Shapes, dtypes, devices, then one device sync for every value check: K/V finite in the dtype
        they will be stored in, and for ``attend`` q finite and sink_logits free of NaN and +inf."""
        B, H, D = self.batch_size, self.num_kv_heads, self.head_dim
        shape = f"[B={B}, Hkv={H}, T, D={D}]"
        for name, x in (("k", k), ("v", v)):
            self._check_tensor(name, x, shape)
            if x.shape[0] != B or x.shape[1] != H or x.shape[3] != D or x.shape[2] < 1:
                raise ValueError(f"{name} must have shape {shape} with T >= 1, got {tuple(x.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        checks = {"k": self._storable(layer, k), "v": self._storable(layer, v)}
        if q is not None:
            self._check_q(q, k, scale, sink_logits)
            checks["q"] = torch.isfinite(q).all()
            if sink_logits is not None:
                checks["sink_logits"] = ~(torch.isnan(sink_logits) | (sink_logits == float("inf"))).any()
        if not bool(torch.stack(list(checks.values())).all()):
            name = next(n for n, ok in checks.items() if not bool(ok))
            if name in ("k", "v"):
                raise ValueError(f"{name} contains NaN or Inf, or values that overflow the storage dtype "
                                 f"(sink_dtype={self.config.sink_dtype}, window_dtype={self.config.window_dtype}); "
                                 "refusing to store it (it would poison a whole block's scales)")
            if name == "q":
                raise ValueError("q contains NaN or Inf")
            raise ValueError("sink_logits must be free of NaN and +inf (-inf means no sink for that head)")

    def _storable(self, layer: int, x: Tensor) -> Tensor:
        """0-dim bool: ``x`` stays finite once cast to the dtypes it is stored in (the first tokens
        go to the sinks in ``sink_dtype``, the rest to the window in ``window_dtype``)."""
        n_sink = min(max(self.config.sink_tokens - self.layers[layer].seq_len, 0), x.shape[2])
        parts = ((x[:, :, :n_sink], self.config.sink_dtype), (x[:, :, n_sink:], self.config.window_dtype))
        ok = [torch.isfinite(part.to(dtype) if _narrower(dtype, x.dtype) else part).all()
              for part, dtype in parts if part.shape[2]]
        return ok[0] if len(ok) == 1 else ok[0] & ok[1]

    def _check_q(self, q, k: Tensor, scale, sink_logits) -> None:
        B, T, D = self.batch_size, k.shape[2], self.head_dim
        shape = f"[B={B}, H, T={T}, D={D}] with H a positive multiple of Hkv={self.num_kv_heads}"
        self._check_tensor("q", q, shape)
        if (q.shape[0] != B or q.shape[2] != T or q.shape[3] != D or q.shape[1] % self.num_kv_heads
                or q.shape[1] == 0):
            raise ValueError(f"q must have shape {shape}, got {tuple(q.shape)}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"scale must be a finite float > 0 (or None for D ** -0.5), got {scale!r}")
        if sink_logits is not None:
            H = q.shape[1]
            if not isinstance(sink_logits, Tensor) or sink_logits.shape != (H,) \
                    or not sink_logits.is_floating_point():
                raise ValueError(f"sink_logits must be a float tensor of shape [H={H}], got "
                                 f"{getattr(sink_logits, 'dtype', type(sink_logits).__name__)} "
                                 f"{tuple(getattr(sink_logits, 'shape', ()))}")
            if sink_logits.device != self.device:
                raise ValueError(f"sink_logits.device must be the cache device {self.device}, got "
                                 f"{sink_logits.device}")

    def _batch_index(self, index) -> Tensor:
        B = self.batch_size
        expected = f"a non-empty 1-D int tensor of rows in [0, {B}) or a bool mask of length {B}"
        try:
            index = torch.as_tensor(index, device=self.device)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"index must be {expected}, got {index!r}") from None
        if index.numel() == 0:  # (an empty list is read as float32)
            raise ValueError(f"index selects no sequence; it must be {expected}")
        if index.dtype == torch.bool:
            if index.shape != (B,):
                raise ValueError(f"a bool index must be a mask of length {B}, got shape {tuple(index.shape)}")
            index = index.nonzero().flatten()
        elif index.is_floating_point() or index.is_complex() or index.ndim != 1:
            raise ValueError(f"index must be {expected}, got {index.dtype} of shape {tuple(index.shape)}")
        if index.numel() == 0:
            raise ValueError(f"the mask selects no sequence; index must be {expected}")
        index = index.long()
        if bool(((index < 0) | (index >= B)).any()):
            raise ValueError(f"index must be {expected}, got rows {index.tolist()}")
        return index


def _narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Can a finite ``than`` value overflow to inf in ``dtype``?"""
    return torch.finfo(dtype).max < torch.finfo(than).max


def _resolve_backend(backend: str, device: torch.device, head_dim: int) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    try:
        import triton  # noqa: F401
        has_triton = True
    except ImportError:
        has_triton = False
    if backend == "auto":
        return "triton" if device.type == "cuda" and has_triton and head_dim % 4 == 0 else "torch"
    if backend == "triton":
        if not has_triton:
            raise ValueError("backend='triton' needs the triton package: pip install 'qsinkkv[triton]'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors (device={device}), or TRITON_INTERPRET=1 "
                             "set before import to run the kernels in Triton's interpreter")
        if head_dim % 4:
            raise ValueError(f"backend='triton' needs head_dim % 4 == 0, got head_dim={head_dim}")
    return backend
