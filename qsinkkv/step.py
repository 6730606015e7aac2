"""How a step runs on one layer: ``run``, the one function every caller takes (``SinkQuantCache``, ``PagedCache``,
an engine's pages): check -> write -> prefill/decode over the step's ``plan.StepPlan``.

``split`` groups a layer's q, k, v as the plan groups the rows (``Split``: the rows with one new token decode,
the rows with more prefill, rows with none sit out), read by the checks, the write and the attention, so a step's
cost follows the tokens it carries, never B x T_max; ``scatter_packed`` / ``scatter_padded`` put the groups'
outputs back in the step's layout."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import checks, write
from .config import CacheConfig
from .layout import token_positions
from .plan import StepPlan
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


def split(plan: StepPlan, q: Tensor | None, k: Tensor, v: Tensor) -> Split:
    """Group one layer's q, k, v by ``plan``'s rows (q None: a step that only stores): a packed step's
    ``[N, heads, D]`` (the one-token rows' gathered, a decode step's the tokens themselves; the longer rows' stay
    where they lie), a padded chunk's ``[B, heads, T, D]`` (views where the rows are one run)."""
    one, multi, lens = plan.one, plan.multi, list(plan.lens)
    if plan.packed:
        qsl = plan.query_start_loc
        if one and len(one) == k.shape[0]:  # every token a one-token row's, in row order (a decode step): no gather
            firsts = [q, k, v]
        else:
            firsts = [None if x is None or not one else x.index_select(0, qsl[one].to(x.device)) for x in (q, k, v)]
        return Split(lens, one, *firsts, multi, None, None, None, qsl=qsl, packed=(q, k, v))
    pick = lambda x, rows, t: None if x is None or not rows else take_rows(x[:, :, :t], rows)  # noqa: E731
    if len(one) == len(lens):  # a decode step: every row's token as it lies (the common case, kept cheap)
        firsts = [None if x is None else x.select(2, 0) for x in (q, k, v)]
    else:
        firsts = [None if x is None or not one else take_rows(x.select(2, 0), one) for x in (q, k, v)]
    T_multi = max(plan.multi_lens, default=0)
    return Split(lens, one, *firsts, multi, *(pick(x, multi, T_multi) for x in (q, k, v)))


def check_values(config: CacheConfig, seq_lens: Tensor, split: Split | None, k: Tensor, v: Tensor, q: Tensor | None,
                 sink_logits: Tensor | None, packed: bool = False,
                 peaks: Callable[[list[Tensor]], list[float]] | None = None) -> None:
    """One device sync for every value check: the K/V to be stored finite in the dtype they are stored in
    (a sequence's first ``sink_tokens`` in ``sink_dtype``, later ones in ``window_dtype``; ``seq_lens [B]`` host:
    tokens held before the step), q finite, sink_logits free of NaN and +inf. A packed step (``packed``: k, v, q
    ``[N, heads, D]``, ``split.lens`` tokens per row) is checked token by token on the packed tensors
    (``checks.packed_tokens_fit``); a uniform chunk past the sinks with one reduction per tensor; otherwise each row
    group of ``split`` on only the columns that hold real tokens (a mixed step must not cost B x T). ``peaks``: the
    whole-tensor reduction of the host checks (``Ops.peaks``: ``peaks_torch``, the default, or
    ``decode_c.peaks_c``)."""
    held, peaks = seq_lens, peaks or checks.peaks_torch
    refused = lambda ok: checks.raise_refused(ok, config, lambda x: _refused_rows(config, held, split, x, packed),  # noqa: E731
                                              {"k": k, "v": v})
    if packed and k.device.type != "cpu":  # an engine's step on its GPU: no host read
        return _packed_tokens_fit_in_step(config, held, split, k, v, q, sink_logits)
    if packed:
        return refused(checks.packed_tokens_fit(config, held, split.lens, k, v, q, sink_logits, peaks))
    if split is None:
        if not held.numel() or int(held.min()) >= config.sink_tokens:
            return refused(checks.peaks_fit(k, v, q, sink_logits, config, peaks=peaks) if k.numel() else {})
    ok = {"k": [], "v": [], "q": []}
    groups = []  # (positions [n, T] host, real [n, T] host or None, q, k, v [n, heads, T, D])
    if split is None:  # a uniform chunk whose first tokens go to the sinks
        groups.append((held.unsqueeze(1) + torch.arange(k.shape[2]), None, q, k, v))
    else:
        if split.one:  # [n, heads, D] -> [n, heads, 1, D]
            groups.append((held[split.one].unsqueeze(1), None,
                           *(None if x is None else x.unsqueeze(2) for x in (split.q_one, split.k_one, split.v_one))))
        if split.multi:
            real = split.multi_real()
            groups.append((held[split.multi].unsqueeze(1) + torch.arange(real.shape[1]), real, split.q_multi,
                           split.k_multi, split.v_multi))
    for pos, real, qg, kg, vg in groups:
        ok["k"].append(checks.storable(kg, pos, real, config))
        ok["v"].append(checks.storable(vg, pos, real, config))
        if qg is not None:
            ok["q"].append(checks.all_finite(qg, real))
    named = {name: torch.stack(x).all() for name, x in ok.items() if x}
    if sink_logits is not None:
        named["sink_logits"] = checks.sink_logits_ok(sink_logits)
    refused(dict(zip(named, torch.stack(list(named.values())).tolist())) if named else {})


