"""Block managers: which blocks of a layer's pools each sequence holds, and the tables that say so.

A ``LayerStorage`` names its blocks through three tables (``storage.py``); a block manager decides
what they hold, once for every layer of a model (the tables are shared by all layers, as in vLLM),
and never touches K/V. The cache composes one and asks it, per step:

  hold(lengths)    -> bool   each sequence holds exactly the blocks ``lengths[b]`` tokens need: what is
                             missing is taken (all or none: ``PoolExhausted`` changes nothing), what is no
                             longer needed goes back; True when the tables changed
  add()                      a new, empty sequence at the end of the batch
  keep(rows)                 keep or reorder sequences; the ones not kept give their blocks back
  tables(device)             ``(sink_table [B], float_table [B, float_slots], quant_table [B, quant_slots])``
  allocate(...)              one layer's pools, sized for this manager

``DenseBlocks``: a fixed batch, sequence b owns blocks ``b * n .. b * n + n - 1`` from the start
(identity tables, ``hold`` is free). ``PagedBlocks``: pools shared by sequences that join and leave,
LIFO free lists (a released block is the next one taken, warm in cache), a sequence's blocks always a
prefix of its ring. ``step_metadata`` describes a step over a manager's tables as vLLM's attention
metadata does. None of this imports the cache or the ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .layout import WindowLayout, cdiv
from .storage import LayerStorage

KINDS = ("sink", "float", "quant")


class PoolExhausted(RuntimeError):
    """A step or admission needs more blocks than the pool has free; nothing was changed."""


def needed_blocks(layout: WindowLayout, lengths: list[int]) -> dict[str, list[int]]:
    """Float and quantized ring slots a sequence of each length uses (always a prefix of its ring)."""
    bs = layout.block_size
    recent = [layout.recent_count(n) for n in lengths]
    return {"float": [min(cdiv(m, bs), layout.float_slots) for m in recent],
            "quant": [min(layout.quantized_blocks(m), layout.quant_slots) for m in recent]}


class DenseBlocks:
    """A fixed batch of ``batch_size`` sequences, each owning its blocks from the start."""

    grows = False  # no block is taken or given back as sequences grow: the cache need not ask

    def __init__(self, layout: WindowLayout, batch_size: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.layout = layout
        self.batch_size = batch_size

    def allocate(self, num_kv_heads: int, head_dim: int, device: torch.device) -> LayerStorage:
        return LayerStorage.allocate(self.layout, self.batch_size, num_kv_heads, head_dim, device)

    def hold(self, lengths: list[int]) -> bool:
        return False

    def add(self) -> None:
        raise ValueError("a dense cache has a fixed batch; use qsinkkv.paged.PagedCache to admit sequences")

    def keep(self, rows: list[int]) -> None:
        """Rows may repeat (beam search): the storage copies each kept sequence's blocks into its new row."""
        self.batch_size = len(rows)

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        n = lambda slots: torch.arange(self.batch_size * slots, dtype=torch.int64,  # noqa: E731
                                       device=device).view(self.batch_size, slots)
        return n(1)[:, 0], n(self.layout.float_slots), n(self.layout.quant_slots)


