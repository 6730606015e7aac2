"""Prefill attention over a ``LayerStorage``: a chunk of T new tokens per sequence attends over what
the storage held before the chunk plus the chunk's own full-precision K/V, under the exact sink +
window mask (as KIVI does); the caller stores the chunk afterwards.

Both PyTorch versions dequantize every stored slot once (``gather``) and go in tiles of queries,
each over those slots and only the chunk keys the tile can see:

* ``prefill_attention_reference``: the dense ``sink_window_attention`` per tile (the oracle's
  rule, in float32; every contract, sink logits);
* ``prefill_attention_torch`` (the torch backend's path, absolute contract): the same tiles
  through ``scaled_dot_product_attention`` with the visible set as a boolean mask, PyTorch's
  fused CPU kernel (``benchmarks/prefill.py`` times it); learned sink logits as one more key, of
  zero value, whose score is the logit (an additive mask column).

Both give a row the bits it gets alone, whatever the other rows of the batch bring: rows go in groups that
read the same keys (``_by_key_set``: one chunk length, no padding), because these kernels' sums over the
keys change with the key count, masked keys included.

The Triton backend's is the flash-style kernel ``qsinkkv.kernels.prefill_attention`` (the same
``gather``, no score matrix; both position contracts).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import trace
from .attention import sink_window_attention
from .layout import QUERY_TILE, query_tiles, visible_mask
from .rope import Rotary
from .storage import LayerStorage, gather


def prefill_attention_reference(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, *,
                                scale: float | None = None, rotary: Rotary | None = None,
                                sink_logits: Tensor | None = None) -> Tensor:
    """q ``[B, H, T, D]``, the chunk's k, v ``[B, Hkv, T, D]`` of which row b holds ``lengths[b]``
    tokens (the rest is padding) at positions ``seq_lens[b] ..`` -> ``[B, H, T, D]`` in q's dtype,
    zero at padding.

    Queries go in tiles; a tile reads the stored slots (at most the capacity plus a block) and
    only the chunk keys it can see: the chunk's sinks and the W before the tile. Time and memory
    grow linearly with T at a fixed capacity."""
    trace.ran("prefill", "reference")
    cfg = layer.layout.config
    attend = functools.partial(sink_window_attention, sink_tokens=cfg.sink_tokens, recent_tokens=cfg.recent_tokens,
                               scale=scale, rotary=rotary, sink_logits=sink_logits)
    return _by_key_set(q, k, v, layer, lengths, attend)


def prefill_attention_torch(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, *,
                            scale: float | None = None, sink_logits: Tensor | None = None) -> Tensor:
    """``prefill_attention_reference`` (absolute contract) with each tile through PyTorch's fused
    ``scaled_dot_product_attention`` under the visible set as a boolean mask, in float32 (float64 for
    float64 inputs). Learned sink logits ``[H]`` (a softmax term with no value, which SDPA has no place for) are
    one more key of zero value per tile whose score is the head's logit: a float mask, 0 where seen, -inf not,
    the logit in the extra column.

    Rows that hold and bring at most S + W tokens in all (a new prompt, or its later chunk within the capacity) see
    every key up to their own (the window of query t, ``(t - W, t]``, reaches back past the sinks): the causal
    mask, SDPA on their own tokens after what they held (``causal_context``; nothing for a new prompt: SDPA's
    causal kernel), without sink logits. A step of ragged chunks costs the sum of its
    rows' work, not B x T_max; rows go in groups of one chunk length (``_by_key_set``), so each gets the bits it
    gets alone."""
    trace.ran("prefill", "torch")
    cfg = layer.layout.config
    work = torch.float64 if q.dtype == torch.float64 else torch.float32

    def attend(q_t, k_t, v_t, q_pos, k_pos):
        seen = visible_mask(q_pos, k_pos, cfg.sink_tokens, cfg.recent_tokens).unsqueeze(1)  # [B, 1, t, N]
        k_t, v_t = k_t.to(work), v_t.to(work)
        if sink_logits is not None:  # the extra key: k = v = 0, its score the logit
            B, H, t, _ = q_t.shape
            k_t, v_t = (torch.cat((x, x.new_zeros(*x.shape[:2], 1, x.shape[3])), dim=2) for x in (k_t, v_t))
            bias = torch.zeros(seen.shape, dtype=work, device=seen.device).masked_fill_(~seen, float("-inf"))
            seen = torch.cat((bias.expand(B, H, t, -1), sink_logits.to(work).view(1, H, 1, 1).expand(B, H, t, 1)),
                             dim=3)
            # row by row: with a float mask SDPA's CPU path gives a row of a batch a result a rounding apart from
            # the row alone on some CPUs and thread counts (seen with 2 threads, 7e-8): each row alone, always
            return torch.cat([F.scaled_dot_product_attention(q_t[b:b + 1].to(work), k_t[b:b + 1], v_t[b:b + 1],
                                                             attn_mask=seen[b:b + 1], scale=scale,
                                                             enable_gqa=H != k_t.shape[1]) for b in range(B)]
                             ).to(q_t.dtype)
        out = F.scaled_dot_product_attention(q_t.to(work), k_t, v_t, attn_mask=seen, scale=scale,
                                             enable_gqa=q_t.shape[1] != k_t.shape[1])
        return out.to(q_t.dtype)
    def causal(rows, q, k, v):  # rows holding and bringing at most S + W tokens: the causal mask
        held = layer.seq_lens[rows]
        if not int(held.max()):  # fresh rows: their own tokens, the group at once
            return _causal(q, k, v, scale, work)
        context = causal_context(layer if len(rows) == layer.batch_size else layer.select_rows(rows))
        return torch.cat([_causal(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale, work, context.row(i))
                          for i in range(len(rows))])
    return _by_key_set(q, k, v, layer, lengths, attend, causal=None if sink_logits is not None else causal)


@dataclass(frozen=True)
class Context:
    """What rows of a causal prefill (``prefill_causal_packed``) held before their chunk, dequantized, in position
    order: ``k, v [n, Hkv, C, D]`` float32 (row i's first ``held[i]`` of the C columns are its positions
    ``0 .. held[i] - 1``; the rest is padding, never read) -- ``causal_context``'s."""
    k: Tensor
    v: Tensor
    held: list[int]

    def row(self, i: int) -> list[Tensor] | None:
        """Row i's held keys and values ``[1, Hkv, held[i], D]`` (``_causal``'s ``stored``), or None: it held none."""
        n = self.held[i]
        return [x[i:i + 1, :, :n] for x in (self.k, self.v)] if n else None


