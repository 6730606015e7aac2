"""qsinkkv's storage inside an engine's block pool (vLLM's): the engine allocates and frees the pages,
qsinkkv's ops read and write them through ``LayerStorage`` records built from the engine's block table.

A *page* is one block of the engine's pool for one layer: opaque bytes that hold a sequence's sink
segment (its first ``sink_tokens`` K/V, all KV heads, in ``sink_dtype``), or ``fr`` rows of its filling block
(the float ring, K and V of all KV heads in ``window_dtype``: a bf16 block is bigger than a page of codes, so
it spans ``float_pages`` pages of ``fr`` rows), or one quantized block of its window (codes, key
scales/zeros, value scales/zeros, all KV heads). A sequence's *logical* pages, its row of the engine's
block table:

  logical 0                  the sink page, held for the sequence's life
  logical 1 .. float_pages   the float ring's pages, held for the sequence's life
  logical pinned + b         quantized block b of the window (recent tokens ``b*bs .. b*bs + bs - 1``), held
                             while a query can see it (``first_page``) and handed back after

(``pinned = 1 + float_pages``) so ``pages_needed(n)`` pages hold n tokens, and a stream of any length holds at
most ``max_pages(in_flight)``. Every byte a sequence uses is in pages the engine allocates and frees with the
rest of the sequence: finish, abort and preemption free them as the engine frees everything else.

``step_tables`` turns a step's block table into the tables of two records over the same pools: the float
ring's pages, the quantized ring as it stands (``read``: what the prefill reads) and with this step's
completing blocks at their new pages (``store``: where the write puts them, what the decode reads); which logical
page each entry is follows from the lengths (host), the pages are gathered where the engine's table lives, and
nothing is read back to the host (no device sync: its checks are ``torch._assert_async``);
``run`` runs one layer's packed step over them (``step.run``, the code ``SinkQuantCache`` runs). ``EngineStep`` holds
a step's plan (``plan.StepPlan``) and tables and runs each layer over its pools (``LayerPools``, made once for the
engine's life). A ring slot whose block is gone, not yet written, or no longer visible names the engine's null
page, which holds zeros: an op reads only pages the sequence holds or zeros, never another sequence's bytes (a
freed page may hold anything; a new sequence's sink and float pages are zeroed at its first step).

Imports the qsinkkv core only (no engine).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
from torch import Tensor

from . import checks, plan, quant, step
from .config import CacheConfig
from .layout import WindowLayout, cdiv
from .storage import LayerStorage

SINK_PAGES = 1  # the sink page, logical 0 (the float ring's pages follow it)
_ALIGN = 16     # bytes: every region of a page starts at a multiple of this, and a page is a multiple of it


@dataclass(frozen=True)
class PageLayout:
    """The byte layout of one page (one block of one layer, every KV head). ``regions[name] = (offset,
    shape, dtype)``: the tensor ``name`` of ``LayerStorage`` for one page is ``shape [Hkv, ...]`` of ``dtype``
    at byte ``offset``. The sink, float and quantized regions overlap: a page is one of the three. The float
    ring spans ``float_pages`` pages of ``float_block_rows`` rows each (the fewest pages whose rows fit in the
    page that a quantized block or the sinks need)."""
    layout: WindowLayout
    num_kv_heads: int
    head_dim: int
    regions: dict
    page_bytes: int
    float_pages: int
    float_block_rows: int

    @property
    def pinned(self) -> int:
        """Logical pages a sequence holds for its life: its sink page and its float ring's pages."""
        return SINK_PAGES + self.float_pages

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
        layout = WindowLayout(config)
        page_bytes, F = max(quant_bytes, sink_bytes, _ALIGN), layout.float_rows
        for float_pages in range(1 if F else 0, F + 1):  # the fewest pages whose share of the rows fits a page
            rows = cdiv(F, float_pages) if F else 1
            floats, float_bytes = lay([("float_k", (rows, D), config.window_dtype),
                                       ("float_v", (rows, D), config.window_dtype)])
            if float_bytes <= page_bytes or not F:
                break
        page_bytes = max(page_bytes, float_bytes)  # (one row of K and V wider than a page: pages grow to hold it)
        return cls(layout, H, D, {**quantized, **sinks, **floats}, page_bytes, float_pages, rows)

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