class PagedBlocks:
    """Pools of ``max_seqs`` sink pages, ``float_blocks`` and ``quant_blocks`` shared by the sequences
    added and kept; no sequence at first. ``free[kind]`` is the free list (the next block taken is the last),
    ``held[kind][b]`` how many ring slots of sequence b hold a block, ``host[kind]`` the tables on the host
    (what is edited; the layers read device copies from ``tables``)."""

    grows = True

    def __init__(self, layout: WindowLayout, *, max_seqs: int, float_blocks: int, quant_blocks: int):
        for name, value, least in (("max_seqs", max_seqs, 1), ("float_blocks", float_blocks, layout.float_slots),
                                   ("quant_blocks", quant_blocks, layout.quant_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least} (one sequence's ring), got {value!r}")
        self.layout = layout
        self.sizes = {"sink": max_seqs, "float": float_blocks, "quant": quant_blocks}
        self.free = {kind: list(range(n - 1, -1, -1)) for kind, n in self.sizes.items()}
        self.taken = {kind: [] for kind in KINDS}  # taken since the cache last zeroed them (take_new)
        self.host = {"sink": torch.empty(0, dtype=torch.int64),
                     "float": torch.empty(0, layout.float_slots, dtype=torch.int64),
                     "quant": torch.empty(0, layout.quant_slots, dtype=torch.int64)}
        self.held: dict[str, list[int]] = {"float": [], "quant": []}

    @property
    def batch_size(self) -> int:
        return len(self.host["sink"])

    def allocate(self, num_kv_heads: int, head_dim: int, device: torch.device) -> LayerStorage:
        return LayerStorage.allocate_pool(self.layout, num_kv_heads, head_dim, device, sink_pages=self.sizes["sink"],
                                          float_blocks=self.sizes["float"], quant_blocks=self.sizes["quant"])

    def add(self) -> None:
        if not self.free["sink"]:
            raise PoolExhausted(f"no free sequence slot: all max_seqs={self.sizes['sink']} are admitted; "
                                "release one first")
        self.host["sink"] = torch.cat((self.host["sink"], torch.tensor([self._take("sink")])))
        for kind in ("float", "quant"):
            empty = torch.full((1, self.host[kind].shape[1]), -1, dtype=torch.int64)
            self.host[kind] = torch.cat((self.host[kind], empty))
            self.held[kind].append(0)

    def keep(self, rows: list[int]) -> None:
        """Repeating a row (beam search) would share its blocks between sequences, and is refused."""
        if len(set(rows)) < len(rows):
            raise ValueError(f"a paged cache cannot repeat sequences (beam search would share their blocks), got "
                             f"rows {rows}; use SinkQuantCache for beam search")
        dropped = sorted(set(range(self.batch_size)) - set(rows))
        index = torch.tensor(rows, dtype=torch.int64)
        for kind in KINDS:
            held = self.host[kind][dropped]
            self._give(kind, held[held >= 0].tolist())
            self.host[kind] = self.host[kind][index]
        for kind in ("float", "quant"):
            self.held[kind] = [self.held[kind][r] for r in rows]

    def hold(self, lengths: list[int]) -> bool:
        need = needed_blocks(self.layout, lengths)
        held = self.held
        grow = {kind: [(b, held[kind][b], n) for b, n in enumerate(need[kind]) if n > held[kind][b]]
                for kind in ("float", "quant")}
        shrink = {kind: [(b, n, held[kind][b]) for b, n in enumerate(need[kind]) if n < held[kind][b]]
                  for kind in ("float", "quant")}
        if not any(grow.values()) and not any(shrink.values()):  # (most steps)
            return False
        count = {kind: sum(n - h for _, h, n in rows) for kind, rows in grow.items()}
        free = {kind: len(self.free[kind]) + sum(h - n for _, n, h in shrink[kind]) for kind in count}
        if any(count[kind] > free[kind] for kind in count):
            raise PoolExhausted(
                "the pool has too few free blocks for this step: it needs "
                + ", ".join(f"{count[k]} more {k} blocks ({free[k]} free)" for k in count)
                + "; release a sequence or give it fewer new tokens")
        for kind, rows in shrink.items():
            # (the last row first, each row's last block first: a shrink that undoes a grow -- a refused step rolled
            # back -- leaves the free list exactly as it was, so later steps take the same blocks)
            for b, n, h in reversed(rows):
                self._give(kind, self.host[kind][b, n:h].tolist())
                self.host[kind][b, n:h] = -1
                held[kind][b] = n
        for kind, rows in grow.items():
            for b, h, n in rows:
                self.host[kind][b, h:n] = torch.tensor([self._take(kind) for _ in range(n - h)])
                held[kind][b] = n
        return True

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(self.host[kind].to(device, copy=True).contiguous() for kind in KINDS)

    def in_use(self) -> dict[str, int]:
        """Blocks held by sequences, per kind (sink pages, float blocks, quantized blocks)."""
        return {kind: self.sizes[kind] - len(self.free[kind]) for kind in KINDS}

    def _give(self, kind: str, blocks: list[int]) -> None:
        self.free[kind].extend(reversed(blocks))

    def _take(self, kind: str) -> int:
        block = self.free[kind].pop()
        self.taken[kind].append(block)
        return block

    def take_new(self) -> dict[str, list[int]]:
        """The blocks taken since the last call, per kind: they hold a former owner's bytes (or anything) until
        the cache zeroes them, so that a row never reads another's bytes where its own are not written yet."""
        taken, self.taken = self.taken, {kind: [] for kind in KINDS}
        return taken


@dataclass(frozen=True)
class StepMetadata:
    """One step's batch, shaped like vLLM's attention metadata (rows in batch order).

    query_start_loc [B + 1] int64: row b's new tokens are packed rows ``[qsl[b], qsl[b+1])``.
    seq_lens        [B] int64:     tokens each sequence holds after the step.
    sink_table      [B] int64:     each sequence's sink page.
    float_table     [B, float_slots], quant_table [B, quant_slots] int64: the block of each ring
                    slot (-1: not taken).
    slot_mapping    [N] int64:     where each new token's K/V is written in the float pools, as
                    ``block * block_size + row``; -1 for a token that goes to the sink page, is
                    quantized straight from the chunk, or leaves the window within the chunk.
    """
    query_start_loc: Tensor
    seq_lens: Tensor
    sink_table: Tensor
    float_table: Tensor
    quant_table: Tensor
    slot_mapping: Tensor


def step_metadata(layout: WindowLayout, host_tables: dict[str, Tensor], seq_lens: list[int],
                  new_tokens: list[int]) -> StepMetadata:
    """The metadata of a step that brings ``new_tokens[b]`` tokens to sequences holding ``seq_lens[b]``,
    over tables (on the host) that already hold the step's blocks."""
    bs, S = layout.block_size, layout.sink_tokens
    tables = {kind: t.clone() for kind, t in host_tables.items()}
    slots = []
    for b, (n, t) in enumerate(zip(seq_lens, new_tokens)):
        m1 = layout.recent_count(n + t)
        float_from = max(layout.quantized_blocks(m1) * bs, layout.first_visible(m1))  # tokens the float ring keeps
        for p in range(n, n + t):
            r = p - S
            if r < float_from:
                slots.append(-1)
            else:
                row = r % layout.float_rows
                slots.append(int(tables["float"][b, row // bs]) * bs + row % bs)
    qsl = torch.tensor([0] + list(new_tokens)).cumsum(0)
    after = torch.tensor(seq_lens, dtype=torch.int64) + torch.tensor(new_tokens, dtype=torch.int64)
    return StepMetadata(qsl, after, tables["sink"], tables["float"], tables["quant"],
                        torch.tensor(slots, dtype=torch.int64))