def causal_context(rows: LayerStorage) -> Context:
    """The stored tokens of ``rows`` (a storage's rows, each holding at most S + W tokens: nothing has left its
    window, so every position it holds is in one slot) in position order: ``gather``'s slots, sorted."""
    k, v, pos = gather(rows, torch.float32)                                   # [n, Hkv, N, D], [n, N] (-1: empty)
    held = rows.seq_lens.tolist()
    order = torch.where(pos < 0, torch.iinfo(pos.dtype).max, pos).argsort(dim=1)[:, :max(held)]  # [n, C]
    index = order.view(order.shape[0], 1, -1, 1).expand(-1, k.shape[1], -1, k.shape[3])
    return Context(k.gather(2, index), v.gather(2, index), held)


def prefill_causal_packed(q: Tensor, k: Tensor, v: Tensor, starts: list[int], lens: list[int],
                          context: Context | None = None, *, scale: float | None = None,
                          out: Tensor | None = None) -> Tensor:
    """A packed step's rows whose visible set is the causal mask -- each held ``context.held[i]`` tokens (none
    without ``context``) and brings ``lens[i]``, at most S + W in all, so every query sees every position up to
    its own -- read where they lie (``q [N, H, D]``, ``k, v [N, Hkv, D]``, row i's at ``[starts[i], starts[i] +
    lens[i])``) after their ``context`` (what they held, dequantized: the reference's stored keys): causal SDPA
    row by row in float32 (float64 for float64 inputs), as ``prefill_attention_torch``'s own path for such a row
    -> ``[sum(lens), H, D]`` in q's dtype, the rows' tokens in order (written into ``out``, such a tensor, if
    given)."""
    trace.ran("prefill_causal", "torch")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None or out.shape != (sum(lens), *q.shape[1:]) or out.dtype != q.dtype:
        out = q.new_empty((sum(lens), *q.shape[1:]))
    at = 0
    for i, (s, t) in enumerate(zip(starts, lens)):
        rows = [y[s:s + t].transpose(0, 1).unsqueeze(0) for y in (q, k, v)]  # [1, heads, t, D] views
        stored = context.row(i) if context is not None else None
        out[at:at + t] = _causal(*rows, scale, work, stored)[0].transpose(0, 1)
        at += t
    return out


