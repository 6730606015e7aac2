"""Where every token of the recent window lives: the one layout description that the
PyTorch paths and the Triton kernels both read.

The stream of one sequence is positions 0, 1, 2, ...; the first S go to the sink segment.
Recent token ``r = pos - S`` belongs to block ``b = r // block_size`` (block_start_pos =
S + b * bs). With m recent tokens seen and U the unquantized tail (``unquantized_tokens``):

* ``quantized_blocks(m) = max(m - U, 0) // bs`` blocks are full and older than the
  unquantized tail; they live as codes in the *quantized ring* at slot ``b % quant_slots``.
* the newer blocks ``[quantized_blocks, ceil(m / bs))`` (the filling block and the
  residual) live unquantized in the *float ring* at row ``r % (float_slots * bs)``.
* a query at the newest position sees recent tokens ``[max(m - W, 0), m)``; the older
  part of the oldest block is stale and masked.

The ring sizes are the smallest that hold every visible token (proofs in comments), so
storage is fixed at construction and a stream of any length never grows it. The sizes
themselves live in ``CacheConfig`` (their one holder); this adds what follows from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .config import CacheConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def visible_mask(q_pos: Tensor, k_pos: Tensor, sink_tokens: int, recent_tokens: int) -> Tensor:
    """The visible-set rule, bool ``[..., T, N]``: may the query at ``q_pos[..., t]`` see the key at
    ``k_pos[..., n]`` (-1: an empty slot). ``0 <= p <= i and (p < S or p > i - W)``."""
    q = q_pos.unsqueeze(-1)
    k = k_pos.unsqueeze(-2)
    return (k >= 0) & (k <= q) & ((k < sink_tokens) | (k > q - recent_tokens))


def token_positions(held: Tensor, lens: Tensor) -> Tensor:
    """``[N]`` int64 (host): the position in its sequence of each token of a packed step, row b's ``lens[b]``
    new tokens after the ``held[b]`` it held (both ``[B]`` host int64; N = ``lens.sum()``)."""
    rows = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)
    starts = lens.cumsum(0) - lens
    return held[rows] + torch.arange(rows.shape[0]) - starts[rows]


QUERY_TILE = 256  # queries per tile in the references and the eval's replay: bounds a tile's [t, N] scores


def query_tiles(T: int, sink_keys: int, recent_tokens: int, device: torch.device | str = "cpu"):
    """Tiles of ``QUERY_TILE`` queries over a chunk whose keys are its own tokens ``0..T-1``: yields
    ``(t0, t1, keys)``, ``keys`` the chunk tokens a query in ``[t0, t1)`` can see at all, ascending: its first
    ``sink_keys`` tokens (those that are sinks) older than the window of the tile's first query, then
    ``[lo, t1)``. Older keys are outside every window of the tile, so time and memory grow linearly in T."""
    for t0 in range(0, T, QUERY_TILE):
        t1 = min(t0 + QUERY_TILE, T)
        lo = max(t0 - recent_tokens + 1, 0)
        keys = torch.cat((torch.arange(min(sink_keys, lo), device=device), torch.arange(lo, t1, device=device)))
        yield t0, t1, keys


@dataclass(frozen=True)
class WindowLayout:
    config: CacheConfig
    unquantized_tokens: int = field(init=False)  # U: residual_tokens, or the whole window with bits=16
    quant_slots: int = field(init=False)
    float_slots: int = field(init=False)
    _seen: dict = field(init=False, default_factory=dict, compare=False, repr=False)  # visible_bias' memo

    def __post_init__(self) -> None:
        cfg = self.config
        W, bs = cfg.recent_tokens, cfg.block_size
        # The bits=16 special case, in one place: nothing is ever quantized, the float ring holds the window.
        U = W if cfg.bits == 16 else cfg.residual_tokens
        # Full blocks of the visible window that are older than U: the window [m-W, m) minus at
        # least U unquantized tokens spans at most ceil((W-U)/bs) blocks.
        object.__setattr__(self, "unquantized_tokens", U)
        object.__setattr__(self, "quant_slots", cdiv(W - U, bs))
        # Unquantized tokens number m - bs*floor((m-U)/bs) <= U + bs - 1: that many blocks.
        object.__setattr__(self, "float_slots", cdiv(U + bs - 1, bs))

    @property
    def sink_tokens(self) -> int:
        return self.config.sink_tokens

    @property
    def recent_tokens(self) -> int:
        return self.config.recent_tokens

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def float_rows(self) -> int:
        """Rows of the float ring: ``float_slots * block_size``."""
        return self.float_slots * self.config.block_size

    @property
    def num_slots(self) -> int:
        """Slots of one sequence, in ``slot_positions`` order: ``S + quant_slots * bs + float_rows``."""
        return self.sink_tokens + self.quant_slots * self.block_size + self.float_rows

    # --- counts, as functions of the number of recent tokens (ints or tensors) ------------
    def recent_count(self, seq_len):
        """Recent tokens of a sequence of ``seq_len`` tokens (all past its sinks)."""
        return (seq_len - self.sink_tokens).clamp(min=0) if isinstance(seq_len, Tensor) else \
            max(seq_len - self.sink_tokens, 0)

    def quantized_blocks(self, recent):
        """With ``recent`` recent tokens, blocks [0, q) are quantized (some may already be evicted): q."""
        excess = (recent - self.unquantized_tokens).clamp(min=0) if isinstance(recent, Tensor) else \
            max(recent - self.unquantized_tokens, 0)
        return excess // self.block_size

    def quantized_from(self, index):
        """The recent count from which recent token ``index`` (int or tensor) is held quantized: the least count c
        with ``quantized_blocks(c) > index // block_size`` (never reached with bits=16)."""
        return (index // self.block_size + 1) * self.block_size + self.unquantized_tokens

    def first_visible(self, recent):
        """Oldest recent index a query at the newest position sees, with ``recent`` recent tokens (int or tensor)."""
        return (recent - self.recent_tokens).clamp(min=0) if isinstance(recent, Tensor) else \
            max(recent - self.recent_tokens, 0)

    # --- the undo rule: what a write overwrites that the shorter stream (before it) still reads ------------

    def live_float_from(self, quantized_before: int) -> int:
        """The least recent index whose write over its float-ring row overwrites a token the shorter stream still
        reads (every later one does too): the row held token ``r - float_rows``, read from the ring while it is past
        the ``quantized_before`` blocks quantized."""
        return quantized_before * self.block_size + self.float_rows

    def first_kept_block(self, recent):
        """With ``recent`` recent tokens (int or tensor), blocks before this one hold no visible token and may be
        overwritten."""
        return self.first_visible(recent) // self.block_size

    def visible_bias(self, seq_lens: Tensor, device: torch.device) -> Tensor:
        """float32 ``[B, S + quant_slots*bs + float_rows]`` on ``device``, to add to the scores: 0 for
        the slots (sinks, quantized ring, float ring) a query at the newest position of each sequence
        (lengths ``seq_lens [B]``, host) sees, -inf for the others (an add is much cheaper than
        ``masked_fill`` on the CPU). Every layer of a model step asks with the same lengths, so the
        last answer is kept (decode metadata built once per step, not once per layer)."""
        key = (tuple(seq_lens.tolist()), device)
        bias = self._seen.get(key)
        if bias is None:
            seq_lens = seq_lens.to(device)
            pos = torch.cat(self.slot_positions(seq_lens), dim=1)
            seen = visible_mask((seq_lens.long() - 1).unsqueeze(-1), pos, self.sink_tokens,
                                self.recent_tokens).squeeze(1)
            bias = torch.zeros(seen.shape, device=device).masked_fill_(~seen, float("-inf"))
            self._seen.clear()
            self._seen[key] = bias
        return bias

    def visible_slots(self, seq_len: int) -> tuple[Tensor, Tensor]:
        """A row's visible set, in order: the slots (in ``slot_positions`` order, ``gather``'s columns) that a
        query at the newest position of a sequence of ``seq_len`` tokens sees, sorted by position, and those
        positions (host int64 ``[n]`` each). The one answer to "which (position, k, v) does the row see"."""
        pos = torch.cat(self.slot_positions(torch.tensor([seq_len])), dim=1)[0]
        seen = visible_mask(torch.tensor([seq_len - 1]), pos, self.sink_tokens, self.recent_tokens)[0]
        slots = seen.nonzero().flatten()
        slots = slots[torch.argsort(pos[slots])]
        return slots, pos[slots]

    def ring_blocks(self, seq_lens: Tensor) -> Tensor:
        """``[B, quant_slots]`` int64: the window block each quantized-ring slot holds at ``seq_lens [B]`` tokens,
        the newest quantized block b with ``b % quant_slots == slot`` (-1: none yet)."""
        q = self.quantized_blocks(self.recent_count(seq_lens.unsqueeze(-1)))   # [B, 1] blocks quantized
        slot = torch.arange(self.quant_slots, device=seq_lens.device)
        return q - 1 - (q - 1 - slot) % max(self.quant_slots, 1)

    def slot_positions(self, seq_lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Logical position held by every storage slot, per sequence of length ``seq_lens [B]``:
        sinks ``[B, S]``, quantized ring ``[B, quant_slots * bs]``, float ring ``[B, float_rows]``.

        -1 marks an empty slot or a block that was never written. Stale tokens (older than
        the window) keep their position; the visible-set mask drops them.
        """
        S, bs = self.sink_tokens, self.block_size
        dev = seq_lens.device
        n = seq_lens.long().unsqueeze(-1)                                     # [B, 1]
        sink = torch.arange(S, device=dev)
        sink_pos = torch.where(sink < n, sink, -1)
        m = self.recent_count(n)                                              # recent tokens seen
        q = self.quantized_blocks(m)                                          # quantized blocks
        block = self.ring_blocks(seq_lens.long())
        quant_pos = (S + block * bs).unsqueeze(-1) + torch.arange(bs, device=dev)
        quant_pos = torch.where((block >= 0).unsqueeze(-1), quant_pos, -1).flatten(1)
        F = self.float_rows
        row = torch.arange(F, device=dev)
        r = m - 1 - (m - 1 - row) % F                                         # newest r < m in this row
        float_pos = torch.where((r >= q * bs) & (r >= 0), S + r, -1)
        return sink_pos, quant_pos, float_pos
