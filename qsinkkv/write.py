"""The write op: store a step's new tokens into a ``LayerStorage``: one plan, one commit.

Each row of a step gets some new tokens after the ``seq_lens[row]`` it holds: the first S of a sequence go to
its sinks, the rest to its float ring, and every block that becomes full and older than the unquantized tail is
quantized (once) into its quantized-ring slot. Blocks that leave the window before they could be read are never
quantized, and recent tokens that leave it before they could be read are never stored.

``plan`` says, from the lengths alone, where every new token goes, as index tensors: the sink rows, the
float-ring rows, the blocks that complete (their older tokens in the ring, the newer ones the step's) and the
float rows the shorter stream still reads that the step overwrites (the undo rule, ``WindowLayout.live_float_from``).
Every layer of a model step shares one plan. ``commit`` carries it out: the undo copies, then every completing
block quantized (all of them before anything is written, so a refused block leaves the storage untouched), then
the sink and float rows. A decode step of equal rows on a dense storage is the plan's cheapest case: the torch
writer makes one strided copy per ring. ``Writer`` says how the blocks and rows are written (``WRITER_TORCH``, the
reference, or ``decode_c.WRITER_C``: the same bits in C).

``append`` stores a padded chunk ``[B, Hkv, T, D]``; ``append_tokens`` a packed step's tokens ``[N, Hkv, D]``.
Both return an ``Undo`` that restores the state before them, for a caller that must roll back a step another
layer refused; it holds copies of the quantized-ring slots the step's blocks complete into (once per block_size
tokens) and of the float rows the shorter stream still reads that a long chunk wraps over: a plain decode step
copies nothing.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import checks, quant, trace
from .storage import QUANT_TENSORS, LayerStorage


@dataclass
class Undo:
    seq_lens: Tensor                            # [B] before the write
    saved: list[tuple[Tensor, tuple, Tensor]]  # (storage tensor, index, what it held there)


@dataclass(frozen=True)
class Writer:
    """How a plan's blocks and rows are written: ``complete_blocks`` and ``store_rows`` (PyTorch, the reference:
    ``WRITER_TORCH``; ``decode_c.WRITER_C``: the same bits in C). ``kernel`` names it (``trace.KERNELS``)."""
    kernel: str
    complete_blocks: Callable
    store_rows: Callable


def append(storage: LayerStorage, k: Tensor, v: Tensor, lengths: list[int], quantizer,
           writer: Writer | None = None) -> Undo:
    """Store ``k[b, :, :lengths[b]]`` (and v, ``[B, Hkv, T, D]``) after the ``seq_lens[b]`` tokens of every row b.

    quantizer: ``qsinkkv.quant`` or ``qsinkkv.kernels.api`` (same functions, bit-identical codes).
    Raises ValueError (storage unchanged) if a block's scale or zero overflows ``scale_dtype``."""
    B, H, T, D = k.shape
    tokens = [x[:, :, 0] if T == 1 else x.transpose(1, 2).reshape(B * T, H, D) for x in (k, v)]
    every = range(B)
    return append_tokens(storage, *tokens, every, every if T == 1 else range(0, B * T, T), lengths, quantizer, True,
                         writer)


def append_tokens(storage: LayerStorage, k: Tensor, v: Tensor, rows, starts, lens, quantizer,
                  keep_undo: bool = True, writer: Writer | None = None) -> Undo | None:
    """Store ``k[starts[i] : starts[i] + lens[i]]`` (and v, ``[N, Hkv, D]``) after the ``seq_lens[rows[i]]`` tokens
    of row ``rows[i]`` (distinct rows; the others get none). keep_undo=False (a caller that never rolls back: an
    engine) copies nothing aside and returns None.

    Raises ValueError (storage unchanged) if a block's scale or zero overflows ``scale_dtype``."""
    rows = tuple(rows)
    every_row = rows == tuple(range(storage.batch_size))
    before = storage.seq_lens.clone() if keep_undo else None
    held = (storage.seq_lens if every_row else storage.seq_lens[list(rows)]).tolist()
    p = plan(storage.layout, tuple(held), tuple(lens), tuple(starts), rows)
    saved = commit(storage, p, k, v, quantizer, writer or WRITER_TORCH, keep_undo)
    return Undo(before, saved) if keep_undo else None