def _causal(q: Tensor, k: Tensor, v: Tensor, scale: float | None, work: torch.dtype,
            stored: list[Tensor] | None = None) -> Tensor:
    """Causal SDPA in ``work`` precision: ``[b, H, t, D]`` (k, v ``[b, Hkv, t, D]``) -> ``[b, H, t, D]``, q's dtype;
    with ``stored`` (one row's held keys and values ``[1, Hkv, n, D]``, positions ``0 .. n - 1``) after them: query
    j sees them all and the chunk up to itself (bottom-right causal)."""
    gqa = q.shape[1] != k.shape[1]
    if stored is None:
        return F.scaled_dot_product_attention(q.to(work), k.to(work), v.to(work), is_causal=True, scale=scale,
                                              enable_gqa=gqa).to(q.dtype)
    n, t = stored[0].shape[2], q.shape[2]
    keys = [torch.cat((x.to(work), y.to(work)), dim=2) for x, y in zip(stored, (k, v))]
    seen = torch.ones(t, n + t, dtype=torch.bool, device=q.device).tril(n)
    return F.scaled_dot_product_attention(q.to(work), *keys, attn_mask=seen, scale=scale, enable_gqa=gqa).to(q.dtype)


def _by_key_set(q: Tensor, k: Tensor, v: Tensor, layer: LayerStorage, lengths: Tensor, attend, causal=None
                ) -> Tensor:
    """The rows of a chunk in groups that each read the keys its rows would read alone, so a row's output does
    not depend on the other rows of its batch (a sequence gets the same bits pooled as alone): the rows of one
    ``_key_set``, each group's chunk cut to its own length. SDPA's CPU kernel and the reference's softmax and
    ``probs @ v`` reduce over the key axis, and a key masked out (a padding token of the chunk, a sink of
    another row) still changes the length, hence the order, of those sums (by up to a few float32 ulps); the
    batch size does not. ``causal(rows, q, k, v)`` (if given) runs a group whose rows hold and bring at most
    S + W tokens in all (the causal mask, after what they held). Rows of no token, and padding, are zero: a
    padding token is never read (a NaN there reaches no real row)."""
    B, _, T, _ = q.shape
    cfg = layer.layout.config
    groups: dict[tuple[int, int, bool], list[int]] = {}
    for b, (t, held) in enumerate(zip(lengths.tolist(), layer.seq_lens.tolist())):
        if t:
            groups.setdefault(_key_set(cfg, held, t, causal is not None), []).append(b)
    stored = None

    def run(rows, q, k, v, is_causal):
        nonlocal stored
        if is_causal:
            return causal(rows, q, k, v)
        if stored is None:  # every stored slot dequantized once, for all the rows
            stored = gather(layer, k.dtype)
        every = len(rows) == B
        held = layer.seq_lens if every else layer.seq_lens[torch.tensor(rows)]
        return _in_tiles(q, k, v, held, [x if every else _rows(x, rows) for x in stored], cfg, attend)
    if len(groups) == 1:
        (t, _, is_causal), rows = next(iter(groups.items()))
        if t == T and len(rows) == B:  # one key set and no padding (a step of equal chunks): the batch at once
            return run(rows, q, k, v, is_causal)
    out = q.new_zeros(q.shape)
    for (t, _, is_causal), rows in groups.items():
        got = run(rows, *(_rows(x, rows)[:, :, :t] for x in (q, k, v)), is_causal)
        if _one_run(rows):
            out[rows[0]:rows[0] + len(rows), :, :t] = got
        else:
            out[torch.tensor(rows, device=out.device), :, :t] = got
    return out


