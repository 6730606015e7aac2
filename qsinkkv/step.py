"""One step's new tokens grouped by how they run: the rows with one new token decode, the rows with more
prefill, rows with none sit out. Built once per call (from a padded chunk or from packed tokens) and read by
the checks, the write and the attention, so a step's cost follows the tokens it carries, never B x T_max."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import write
from .prefill import causal_context
from .storage import LayerStorage


@dataclass
class Split:
    """A step's new tokens grouped by how they run: the rows with one new token decode, the rows with more
    prefill; rows with none are in neither. q is None for ``append``.

    lens: [B] new tokens per row. one: the rows of one token; q_one [len(one), H, D], k_one, v_one
    [len(one), Hkv, D]. multi: the rows of more; q_multi [len(multi), H, T_multi, D], k_multi, v_multi
    [len(multi), Hkv, T_multi, D], row i holding ``lens[multi[i]]`` real tokens (T_multi: the longest).
    A packed step also keeps its tokens where they lie: ``packed`` (q, k, v ``[N, heads, D]``), row b's at
    ``[qsl[b], qsl[b+1])``; its padded multi chunk is made only if a prefill asks for it (``multi_chunk``)."""
    lens: list[int]
    one: list[int]
    q_one: Tensor | None
    k_one: Tensor | None
    v_one: Tensor | None
    multi: list[int]
    q_multi: Tensor | None
    k_multi: Tensor | None
    v_multi: Tensor | None
    qsl: Tensor | None = None                         # [B + 1] host int64 (a packed step)
    packed: tuple[Tensor, Tensor, Tensor] | None = None  # (q, k, v) [N, heads, D] (a packed step)

    @property
    def multi_lens(self) -> list[int]:
        """The new tokens of each row of ``multi``."""
        return [self.lens[b] for b in self.multi]

    def multi_real(self) -> Tensor:
        """bool ``[len(multi), T_multi]`` (host): which columns of the ``*_multi`` tensors hold real tokens."""
        return torch.arange(max(self.multi_lens)) < torch.tensor(self.multi_lens).unsqueeze(1)

    def multi_chunk(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(q_multi, k_multi, v_multi)``: a padded step's own, or gathered from a packed step's tokens once (one
        longer row: a view; padding repeats a token)."""
        if self.k_multi is None and self.packed is not None:
            q, k, v = self.packed
            if len(self.multi) == 1:
                start, t = int(self.qsl[self.multi[0]]), self.lens[self.multi[0]]
                chunk = [x[start:start + t].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]  # [1, heads, t, D]
            else:
                n, T = len(self.multi), max(self.multi_lens)
                tokens = (self.qsl[self.multi].unsqueeze(1) + torch.arange(T)).clamp(max=k.shape[0] - 1).flatten()
                chunk = [x.index_select(0, tokens.to(x.device)).view(n, T, *x.shape[1:]).transpose(1, 2)
                         for x in (q, k, v)]
            self.q_multi, self.k_multi, self.v_multi = chunk
        return self.q_multi, self.k_multi, self.v_multi

    def multi_tokens(self) -> Tensor:
        """``[sum(multi_lens)]`` host int64: a packed step's tokens of the longer rows, row by row."""
        starts, lens = self.qsl[self.multi], torch.tensor(self.multi_lens)
        return torch.repeat_interleave(starts - (lens.cumsum(0) - lens), lens) + torch.arange(int(lens.sum()))


def split_padded(q: Tensor | None, k: Tensor, v: Tensor, lens: list[int]) -> Split:
    """Group the rows of a padded chunk ``[B, heads, T, D]``: views where the rows are one run."""
    one, multi = _one_and_multi(lens)
    pick = lambda x, rows, t: None if x is None or not rows else take_rows(x[:, :, :t], rows)  # noqa: E731
    if len(one) == len(lens):  # a decode step: every row's token as it lies (the common case, kept cheap)
        firsts = [None if x is None else x.select(2, 0) for x in (q, k, v)]
    else:
        firsts = [None if x is None or not one else take_rows(x.select(2, 0), one) for x in (q, k, v)]
    T_multi = max((lens[b] for b in multi), default=0)
    return Split(lens, one, *firsts, multi, *(pick(x, multi, T_multi) for x in (q, k, v)))