def _refused_rows(config: CacheConfig, seq_lens: Tensor, split: Split | None, x: Tensor, packed: bool
                  ) -> tuple[list[int], int, float]:
    """For the message of a refusal only: ``(rows, tokens, max |x|)`` of the tokens of ``x`` (packed ``[N, heads,
    D]``, or a padded chunk ``[B, heads, T, D]`` whose row b holds ``split.lens[b]`` tokens, all T without a
    split) that the value checks refuse, each against the bound of the dtype it is stored in."""
    if packed:
        lens = torch.tensor(split.lens)
        rows, pos = torch.repeat_interleave(torch.arange(lens.shape[0]), lens), token_positions(seq_lens, lens)
        top = checks.peak(x.flatten(1), dim=1)
    else:
        B, T = x.shape[0], x.shape[2]
        lens = torch.full((B,), T) if split is None else torch.tensor(split.lens)
        real = (torch.arange(T) < lens.unsqueeze(1)).flatten()
        rows = torch.arange(B).repeat_interleave(T)[real]
        pos = (seq_lens.unsqueeze(1) + torch.arange(T)).flatten()[real]
        top = checks.peak(x, dim=(1, 3)).flatten()[real.to(x.device)]
    top = top.double().cpu()
    bound = torch.where(pos < config.sink_tokens, checks.overflow_bound(config.sink_dtype, x.dtype),
                        checks.window_bound(config, x.dtype))
    bad = ~(top < bound)
    if not bad.any():
        return [], 0, math.nan
    return sorted(set(rows[bad].tolist())), int(bad.sum()), float(top[bad].nan_to_num(math.inf).max())


def _packed_tokens_fit_in_step(config: CacheConfig, seq_lens: Tensor, split: Split, k: Tensor, v: Tensor,
                              q: Tensor | None, sink_logits: Tensor | None) -> None:
    """``checks.packed_tokens_fit``'s checks of a packed step on a device, with no host read: each token's max
    |x| against the bound of the dtype it is stored in, q finite, sink logits free of NaN and +inf, one reduction per
    tensor and one ``torch._assert_async`` (``checks.condition_in_step``: on a GPU a device-side assert before the
    step's first write; on the CPU ``check_values``' own named error)."""
    S = config.sink_tokens
    to_sinks = (token_positions(seq_lens, torch.tensor(split.lens)) < S).to(k.device, non_blocking=True)
    fits = []
    for x in (k, v):
        bound = torch.where(to_sinks, checks.overflow_bound(config.sink_dtype, x.dtype),
                            checks.window_bound(config, x.dtype))
        fits.append((checks.peak(x.flatten(1), dim=1).double() < bound).all())
    if q is not None:
        fits.append(checks.peak(q) < math.inf)
    if sink_logits is not None:
        fits.append(checks.sink_logits_ok(sink_logits))

    def error() -> Exception:
        cpu = lambda x: None if x is None else x.cpu()  # noqa: E731
        check_values(config, seq_lens, split, cpu(k), cpu(v), cpu(q), cpu(sink_logits), packed=True)  # raises
        return RuntimeError("the value checks on the device refused what the host's accept: the two disagree")

    checks.condition_in_step(torch.stack(fits).all(), error)