def pages_needed(layout: WindowLayout, pinned: int, tokens: int) -> int:
    """Logical pages a sequence of ``tokens`` tokens uses (its ``pinned`` pages -- the sink page and the float ring's,
    ``PageLayout.pinned`` -- and every block quantized so far; the oldest may have been handed back)."""
    return 0 if tokens <= 0 else pinned + layout.quantized_blocks(layout.recent_count(tokens))


def first_page(layout: WindowLayout, pinned: int, held):
    """With ``held`` tokens held (an int or a tensor), before the step that brings the next: the window's logical
    pages ``[pinned, first_page)`` hold no token that query, or any later one, sees (they may go back)."""
    return pinned + layout.first_kept_block(layout.recent_count(held + 1))


def max_pages(layout: WindowLayout, pinned: int, in_flight: int) -> int:
    """Pages one sequence holds at most, however long it streams, when a step brings at most ``in_flight``
    tokens: its pinned pages, the blocks of one window and those the step completes before older ones go back."""
    return pinned + cdiv(layout.recent_tokens - 1 + max(in_flight, 1), layout.block_size) + 1


def _pages(table: Tensor, block: Tensor, first: Tensor, null_page: int, pinned: int) -> Tensor:
    """The page of each block, or ``null_page`` where it is not there yet or older than logical page ``first``
    (handed back: a freed page may already hold another sequence's bytes). ``block``, ``first``: host, from the
    lengths; the gather runs where ``table`` lives."""
    logical = pinned + block
    live = (block >= 0) & (logical >= first.unsqueeze(1)) & (logical < table.shape[1])
    where = logical.clamp(min=0, max=table.shape[1] - 1).to(table.device, non_blocking=True)
    return torch.where(live.to(table.device, non_blocking=True), table.gather(1, where), null_page)