def split_packed(q: Tensor, k: Tensor, v: Tensor, qsl: Tensor, lens: list[int]) -> Split:
    """Group the rows of a packed step (``[N, heads, D]``, row b at ``[qsl[b], qsl[b+1])``): the one-token rows
    are gathered (a decode step's are the tokens themselves); the longer ones stay where they lie."""
    one, multi = _one_and_multi(lens)
    if one and len(one) == q.shape[0]:  # every token is a one-token row's, in row order (a decode step): no gather
        firsts = [q, k, v]
    else:
        firsts = [x.index_select(0, qsl[one].to(x.device)) if one else None for x in (q, k, v)]
    return Split(lens, one, *firsts, multi, None, None, None, qsl=qsl, packed=(q, k, v))


def token_positions(held: Tensor, lens: Tensor) -> Tensor:
    """``[N]`` int64 (host): the position in its sequence of each token of a packed step, row b's ``lens[b]``
    new tokens after the ``held[b]`` it held (both ``[B]`` host int64; N = ``lens.sum()``)."""
    rows = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)
    starts = lens.cumsum(0) - lens
    return held[rows] + torch.arange(rows.shape[0]) - starts[rows]


def _one_and_multi(lens: list[int]) -> tuple[list[int], list[int]]:
    """The rows with one new token, and the rows with more."""
    return [b for b, t in enumerate(lens) if t == 1], [b for b, t in enumerate(lens) if t > 1]


def take_rows(x: Tensor, rows: list[int]) -> Tensor:
    """``x[rows]``: a view when the rows are one contiguous run (one long row beside the decoders), else a copy."""
    first, n = rows[0], len(rows)
    if rows == list(range(first, first + n)):
        return x.narrow(0, first, n)
    return x.index_select(0, torch.tensor(rows, device=x.device))


def attend_split(ops, split: Split, read: LayerStorage, store: LayerStorage, *, scale: float | None,
                 sink_logits: Tensor | None, undo_to: Callable[[write.Undo], None] | None = None
                 ) -> tuple[Tensor | None, Tensor | None]:
    """A mixed step, row group by row group: the longer rows prefill over what was stored before (``read``: the
    storage as it stands, and their own chunk in full precision), the step is stored (into ``store``), then the
    one-token rows decode, as each would alone, over what is stored. ``read`` and ``store`` are one storage in a
    qsinkkv cache; an engine's pool gives two records of the same pools whose quantized tables differ where a
    block completes this step (its new page, while the prefill still reads the old one). A step's cost follows
    the tokens it carries, not B x T_max.

    Returns ``([len(one), H, D], the longer rows' output)`` (None for an empty group); the longer rows' output is
    ``[len(multi), H, T_multi, D]`` for a padded step, their tokens ``[sum(multi_lens), H, D]`` row by row for a
    packed one. ``undo_to`` (a caller that may roll the step back) gets the write's undo record as soon as the write
    is done, before the decode that may still raise; without it nothing is copied aside (an engine never rolls
    back). A packed step whose longer rows each hold and bring at most S + W tokens in all (every query sees every
    position up to its own: the causal mask) takes ``ops.prefill_causal`` on the tokens where they lie, after what
    the rows held (``prefill.causal_context``; none when each starts fresh)."""
    multi_out = one_out = None
    if split.multi:
        if split.packed is not None and ops.prefill_causal is not None and sink_logits is None \
                and _causal(split, read):
            q, k, v = split.packed
            held = read.seq_lens[split.multi]
            context = None if not int(held.max()) else causal_context(
                read if len(split.multi) == read.batch_size else read.select_rows(split.multi))
            multi_out = ops.prefill_causal(q, k, v, split.qsl[split.multi].tolist(), split.multi_lens, context,
                                           scale=scale)
        else:
            every_row = len(split.multi) == read.batch_size  # (in order: reads the storage as it lies)
            multi_out = ops.prefill(*split.multi_chunk(), read if every_row else read.select_rows(split.multi),
                                    torch.tensor(split.multi_lens), scale=scale, sink_logits=sink_logits)
            if split.packed is not None:  # [n, H, T, D] -> the real tokens, row by row
                n, H, T, D = multi_out.shape
                real = (torch.arange(n).unsqueeze(1) * T + torch.arange(T))[split.multi_real()]
                multi_out = multi_out.transpose(1, 2).reshape(n * T, H, D).index_select(0, real.to(multi_out.device))
    keep_undo = undo_to is not None
    if split.one or split.multi:
        undo = write.append_tokens(store, *_tokens(split), ops.quantizer, keep_undo, ops.writer)
    else:  # no new token in any row
        undo = write.Undo(store.seq_lens.clone(), []) if keep_undo else None
    if keep_undo:
        undo_to(undo)
    if split.one:
        every_row = len(split.one) == store.batch_size  # (decode reads; it needs no copy of the tables)
        one_out = ops.decode(split.q_one, store if every_row else store.select_rows(split.one), scale=scale,
                             sink_logits=sink_logits)
    return one_out, multi_out


