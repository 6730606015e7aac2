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
(never stored, never seen, output zero). Every call, padded or packed, store-only or attending, plans its step
once (``plan.py``: the plan of a step's first layer serves the others) and runs it through one function,
``step.run`` (check, write, the rows that prefill, the rows that decode), as an engine's pages do.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import checks, plan, step, write
from .blocks import DenseBlocks, PagedBlocks
from .config import CacheConfig
from .layout import WindowLayout
from .ops import select_ops
from .rope import Rotary

# float8 model dtypes have no isfinite (and no way to refuse a NaN): not accepted
_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class SinkQuantCache:
    """A multi-layer KV cache with bf16 sinks and a quantized recent window.

    ``SinkQuantCache(config, num_layers, batch_size, num_kv_heads, head_dim, device, dtype,
    rotary=None, backend="auto", decode_variant="dequantize", *, blocks=None)``

    dtype is the dtype of the K/V (and queries) the model passes in. With
    ``config.positions == "cache_index"`` pass ``rotary`` (a fixed ``Rotary`` schedule) and
    give pre-RoPE queries and keys: the cache rotates them by their index in the cache.
    backend: "torch" (PyTorch ops), "c" (decode attention in C on the CPU, ``decode_c.py``),
    "triton" (block quantization, decode and prefill attention in Triton kernels: CUDA tensors,
    or CPU tensors under TRITON_INTERPRET=1), or "auto" (Triton on CUDA when it is installed, C
    on the CPU where it applies and compiles, else torch); ``ops.select_ops`` says where each
    applies. decode_variant: how the Triton decode kernel reads quantized blocks ("dequantize", "folded",
    "fp16": ``ops.DECODE_VARIANTS``); the other backends take only the default.
    blocks: who holds which block (``qsinkkv.blocks``): None for ``DenseBlocks(batch_size)``, each sequence
    owning its blocks from the start; a ``PagedBlocks`` shares pools between sequences that join and leave
    (``batch_size`` must then be the manager's, 0 for a new pool; ``qsinkkv.paged.PagedCache`` builds it).
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
        self.ops = select_ops(backend, self.device, head_dim, rotary, decode_variant, config=config, dtype=dtype)
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
        """The manager's tables (one device copy) into every layer; the blocks it took since the last push are
        zeroed in every layer (a block's rows not yet written are read, masked: they must not hold NaN)."""
        sink, floats, quants = self.blocks.tables(self.device)
        taken = self.blocks.take_new() if self.blocks.grows else {}
        for layer in self.layers:
            layer.sink_table, layer.float_table, layer.quant_table = sink, floats, quants
            layer.zero_blocks(taken)

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
        self._crop(self._checked([cut] * self.num_layers))

    def crop_to(self, lengths) -> None:
        """Bring every layer to ``lengths`` (an int, or ``[B]`` per sequence) by forgetting its newest
        tokens; this also brings layers left out of step by an interrupted forward back to one
        length. Refused, with nothing changed, as crop, or when a layer holds fewer tokens."""
        self._crop(self.crop_cuts(lengths))

    def crop_cuts(self, lengths) -> list[list[int]]:
        """The tokens ``crop_to(lengths)`` would cut from each layer's sequences, or the ValueError it would raise
        (nothing changes either way): a caller holding several caches checks them all before cropping any."""
        target = self._per_sequence("lengths", lengths)
        cuts = [[n - t for n, t in zip(layer.seq_lens.tolist(), target)] for layer in self.layers]
        for i, cut in enumerate(cuts):
            if min(cut) < 0:
                raise ValueError(f"layer {i} holds {self.layers[i].seq_lens.tolist()} tokens, fewer than {target}")
        return self._checked(cuts)

    def _checked(self, cuts: list[list[int]]) -> list[list[int]]:
        for layer, cut in zip(self.layers, cuts):  # check all before changing any
            why = write.crop_refusal(layer, cut)
            if why:
                raise ValueError(why)
        return cuts

    def _crop(self, cuts: list[list[int]]) -> None:
        """Forget ``cuts[layer][b]`` tokens (``_checked``)."""
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
        self._run(layer, lambda: self._padded(layer, None, k, v, lengths), None, k, v)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, lengths=None, *, scale: float | None = None,
               sink_logits: Tensor | None = None) -> Tensor:
        """Store the new tokens' ``k, v [B, Hkv, T, D]`` and return the attention output of their
        queries ``q [B, H, T, D]`` (``H`` a multiple of ``Hkv``): ``[B, H, T, D]`` in q's dtype.

        lengths: optional ``[B]``: row b holds ``lengths[b]`` new tokens, the rest of the row is
        padding (not stored, output zero). scale defaults to ``D ** -0.5``; sink_logits ``[H]`` are
        optional learned per-head sink logits (gpt-oss) adding ``exp(s_h)`` to the softmax denominator.
        """
        return self._run(layer, lambda: self._padded(layer, q, k, v, lengths, scale, sink_logits), q, k, v, scale,
                         sink_logits)

    def attend_packed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, query_start_loc, *,
                      scale: float | None = None, sink_logits: Tensor | None = None) -> Tensor:
        """``attend`` on packed tokens (vLLM's layout): ``q [N, H, D]``, ``k, v [N, Hkv, D]``, row b's new
        tokens at ``[query_start_loc[b], query_start_loc[b+1])`` -> ``[N, H, D]``. Nothing is padded to
        ``[B, T_max]``: rows of one token decode, only the longer rows prefill (padded to their own longest)."""
        def make_plan() -> plan.StepPlan:
            _, lens = checks.packed(self._holds(), q, k, v, query_start_loc, scale, sink_logits)
            return plan.packed(self.layout, self.layers[layer].seq_lens, lens)

        return self._run(layer, make_plan, q, k, v, scale, sink_logits)

    def _padded(self, layer: int, q, k, v, lengths, scale=None, sink_logits=None) -> plan.StepPlan:
        """A padded chunk's shapes, dtypes, devices and lengths checked (``checks.chunk``), and its plan."""
        lens = checks.chunk(self._holds(), k, v, lengths, q, scale, sink_logits)
        return plan.padded(self.layout, self.layers[layer].seq_lens, lens, k.shape[2])

    def _run(self, layer: int, make_plan: Callable[[], plan.StepPlan], q: Tensor | None, k: Tensor, v: Tensor,
             scale: float | None = None, sink_logits: Tensor | None = None) -> Tensor | None:
        """``layer``'s step: the arguments checked and the step planned (``make_plan()``: the plan of the step's
        first layer, memoized, for the others), then ``step.run`` over the layer's storage (read and stored into
        alike): the values checked, the step's blocks taken (``_reserve``), the write's undo record kept as soon as
        it is made. Whatever refuses the call, in this layer, rolls the step back on every layer (a model's forward
        may have run layers 0 .. layer - 1 already): the cache is left as it was before the step."""
        self._check_layer(layer)
        storage = self.layers[layer]
        before = storage.seq_lens.clone()
        try:
            step_plan = make_plan()
            return step.run(self.ops, step_plan, storage, storage, q, k, v, scale=scale, sink_logits=sink_logits,
                            prepare=lambda: self._reserve(layer, step_plan.lens),
                            undo_to=lambda undo: self._undo.__setitem__(layer, undo))
        except BaseException as e:
            self._roll_back_step(layer, before, e)
            raise

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
        return self.layout.visible_slots(int(self.layers[layer].seq_lens[seq]))[1].tolist()

    # --- validation (checks.py): everything is checked before any state changes ------------------
    def _holds(self) -> checks.Holds:
        return checks.Holds(self.batch_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def _check_layer(self, layer) -> None:
        checks.layer_index(layer, self.num_layers)

    def _per_sequence(self, name: str, value) -> list[int]:
        return checks.per_sequence(name, value, self.batch_size)

    def _batch_index(self, index, allow_repeats: bool = True) -> Tensor:
        return checks.batch_index(index, self.batch_size, self.device, allow_repeats)
