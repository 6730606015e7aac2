"""Where every token of the recent window lives: the one layout description that the
PyTorch reference and the Triton kernels both read.

The stream is positions 0, 1, 2, ...; the first S go to the sink segment. Recent token
``r = pos - S`` belongs to block ``b = r // block_size`` (block_start_pos = S + b * bs).
With m recent tokens seen:

* ``quantized_blocks(m) = max(m - R, 0) // bs`` blocks are full and older than the
  residual R; they live as codes in the *quantized ring* at slot ``b % quant_slots``.
* the newer blocks ``[quantized_blocks, ceil(m / bs))`` (the filling block and the
  residual) live unquantized in the *float ring* at slot ``b % float_slots``.
* a query at the newest position sees recent tokens ``[max(m - W, 0), m)``; the older
  part of the oldest block is stale and masked.

The ring sizes are the smallest that hold every visible token (proofs in comments), so
storage is fixed at construction and a stream of any length never grows it. With
``bits=16`` everything is "residual": the float ring holds the whole window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import CacheConfig


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WindowLayout:
    sink_tokens: int
    recent_tokens: int
    block_size: int
    residual_tokens: int  # effective R: recent_tokens when bits == 16
    quant_slots: int
    float_slots: int

    @classmethod
    def from_config(cls, config: CacheConfig) -> "WindowLayout":
        W, bs = config.recent_tokens, config.block_size
        R = W if config.bits == 16 else config.residual_tokens
        # Full blocks of the visible window that are older than the residual: the window
        # [m-W, m) minus at least R unquantized tokens spans at most ceil((W-R)/bs) blocks.
        quant_slots = _cdiv(W - R, bs)
        # Unquantized tokens number m - bs*floor((m-R)/bs) <= R + bs - 1: that many blocks.
        float_slots = _cdiv(R + bs - 1, bs)
        return cls(config.sink_tokens, W, bs, R, quant_slots, float_slots)

    # --- counts, as functions of the number of recent tokens m ------------------------------
    def quantized_blocks(self, m: int) -> int:
        """Blocks [0, q) are quantized (some may already be evicted)."""
        return max(m - self.residual_tokens, 0) // self.block_size

    def quantized_from(self, r):
        """The recent count m from which recent token ``r`` (int or tensor) is held quantized:
        the least m with ``quantized_blocks(m) > r // block_size`` (never reached with bits=16)."""
        return (r // self.block_size + 1) * self.block_size + self.residual_tokens

    def first_visible(self, m: int) -> int:
        """Oldest recent index a query at the newest position sees."""
        return max(m - self.recent_tokens, 0)

    def first_kept_block(self, m: int) -> int:
        """Blocks before this one hold no visible token and may be overwritten."""
        return self.first_visible(m) // self.block_size

    def end_block(self, m: int) -> int:
        return _cdiv(m, self.block_size)

    def block_start_pos(self, b: int) -> int:
        return self.sink_tokens + b * self.block_size

    def recent_count(self, seq_len: int) -> int:
        return max(seq_len - self.sink_tokens, 0)


    def slot_positions(self, seq_lens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Logical position held by every storage slot, per sequence of length ``seq_lens [B]``:
        sinks ``[B, S]``, quantized ring ``[B, quant_slots * bs]``, float ring ``[B, float_slots * bs]``.

        -1 marks an empty slot or a block that was never written. Stale tokens (older than
        the window) keep their position; the visible-set mask drops them.
        """
        S, bs, R = self.sink_tokens, self.block_size, self.residual_tokens
        dev = seq_lens.device
        n = seq_lens.long().unsqueeze(-1)                                     # [B, 1]
        sink = torch.arange(S, device=dev)
        sink_pos = torch.where(sink < n, sink, -1)
        m = (n - S).clamp(min=0)                                              # recent tokens seen
        q = (m - R).clamp(min=0) // bs                                        # quantized blocks
        nq = self.quant_slots
        slot = torch.arange(nq, device=dev)
        block = q - 1 - (q - 1 - slot) % max(nq, 1)                           # newest b < q with b % nq == slot
        quant_pos = (S + block * bs).unsqueeze(-1) + torch.arange(bs, device=dev)
        quant_pos = torch.where((block >= 0).unsqueeze(-1), quant_pos, -1).flatten(1)
        F = self.float_slots * bs
        row = torch.arange(F, device=dev)
        r = m - 1 - (m - 1 - row) % F                                         # newest r < m in this row
        float_pos = torch.where((r >= q * bs) & (r >= 0), S + r, -1)
        return sink_pos, quant_pos, float_pos
