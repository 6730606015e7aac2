"""CacheConfig: every size and format choice of a qsinkkv cache, validated once."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _fail(field: str, expected: str, got) -> None:
    raise ValueError(f"CacheConfig.{field} must be {expected}, got {got!r}")


def _check_int(field: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(field, f"an int >= {minimum}", value)


@dataclass(frozen=True)
class CacheConfig:
    """What the cache keeps and how.

    The visible set of a query at absolute position i is
    ``[0..i]`` while ``i < capacity``, else ``[0..S-1] ∪ [i-W+1 .. i]`` with
    ``S = sink_tokens`` and ``W = recent_tokens``.

    Fields:
      sink_tokens:      S >= 0, the first S tokens of the stream, kept in ``sink_dtype`` and
                        never evicted. 0 gives a plain sliding window (a baseline).
      recent_tokens:    W >= 1, the newest W tokens.
      bits:             16 (recent window in ``window_dtype``: the StreamingLLM baseline),
                        8 or 4 (int8 / int4 codes, two int4 codes per byte).
      block_size:       tokens per quantized block; keys get one scale/zero per
                        (block, head, channel), so a block is quantized once, when full.
      value_group_size: channels per value quantization group (scale/zero per token, head,
                        group); must divide head_dim (checked by the cache).
      residual_tokens:  the newest R tokens stay unquantized (KIVI-style), 0 <= R <= W.
      positions:        "absolute" (keys keep their true RoPE rotation) or "cache_index"
                        (StreamingLLM: keys stored pre-RoPE, rotated by their index in the cache).
      sink_dtype:       float dtype of the sink segment.
      window_dtype:     float dtype of the unquantized recent tokens (the filling block, the
                        residual, and the whole window when bits=16).
      scale_dtype:      dtype of quantization scales and zeros.
    """

    sink_tokens: int = 4
    recent_tokens: int = 1020
    bits: int = 4
    block_size: int = 64
    value_group_size: int = 64
    residual_tokens: int = 0
    positions: str = "absolute"
    sink_dtype: torch.dtype = torch.bfloat16
    window_dtype: torch.dtype = torch.bfloat16
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        _check_int("sink_tokens", self.sink_tokens, 0)
        _check_int("recent_tokens", self.recent_tokens, 1)
        if type(self.bits) is not int or self.bits not in (16, 8, 4):  # 8.0 would pass `in`, then break `<<`
            _fail("bits", "one of the ints 16, 8, 4", self.bits)
        _check_int("block_size", self.block_size, 1)
        _check_int("value_group_size", self.value_group_size, 1)
        _check_int("residual_tokens", self.residual_tokens, 0)
        if self.residual_tokens > self.recent_tokens:
            _fail("residual_tokens", f"<= recent_tokens ({self.recent_tokens})", self.residual_tokens)
        if self.positions not in ("absolute", "cache_index"):
            _fail("positions", "'absolute' or 'cache_index'", self.positions)
        if self.sink_dtype not in _FLOAT_DTYPES:
            _fail("sink_dtype", "one of torch.bfloat16, torch.float16, torch.float32", self.sink_dtype)
        if self.window_dtype not in _FLOAT_DTYPES:
            _fail("window_dtype", "one of torch.bfloat16, torch.float16, torch.float32", self.window_dtype)
        if self.scale_dtype not in _SCALE_DTYPES:
            _fail("scale_dtype", "one of torch.float16, torch.bfloat16, torch.float32", self.scale_dtype)

    @property
    def capacity(self) -> int:
        """C = S + W: tokens a query sees once the stream is longer than the cache."""
        return self.sink_tokens + self.recent_tokens

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if this config cannot store heads of size ``head_dim``."""
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
        if self.bits == 16:
            return
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"bits=4 packs two channels per byte and needs an even head_dim, got head_dim={head_dim}")
        if head_dim % self.value_group_size:
            raise ValueError(
                f"CacheConfig.value_group_size must divide head_dim={head_dim}, "
                f"got value_group_size={self.value_group_size}")
