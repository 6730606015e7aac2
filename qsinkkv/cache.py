"""SinkQuantCache: bf16 attention sinks + an int8/int4 quantized recent window, per layer and
per sequence.

The cache owns one ``LayerStorage`` per layer (``storage.py``: the tensors, and a length per
sequence) and the ops chosen once at construction (``ops.py``). It checks every input before
an op runs, so a refused call changes nothing, and it keeps the layers of a model step in step:
a call refused in one layer rolls the step back on the layers that already took it.

Decode (one new token per sequence): the token is stored, then its query attends over the
storage. Prefill (a chunk of T > 1): each query attends over what the cache held before the
chunk plus the chunk's own full-precision K/V under the exact sink + window mask; then the chunk
is stored. A chunk may be ragged: row b holds ``lengths[b]`` new tokens, the rest is padding
(never stored, never seen, output zero).
"""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from . import write
from .checks import host_ints
from .config import CacheConfig
from .layout import WindowLayout, visible_mask
from .ops import select_ops
from .rope import Rotary
from .storage import LayerStorage

# float8 model dtypes have no isfinite (and no way to refuse a NaN): not accepted
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class SinkQuantCache:
    """A multi-layer KV cache with bf16 sinks and a quantized recent window.

    ``SinkQuantCache(config, num_layers, batch_size, num_kv_heads, head_dim, device, dtype,
    rotary=None, backend="auto")``

    dtype is the dtype of the K/V (and queries) the model passes in. With
    ``config.positions == "cache_index"`` pass ``rotary`` (a fixed ``Rotary`` schedule) and
    give pre-RoPE queries and keys: the cache rotates them by their index in the cache.
    backend: "torch" (PyTorch ops), "c" (decode attention in C on the CPU, ``decode_c.py``),
    "triton" (block quantization, decode and prefill attention in Triton kernels: CUDA tensors,
    or CPU tensors under TRITON_INTERPRET=1), or "auto" (Triton on CUDA when it is installed, C
    on the CPU where it applies and compiles, else torch); ``ops.select_ops`` says where each
    applies. decode_variant: how the Triton decode kernel reads quantized blocks ("dequantize", "folded",
    "fp16": ``ops.DECODE_VARIANTS``); the other backends take only the default.
    """

    def __init__(self, config: CacheConfig, num_layers: int, batch_size: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 rotary: Rotary | None = None, backend: str = "auto", decode_variant: str = "dequantize"):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        config.check_head_dim(head_dim)
        if dtype not in _MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(str, _MODEL_DTYPES))} (the K/V dtype), "
                             f"got {dtype!r}")
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
        self.layout = WindowLayout(config)
        self.device = torch.empty(0, device=device).device
        self.dtype = dtype
        self.rotary = rotary
        self.ops = select_ops(backend, self.device, head_dim, rotary, decode_variant)
        self.layers = self._allocate(num_layers, batch_size, num_kv_heads, head_dim)
        self._undo: list[write.Undo | None] = [None] * num_layers  # each layer's last append

    def _allocate(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int) -> list[LayerStorage]:
        """One dense storage per layer: each sequence owns its blocks from the start."""
        return [LayerStorage.allocate(self.layout, batch_size, num_kv_heads, head_dim, self.device)
                for _ in range(num_layers)]

    def _reserve(self, layer: int, lens: list[int]) -> None:
        """Blocks for ``lens`` more tokens per sequence of ``layer``, before any is stored (a dense cache
        has them all)."""

    def _release_unneeded(self) -> None:
        """Give back blocks the current lengths no longer need (a dense cache keeps them all)."""

    # --- sizes (read from the storage: one holder each) -------------------------------------
    @property
    def backend(self) -> str:
        return self.ops.backend

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    # --- lengths ----------------------------------------------------------------------------
    def seq_lens(self, layer: int = 0) -> Tensor:
        """``[B]`` int64 (host): tokens stored per sequence in ``layer``."""
        self._check_layer(layer)
        return self.layers[layer].seq_lens.clone()

    def get_seq_length(self, layer: int = 0) -> int:
        """Tokens of the longest sequence in ``layer``."""
        self._check_layer(layer)
        return int(self.layers[layer].seq_lens.max())

    @property
    def seq_length(self) -> int:
        """Tokens of the longest sequence in layer 0."""
        return self.get_seq_length(0)

    def layer_lengths(self) -> list[int]:
        """The longest sequence of every layer (all equal between model steps)."""
        return [int(layer.seq_lens.max()) for layer in self.layers]

    def in_step(self) -> bool:
        """Do all layers hold the same length for every sequence (no model step half done)?"""
        first = self.layers[0].seq_lens
        return all(torch.equal(layer.seq_lens, first) for layer in self.layers[1:])

    def nbytes(self) -> int:
        """Bytes held by all layers: codes, scales, zeros, sinks and unquantized blocks."""
        return sum(layer.nbytes() for layer in self.layers)

    # --- changing what is held ----------------------------------------------------------------
    def reset(self, seqs=None) -> None:
        """Empty every sequence, or only the rows ``seqs`` (a list, int tensor or bool mask of rows)."""
        rows = None if seqs is None else self._batch_index(seqs, allow_repeats=False)
        for i, layer in enumerate(self.layers):
            layer.clear(torch.arange(self.batch_size, device=self.device) if rows is None else rows)
            self._undo[i] = None
        self._release_unneeded()

    def crop(self, tokens) -> None:
        """Forget the newest ``tokens`` (an int, or ``[B]`` per sequence) of every layer; refused, with
        nothing changed, when a shorter stream would need evicted tokens or blocks already quantized."""
        cut = self._per_sequence("tokens", tokens)
        self._crop([cut] * self.num_layers)

    def crop_to(self, lengths) -> None:
        """Bring every layer to ``lengths`` (an int, or ``[B]`` per sequence) by forgetting its newest
        tokens; this also brings layers left out of step by an interrupted forward back to one
        length. Refused, with nothing changed, as crop, or when a layer holds fewer tokens."""
        target = self._per_sequence("lengths", lengths)
        cuts = [[n - t for n, t in zip(layer.seq_lens.tolist(), target)] for layer in self.layers]
        for i, cut in enumerate(cuts):
            if min(cut) < 0:
                raise ValueError(f"layer {i} holds {self.layers[i].seq_lens.tolist()} tokens, fewer than {target}")
        self._crop(cuts)

    def _crop(self, cuts: list[list[int]]) -> None:
        for layer, cut in zip(self.layers, cuts):  # check all before changing any
            why = write.crop_refusal(layer, cut)
            if why:
                raise ValueError(why)
        for i, (layer, cut) in enumerate(zip(self.layers, cuts)):
            layer.seq_lens -= torch.tensor(cut, dtype=torch.int64)
            self._undo[i] = None
        self._release_unneeded()

    def select_batch(self, index) -> None:
        """Keep (or reorder, or repeat) sequences: storage ``[B, ...] -> [len(index), ...]``.

        index: a non-empty 1-D int tensor (or list) of rows in ``[0, B)``, or a bool mask of length B."""
        index = self._batch_index(index)
        for i, layer in enumerate(self.layers):
            layer.select(index)
            self._undo[i] = None

    # --- storing and attending ----------------------------------------------------------------
    def append(self, layer: int, k: Tensor, v: Tensor, lengths=None) -> None:
        """Store new tokens ``k, v [B, Hkv, T, D]`` of ``layer`` (any T >= 1); with ``lengths [B]``
        row b holds ``lengths[b]`` tokens, the rest of the row is padding."""
        self._check_layer(layer)
        before = self.layers[layer].seq_lens.clone()
        try:
            lens = self._check_kv(layer, k, v, lengths)
            self._reserve(layer, lens)
            self._undo[layer] = write.append(self.layers[layer], k, v, lens, self.ops.quantizer)
        except BaseException as e:
            self._roll_back_step(layer, before, e)
            raise

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, lengths=None, *, scale: float | None = None,
               sink_logits: Tensor | None = None) -> Tensor:
        """Store the new tokens' ``k, v [B, Hkv, T, D]`` and return the attention output of their
        queries ``q [B, H, T, D]`` (``H`` a multiple of ``Hkv``): ``[B, H, T, D]`` in q's dtype.

        lengths: optional ``[B]``: row b holds ``lengths[b]`` new tokens, the rest of the row is
        padding (not stored, output zero). scale defaults to ``D ** -0.5``; sink_logits ``[H]`` are
        optional learned per-head sink logits (gpt-oss) adding ``exp(s_h)`` to the softmax denominator.
        """
        self._check_layer(layer)
        before = self.layers[layer].seq_lens.clone()
        try:
            lens = self._check_kv(layer, k, v, lengths, q=q, scale=scale, sink_logits=sink_logits)
            self._reserve(layer, lens)
            return self._attend(layer, q, k, v, lens, scale, sink_logits)
        except BaseException as e:
            self._roll_back_step(layer, before, e)
            raise

    def _attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, lens: list[int], scale, sink_logits) -> Tensor:
        storage, T = self.layers[layer], k.shape[2]
        if T == 1:  # decode: store, then attend over exactly what is stored
            self._undo[layer] = write.append(storage, k, v, lens, self.ops.quantizer)
            out = self.ops.decode(q[:, :, 0], storage, scale=scale, sink_logits=sink_logits).unsqueeze(2)
            if 0 in lens:  # a row with no new token has no query
                out = out.masked_fill(torch.tensor(lens, device=out.device).view(-1, 1, 1, 1) == 0, 0)
            return out
        # prefill: what was stored before + this chunk in full precision; the chunk is stored after. Only the
        # rows with more than one new token prefill (over their own longest chunk); a row with one decodes, as
        # it would alone, over what is stored: a step's cost follows the tokens it carries, not B x T.
        multi = [b for b, t in enumerate(lens) if t > 1]
        single = [b for b, t in enumerate(lens) if t == 1]
        if len(multi) == len(lens):
            out = self.ops.prefill(q, k, v, storage, torch.tensor(lens), scale=scale, sink_logits=sink_logits)
        else:
            out = q.new_zeros(q.shape)
        if multi and len(multi) < len(lens):
            rows, T_multi = torch.tensor(multi), max(lens[b] for b in multi)
            chunk = [_take_rows(x[:, :, :T_multi], rows) for x in (q, k, v)]
            part = self.ops.prefill(*chunk, storage.select_rows(multi), torch.tensor([lens[b] for b in multi]),
                                    scale=scale, sink_logits=sink_logits)
            out[rows.to(out.device), :, :T_multi] = part
        self._undo[layer] = write.append(storage, k, v, lens, self.ops.quantizer)
        if single:
            rows = torch.tensor(single)
            part = self.ops.decode(_take_rows(q[:, :, 0], rows), storage.select_rows(single), scale=scale,
                                   sink_logits=sink_logits)
            out[rows.to(out.device), :, 0] = part
        return out

    def _roll_back_step(self, layer: int, before: Tensor, error: BaseException) -> None:
        """A call on ``layer`` (whose lengths were ``before``) failed: undo that layer's own store, if
        it happened, and the same step on every layer that already took it (a model's forward runs the
        layers in order, so a refusal in layer 5 finds layers 0-4 one step ahead). Layers that are
        ahead by anything but their last append cannot be restored; the error then says so."""
        stuck = []
        for i, storage in enumerate(self.layers):
            if torch.equal(storage.seq_lens, before):
                continue
            undo = self._undo[i]
            if undo is not None and torch.equal(undo.seq_lens, before):
                write.undo(storage, undo)
                self._undo[i] = None
            elif i == layer or bool((storage.seq_lens > before).any()):
                stuck.append(i)
        self._release_unneeded()
        if stuck:
            error.add_note(f"qsinkkv: layers {stuck} could not be rolled back to the refused step's lengths; the "
                           f"cache's layers hold {self.layer_lengths()} tokens (longest sequence): crop or reset() "
                           "it before the next step")

    def visible_positions(self, layer: int = 0, seq: int = 0) -> list[int]:
        """Logical positions a query at the newest position of sequence ``seq`` sees, read from storage."""
        self._check_layer(layer)
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < self.batch_size:
            raise IndexError(f"seq must be an int in [0, {self.batch_size}), got {seq!r}")
        n = self.layers[layer].seq_lens[seq:seq + 1]
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

    def _check_kv(self, layer, k, v, lengths, *, q=None, scale=None, sink_logits=None) -> list[int]:
        """Shapes, dtypes, devices, lengths; then one device sync for every value check: the stored
        K/V finite in the dtype they will be stored in, and for ``attend`` q finite and sink_logits
        free of NaN and +inf. Returns the new tokens per row."""
        B, H, D = self.batch_size, self.num_kv_heads, self.head_dim
        if not B:
            raise ValueError("the cache holds no sequence: admit() one first")
        shape = f"[B={B}, Hkv={H}, T, D={D}]"
        for name, x in (("k", k), ("v", v)):
            self._check_tensor(name, x, shape)
            if x.shape[0] != B or x.shape[1] != H or x.shape[3] != D or x.shape[2] < 1:
                raise ValueError(f"{name} must have shape {shape} with T >= 1, got {tuple(x.shape)}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        T = k.shape[2]
        lens = [T] * B if lengths is None else self._lengths(lengths, T)
        if q is not None:
            self._check_q(q, k, scale, sink_logits)
        real = None if lengths is None else torch.arange(T) < torch.tensor(lens).unsqueeze(1)  # [B, T] host
        if real is None and int(self.layers[layer].seq_lens.min()) >= self.config.sink_tokens:
            checks = self._peaks_fit(k, v, q, sink_logits)  # the common case, every token to the window
        else:
            # only the columns that hold real tokens: rows of one token read one column, the others up to
            # their longest (a padded mixed step must not cost B x T)
            parts = [(None, T)] if real is None else _row_groups(lens)
            ok = {"k": [], "v": [], "q": []}
            for rows, t in parts:
                pick = (lambda x: x[:, :, :t]) if rows is None else (
                    lambda x: _take_rows(x[:, :, :t], rows))
                where = None if real is None else real[slice(None) if rows is None else rows, :t]
                ok["k"].append(self._storable(layer, pick(k), where, rows))
                ok["v"].append(self._storable(layer, pick(v), where, rows))
                if q is not None:
                    ok["q"].append(_all_finite(pick(q), where))
            yes = torch.ones((), dtype=torch.bool, device=k.device)
            checks = {name: torch.stack(x).all() if x else yes for name, x in ok.items()
                      if name != "q" or q is not None}
            if q is not None:
                if sink_logits is not None:
                    checks["sink_logits"] = ~(torch.isnan(sink_logits) | (sink_logits == float("inf"))).any()
            checks = dict(zip(checks, torch.stack(list(checks.values())).tolist()))
        if not all(checks.values()):
            name = next(n for n, ok in checks.items() if not ok)
            if name in ("k", "v"):
                raise ValueError(f"{name} contains NaN or Inf, or values that overflow the storage dtype "
                                 f"(sink_dtype={self.config.sink_dtype}, window_dtype={self.config.window_dtype}); "
                                 "refusing to store it (it would poison a whole block's scales)")
            if name == "q":
                raise ValueError("q contains NaN or Inf")
            raise ValueError("sink_logits must be free of NaN and +inf (-inf means no sink for that head)")
        return lens

    def _lengths(self, lengths, T: int) -> list[int]:
        B = self.batch_size
        expected = f"a 1-D int tensor (or list) of B={B} counts in [0, T={T}]"
        t = host_ints("lengths", lengths, expected)
        if t.shape != (B,):
            raise ValueError(f"lengths must be {expected}, got shape {tuple(t.shape)}")
        lens = t.tolist()
        if min(lens) < 0 or max(lens) > T:
            raise ValueError(f"lengths must be {expected}, got {lens}")
        return lens

    def _peaks_fit(self, k: Tensor, v: Tensor, q: Tensor | None, sink_logits: Tensor | None) -> dict[str, bool]:
        """Every token goes to the window: one reduction per tensor and one sync. |x| below the
        window dtype's overflow bound means finite once stored (NaN fails every comparison)."""
        window = _overflow_bound(self.config.window_dtype, k.dtype)
        named = {"k": (k, window), "v": (v, window)}
        if q is not None:
            named["q"] = (q, math.inf)
        # max |x| is one of x's own values: exact in x's dtype (q, k, v share the cache dtype)
        peaks = torch.stack([torch.linalg.vector_norm(x, float("inf")) for x, _ in named.values()]).tolist()
        ok = {name: p < bound for (name, (_, bound)), p in zip(named.items(), peaks)}
        if sink_logits is not None:  # -inf is allowed, NaN and +inf are not
            ok["sink_logits"] = torch.amax(sink_logits).item() < math.inf
        return ok

    def _storable(self, layer: int, x: Tensor, real: Tensor | None, rows: Tensor | None = None) -> Tensor:
        """0-dim bool: the tokens of ``x`` (the sequences ``rows``, default all) that will be stored stay finite
        once cast to the dtype they are stored in (a sequence's first S tokens go to its sinks in
        ``sink_dtype``, later ones to the window in ``window_dtype``)."""
        cfg, T = self.config, x.shape[2]
        n0 = self.layers[layer].seq_lens if rows is None else self.layers[layer].seq_lens[rows]
        if real is None and int(n0.min()) >= cfg.sink_tokens:  # the common case: every token goes to the window
            return _all_finite(x.to(cfg.window_dtype) if _narrower(cfg.window_dtype, x.dtype) else x)
        pos = n0.unsqueeze(1) + torch.arange(T)                                              # [B, T] host
        stored = torch.ones_like(pos, dtype=torch.bool) if real is None else real
        ok = []
        for where, dtype in ((stored & (pos < cfg.sink_tokens), cfg.sink_dtype),
                             (stored & (pos >= cfg.sink_tokens), cfg.window_dtype)):
            if bool(where.any()):
                ok.append(_all_finite(x.to(dtype) if _narrower(dtype, x.dtype) else x, where))
        return torch.stack(ok).all() if ok else torch.ones((), dtype=torch.bool, device=x.device)

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

    def _per_sequence(self, name: str, value) -> list[int]:
        """An int for every sequence, or ``[B]`` ints."""
        B = self.batch_size
        expected = f"an int or {B} ints (one per sequence)"
        if isinstance(value, int) and not isinstance(value, bool):
            return [value] * B
        t = host_ints(name, value, expected)
        if t.shape != (B,):
            raise ValueError(f"{name} must be {expected}, got {value!r}")
        return t.tolist()

    def _batch_index(self, index, allow_repeats: bool = True) -> Tensor:
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
        if bool(((index < 0) | (index >= B)).any()) or (not allow_repeats and len(set(index.tolist())) < len(index)):
            raise ValueError(f"index must be {expected}, got rows {index.tolist()}")
        return index


def _take_rows(x: Tensor, rows: Tensor) -> Tensor:
    """``x[rows]``: a view when the rows are one contiguous run (one long row beside the decoders), else a copy."""
    first, n = int(rows[0]), len(rows)
    if rows.tolist() == list(range(first, first + n)):
        return x.narrow(0, first, n)
    return x.index_select(0, rows.to(x.device))


def _row_groups(lens: list[int]) -> list[tuple[Tensor, int]]:
    """The rows of a ragged chunk that hold tokens, as (rows, columns to read): the rows of one token (one
    column) and the longer ones (up to their longest); rows of none are left out."""
    groups = []
    for rows in ([b for b, t in enumerate(lens) if t == 1], [b for b, t in enumerate(lens) if t > 1]):
        if rows:
            groups.append((torch.tensor(rows), max(lens[b] for b in rows)))
    return groups


def _all_finite(x: Tensor, where: Tensor | None = None) -> Tensor:
    """0-dim bool: ``x [B, *, T, D]`` finite (only at the ``[B, T]`` positions ``where``, if given)."""
    if where is None:
        return torch.isfinite(x).all()
    bad = ~torch.isfinite(x).all(dim=-1).all(dim=1)                     # [B, T]
    return ~(bad & where.to(x.device)).any()


def _overflow_bound(dtype: torch.dtype, source: torch.dtype) -> float:
    """|x| of a ``source`` value at or above this is inf once cast to ``dtype``: its max plus half an
    ulp (round to nearest even: the max has an odd mantissa, so the halfway point rounds up)."""
    if not _narrower(dtype, source):
        return math.inf
    fi = torch.finfo(dtype)
    return fi.max + fi.eps * 2.0 ** math.floor(math.log2(fi.max)) / 2


def _narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Can a finite ``than`` value overflow to inf in ``dtype``?"""
    return torch.finfo(dtype).max < torch.finfo(than).max