def _causal(split: Split, read: LayerStorage) -> bool:
    """Every longer row holds and brings at most S + W tokens in all (its visible set is the causal mask)."""
    cfg = read.layout.config
    held = read.seq_lens[split.multi]
    return int((held + torch.tensor(split.multi_lens)).max()) <= cfg.sink_tokens + cfg.recent_tokens


def _tokens(split: Split) -> tuple:
    """The step's new K/V as ``write.append_tokens`` takes them: ``k, v [N, Hkv, D]`` and the rows, starts and
    lengths: a packed step's tokens where they lie, a padded step's one-token rows then the longer rows (padded
    to their longest)."""
    one, multi = split.one, split.multi
    if split.packed is not None:  # rows in token order (write.store_rows reads a run of every token in place)
        starts = split.qsl.tolist()
        rows = sorted(one + multi, key=starts.__getitem__)
        return *split.packed[1:], rows, [starts[b] for b in rows], [split.lens[b] for b in rows]
    if not multi:  # a decode step's one-token rows: their tokens as they are
        every = range(len(one))
        return split.k_one, split.v_one, one, every, [1] * len(one)
    T = split.k_multi.shape[2]
    parts = [[x] if one else [] for x in (split.k_one, split.v_one)]
    for part, x in zip(parts, (split.k_multi, split.v_multi)):
        part.append(x.transpose(1, 2).reshape(len(multi) * T, *x.shape[1::2]))
    k, v = (part[0] if len(part) == 1 else torch.cat(part) for part in parts)
    starts = list(range(len(one))) + [len(one) + i * T for i in range(len(multi))]
    return k, v, one + multi, starts, [1] * len(one) + split.multi_lens


def scatter_packed(out: Tensor, qsl: Tensor, split: Split, one_out: Tensor | None, multi_out: Tensor | None) -> Tensor:
    """Put a packed step's row groups' outputs (``attend_split``'s) back at their tokens: ``out [N, H, D]``, row b's
    tokens at ``[qsl[b], qsl[b+1])`` (``qsl`` host). Returns ``out``."""
    if split.one and len(split.one) == out.shape[0]:  # a decode step: row order is token order
        return out.copy_(one_out)
    if split.multi and not split.one and sum(split.multi_lens) == out.shape[0]:  # every token a longer row's, in order
        return out.copy_(multi_out)
    if split.one:
        out.index_copy_(0, qsl[split.one].to(out.device), one_out)
    if split.multi:
        out.index_copy_(0, split.multi_tokens().to(out.device), multi_out)
    return out


def scatter_padded(q: Tensor, split: Split, one_out: Tensor | None, multi_out: Tensor | None) -> Tensor:
    """A padded step's row groups' outputs (``attend_split``'s) as ``[B, H, T, D]`` (q's shape): each row's at its
    columns, zero at padding and in rows with no new token; the decoding rows' or the prefilling rows' own output
    where it is all of it."""
    B, _, T, _ = q.shape
    if len(split.one) == B and T == 1:  # a decode step
        return one_out.unsqueeze(2)
    if len(split.multi) == B and multi_out.shape[2] == T:  # every row prefills the whole chunk
        return multi_out
    out = q.new_zeros(q.shape)
    if split.one:
        out[torch.tensor(split.one, device=out.device), :, 0] = one_out
    if split.multi:
        out[torch.tensor(split.multi, device=out.device), :, :multi_out.shape[2]] = multi_out
    return out