def step_tables(pages: PageLayout, block_table: Tensor, held: Tensor, lens: Tensor, null_page: int = 0,
                num_pages: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A step's tables, from the engine's ``block_table [B, >= pages_needed]`` (int, logical -> page, on the host or
    the engine's device), the tokens each row holds before the step ``held [B]`` and its new tokens ``lens [B]``
    (host int64): ``(sink_table [B], float_table [B, float_pages], quant_read [B, nq], quant_store [B, nq])`` int64
    on the table's device: the sink page, the float ring's pages, the quantized ring before the step, and with the
    blocks this step completes at their pages. Which logical page each entry is follows from the lengths alone (on
    the host); the pages are gathered where the table lives, and nothing is read back to the host (no device sync
    in an engine's step). Refuses (on the CPU at once, by name; on a GPU as a device-side assert: the engine stops)
    a step whose block table names the null page (or no page) where the step writes -- the engine did not allocate
    it -- or names a negative page, or, given the pool's ``num_pages``, one past the pool (``EngineStep`` checks
    every layer's pool against the tables once per pool size)."""
    layout, pinned = pages.layout, pages.pinned
    table = block_table.long()
    if not 0 <= null_page < (num_pages or null_page + 1):
        raise ValueError(f"null_page must be a page of the pool, in [0, {num_pages}), got {null_page}")
    if table.shape[1] < pinned:  # (no row holds a token yet past the pinned pages: none is read)
        table = torch.cat((table, table.new_full((table.shape[0], pinned - table.shape[1]), null_page)), dim=1)
    first = first_page(layout, pinned, held)
    block_read, block_store = layout.ring_blocks(held), layout.ring_blocks(held + lens)
    quant_read = _pages(table, block_read, first, null_page, pinned)
    quant_store = _pages(table, block_store, first, null_page, pinned)
    sink_table, float_table = table[:, 0], table[:, SINK_PAGES:pinned]
    # a completing block that stays visible is written at its page (one that leaves at once is never written)
    completing = (block_store != block_read) & (pinned + block_store >= first_page(layout, pinned, held + lens - 1)
                                                .unsqueeze(1))
    busy = lens > 0
    writes_sink = busy & (held < layout.sink_tokens)
    writes_float = busy & (held + lens > layout.sink_tokens)
    on = table.device
    unallocated = ((completing.to(on) & (quant_store == null_page)).any(1)
                   | (writes_sink.to(on) & (sink_table == null_page))
                   | (writes_float.to(on) & (float_table == null_page).any(1)))

    def error() -> RuntimeError:
        rows = unallocated.cpu()
        return RuntimeError("qsinkkv: the engine's block table names the null page (or no page) where this step "
                            "writes a sink, a float-ring row or a completing block: rows "
                            f"{rows.nonzero().flatten().tolist()} hold {held[rows].tolist()} tokens and bring "
                            f"{lens[rows].tolist()}")

    checks.condition_in_step(~unallocated.any(), error)
    used = (sink_table, float_table, quant_read, quant_store)
    checks.table_in_step("block_table", torch.cat([t.flatten() for t in used]), num_pages or 1 << 62,
                         "the engine's pool" if num_pages else "an engine's pool (pages are >= 0)", none_ok=False)
    return used


class LayerPools:
    """One layer's storage in an engine, for the engine's life: the pools over its pages (``PageLayout.views``: every
    ``LayerStorage`` pool, the float ring's included, a view of the same pages), fixed once made (a read-only
    mapping)."""
    __slots__ = ("pools",)

    def __init__(self, pages: dict[str, Tensor]):
        self.pools = MappingProxyType(dict(pages))  # every LayerStorage pool, by name

    @property
    def num_pages(self) -> int:
        return self.pools["key_codes"].shape[1]


TABLE_NAMES = ("sink_table", "float_table", "quant_read", "quant_store")


def storages(layer: LayerPools, layout: WindowLayout, tables: tuple[Tensor, Tensor, Tensor, Tensor], held: Tensor,
             checked: bool = False) -> tuple[LayerStorage, LayerStorage]:
    """The ``(read, store)`` records of one layer for a step: its pools and the step's tables (``step_tables``:
    computed once per step, for every layer, and checked here against this layer's pages, unless ``checked``: the
    caller did for a pool of this size); one ``seq_lens`` (a copy of ``held``), which the write advances."""
    sink_table, float_table, quant_read, quant_store = tables
    if not checked:
        _check_pools(layer, tables)
    device = layer.pools["key_codes"].device
    read = LayerStorage(layout, **layer.pools, sink_table=sink_table.to(device), float_table=float_table.to(device),
                        quant_table=quant_read.to(device), seq_lens=held.clone(), dense=False)
    return read, replace(read, quant_table=quant_store.to(device))


def _check_pools(layer: LayerPools, tables: tuple[Tensor, ...]) -> None:
    """The step's tables name pages of this layer's pool (``checks.table_in_step``: no host read)."""
    for name, t in zip(TABLE_NAMES, tables):
        checks.table_in_step(f"the step's {name} (from the engine's block_table)", t, layer.num_pages,
                             "this layer's pages", none_ok=False)


def attend_packed(ops, read: LayerStorage, store: LayerStorage, q: Tensor, k: Tensor, v: Tensor, qsl: Tensor, *,
                  scale: float | None = None, sink_logits: Tensor | None = None, check: bool = True,
                  out: Tensor | None = None) -> Tensor:
    """One layer's packed step over an engine's pages: ``q [N, H, D]``, ``k, v [N, Hkv, D]``, row b's new tokens
    at ``[qsl[b], qsl[b+1])`` (host int64, ``qsl[0] == 0``) -> ``[N, H, D]`` (in q's dtype, or written into ``out``
    and returned), stored into ``store`` (``storages``), as ``SinkQuantCache.attend_packed`` computes it;
    ``sink_logits [H]`` float32: the layer's learned sinks, or None. check: refuse non-finite K/V or q, or NaN/+inf
    sink logits (``step.check_values``) before anything is written. ``EngineStep.attend`` without its plan made once."""
    if int(qsl[0]) != 0:
        raise ValueError(f"qsl must start at 0 (row 0's first token), got {qsl.tolist()}")
    return run(ops, plan.packed(read.layout, read.seq_lens, qsl.diff().tolist()), read, store, q, k, v, scale=scale,
               sink_logits=sink_logits, check=check, out=out)


def starting_pages(step_plan: plan.StepPlan, read: LayerStorage) -> dict[str, Tensor]:
    """The sink and float pages of the rows that start at this step (``LayerStorage.zero_blocks``' argument: what
    ``run`` zeroes), from the step's tables: the same for every layer."""
    rows = torch.tensor(step_plan.starting).to(read.device, non_blocking=True)
    return {"sink": read.sink_table[rows], "float": read.float_table[rows].flatten()}


def run(ops, step_plan: plan.StepPlan, read: LayerStorage, store: LayerStorage, q: Tensor, k: Tensor, v: Tensor, *,
        scale: float | None, sink_logits: Tensor | None, check: bool = True, out: Tensor | None = None,
        new_pages: dict[str, Tensor] | None = None) -> Tensor:
    """``step.run`` over an engine's records: learned sinks of the wrong shape refused by name, and a new sequence's
    pages zeroed once the values pass (``new_pages``: ``starting_pages``' answer, if the caller has it for the step).
    An engine never rolls a step back: nothing is copied aside for an undo."""
    if check and sink_logits is not None and (sink_logits.shape != (q.shape[1],)
                                              or not sink_logits.is_floating_point()):
        raise ValueError(f"sink_logits must be a float tensor of shape [H={q.shape[1]}], got {sink_logits.dtype} "
                         f"{tuple(sink_logits.shape)}")

    def zero_new_rows() -> None:  # a new sequence's sink and float pages may hold a former owner's bytes (every entry
        # of an engine's table is a page, the null page -- zeros -- among them: no mask, no host read)
        read.zero_blocks(new_pages or starting_pages(step_plan, read))

    return step.run(ops, step_plan, read, store, q, k, v, scale=scale, sink_logits=sink_logits, check=check,
                    prepare=zero_new_rows if step_plan.starting else None, out=out)


class EngineStep:
    """One engine step for every layer: its plan (``plan.StepPlan``) and tables (``step_tables``), made once, and
    ``attend``, which runs one layer's packed step over them. A plain decode step (``StepPlan.decoding``: every row
    one token past its sinks, the common step) on ops with a fused step kernel (``Ops.engine_decode``: the C one,
    ``Ops.kernels["engine_step"]``) runs the checks, the write and the decode in two C calls per layer, prepared
    once for all layers at the first, with no per-layer record (a value they refuse raises by name, nothing
    written); any other step runs ``step.run`` over the layer's records, as ``attend_packed`` does.
    ``held``, ``lens`` [B] host int64."""

    def __init__(self, layout: WindowLayout, held: Tensor, lens: Tensor, tables: tuple[Tensor, Tensor, Tensor, Tensor]):
        self.layout, self.tables = layout, tables
        self.plan = plan.packed(layout, held, lens.tolist())  # (its held: the tokens each row holds before the step)
        self._pool_pages = None  # the pool size the tables were checked against (every layer of an engine: one)
        self._engine = None
        self._new_pages = None  # starting_pages, once for the step's layers

    def _check(self, layer: LayerPools) -> None:
        """The tables name pages of ``layer``'s pool: checked once per pool size (no host read on a device)."""
        if layer.num_pages != self._pool_pages:
            _check_pools(layer, self.tables)
            self._pool_pages = layer.num_pages

    def records(self, layer: LayerPools) -> tuple[LayerStorage, LayerStorage]:
        """``storages`` of ``layer`` for this step."""
        self._check(layer)
        return storages(layer, self.layout, self.tables, self.plan.held, checked=True)

    def fused(self, ops) -> bool:
        return self.plan.decoding and ops.engine_decode is not None

    def _refuse(self, ops) -> Callable[[Tensor, Tensor, Tensor], None]:
        """What a fused step calls when its C check refuses a value: ``step.check_values``' error for the step's
        q, k, v (its reduction the ops': ``Ops.peaks``), raised by name."""
        def refuse(q: Tensor, k: Tensor, v: Tensor) -> None:
            step.check_values(self.layout.config, self.plan.held, step.split(self.plan, q, k, v), k, v, q, None,
                              packed=True, peaks=ops.peaks)
        return refuse

    def attend(self, ops, layer: LayerPools, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None,
               sink_logits: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """``attend_packed``'s result for ``layer`` in q's dtype, or written into ``out`` (``[N, H, D]``, contiguous;
        the engine's output buffer: a fused step writes it in place, in its dtype) and returned. ``sink_logits [H]``
        float32: the layer's learned sinks, or None."""
        if self.fused(ops):
            self._check(layer)
            if self._engine is None:
                self._engine = ops.engine_decode(self.records(layer)[1], self.plan, self._refuse(ops))
            return self._engine.run(layer, q, k, v, scale, out, sink_logits)
        read, store = self.records(layer)
        into = out if out is not None and out.dtype == q.dtype else None  # (another dtype: computed, then cast)
        if self.plan.starting and self._new_pages is None:
            self._new_pages = starting_pages(self.plan, read)
        result = run(ops, self.plan, read, store, q, k, v, scale=scale, sink_logits=sink_logits, out=into,
                     new_pages=self._new_pages)
        return result if out is None or into is not None else out.copy_(result)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
