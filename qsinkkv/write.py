"""The write op: store a ragged chunk of new tokens into a ``LayerStorage``.

Row b of a chunk ``k, v [B, Hkv, T, D]`` holds ``lengths[b]`` new tokens (the rest of the row
is padding and is never stored); they go to positions ``seq_lens[b] ..``: the first S of a
sequence to its sinks, the rest to its float ring, and every block that becomes full and
older than the unquantized tail is quantized (once) into its quantized ring slot. Blocks that
leave the window before they could be read are never quantized.

Transactional: every block is quantized before anything is written, so a refused block (its
scale overflows) leaves the storage untouched; and ``append`` returns an ``Undo`` that restores
the state before it, for a caller that must roll back a step other layers refused. The undo
copies aside only what the write overwrites that the shorter stream still reads (a quantized
slot when a block completes, float rows when a long chunk wraps the ring): a plain decode step
copies nothing.

Rows that share their length and chunk length (every batch of equal lengths) are written in one
pass; a decode step of rows at different lengths (a left-padded ``generate``) in one indexed
write per tensor; any other ragged chunk row by row.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .storage import QUANT_TENSORS, LayerStorage


@dataclass
class Undo:
    seq_lens: Tensor                            # [B] before the write
    saved: list[tuple[Tensor, tuple, Tensor]]  # (storage tensor or row view, index, what it held there)


def append(storage: LayerStorage, k: Tensor, v: Tensor, lengths: list[int], quantizer) -> Undo:
    """Store ``k[b, :, :lengths[b]]`` (and v) after the ``seq_lens[b]`` tokens of every row b.

    quantizer: ``qsinkkv.quant`` or ``qsinkkv.kernels`` (same functions, bit-identical codes).
    Raises ValueError (storage unchanged) if a block's scale or zero overflows ``scale_dtype``."""
    before = storage.seq_lens.clone()
    n0 = before.tolist()
    if k.shape[2] == 1 and min(lengths) == 1 and len(set(n0)) == 1 and _stays_float(storage.layout, n0[0]):
        # the common decode step: one token per row into the float ring, no block completes, nothing
        # the shorter stream reads is overwritten (the row held a token already quantized or empty)
        layout, s = storage.layout, storage
        row = (n0[0] - layout.sink_tokens) % layout.float_rows
        for ring, x in ((s.float_k, k), (s.float_v, v)):
            if s.dense:  # each sequence's float ring is one run of rows: a strided copy
                ring.view(ring.shape[0], len(n0), layout.float_rows, -1)[:, :, row].copy_(x[:, :, 0].transpose(0, 1))
            else:
                ring[:, s.float_table[:, row // layout.block_size], row % layout.block_size] = \
                    x[:, :, 0].transpose(0, 1).to(ring.dtype)
        storage.seq_lens += 1
        return Undo(before, [])
    if len(set(n0)) == 1 and len(set(lengths)) == 1:
        if not lengths[0]:
            return Undo(before, [])
        plan = _plan(storage, k[:, :, :lengths[0]], v[:, :, :lengths[0]], quantizer)  # may raise: nothing written
        return Undo(before, _commit(plan))
    # a ragged chunk: rows with one token in one indexed write, the others row by row
    ones = [b for b, t in enumerate(lengths) if t == 1]
    chunks = [(b, k[b:b + 1, :, :t], v[b:b + 1, :, :t]) for b, t in enumerate(lengths) if t > 1]
    return append_rows(storage, ones, k[ones, :, 0], v[ones, :, 0], chunks, quantizer)


def append_rows(storage: LayerStorage, ones: list[int], k_one: Tensor, v_one: Tensor,
                chunks: list[tuple[int, Tensor, Tensor]], quantizer, keep_undo: bool = True,
                one_token: OneTokenWrite | None = None) -> Undo | None:
    """A step given by rows, not padded: the sequences ``ones`` get one token each (``k_one, v_one
    [len(ones), Hkv, D]``, in that order), each ``(b, k, v)`` of ``chunks`` gets ``k, v [1, Hkv, t, D]``
    after its ``seq_lens[b]`` tokens; the other sequences get none. What a packed step (and the ragged
    part of ``append``) writes, without a ``[B, Hkv, T_max, D]`` chunk. keep_undo=False (a caller that never
    rolls back: an engine) copies nothing aside and returns None. one_token: how the one-token rows are written
    (``ONE_TOKEN_TORCH``, the default, or ``decode_c.ONE_TOKEN_C``: the same bits).

    Raises ValueError (storage unchanged) if a block's scale or zero overflows ``scale_dtype``."""
    before = storage.seq_lens.clone()
    plans = [_plan(storage.rows(b), kk, vv, quantizer) for b, kk, vv in chunks]  # may raise: nothing written yet
    # (it quantizes before it writes, so it may raise with nothing written too)
    one_token = one_token or ONE_TOKEN_TORCH
    saved = _append_one_token(storage, ones, k_one, v_one, quantizer, keep_undo, one_token) if ones else []
    for plan in plans:
        saved += _commit(plan, keep_undo)
    return Undo(before, saved) if keep_undo else None


def undo(storage: LayerStorage, record: Undo) -> None:
    """Return to the state before the ``append`` that made ``record`` (slots past the old lengths
    may keep the undone tokens: no query sees them)."""
    for target, index, old in reversed(record.saved):
        target[index] = old
    storage.seq_lens.copy_(record.seq_lens)


@dataclass
class _Plan:
    """One uniform part of a write (rows that all hold ``held`` tokens and get ``T`` more), computed
    and quantized but not yet written. Counts of recent tokens and of quantized blocks, before and after
    the chunk; blocks ``[first_block, quantized_after)`` are quantized by it."""
    storage: LayerStorage
    k: Tensor
    v: Tensor
    held: int
    to_sinks: int                # the chunk's first tokens that go to the sinks
    recent_before: int
    recent_after: int
    quantized_before: int
    quantized_after: int
    first_block: int
    float_k: Tensor | None       # the chunk's tokens that stay unquantized: recent
    float_v: Tensor | None       # [max(recent_before, quantized_after * bs), recent_after), as given
    quantized: tuple | None


def _plan(s: LayerStorage, k: Tensor, v: Tensor, quantizer) -> _Plan:
    layout, cfg = s.layout, s.layout.config
    bs = cfg.block_size
    held, T = int(s.seq_lens[0]), k.shape[2]
    to_sinks = min(max(cfg.sink_tokens - held, 0), T)
    recent_before, recent_after = layout.recent_count(held), layout.recent_count(held + T)
    quantized_before, quantized_after = layout.quantized_blocks(recent_before), layout.quantized_blocks(recent_after)
    # Blocks before `first_block` are never visible again: neither quantize nor store them.
    first_block = max(quantized_before, layout.first_kept_block(recent_after))
    start, end = first_block * bs, quantized_after * bs  # the blocks quantized now: recent tokens [start, end)
    lo = max(start, recent_before)                       # the chunk's first recent token that is stored at all
    recent = [x[:, :, to_sinks + lo - recent_before:] for x in (k, v)] if recent_after > lo else None  # [lo, after)
    quantized = None
    if end > start:
        blocks = []
        for ring, x in ((s.float_k, recent[0] if recent else None), (s.float_v, recent[1] if recent else None)):
            # the block's older tokens are in the float ring, the newer ones in the chunk
            parts = [ring[_float_index(s, start, min(recent_before, end))].transpose(0, 1)] \
                if start < recent_before else []
            if end > lo:  # window_dtype first: a block is quantized from its window_dtype values
                parts.append(x[:, :, :end - lo].to(cfg.window_dtype))
            tokens = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
            B, H, _, D = tokens.shape
            blocks.append(tokens.reshape(B, H, quantized_after - first_block, bs, D))
        quantized = (quantizer.quantize_key_blocks(blocks[0], cfg.bits, cfg.scale_dtype)
                     + quantizer.quantize_values(blocks[1], cfg.bits, cfg.value_group_size, cfg.scale_dtype))
    float_from = max(recent_before, end)
    float_k = float_v = None
    if recent_after > float_from:
        float_k, float_v = (x[:, :, float_from - lo:] for x in recent)
    return _Plan(s, k, v, held, to_sinks, recent_before, recent_after, quantized_before, quantized_after,
                 first_block, float_k, float_v, quantized)


def _commit(p: _Plan, keep_undo: bool = True) -> list[tuple[Tensor, tuple, Tensor]]:
    s, layout, cfg = p.storage, p.storage.layout, p.storage.layout.config
    T = p.k.shape[2]
    saved = []
    if p.quantized is not None:
        slots = torch.arange(p.first_block, p.quantized_after, device=s.device) % layout.quant_slots
        where = (slice(None), s.quant_table[:, slots])                        # pool[where]: [Hkv, B, n, ...]
        # the shorter stream's live blocks may share these slots
        if keep_undo and p.quantized_before > layout.first_kept_block(p.recent_before):
            saved += [_save(getattr(s, name), where) for name in QUANT_TENSORS]
        for name, src in zip(QUANT_TENSORS, p.quantized):
            getattr(s, name)[where] = src.transpose(0, 1)
    if p.to_sinks:  # sink slots past the old length: nothing live is overwritten
        where = (slice(None), s.sink_table[:, None], torch.arange(p.held, p.held + p.to_sinks, device=s.device))
        s.sink_k[where] = p.k[:, :, :p.to_sinks].transpose(0, 1).to(cfg.sink_dtype)
        s.sink_v[where] = p.v[:, :, :p.to_sinks].transpose(0, 1).to(cfg.sink_dtype)
    if p.float_k is not None:
        n = p.float_k.shape[2]
        where = _float_index(s, p.recent_after - n, p.recent_after)
        if keep_undo and layout.overwrites_live_float(p.recent_after - 1, p.quantized_before):
            saved += [_save(t, where) for t in (s.float_k, s.float_v)]
        for ring, x in ((s.float_k, p.float_k), (s.float_v, p.float_v)):
            ring[where] = x.transpose(0, 1).to(ring.dtype)
    s.seq_lens += T  # in place: a row view writes through to the whole storage's lengths
    return saved


@dataclass(frozen=True)
class _OneTokenPlan:
    """Where the new tokens of a one-token step go, as host index tensors (``at``: places in ``k, v``; ``rows``:
    rows of the storage): to the sinks at ``sink_pos``; to float-ring row ``float_row``; completing block
    ``full_block`` (quantized now into its ring slot); ``live_*``: float rows the shorter stream still reads
    (saved for undo). It depends only on the lengths, so every layer of a model step shares one."""
    sink_at: Tensor
    sink_rows: Tensor
    sink_pos: Tensor
    float_at: Tensor
    float_rows: Tensor
    float_row: Tensor
    full_at: Tensor
    full_rows: Tensor
    full_block: Tensor
    full_new: Tensor     # [n] recent index of the new token in each completing block's row
    live_rows: Tensor
    live_row: Tensor


@functools.lru_cache(maxsize=8)
def _one_token_plan(layout, lengths: tuple[int, ...], rows: tuple[int, ...]) -> _OneTokenPlan:
    S, bs, F = layout.sink_tokens, layout.block_size, layout.float_rows
    sink, floats, live, full = [], [], [], []      # per token: (place in k, v; storage row; where it goes)
    for i, (b, n) in enumerate(zip(rows, lengths)):   # once per step and lengths: plain ints
        if n < S:
            sink.append((i, b, n))
            continue
        r = n - S                            # the new token's recent index
        q0, q1 = layout.quantized_blocks(r), layout.quantized_blocks(r + 1)
        if r >= q1 * bs:                     # it stays unquantized (else it completes its own block now)
            floats.append((i, b, r % F))
            if layout.overwrites_live_float(r, q0):
                live.append((b, r % F))
        if q1 > max(q0, layout.first_kept_block(r + 1)):
            full.append((i, b, q1 - 1, r))
    def columns(entries, n):  # [(a, b, ...)] -> [tensor of a, tensor of b, ...]
        return [torch.tensor([e[j] for e in entries], dtype=torch.long) for j in range(n)]
    return _OneTokenPlan(*columns(sink, 3), *columns(floats, 3), *columns(full, 4), *columns(live, 2))


def _append_one_token(s: LayerStorage, rows: list[int], k: Tensor, v: Tensor, quantizer, keep_undo: bool,
                      impl: OneTokenWrite) -> list:
    """One new token for each sequence in ``rows`` (``k, v [len(rows), Hkv, D]``, in that order), each at
    its own length, written with one indexed write per tensor and kind of row (a pass per sequence would cost
    a pass per sequence); where each goes is ``_one_token_plan``'s, computed once for every layer of a step."""
    layout, cfg = s.layout, s.layout.config
    bs, nq = cfg.block_size, max(layout.quant_slots, 1)
    dev = s.device
    every_row = len(rows) == s.batch_size  # (rows are distinct and in order: then 0 .. B-1)
    p = _one_token_plan(layout, tuple((s.seq_lens if every_row else s.seq_lens[rows]).tolist()), tuple(rows))
    on = lambda x: x.to(dev)  # noqa: E731
    saved = []  # what the shorter stream reads and this step overwrites: a completing block's slot, live rows
    if keep_undo and p.live_rows.numel():
        row = on(p.live_row)
        where_f = (slice(None), s.float_table[on(p.live_rows), row // bs], row % bs)
        saved += [_save(t, where_f) for t in (s.float_k, s.float_v)]
    if p.full_at.numel():
        if keep_undo:
            where_q = (slice(None), s.quant_table[on(p.full_rows), on(p.full_block) % nq])  # pool[where_q]: [Hkv, n]
            saved += [_save(getattr(s, name), where_q) for name in QUANT_TENSORS]
        # before the rows below are stored: a completing block reads the ring, where a new token may go
        impl.complete_blocks(s, k, v, p.full_at, p.full_rows, p.full_block, p.full_new, quantizer)
    if p.sink_at.numel():  # (a sink page is one block of sink_tokens rows)
        impl.store_rows(s.sink_k, s.sink_v, s.sink_table.unsqueeze(1), k, v, p.sink_at, p.sink_rows, p.sink_pos,
                        cfg.sink_tokens)
    if p.float_at.numel():
        impl.store_rows(s.float_k, s.float_v, s.float_table, k, v, p.float_at, p.float_rows, p.float_row, bs)
    if every_row:
        s.seq_lens += 1
    else:
        s.seq_lens[rows] += 1
    return saved


def complete_blocks(s: LayerStorage, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor, blocks: Tensor,
                    new_recent: Tensor, quantizer) -> None:
    """Token ``at[i]`` of ``k, v [n, Hkv, D]`` completes recent block ``blocks[i]`` of sequence ``seqs[i]`` (as its
    recent index ``new_recent[i]``; the block's older tokens are in the float ring): quantize every such block
    (the new token cast to ``window_dtype`` first, as the ring holds it) and write it to its quantized-ring slot
    ``quant_table[seqs[i], blocks[i] % quant_slots]``. All host int64 ``[n]``. Raises ValueError (nothing written)
    if a scale or zero overflows ``scale_dtype``. The one-token write's reference; ``decode_c`` has its C version."""
    layout, cfg = s.layout, s.layout.config
    bs, F, nq, dev = cfg.block_size, layout.float_rows, max(layout.quant_slots, 1), s.device
    fr, blk = seqs.to(dev), blocks.to(dev)
    tok = blk.unsqueeze(1) * bs + torch.arange(bs, device=dev)                      # [n, bs] recent indices
    new = tok == new_recent.to(dev).unsqueeze(1)                                    # the new token's place
    parts = []
    for ring, x in ((s.float_k, k), (s.float_v, v)):
        xb = x[at.to(x.device)].to(cfg.window_dtype).unsqueeze(1)                  # [n, 1, Hkv, D]
        if F:  # the block's other tokens are in the float ring (empty when bs == 1 and R == 0: never read)
            held = ring[:, s.float_table[fr.unsqueeze(1), tok % F // bs], tok % bs]    # [Hkv, n, bs, D]
            xb = torch.where(new.view(*new.shape, 1, 1), xb, held.permute(1, 2, 0, 3))
        parts.append(xb.transpose(1, 2))                                           # [n, Hkv, bs, D]
    quantized = (quantizer.quantize_key_blocks(parts[0].unsqueeze(2), cfg.bits, cfg.scale_dtype)
                 + quantizer.quantize_values(parts[1].unsqueeze(2), cfg.bits, cfg.value_group_size, cfg.scale_dtype))
    where = (slice(None), s.quant_table[fr, blk % nq])                             # pool[where]: [Hkv, n, ...]
    for name, src in zip(QUANT_TENSORS, quantized):
        getattr(s, name)[where] = src.squeeze(2).transpose(0, 1)


def store_rows(pool_k: Tensor, pool_v: Tensor, table: Tensor, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor,
               ring_rows: Tensor, rows_per_block: int) -> None:
    """Token ``at[i]`` of ``k, v [n, Hkv, D]`` into row ``ring_rows[i] % rows_per_block`` of block
    ``table[seqs[i], ring_rows[i] // rows_per_block]`` of ``pool_k, pool_v [Hkv, blocks, rows_per_block, D]``, cast
    to the pools' dtype (``table [B, slots]``; ``at``, ``seqs``, ``ring_rows`` host int64 ``[n]``, ``at``
    increasing: all of ``k`` when as long). The one-token write's reference; ``decode_c`` has its C version."""
    dev = pool_k.device
    rows = ring_rows.to(dev)
    where = (slice(None), table[seqs.to(dev), rows // rows_per_block], rows % rows_per_block)
    for pool, x in ((pool_k, k), (pool_v, v)):
        pool[where] = (x if len(at) == x.shape[0] else x[at.to(x.device)]).transpose(0, 1).to(pool.dtype)


@dataclass(frozen=True)
class OneTokenWrite:
    """How a one-token step's rows are written: the blocks they complete and the rows they store (PyTorch, the
    reference: ``ONE_TOKEN_TORCH``; ``decode_c.ONE_TOKEN_C``: the same bits in C)."""
    complete_blocks: Callable
    store_rows: Callable


ONE_TOKEN_TORCH = OneTokenWrite(complete_blocks, store_rows)


def _stays_float(layout, n: int) -> bool:
    """Does the token at position n go to the float ring and complete no block?"""
    r = n - layout.sink_tokens
    q = layout.quantized_blocks(r + 1)
    return r >= 0 and q == layout.quantized_blocks(r) and r >= q * layout.block_size


def _save(t: Tensor, index: tuple) -> tuple[Tensor, tuple, Tensor]:
    return t, index, t[index].clone()


def _float_index(s: LayerStorage, r0: int, r1: int) -> tuple:
    """Where recent tokens r0 .. r1-1 of every row of ``s`` sit in the float pools: ``pool[index]`` is
    ``[Hkv, B, r1 - r0, D]``."""
    rows = torch.arange(r0, r1, device=s.device) % s.layout.float_rows
    bs = s.layout.block_size
    return slice(None), s.float_table[:, rows // bs], rows % bs


# --- forgetting the newest tokens ----------------------------------------------------------------

def crop_refusal(storage: LayerStorage, tokens: list[int]) -> str | None:
    """Why the newest ``tokens[b]`` tokens of each row cannot be forgotten, or None: the shorter
    stream's storage must be intact (no block it needs was evicted, none it would hold unquantized
    was quantized)."""
    layout = storage.layout
    for b, (n, t) in enumerate(zip(storage.seq_lens.tolist(), tokens)):
        if not 0 <= t <= n:
            return f"sequence {b} holds {n} tokens; cannot crop {t}"
        m, m_new = layout.recent_count(n), layout.recent_count(n - t)
        if layout.quantized_blocks(m_new) != layout.quantized_blocks(m):
            return (f"cannot crop {t} tokens of sequence {b}: a block they share with older tokens was already "
                    f"quantized (block_size={layout.block_size}, unquantized_tokens={layout.unquantized_tokens})")
        if m > layout.recent_tokens and layout.first_kept_block(m_new) != layout.first_kept_block(m):
            return (f"cannot crop {t} tokens of sequence {b}: the shorter stream would see tokens that were "
                    f"already evicted from the window (recent_tokens={layout.recent_tokens})")
    return None