def take_rows(x: Tensor, rows: list[int]) -> Tensor:
    """``x[rows]``: a view when the rows are one contiguous run (one long row beside the decoders), else a copy."""
    first, n = rows[0], len(rows)
    if rows == list(range(first, first + n)):
        return x.narrow(0, first, n)
    return x.index_select(0, torch.tensor(rows, device=x.device))


def run(ops, plan: StepPlan, read: LayerStorage, store: LayerStorage, q: Tensor | None, k: Tensor, v: Tensor, *,
        scale: float | None = None, sink_logits: Tensor | None = None, check: bool = True,
        prepare: Callable[[], None] | None = None, undo_to: Callable[[write.Undo], None] | None = None,
        out: Tensor | None = None) -> Tensor | None:
    """One layer's step, the one way every caller runs it (``SinkQuantCache``, ``PagedCache``, an engine's pages):
    check -> write -> prefill/decode, row group by row group, as ``plan`` (``plan.py``) groups the rows.

    q, k, v: the step's ``[N, heads, D]`` (``plan.packed``) or ``[B, heads, T, D]``; q None: store only. ``read``
    and ``store`` are one storage in a qsinkkv cache; an engine's pool gives two records of the same pools whose
    quantized tables differ where a block completes this step (its new page, while the prefill still reads the old
    one). ``check``: refuse non-finite K/V or q, or NaN/+inf sink logits (``check_values``), before anything is
    written; then ``prepare()`` (a cache takes the step's blocks; an engine zeroes a new sequence's pages); then
    the longer rows prefill over what was stored before (``read``, and their own chunk in full precision), the step
    is stored (``store``), and the one-token rows decode, as each would alone, over what is stored. ``undo_to`` (a
    caller that may roll the step back) gets the write's undo record as soon as the write is done, before the decode
    that may still raise; without it nothing is copied aside (an engine never rolls back).

    Returns the output in q's layout and dtype (``[N, H, D]``, written into ``out`` if given; or ``[B, H, T, D]``,
    zero at padding and in rows with no new token), or None without q. A step's cost follows the tokens it
    carries, not B x T_max."""
    groups = split(plan, q, k, v)
    if check:
        check_values(read.layout.config, plan.held, None if plan.uniform else groups, k, v, q, sink_logits,
                      packed=plan.packed, peaks=ops.peaks)
    if prepare is not None:
        prepare()
    multi_out = one_out = None
    if q is not None and plan.packed:  # the step's output; a step of prefilling rows only, in token order, is the
        # longer rows' own: their kernel may write it itself
        out = q.new_empty(q.shape) if out is None else out
    if q is not None and plan.multi:
        whole = out if plan.packed and not plan.one and sum(plan.multi_lens) == q.shape[0] else None
        multi_out = _prefill(ops, plan, groups, read, scale, sink_logits, whole)
    keep_undo = undo_to is not None
    before = store.seq_lens.clone() if keep_undo else None
    saved = write.commit(store, plan.write, *tokens(plan, groups), ops.quantizer, ops.writer, keep_undo) \
        if plan.one or plan.multi else []
    if keep_undo:
        undo_to(write.Undo(before, saved))
    if q is None:
        return None
    if plan.one:
        every_row = len(plan.one) == store.batch_size  # (decode reads; it needs no copy of the tables)
        one_out = ops.decode(groups.q_one, store if every_row else store.select_rows(plan.one), scale=scale,
                             sink_logits=sink_logits)
    if plan.packed:
        return scatter_packed(out, plan.query_start_loc, groups, one_out, multi_out)
    return scatter_padded(q, groups, one_out, multi_out)


