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
from dataclasses import dataclass

import torch
from torch import Tensor

from . import checks, write
from .blocks import DenseBlocks, PagedBlocks
from .checks import host_ints
from .config import CacheConfig
from .layout import WindowLayout, visible_mask
from .ops import select_ops
from .rope import Rotary

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
                 rotary: Rotary | None = None, backend: str = "auto", decode_variant: str = "dequantize", *,
                 blocks: DenseBlocks | PagedBlocks | None = None):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads)):
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
        layout = WindowLayout(config)
        if blocks is None:
            blocks = DenseBlocks(layout, batch_size)
        elif not isinstance(blocks, (DenseBlocks, PagedBlocks)):
            raise TypeError(f"blocks must be a qsinkkv.blocks.DenseBlocks or PagedBlocks, got {type(blocks).__name__}")
        elif blocks.layout.config != config or batch_size != blocks.batch_size:
            raise ValueError(f"blocks must be built for this config with batch_size={batch_size} sequences, got one "
                             f"for {blocks.layout.config} holding {blocks.batch_size}")
        self.config = config
        self.layout = layout
        self.device = torch.empty(0, device=device).device
        self.dtype = dtype
        self.rotary = rotary
        self.ops = select_ops(backend, self.device, head_dim, rotary, decode_variant)
        self.blocks = blocks  # which blocks each sequence holds: the tables of every layer (blocks.py)
        self.layers = [blocks.allocate(num_kv_heads, head_dim, self.device) for _ in range(num_layers)]
        if blocks.grows:
            self._push_tables()
        self._undo: list[write.Undo | None] = [None] * num_layers  # each layer's last append

    # --- blocks (the manager decides; every layer reads the same tables) ------------------------
    def _reserve(self, layer: int, lens: list[int]) -> None:
        """Before ``layer`` stores ``lens`` more tokens per sequence: hold exactly the blocks the step needs
        (what ``layer`` holds after it, or what a layer that already took the step holds), all or none.
        Blocks an earlier ``reserve`` took for more tokens than the step brings go back (they hold nothing
        yet), so a reservation lasts until the next step and never starves others."""
        if not self.blocks.grows:
            return
        after = [max(longest, n + t) for longest, n, t in
                 zip(self._longest(), self.layers[layer].seq_lens.tolist(), lens)]
        if self.blocks.hold(after):
            self._push_tables()

    def _release_unneeded(self) -> None:
        """Give back blocks the current lengths no longer need."""
        if self.blocks.grows and self.blocks.hold(self._longest()):
            self._push_tables()

    def _longest(self) -> list[int]:
        """Per sequence, the most tokens any layer holds (layers differ only inside a step)."""
        return torch.stack([layer.seq_lens for layer in self.layers]).amax(0).tolist() if self.batch_size else []

    def _push_tables(self) -> None:
        """The manager's tables (one device copy) into every layer."""
        sink, floats, quants = self.blocks.tables(self.device)
        for layer in self.layers:
            layer.sink_table, layer.float_table, layer.quant_table = sink, floats, quants

    def _keep_rows(self, rows: list[int]) -> None:
        """Keep sequences ``rows`` (in that order): a dense storage copies their blocks, a paged one keeps their
        table rows (the manager refuses, before anything changes, what it cannot do)."""
        self.blocks.keep(rows)
        index = torch.tensor(rows, dtype=torch.int64)
        for i, layer in enumerate(self.layers):
            if self.blocks.grows:
                layer.seq_lens = layer.seq_lens[index]
            else:
                layer.select(index)
            self._undo[i] = None  # rows moved: an undo record names the old ones
        if self.blocks.grows:
            self._push_tables()

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
        self._keep_rows(self._batch_index(index).tolist())

    # --- storing and attending ----------------------------------------------------------------
    def append(self, layer: int, k: Tensor, v: Tensor, lengths=None) -> None:
        """Store new tokens ``k, v [B, Hkv, T, D]`` of ``layer`` (any T >= 1); with ``lengths [B]``
        row b holds ``lengths[b]`` tokens, the rest of the row is padding."""
        self._check_layer(layer)
        before = self.layers[layer].seq_lens.clone()
        try:
            lens, _ = self._check_kv(layer, k, v, lengths)
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
            lens, split = self._check_kv(layer, k, v, lengths, q=q, scale=scale, sink_logits=sink_logits)
            self._reserve(layer, lens)
            storage = self.layers[layer]
            if k.shape[2] == 1:  # decode: store, then attend over exactly what is stored
                self._undo[layer] = write.append(storage, k, v, lens, self.ops.quantizer)
                out = self.ops.decode(q[:, :, 0], storage, scale=scale, sink_logits=sink_logits).unsqueeze(2)
                if 0 in lens:  # a row with no new token has no query
                    out = out.masked_fill(torch.tensor(lens, device=out.device).view(-1, 1, 1, 1) == 0, 0)
                return out
            if split is None or len(split.multi) == len(lens):  # every row prefills
                out = self.ops.prefill(q, k, v, storage, torch.tensor(lens), scale=scale, sink_logits=sink_logits)
                self._undo[layer] = write.append(storage, k, v, lens, self.ops.quantizer)
                return out
            out = q.new_zeros(q.shape)
            one_out, multi_out = self._attend_split(layer, split, scale, sink_logits)
            if split.one:
                out[torch.tensor(split.one, device=out.device), :, 0] = one_out
            if split.multi:
                out[torch.tensor(split.multi, device=out.device), :, :multi_out.shape[2]] = multi_out
            return out
        except BaseException as e:
            self._roll_back_step(layer, before, e)
            raise

    def attend_packed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, query_start_loc, *,
                      scale: float | None = None, sink_logits: Tensor | None = None) -> Tensor:
        """``attend`` on packed tokens (vLLM's layout): ``q [N, H, D]``, ``k, v [N, Hkv, D]``, row b's new
        tokens at ``[query_start_loc[b], query_start_loc[b+1])`` -> ``[N, H, D]``. Nothing is padded to
        ``[B, T_max]``: rows of one token decode, only the longer rows prefill (padded to their own longest)."""
        self._check_layer(layer)
        before = self.layers[layer].seq_lens.clone()
        try:
            qsl, lens = self._check_packed(q, k, v, query_start_loc, scale, sink_logits)
            split = _split_packed(q, k, v, qsl, lens)
            self._check_values(layer, split, k, v, q, sink_logits, packed=True)
            self._reserve(layer, lens)
            out = q.new_empty(q.shape)
            one_out, multi_out = self._attend_split(layer, split, scale, sink_logits)
            if split.one:
                out[qsl[split.one].to(out.device)] = one_out
            if split.multi:
                t = torch.arange(multi_out.shape[2])
                real = t < torch.tensor([lens[b] for b in split.multi]).unsqueeze(1)      # [n, T_multi]
                tokens = (qsl[split.multi].unsqueeze(1) + t)[real]
                out[tokens.to(out.device)] = multi_out.transpose(1, 2)[real.to(out.device)]
            return out
        except BaseException as e:
            self._roll_back_step(layer, before, e)
            raise

    def _attend_split(self, layer: int, split: _Split, scale, sink_logits) -> tuple[Tensor | None, Tensor | None]:
        """A mixed step, row group by row group: the longer rows prefill over what was stored before (and their
        own chunk in full precision), the step is stored, then the one-token rows decode, as each would alone,
        over what is stored. A step's cost follows the tokens it carries, not B x T_max.
        Returns ``([len(one), H, D], [len(multi), H, T_multi, D])`` (None for an empty group)."""
        storage, lens = self.layers[layer], split.lens
        multi_out = one_out = None
        if split.multi:
            multi_out = self.ops.prefill(split.q_multi, split.k_multi, split.v_multi, storage.select_rows(split.multi),
                                         torch.tensor([lens[b] for b in split.multi]), scale=scale,
                                         sink_logits=sink_logits)
        chunks = [(b, split.k_multi[i:i + 1, :, :lens[b]], split.v_multi[i:i + 1, :, :lens[b]])
                  for i, b in enumerate(split.multi)]
        self._undo[layer] = write.append_rows(storage, split.one, split.k_one, split.v_one, chunks,
                                              self.ops.quantizer)
        if split.one:
            one_out = self.ops.decode(split.q_one, storage.select_rows(split.one), scale=scale,
                                      sink_logits=sink_logits)
        return one_out, multi_out

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

    def _check_tensor(self, name: str, x, shape: str, ndim: int = 4) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(x).__name__}")
        if x.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dims {shape}, got shape {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name}.dtype must be the cache dtype {self.dtype}, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"{name}.device must be the cache device {self.device}, got {x.device}")

    def _check_kv(self, layer, k, v, lengths, *, q=None, scale=None, sink_logits=None) -> tuple[list[int], _Split]:
        """Shapes, dtypes, devices, lengths; then one device sync for every value check (``_check_values``).
        Returns the new tokens per row and, for a ragged chunk (``lengths`` given), its rows grouped as they
        run (``_Split``; None otherwise)."""
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
            shape = f"[B={B}, H, T={T}, D={D}] with H a positive multiple of Hkv={self.num_kv_heads}"
            self._check_tensor("q", q, shape)
            if q.shape[0] != B or q.shape[2] != T or q.shape[3] != D or q.shape[1] % H or q.shape[1] == 0:
                raise ValueError(f"q must have shape {shape}, got {tuple(q.shape)}")
            self._check_scale_and_sinks(q.shape[1], scale, sink_logits)
        split = None if lengths is None else _split_padded(q, k, v, lens)
        self._check_values(layer, split, k, v, q, sink_logits)
        return lens, split

    def _check_packed(self, q, k, v, query_start_loc, scale, sink_logits) -> tuple[Tensor, list[int]]:
        """``attend_packed``'s shapes, dtypes, devices and offsets: ``query_start_loc`` on the host and the new
        tokens per row."""
        B, Hkv, D = self.batch_size, self.num_kv_heads, self.head_dim
        if not B:
            raise ValueError("the cache holds no sequence: admit() one first")
        expected = f"a 1-D int tensor of B + 1 = {B + 1} offsets from 0 to N, non-decreasing"
        qsl = host_ints("query_start_loc", query_start_loc, expected)
        for name, x, heads in (("q", q, f"H (a positive multiple of Hkv={Hkv})"), ("k", k, f"Hkv={Hkv}"),
                               ("v", v, f"Hkv={Hkv}")):
            shape = f"[N, {heads}, D={D}]"
            if not isinstance(x, Tensor) or x.ndim != 3:
                raise ValueError(f"{name} must be a packed {shape} tensor, got "
                                 f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
            self._check_tensor(name, x, shape, ndim=3)
            if x.shape[2] != D or (x.shape[1] != Hkv if name != "q" else x.shape[1] % Hkv or not x.shape[1]):
                raise ValueError(f"{name} must be a packed {shape} tensor, got {tuple(x.shape)}")
        N = q.shape[0]
        if (qsl.shape != (B + 1,) or int(qsl[0]) != 0
                or int(qsl[-1]) != N or bool((qsl.diff() < 0).any()) or k.shape[0] != N or v.shape[0] != N):
            raise ValueError(f"query_start_loc must be {expected} (N = {N} rows of q, k and v), got "
                             f"{qsl.tolist() if qsl.ndim == 1 else qsl}")
        self._check_scale_and_sinks(q.shape[1], scale, sink_logits)
        return qsl, qsl.diff().tolist()

    def _check_scale_and_sinks(self, H: int, scale, sink_logits) -> None:
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"scale must be a finite float > 0 (or None for D ** -0.5), got {scale!r}")
        if sink_logits is not None:
            if not isinstance(sink_logits, Tensor) or sink_logits.shape != (H,) \
                    or not sink_logits.is_floating_point():
                raise ValueError(f"sink_logits must be a float tensor of shape [H={H}], got "
                                 f"{getattr(sink_logits, 'dtype', type(sink_logits).__name__)} "
                                 f"{tuple(getattr(sink_logits, 'shape', ()))}")
            if sink_logits.device != self.device:
                raise ValueError(f"sink_logits.device must be the cache device {self.device}, got "
                                 f"{sink_logits.device}")

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

    def _check_values(self, layer: int, split: _Split | None, k: Tensor, v: Tensor, q: Tensor | None,
                      sink_logits: Tensor | None, packed: bool = False) -> None:
        """One device sync for every value check: the K/V to be stored finite in the dtype they are stored in,
        q finite, sink_logits free of NaN and +inf. When every token of ``k, v`` is real and goes to the window
        (a uniform chunk past the sinks, or a packed step past them) one reduction per tensor; otherwise each
        row group of ``split`` on only the columns that hold real tokens (a mixed step must not cost B x T)."""
        cfg, n0 = self.config, self.layers[layer].seq_lens
        if split is None or packed:
            busy = n0 if split is None else n0[[b for b, t in enumerate(split.lens) if t]]
            if not busy.numel() or int(busy.min()) >= cfg.sink_tokens:
                ok = checks.peaks_fit(k, v, q, sink_logits, cfg.window_dtype) if k.numel() else {}
                return _raise_refused(ok, cfg)
        ok = {"k": [], "v": [], "q": []}
        groups = []
        if split is None:  # a uniform chunk whose first tokens go to the sinks
            groups.append((n0.unsqueeze(1) + torch.arange(k.shape[2]), None, q, k, v, 0))
        elif split.one:
            groups.append((n0[split.one].unsqueeze(1), None, split.q_one, split.k_one, split.v_one, 1))
        if split is not None and split.multi:
            t = torch.arange(split.k_multi.shape[2])
            real = t < torch.tensor([split.lens[b] for b in split.multi]).unsqueeze(1)   # [n, T_multi] host
            groups.append((n0[split.multi].unsqueeze(1) + t, real, split.q_multi, split.k_multi, split.v_multi, 0))
        for pos, real, qg, kg, vg, one in groups:
            if one:  # [n, heads, D] -> [n, heads, 1, D]
                qg, kg, vg = (None if x is None else x.unsqueeze(2) for x in (qg, kg, vg))
            ok["k"].append(checks.storable(kg, pos, real, cfg))
            ok["v"].append(checks.storable(vg, pos, real, cfg))
            if qg is not None:
                ok["q"].append(checks.all_finite(qg, real))
        if q is None:
            del ok["q"]
        named = {name: torch.stack(x).all() for name, x in ok.items() if x}
        if sink_logits is not None:
            named["sink_logits"] = ~(torch.isnan(sink_logits) | (sink_logits == float("inf"))).any()
        _raise_refused(dict(zip(named, torch.stack(list(named.values())).tolist())) if named else {}, cfg)

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


