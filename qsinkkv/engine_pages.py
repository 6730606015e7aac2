"""qsinkkv's storage inside an engine's block pool (vLLM's): the engine allocates and frees the pages,
qsinkkv's ops read and write them through ``LayerStorage`` records built from the engine's block table.

A *page* is one block of the engine's pool for one layer: opaque bytes that hold either a sequence's sink
segment (its first ``sink_tokens`` K/V, all KV heads, in ``sink_dtype``) or one quantized block of its
window (codes, key scales/zeros, value scales/zeros, all KV heads). A sequence's *logical* pages, its
row of the engine's block table:

  logical 0        the sink page, held for the sequence's life
  logical 1 + b    quantized block b of the window (recent tokens ``b*bs .. b*bs + bs - 1``), held
                   while a query can see it (``first_page``) and handed back after

so ``pages_needed(n)`` pages hold n tokens, and a stream of any length holds at most
``max_pages(in_flight)``. The filling block (the float ring) is not a page: it is bigger than a quantized
block (bf16, not codes), so it lives in a pool the engine adapter keeps beside the pages, one ring per
running sequence (``FloatRings`` says which), sized once and counted wherever memory is compared.

``step_tables`` turns a step's block table into the tables of two records over the same pools: the
quantized ring as it stands (``read``: what the prefill reads) and with this step's completing blocks at
their new pages (``store``: where the write puts them, what the decode reads); ``attend_packed`` runs one
layer's packed step (``step.attend_split``, the code ``SinkQuantCache`` runs) over them. ``EngineStep`` holds a
step's tables and runs each layer over its pools (``LayerPools``, made once for the engine's life). A ring
slot whose block is gone, not yet written, or no longer visible names the engine's null page, which holds
zeros: an op reads only pages the sequence holds or zeros, never another sequence's bytes (a freed page may
hold anything).

Imports the qsinkkv core only (no engine).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from . import checks, quant
from .config import CacheConfig
from .layout import WindowLayout, cdiv
from .step import attend_split, scatter_packed, split_packed
from .storage import LayerStorage

SINK_PAGES = 1  # logical pages before the window's: the sink page
_ALIGN = 16     # bytes: every region of a page starts at a multiple of this, and a page is a multiple of it


@dataclass(frozen=True)
class PageLayout:
    """The byte layout of one page (one block of one layer, every KV head). ``regions[name] = (offset,
    shape, dtype)``: the tensor ``name`` of ``LayerStorage`` for one page is ``shape [Hkv, ...]`` of ``dtype``
    at byte ``offset``. The sink regions and the quantized regions overlap: a page is one or the other."""
    layout: WindowLayout
    num_kv_heads: int
    head_dim: int
    regions: dict
    page_bytes: int

    @classmethod
    def of(cls, config: CacheConfig, num_kv_heads: int, head_dim: int) -> PageLayout:
        """The page of a bits 8/4 config (bits=16 keeps the engine's own pages: nothing to quantize)."""
        if config.bits == 16:
            raise ValueError("PageLayout holds quantized blocks: bits must be 8 or 4, got bits=16")
        if config.residual_tokens:
            raise ValueError("an engine's pages hold the window as quantized blocks and one filling block: "
                             f"residual_tokens must be 0, got residual_tokens={config.residual_tokens}")
        config.check_head_dim(head_dim)
        H, D, S, bs = num_kv_heads, head_dim, config.sink_tokens, config.block_size
        Dc, G = D // quant.codes_per_byte(config.bits), D // config.value_group_size
        u8, sc = torch.uint8, config.scale_dtype

        def lay(parts):
            regions, at = {}, 0
            for name, shape, dtype in parts:
                regions[name] = (at, (H, *shape), dtype)
                at += cdiv(H * _numel(shape) * _size(dtype), _ALIGN) * _ALIGN
            return regions, at

        quantized, quant_bytes = lay([("key_codes", (bs, Dc), u8), ("value_codes", (bs, Dc), u8),
                                      ("key_scale", (D,), sc), ("key_zero", (D,), sc),
                                      ("value_scale", (bs, G), sc), ("value_zero", (bs, G), sc)])
        sinks, sink_bytes = lay([("sink_k", (S, D), config.sink_dtype), ("sink_v", (S, D), config.sink_dtype)])
        return cls(WindowLayout(config), H, D, {**quantized, **sinks}, max(quant_bytes, sink_bytes, _ALIGN))

    def views(self, pages: Tensor) -> dict[str, Tensor]:
        """The ``LayerStorage`` pools over ``pages`` (uint8 ``[num_pages, >= page_bytes]``, a page a row, rows
        any stride apart that keeps the regions aligned): ``name -> [Hkv, num_pages, ...]`` views (writing
        them writes the pages)."""
        if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] < self.page_bytes:
            raise ValueError(f"pages must be uint8 [num_pages, >= {self.page_bytes}], got {pages.dtype} "
                             f"{list(pages.shape)}")
        if pages.stride(1) != 1 or pages.stride(0) % _ALIGN or pages.storage_offset() % _ALIGN:
            raise ValueError(f"pages must have contiguous rows, {_ALIGN}-byte aligned and a multiple of {_ALIGN} "
                             f"bytes apart; got strides {pages.stride()} at offset {pages.storage_offset()}")
        out = {}
        for name, (at, shape, dtype) in self.regions.items():
            nbytes = _numel(shape) * _size(dtype)
            out[name] = pages[:, at:at + nbytes].view(dtype).unflatten(1, shape).transpose(0, 1)
        return out