def undo(storage: LayerStorage, record: Undo) -> None:
    """Return to the state before the ``append`` that made ``record`` (slots past the old lengths
    may keep the undone tokens: no query sees them)."""
    for target, index, old in reversed(record.saved):
        target[index] = old
    storage.seq_lens.copy_(record.seq_lens)


@dataclass(frozen=True)
class WritePlan:
    """Where a step's new tokens go, from the lengths alone: host int64 ``[n]`` tensors, ``*_at`` places in the
    step's tokens ``k, v [N, Hkv, D]``, ``*_rows`` rows of the storage.

    sink_at, sink_rows, sink_pos: token to sink ``sink_pos`` of its row.
    float_at, float_rows, float_row: token to float-ring row ``float_row``.
    full_rows, full_block, full_from, full_at: recent block ``full_block`` of its row completes and is quantized
      into its ring slot now; its tokens from recent index ``full_from`` on are the step's, from ``full_at`` on
      (the older ones are in the float ring; ``full_from`` past the block: all of them are).
    live_float_rows, live_float_row: float-ring rows the shorter stream still reads and the step overwrites
      (copied aside for undo, with every quantized-ring slot a block completes into).
    rows, lens: the rows that get tokens, and how many each.
    ring_row: the cheapest case (rows 0 .. n-1, token i one new token of row i, each to this float-ring row,
      nothing else written), else None."""
    sink_at: Tensor
    sink_rows: Tensor
    sink_pos: Tensor
    float_at: Tensor
    float_rows: Tensor
    float_row: Tensor
    full_rows: Tensor
    full_block: Tensor
    full_from: Tensor
    full_at: Tensor
    live_float_rows: Tensor
    live_float_row: Tensor
    rows: Tensor
    lens: Tensor
    ring_row: int | None


@functools.lru_cache(maxsize=16)
def plan(layout, held: tuple[int, ...], lens: tuple[int, ...], starts: tuple[int, ...],
         rows: tuple[int, ...]) -> WritePlan:
    """The plan of a step where row ``rows[i]``, holding ``held[i]`` tokens, gets the ``lens[i]`` tokens at
    ``starts[i] ..`` of the step's tokens. Plain ints, once per step and lengths (every layer asks alike)."""
    S, bs, F = layout.sink_tokens, layout.block_size, layout.float_rows
    sink, floats, full, live_float = ([], [], []), ([], [], []), ([], [], [], []), ([], [])
    for row, n, t, first_at in zip(rows, held, lens, starts):
        to_sinks = min(max(S - n, 0), t)
        if to_sinks:
            sink[0].extend(range(first_at, first_at + to_sinks))
            sink[1].extend([row] * to_sinks)
            sink[2].extend(range(n, n + to_sinks))
        before, after = layout.recent_count(n), layout.recent_count(n + t)  # recent tokens before / after
        if after == before:
            continue
        at_before = first_at + to_sinks  # the place of recent token `before`, the row's first new recent one
        quantized_before, quantized_after = layout.quantized_blocks(before), layout.quantized_blocks(after)
        # Blocks before first_kept_block(after) are never visible again: neither quantize nor store them.
        for block in range(max(quantized_before, layout.first_kept_block(after)), quantized_after):
            first_new = max(block * bs, before)
            for column, x in zip(full, (row, block, first_new, at_before + first_new - before)):
                column.append(x)
        stays = max(before, quantized_after * bs)  # recent tokens [stays, after) stay unquantized: to the ring
        floats[0].extend(range(at_before + stays - before, at_before + after - before))
        floats[1].extend([row] * (after - stays))
        if after - stays == 1:  # (a decode step's: no generator)
            floats[2].append(stays % F)
        else:
            floats[2].extend(r % F for r in range(stays, after))
        live_from = max(stays, layout.live_float_from(quantized_before))
        if after > live_from:
            live_float[0].extend([row] * (after - live_from))
            live_float[1].extend(r % F for r in range(live_from, after))
    cheapest = (not sink[0] and not full[0] and rows == tuple(range(len(rows))) and set(lens) == {1}
                and floats[0] == list(starts) == list(rows) and len(set(floats[2])) == 1)
    columns = (*sink, *floats, *full, *live_float, rows, lens)
    flat = torch.tensor([x for column in columns for x in column], dtype=torch.long)  # one tensor, split in views
    return WritePlan(*flat.split([len(column) for column in columns]), floats[2][0] if cheapest else None)