def _raise_refused(ok: dict[str, bool], cfg: CacheConfig) -> None:
    """Raise for the first value check that failed (``ok``: check name -> passed)."""
    bad = next((name for name, passed in ok.items() if not passed), None)
    if bad in ("k", "v"):
        raise ValueError(f"{bad} contains NaN or Inf, or values that overflow the storage dtype "
                         f"(sink_dtype={cfg.sink_dtype}, window_dtype={cfg.window_dtype}); "
                         "refusing to store it (it would poison a whole block's scales)")
    if bad == "q":
        raise ValueError("q contains NaN or Inf")
    if bad == "sink_logits":
        raise ValueError("sink_logits must be free of NaN and +inf (-inf means no sink for that head)")


@dataclass
class _Split:
    """A step's new tokens grouped by how they run: the rows with one new token decode, the rows with more
    prefill; rows with none are in neither. q is None for ``append``.

    lens: [B] new tokens per row. one: the rows of one token; q_one [len(one), H, D], k_one, v_one
    [len(one), Hkv, D]. multi: the rows of more; q_multi [len(multi), H, T_multi, D], k_multi, v_multi
    [len(multi), Hkv, T_multi, D], row i holding ``lens[multi[i]]`` real tokens (T_multi: the longest)."""
    lens: list[int]
    one: list[int]
    q_one: Tensor | None
    k_one: Tensor | None
    v_one: Tensor | None
    multi: list[int]
    q_multi: Tensor | None
    k_multi: Tensor | None
    v_multi: Tensor | None