def _key_set(cfg, held: int, t: int, has_causal: bool) -> tuple[int, int, bool]:
    """What the keys of a row holding ``held`` tokens and bringing ``t`` depend on, beside the stored slots (the
    layout's, the same for every row): ``t``; its sinks among the chunk's tokens (``S - held``) as far as a tile
    past the first reads them (``query_tiles``: ``min(sinks, lo)``, lo largest in the last tile); whether it
    runs ``causal`` (as ``plan.StepPlan.causal`` says of a packed step's rows)."""
    last = (t - 1) // QUERY_TILE * QUERY_TILE
    sinks = min(max(cfg.sink_tokens - held, 0), max(last - cfg.recent_tokens + 1, 0))
    return t, sinks, has_causal and held + t <= cfg.sink_tokens + cfg.recent_tokens


def _one_run(rows: list[int]) -> bool:
    return rows == list(range(rows[0], rows[0] + len(rows)))


def _rows(x: Tensor, rows: list[int]) -> Tensor:
    """``x[rows]``: a view when the rows are one run, else a copy."""
    if _one_run(rows):
        return x.narrow(0, rows[0], len(rows))
    return x.index_select(0, torch.tensor(rows, device=x.device))


def _in_tiles(q: Tensor, k: Tensor, v: Tensor, held: Tensor, stored: list[Tensor], cfg, attend) -> Tensor:
    """The tiling both versions share, for rows that hold ``held [B]`` (host) tokens and each bring all T chunk
    tokens (``_by_key_set`` cuts the padding off), over their stored slots ``stored`` (``gather``'s k, v, positions):
    ``attend(q_tile, k, v, q_pos, k_pos)`` for each tile of queries over the stored slots and the chunk keys it
    can see (k, v in the work precision: float32, float64 for float64 inputs)."""
    T = q.shape[2]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    stored_k, stored_v, stored_pos = stored
    q_pos = held.to(q.device).unsqueeze(1) + torch.arange(T, device=q.device)                # [B, T]
    chunk_sinks = max(cfg.sink_tokens - int(held.min()), 0)   # chunk tokens that are some row's sinks
    out = torch.empty_like(q)
    for t0, t1, idx in query_tiles(T, chunk_sinks, cfg.recent_tokens, q.device):  # a tile reads at most
        keys = (k, v, q_pos) if t1 - t0 == T else (k[:, :, idx], v[:, :, idx], q_pos[:, idx])  # S + W + QUERY_TILE
        out[:, :, t0:t1] = attend(q[:, :, t0:t1], _join(stored_k, keys[0], work), _join(stored_v, keys[1], work),
                                  q_pos[:, t0:t1], torch.cat((stored_pos, keys[2]), dim=1))
    return out


def _join(stored: Tensor, chunk: Tensor, dtype: torch.dtype) -> Tensor:
    """``torch.cat((stored, chunk), dim=2).to(dtype)`` in one pass."""
    n = stored.shape[2]
    out = stored.new_empty((*stored.shape[:2], n + chunk.shape[2], stored.shape[3]), dtype=dtype)
    out[:, :, :n] = stored
    out[:, :, n:] = chunk
    return out