def commit(storage: LayerStorage, step: WritePlan, k: Tensor, v: Tensor, quantizer, writer: Writer,
           keep_undo: bool = True) -> list[tuple[Tensor, tuple, Tensor]]:
    """Carry out the write plan ``step`` over the step's tokens ``k, v [N, Hkv, D]``; returns what the undo must put
    back (nothing with keep_undo=False). Raises ValueError (nothing written) if a block's scale overflows."""
    layout, cfg, dev = storage.layout, storage.layout.config, storage.device
    fr = storage.float_k.shape[2]  # rows of a float block (block_size; an engine's page: the rows a page holds)
    saved = []
    if keep_undo and step.live_float_rows.numel():
        row = step.live_float_row.to(dev)
        where = (slice(None), storage.float_table[step.live_float_rows.to(dev), row // fr], row % fr)
        saved += [_save(t, where) for t in (storage.float_k, storage.float_v)]
    if keep_undo and step.full_rows.numel():  # every slot a block completes into: once per block_size tokens
        # (an engine's new page given back must come back as it was)
        slot = step.full_block.to(dev) % layout.quant_slots
        where = (slice(None), storage.quant_table[step.full_rows.to(dev), slot])  # pool[where]: [Hkv, n, ...]
        saved += [_save(getattr(storage, name), where) for name in QUANT_TENSORS]
    if step.full_rows.numel():  # before the rows below: a completing block reads the ring, where a new token may go
        writer.complete_blocks(storage, k, v, step.full_at, step.full_rows, step.full_block, step.full_from, quantizer)
    if step.sink_at.numel():  # (a sink page is one block of sink_tokens rows)
        writer.store_rows(storage.sink_k, storage.sink_v, storage.sink_table.unsqueeze(1), k, v, step.sink_at,
                          step.sink_rows, step.sink_pos, cfg.sink_tokens)
    cheapest = step.ring_row is not None and step.rows.shape[0] == storage.batch_size  # one float row of every row
    if cheapest and storage.dense and writer is WRITER_TORCH:  # each sequence's ring is one run of rows: a strided copy
        trace.ran("write_rows", "torch")
        for ring, x in ((storage.float_k, k), (storage.float_v, v)):
            x = x if x.shape[0] == storage.batch_size else x[:storage.batch_size]
            rows = ring.view(ring.shape[0], storage.batch_size, layout.float_rows, -1)[:, :, step.ring_row]
            rows.copy_(x.transpose(0, 1))
    elif step.float_at.numel():
        writer.store_rows(storage.float_k, storage.float_v, storage.float_table, k, v, step.float_at, step.float_rows,
                          step.float_row, fr)
    if cheapest:  # (a row's view writes its lengths through to the whole storage's)
        storage.seq_lens += 1
    else:
        storage.seq_lens[step.rows] += step.lens
    return saved


def complete_blocks(storage: LayerStorage, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor, blocks: Tensor,
                    first_new: Tensor, quantizer) -> None:
    """Recent block ``blocks[i]`` of sequence ``seqs[i]`` completes: its tokens from recent index ``first_new[i]`` on
    are ``k, v [N, Hkv, D]`` from token ``at[i]`` on, its older ones are in the float ring. Quantize every such
    block (the new tokens cast to ``window_dtype`` first, as the ring holds them) and write it to its quantized-ring
    slot ``quant_table[seqs[i], blocks[i] % quant_slots]``. All host int64 ``[n]``. Raises ValueError (nothing
    written) if a scale or zero overflows ``scale_dtype``. The write's reference; ``decode_c`` has its C version."""
    trace.ran("write_blocks", "torch")
    slots, ring_blocks = check_blocks(storage, seqs, blocks, first_new)
    cfg = storage.layout.config
    parts = completing_blocks(storage, k, v, at, seqs, blocks, first_new, ring_blocks)
    quantized = (quantizer.quantize_key_blocks(parts[0].unsqueeze(2), cfg.bits, cfg.scale_dtype)
                 + quantizer.quantize_values(parts[1].unsqueeze(2), cfg.bits, cfg.value_group_size, cfg.scale_dtype))
    put_blocks(storage, seqs, blocks, [x.squeeze(2) for x in quantized], slots)


def check_blocks(storage: LayerStorage, seqs: Tensor, blocks: Tensor, first_new: Tensor) -> tuple[Tensor, Tensor]:
    """``complete_blocks``' table entries (its arguments) name blocks of their pools: each block's quantized-ring
    slot (where it is written) and the float-ring blocks of its older tokens (where they are read). Every writer
    refuses a table it would follow outside a pool, or to no block (-1), before anything is written: by name on the
    CPU, as a device-side assert on a GPU (``checks.table_in_step``: no host read; C checks in C). Returns the
    entries, on the storage's device, for the write to follow: ``slots [n]`` (``quant_table``'s) and the float-ring
    block of each token of each block ``[n, block_size]`` (``float_table``'s; empty without a float ring)."""
    layout, dev = storage.layout, storage.device
    seq, blk = seqs.to(dev), blocks.to(dev)
    slots = storage.quant_table[seq, blk % layout.quant_slots]
    checks.table_in_step("quant_table", slots, min(getattr(storage, name).shape[1] for name in QUANT_TENSORS),
                         "the quantized pools (the slots this write completes into)", none_ok=False)
    if not layout.float_rows:  # (bs == 1 and no residual: a block's tokens are all the step's)
        return slots, seq.new_empty(seq.shape[0], 0)
    tok = _block_tokens(layout, blk)
    ring_blocks = storage.float_table[seq.unsqueeze(1), tok % layout.float_rows // storage.float_k.shape[2]]
    older = tok < first_new.to(dev).unsqueeze(1)  # read from the ring (block 0 stands for the rest: no host read)
    checks.table_in_step("float_table", torch.where(older, ring_blocks, 0), min(storage.float_k.shape[1],
                         storage.float_v.shape[1]), "the float pools (the ring rows this write reads)", none_ok=False)
    return slots, ring_blocks


def check_rows(pool_k: Tensor, pool_v: Tensor, table: Tensor, seqs: Tensor, ring_rows: Tensor,
               rows_per_block: int) -> Tensor:
    """``store_rows``' table entries (its arguments) name blocks of ``pool_k`` and ``pool_v``, never -1: as
    ``check_blocks``, before anything is written. Returns them ``[n]`` (on the table's device)."""
    dev = table.device
    entries = table[seqs.to(dev), ring_rows.to(dev) // rows_per_block]
    checks.table_in_step("table", entries, min(pool_k.shape[1], pool_v.shape[1]),
                         "pool_k and pool_v (the rows this write stores)", none_ok=False)
    return entries


def put_blocks(storage: LayerStorage, seqs: Tensor, blocks: Tensor, quantized: list[Tensor],
               slots: Tensor | None = None) -> None:
    """Write quantized blocks into their quantized-ring slots ``quant_table[seqs[i], blocks[i] % quant_slots]``
    (``slots``, when the caller has them: ``check_blocks``'): ``quantized``, the six ``QUANT_TENSORS`` of the n
    blocks, each ``[n, Hkv, ...]`` (a pool's block)."""
    dev = storage.device
    if slots is None:
        slots = storage.quant_table[seqs.to(dev), blocks.to(dev) % storage.layout.quant_slots]
    for name, src in zip(QUANT_TENSORS, quantized):                                 # pool[:, slots]: [Hkv, n, ...]
        getattr(storage, name)[:, slots] = src.transpose(0, 1)


def _block_tokens(layout, blk: Tensor) -> Tensor:
    """``[n, block_size]``: the recent indices of the tokens of blocks ``blk [n]``."""
    return blk.unsqueeze(1) * layout.block_size + torch.arange(layout.block_size, device=blk.device)


def completing_blocks(storage: LayerStorage, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor, blocks: Tensor,
                      first_new: Tensor, ring_blocks: Tensor | None = None) -> list[Tensor]:
    """The tokens of each block ``complete_blocks`` completes (same arguments), as they will be quantized: its older
    ones from the float ring (``ring_blocks``, ``check_blocks``' entries when the caller has them), the step's from
    ``k, v``, in ``window_dtype``: ``[k_blocks, v_blocks]``, each ``[n, Hkv, block_size, D]`` (copies)."""
    layout, cfg = storage.layout, storage.layout.config
    F, dev = layout.float_rows, storage.device
    fr = storage.float_k.shape[2]  # rows of a float block (block_size; an engine's page: the rows a page holds)
    seq, blk = seqs.to(dev), blocks.to(dev)
    tok = _block_tokens(layout, blk)                                                # [n, bs] recent indices
    new = tok >= first_new.to(dev).unsqueeze(1)                                     # the step's tokens
    place = at.to(dev).unsqueeze(1) + tok - first_new.to(dev).unsqueeze(1)         # [n, bs] where they are in k, v
    if F and ring_blocks is None:
        ring_blocks = storage.float_table[seq.unsqueeze(1), tok % F // fr]
    parts = []
    for ring, x in ((storage.float_k, k), (storage.float_v, v)):
        if F:  # the block's older tokens are in the float ring (none when bs == 1 and R == 0: never read)
            xb = ring[:, ring_blocks, tok % F % fr]                                 # [Hkv, n, bs, D], a copy
            i, t = new.nonzero(as_tuple=True)
            xb[:, i, t] = x[place[i, t].to(x.device)].transpose(0, 1).to(dev, cfg.window_dtype)
        else:
            xb = x[place.to(x.device)].permute(2, 0, 1, 3).to(dev, cfg.window_dtype)  # [Hkv, n, bs, D]
        parts.append(xb.transpose(0, 1))                                            # [n, Hkv, bs, D]
    return parts


def overflow_error(storage: LayerStorage, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor, blocks: Tensor,
                   first_new: Tensor) -> ValueError:
    """The error of a write whose block's scale overflowed (``quant.scale_overflow``'s), naming the largest |x| of the
    blocks it completes (``complete_blocks``' arguments; gathered as the reference gathers them): every writer's."""
    parts = completing_blocks(storage, k, v, at, seqs, blocks, first_new)
    return quant.scale_overflow(storage.layout.config.scale_dtype, max(float(x.float().abs().amax()) for x in parts))


def store_rows(pool_k: Tensor, pool_v: Tensor, table: Tensor, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor,
               ring_rows: Tensor, rows_per_block: int) -> None:
    """Token ``at[i]`` of ``k, v [N, Hkv, D]`` into row ``ring_rows[i] % rows_per_block`` of block
    ``table[seqs[i], ring_rows[i] // rows_per_block]`` of ``pool_k, pool_v [Hkv, blocks, rows_per_block, D]``, cast
    to the pools' dtype (``table [B, slots]``; ``at``, ``seqs``, ``ring_rows`` host int64 ``[n]``, ``at``
    increasing: all of ``k`` when as long). The write's reference; ``decode_c`` has its C version."""
    trace.ran("write_rows", "torch")
    blocks = check_rows(pool_k, pool_v, table, seqs, ring_rows, rows_per_block)  # (on the table's device: the pools')
    where = (slice(None), blocks, ring_rows.to(blocks.device) % rows_per_block)
    for pool, x in ((pool_k, k), (pool_v, v)):
        pool[where] = (x if len(at) == x.shape[0] else x[at.to(x.device)]).transpose(0, 1).to(pool.dtype)


WRITER_TORCH = Writer("torch", complete_blocks, store_rows)


def _save(t: Tensor, index: tuple) -> tuple[Tensor, tuple, Tensor]:
    return t, index, t[index].clone()


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