def pages_needed(layout: WindowLayout, n: int) -> int:
    """Logical pages a sequence of ``n`` tokens uses (its sink page and every block quantized so far; the
    oldest may have been handed back)."""
    return 0 if n <= 0 else SINK_PAGES + layout.quantized_blocks(layout.recent_count(n))


def first_page(layout: WindowLayout, n):
    """With ``n`` tokens held (an int or a tensor), before the step that brings token n: the window's logical
    pages ``[SINK_PAGES, first_page)`` hold no token that query, or any later one, sees (they may go back)."""
    return SINK_PAGES + layout.first_kept_block(layout.recent_count(n + 1))


def max_pages(layout: WindowLayout, in_flight: int) -> int:
    """Pages one sequence holds at most, however long it streams, when a step brings at most ``in_flight``
    tokens: its sink page, the blocks of one window and those the step completes before older ones go back."""
    return SINK_PAGES + cdiv(layout.recent_tokens - 1 + max(in_flight, 1), layout.block_size) + 1


def float_ring_bytes(config: CacheConfig, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one sequence's float ring in one layer (K and V): what an engine adapter keeps beside the pages,
    per sequence it runs at once."""
    layout = WindowLayout(config)
    return 2 * num_kv_heads * layout.float_rows * head_dim * _size(config.window_dtype)


class FloatRings:
    """Which float ring (filling block) each running sequence uses, keyed by its sink page (the engine's block,
    held for the sequence's life and unique among running ones). ``capacity`` rings, one per sequence the
    engine runs at once; a sequence takes one at its first step and gives it back when the engine says it
    finished (``release``)."""

    def __init__(self, capacity: int):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._of_page = torch.full((1,), -1, dtype=torch.int64)  # sink page -> ring (-1: none)

    def rings(self, sink_pages: Tensor, starts: Tensor) -> Tensor:
        """``[B]`` int64 (host): the ring of each row, given its sink page and the tokens it held before this
        step (``starts``, host); a row at 0 (a new sequence, or one the engine restarts) takes a ring."""
        pages = sink_pages.long().cpu()
        if pages.numel() and int(pages.max()) >= self._of_page.shape[0]:
            grown = torch.full((int(pages.max()) + 1,), -1, dtype=torch.int64)
            grown[:self._of_page.shape[0]] = self._of_page
            self._of_page = grown
        for page in pages[starts == 0].tolist():  # new sequences only: a step's running rows cost one gather
            if self._of_page[page] < 0:           # (a page that still names a ring: its sequence ended unseen)
                if not self._free:
                    raise RuntimeError(f"FloatRings: all {self.capacity} float rings are in use; the engine runs more "
                                       "sequences at once than the rings were sized for (max_num_seqs)")
                self._of_page[page] = self._free.pop()
        rings = self._of_page[pages]
        if bool((rings < 0).any()):
            raise RuntimeError(f"FloatRings: rows with sink pages {pages[rings < 0].tolist()} hold tokens but no float "
                               "ring (their first step was not seen)")
        return rings

    def release(self, sink_pages) -> None:
        """The sequences whose sink pages these are have ended: their rings go back."""
        for page in sink_pages:
            if 0 <= page < self._of_page.shape[0] and self._of_page[page] >= 0:
                self._free.append(int(self._of_page[page]))
                self._of_page[page] = -1

    def in_use(self) -> int:
        return self.capacity - len(self._free)


def _ring_blocks(layout: WindowLayout, held: Tensor) -> Tensor:
    """``[B, quant_slots]``: the block each quantized ring slot holds at ``held`` tokens, the newest b with
    ``b % quant_slots == slot`` (-1: none yet), as ``WindowLayout.slot_positions`` places them."""
    nq = layout.quant_slots
    q = layout.quantized_blocks(layout.recent_count(held)).unsqueeze(1)            # [B, 1] blocks quantized
    return q - 1 - (q - 1 - torch.arange(nq)) % nq


def _pages(table: Tensor, block: Tensor, first: Tensor, null_page: int) -> Tensor:
    """The page of each block, or ``null_page`` where it is not there yet or older than logical page ``first``
    (handed back: a freed page may already hold another sequence's bytes)."""
    logical = SINK_PAGES + block
    live = (block >= 0) & (logical >= first.unsqueeze(1)) & (logical < table.shape[1])
    return torch.where(live, table.gather(1, logical.clamp(min=0, max=table.shape[1] - 1)), null_page)


def step_tables(layout: WindowLayout, block_table: Tensor, held: Tensor, lens: Tensor, null_page: int = 0,
                num_pages: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A step's tables, from the engine's ``block_table [B, >= pages_needed]`` (host int, logical -> page), the
    tokens each row holds before the step ``held [B]`` and its new tokens ``lens [B]`` (host int64):
    ``(sink_table [B], quant_read [B, nq], quant_store [B, nq])``: the quantized ring before the step, and with
    the blocks this step completes at their pages. Raises if a page the step writes is the null page or past
    the table (the engine did not allocate it), or if a page the step uses is negative or, given the pool's
    ``num_pages``, past the pool (``EngineStep`` checks every layer's pool against the tables once per step)."""
    table = block_table.long()
    if not 0 <= null_page < (num_pages or null_page + 1):
        raise ValueError(f"null_page must be a page of the pool, in [0, {num_pages}), got {null_page}")
    first = first_page(layout, held)
    block_read, block_store = _ring_blocks(layout, held), _ring_blocks(layout, held + lens)
    quant_read = _pages(table, block_read, first, null_page)
    quant_store = _pages(table, block_store, first, null_page)
    sink_table = table[:, 0]
    # a completing block that stays visible is written at its page (one that leaves at once is never written)
    completing = (block_store != block_read) & (SINK_PAGES + block_store >= first_page(layout, held + lens - 1)
                                                .unsqueeze(1))
    unallocated = (completing & (quant_store == null_page)).any(1) | ((held < layout.sink_tokens) & (lens > 0)
                                                                      & (sink_table == null_page))
    if bool(unallocated.any()):
        raise RuntimeError("qsinkkv: the engine's block table names the null page (or no page) where this step writes "
                           f"a sink or a completing block: rows {unallocated.nonzero().flatten().tolist()} hold "
                           f"{held[unallocated].tolist()} tokens and bring {lens[unallocated].tolist()}")
    used = (sink_table, quant_read, quant_store)
    checks.table("block_table", torch.cat([t.flatten() for t in used]), num_pages or 1 << 62,
                 "the engine's pool" if num_pages else "an engine's pool (pages are >= 0)", none_ok=False)
    return used


def ring_table(layout: WindowLayout, rings: Tensor) -> Tensor:
    """``[B, float_slots]``: the float-pool blocks of each row's ring (``rings [B]``, ``FloatRings.rings``), the
    ``float_table`` of a step's records."""
    nf = layout.float_slots
    return rings.unsqueeze(1) * nf + torch.arange(nf)


class LayerPools:
    """One layer's storage in an engine, for the engine's life: the pools over its pages (``PageLayout.views``) and
    its float rings ``float_k, float_v [Hkv, rings * float_slots, bs, D]``. ``derived``: what an op computes from
    the pools once and keeps for every step (the C decode's pointers and strides)."""

    def __init__(self, pages: dict[str, Tensor], float_k: Tensor, float_v: Tensor):
        self.pools = {**pages, "float_k": float_k, "float_v": float_v}  # every LayerStorage pool, by name
        self.derived: dict = {}


def storages(layer: LayerPools, layout: WindowLayout, tables: tuple[Tensor, Tensor, Tensor], float_table: Tensor,
             held: Tensor) -> tuple[LayerStorage, LayerStorage]:
    """The ``(read, store)`` records of one layer for a step: its pools, the step's tables (``step_tables``, and
    ``ring_table`` for the float pools: computed once per step, for every layer); one ``seq_lens`` (a copy of
    ``held``), which the write advances."""
    sink_table, quant_read, quant_store = tables
    _check_pools(layer, tables, float_table)
    device = layer.pools["float_k"].device
    read = LayerStorage(layout, **layer.pools, sink_table=sink_table.to(device), float_table=float_table.to(device),
                        quant_table=quant_read.to(device), seq_lens=held.clone(), dense=False)
    return read, replace(read, quant_table=quant_store.to(device))


def _check_pools(layer: LayerPools, tables: tuple[Tensor, Tensor, Tensor], float_table: Tensor) -> None:
    """The step's tables name pages and float blocks of this layer's pools (host min/max)."""
    pages = layer.pools["key_codes"].shape[1]
    for name, t in zip(("sink_table", "quant_read", "quant_store"), tables):
        checks.table(f"the step's {name} (from the engine's block_table)", t, pages, "this layer's pages",
                     none_ok=False)
    checks.table("float_table", float_table, layer.pools["float_k"].shape[1], "this layer's float rings")


def attend_packed(ops, read: LayerStorage, store: LayerStorage, q: Tensor, k: Tensor, v: Tensor, qsl: Tensor, *,
                  scale: float | None = None, check: bool = True) -> Tensor:
    """One layer's packed step over an engine's pages: ``q [N, H, D]``, ``k, v [N, Hkv, D]``, row b's new tokens
    at ``[qsl[b], qsl[b+1])`` (host int64) -> ``[N, H, D]``, stored into ``store`` (``storages``), as
    ``SinkQuantCache.attend_packed`` computes it. check: refuse non-finite K/V or q (what the storage would
    hold: ``checks.values``) before anything is written."""
    lens = (qsl[1:] - qsl[:-1]).tolist()
    split = split_packed(q, k, v, qsl, lens)
    if check:
        checks.values(read.layout.config, read.seq_lens, split, k, v, q, None, packed=True)
    starting = (read.seq_lens == 0).nonzero().flatten()
    if starting.numel():  # a new sequence's sink page and float ring may hold a former owner's bytes
        read.clear(starting)
    # an engine never rolls a step back: nothing is copied aside for an undo
    one_out, multi_out, _ = attend_split(ops, split, read, store, scale=scale, sink_logits=None, keep_undo=False)
    return scatter_packed(q.new_empty(q.shape), qsl, split, one_out, multi_out)


class EngineStep:
    """One engine step for every layer: the step's tables, made once (``step_tables``, ``ring_table``), and
    ``attend``, which runs one layer's packed step as ``attend_packed`` does. A step in which every row brings
    one token past its sinks (the common decode step), on ops that have an engine decode (``Ops.engine_decode``:
    the C one), runs the checks, the write and the decode in two C calls per layer, prepared once for all layers
    at the first, with no per-layer record; any other step, or one those refuse (a NaN, a scale that overflows:
    nothing was written), runs ``attend_packed`` over the layer's records, which raises by name.
    ``held``, ``lens`` [B] host int64, ``qsl`` [B + 1]."""

    def __init__(self, layout: WindowLayout, held: Tensor, lens: Tensor, tables: tuple[Tensor, Tensor, Tensor],
                 float_table: Tensor):
        self.layout, self.held, self.tables, self.float_table = layout, held, tables, float_table
        self.query_start_loc = torch.cat((lens.new_zeros(1), lens.cumsum(0)))
        self.decoding = bool((lens == 1).all()) and bool((held >= max(layout.sink_tokens, 1)).all())
        # the pages and float blocks the step names, past which a layer's pool must reach (checked per layer)
        for name, t in (("block_table", torch.cat([t.flatten() for t in tables])), ("float_table", float_table)):
            checks.table(name, t, 1 << 62, "a pool (entries >= 0)", none_ok=False)
        self.pages_named = 1 + max((int(t.max()) for t in tables if t.numel()), default=-1)
        self.floats_named = 1 + (int(float_table.max()) if float_table.numel() else -1)
        self._engine = None
        self.fused_layers = 0  # layers that ran fused (the others ran attend_packed)

    def records(self, layer: LayerPools) -> tuple[LayerStorage, LayerStorage]:
        """``storages`` of ``layer`` for this step."""
        return storages(layer, self.layout, self.tables, self.float_table, self.held)

    def fused(self, ops) -> bool:
        return self.decoding and ops.engine_decode is not None

    def attend(self, ops, layer: LayerPools, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
               out: Tensor | None = None) -> Tensor:
        """``attend_packed``'s result for ``layer`` in q's dtype, or written into ``out`` (``[N, H, D]``, contiguous;
        the engine's output buffer: a fused step writes it in place, in its dtype) and returned."""
        if self.fused(ops):
            pages, floats = layer.pools["key_codes"].shape[1], layer.pools["float_k"].shape[1]
            if self.pages_named > pages or self.floats_named > floats:
                _check_pools(layer, self.tables, self.float_table)  # raises, naming the table
            if self._engine is None:
                self._engine = ops.engine_decode(self.records(layer)[1])
            done = self._engine.run(layer, q, k, v, scale, out)
            if done is not None:
                self.fused_layers += 1
                return done
        read, store = self.records(layer)
        result = attend_packed(ops, read, store, q, k, v, self.query_start_loc, scale=scale)
        return result if out is None else out.copy_(result)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