def _prefill(ops, plan: StepPlan, groups: Split, read: LayerStorage, scale: float | None,
             sink_logits: Tensor | None, out: Tensor | None = None) -> Tensor:
    """The longer rows' output: ``[len(multi), H, T_multi, D]`` for a padded step, their tokens ``[sum(multi_lens),
    H, D]`` row by row for a packed one. A packed step whose longer rows see just the causal mask (``plan.causal``)
    takes ``ops.prefill_causal`` on the tokens where they lie, after what the rows held (``prefill.causal_context``;
    none when each starts fresh), written into ``out`` (the step's ``[N, H, D]``, every token a longer row's) where
    the kernel can."""
    def rows() -> LayerStorage:  # the longer rows' storage (every row in order: the storage as it lies)
        return read if len(plan.multi) == read.batch_size else read.select_rows(plan.multi)

    if plan.packed and plan.causal and ops.prefill_causal is not None and sink_logits is None:
        q, k, v = groups.packed
        context = causal_context(rows()) if plan.multi_held else None
        return ops.prefill_causal(q, k, v, plan.query_start_loc[plan.multi].tolist(), plan.multi_lens, context,
                                  scale=scale, out=out)
    out = ops.prefill(*groups.multi_chunk(), rows(), torch.tensor(plan.multi_lens), scale=scale,
                      sink_logits=sink_logits)
    if plan.packed:  # [n, H, T, D] -> the real tokens, row by row
        n, H, T, D = out.shape
        real = (torch.arange(n).unsqueeze(1) * T + torch.arange(T))[groups.multi_real()]
        out = out.transpose(1, 2).reshape(n * T, H, D).index_select(0, real.to(out.device))
    return out


def tokens(plan: StepPlan, groups: Split) -> tuple[Tensor, Tensor]:
    """The step's new K/V as ``plan.write`` places them, ``k, v [N, Hkv, D]``: a packed step's tokens where they
    lie; a padded step's one-token rows, then the longer rows padded to their longest."""
    if plan.packed:
        return groups.packed[1:]
    if not plan.multi:  # a decode step's one-token rows: their tokens as they are
        return groups.k_one, groups.v_one
    T = groups.k_multi.shape[2]
    parts = [[x] if plan.one else [] for x in (groups.k_one, groups.v_one)]
    for part, x in zip(parts, (groups.k_multi, groups.v_multi)):
        part.append(x.transpose(1, 2).reshape(len(plan.multi) * T, *x.shape[1::2]))
    return tuple(part[0] if len(part) == 1 else torch.cat(part) for part in parts)


def scatter_packed(out: Tensor, qsl: Tensor, split: Split, one_out: Tensor | None, multi_out: Tensor | None) -> Tensor:
    """Put a packed step's row groups' outputs (``run``'s) back at their tokens: ``out [N, H, D]``, row b's
    tokens at ``[qsl[b], qsl[b+1])`` (``qsl`` host). Returns ``out``."""
    if split.one and len(split.one) == out.shape[0]:  # a decode step: row order is token order
        return out.copy_(one_out)
    if split.multi and not split.one and sum(split.multi_lens) == out.shape[0]:  # every token a longer row's, in order
        return out if multi_out is out else out.copy_(multi_out)
    if split.one:
        out.index_copy_(0, qsl[split.one].to(out.device), one_out)
    if split.multi:
        out.index_copy_(0, split.multi_tokens().to(out.device), multi_out)
    return out


def scatter_padded(q: Tensor, split: Split, one_out: Tensor | None, multi_out: Tensor | None) -> Tensor:
    """A padded step's row groups' outputs (``run``'s) as ``[B, H, T, D]`` (q's shape): each row's at its
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