def _split_padded(q: Tensor | None, k: Tensor, v: Tensor, lens: list[int]) -> _Split:
    """Group the rows of a padded chunk ``[B, heads, T, D]``: views where the rows are one run."""
    one = [b for b, t in enumerate(lens) if t == 1]
    multi = [b for b, t in enumerate(lens) if t > 1]
    pick = lambda x, rows, t: None if x is None or not rows else _take_rows(x[:, :, :t], rows)  # noqa: E731
    firsts = [None if x is None or not one else _take_rows(x[:, :, 0], one) for x in (q, k, v)]
    T_multi = max((lens[b] for b in multi), default=0)
    return _Split(lens, one, *firsts, multi, *(pick(x, multi, T_multi) for x in (q, k, v)))


def _split_packed(q: Tensor, k: Tensor, v: Tensor, qsl: Tensor, lens: list[int]) -> _Split:
    """Group the rows of a packed step (``[N, heads, D]``, row b at ``[qsl[b], qsl[b+1])``): the one-token rows
    are gathered, the longer ones padded to their longest only (one longer row: a view)."""
    one = [b for b, t in enumerate(lens) if t == 1]
    multi = [b for b, t in enumerate(lens) if t > 1]
    firsts = [x[qsl[one].to(x.device)] if one else None for x in (q, k, v)]
    if not multi:
        return _Split(lens, one, *firsts, multi, None, None, None)
    if len(multi) == 1:
        start, t = int(qsl[multi[0]]), lens[multi[0]]
        chunk = [x[start:start + t].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]   # [1, heads, t, D] views
    else:
        T_multi = max(lens[b] for b in multi)
        tokens = (qsl[multi].unsqueeze(1) + torch.arange(T_multi)).clamp(max=q.shape[0] - 1)  # pads repeat a token
        chunk = [x[tokens.to(x.device)].transpose(1, 2) for x in (q, k, v)]
    return _Split(lens, one, *firsts, multi, *chunk)


def _take_rows(x: Tensor, rows: list[int]) -> Tensor:
    """``x[rows]``: a view when the rows are one contiguous run (one long row beside the decoders), else a copy."""
    first, n = rows[0], len(rows)
    if rows == list(range(first, first + n)):
        return x.narrow(0, first, n)
    return x.index_select(0, torch.tensor(rows, device=x.device))
