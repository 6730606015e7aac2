"""LayerStorage: one layer's KV storage as a plain record, the thing every op reads.

The ops (``write``, ``decode``, ``prefill``, ``qsinkkv.kernels``) take this record and never the
cache; ``SinkQuantCache`` owns one per layer and validates what reaches them. Which slot
holds which token is ``layout.py``'s business; the lengths are ``seq_lens``.

  sink_k, sink_v           [B, Hkv, S, D]                    sink_dtype
  float_k, float_v         [B, Hkv, float_rows, D]           window_dtype  (filling block + residual)
  key_codes, value_codes   [B, Hkv, quant_slots, bs, D/cpb]  uint8         (cpb = 2 for int4, else 1)
  key_scale, key_zero      [B, Hkv, quant_slots, D]          scale_dtype   (per block and channel)
  value_scale, value_zero  [B, Hkv, quant_slots, bs, D/G]    scale_dtype   (per token and group)
  seq_lens                 [B] int64 on the host             tokens stored per sequence

``seq_lens`` lives on the host: the write path decides on the host which rows fill a
block or a sink (no device sync), and the kernels take a device copy.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from . import quant
from .layout import WindowLayout

STORAGE_TENSORS = ("sink_k", "sink_v", "float_k", "float_v", "key_codes", "key_scale", "key_zero",
                   "value_codes", "value_scale", "value_zero")


@dataclass(eq=False)
class LayerStorage:
    layout: WindowLayout
    sink_k: Tensor
    sink_v: Tensor
    float_k: Tensor
    float_v: Tensor
    key_codes: Tensor
    key_scale: Tensor
    key_zero: Tensor
    value_codes: Tensor
    value_scale: Tensor
    value_zero: Tensor
    seq_lens: Tensor

    @classmethod
    def allocate(cls, layout: WindowLayout, batch_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> LayerStorage:
        cfg = layout.config
        B, H, D, S, bs = batch_size, num_kv_heads, head_dim, cfg.sink_tokens, cfg.block_size
        zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        nq, Dc = layout.quant_slots, D // quant.codes_per_byte(cfg.bits)
        groups = D // cfg.value_group_size if cfg.bits != 16 else 0
        return cls(
            layout,
            sink_k=zeros(B, H, S, D, dtype=cfg.sink_dtype), sink_v=zeros(B, H, S, D, dtype=cfg.sink_dtype),
            float_k=zeros(B, H, layout.float_rows, D, dtype=cfg.window_dtype),
            float_v=zeros(B, H, layout.float_rows, D, dtype=cfg.window_dtype),
            key_codes=zeros(B, H, nq, bs, Dc, dtype=torch.uint8),
            key_scale=zeros(B, H, nq, D, dtype=cfg.scale_dtype), key_zero=zeros(B, H, nq, D, dtype=cfg.scale_dtype),
            value_codes=zeros(B, H, nq, bs, Dc, dtype=torch.uint8),
            value_scale=zeros(B, H, nq, bs, groups, dtype=cfg.scale_dtype),
            value_zero=zeros(B, H, nq, bs, groups, dtype=cfg.scale_dtype),
            seq_lens=torch.zeros(B, dtype=torch.int64))

    @property
    def batch_size(self) -> int:
        return self.sink_k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.sink_k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.sink_k.shape[3]

    @property
    def device(self) -> torch.device:
        return self.sink_k.device

    def tensors(self) -> dict[str, Tensor]:
        """The storage tensors by name (not ``seq_lens``)."""
        return {name: getattr(self, name) for name in STORAGE_TENSORS}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def rows(self, b: int) -> LayerStorage:
        """Sequence ``b`` alone, as views: writing through it writes this storage."""
        kw = {f.name: getattr(self, f.name)[b:b + 1] for f in fields(self) if f.name != "layout"}
        return LayerStorage(self.layout, **kw)

    def select(self, index: Tensor) -> None:
        """Keep, reorder or repeat sequences (``index [B']`` of rows)."""
        for name in STORAGE_TENSORS:
            setattr(self, name, getattr(self, name).index_select(0, index.to(self.device)).contiguous())
        self.seq_lens = self.seq_lens.index_select(0, index.cpu())


def gather(storage: LayerStorage, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Every slot, dequantized (the reference read): k, v ``[B, Hkv, N, D]`` in ``dtype`` and
    their positions ``[B, N]`` (-1: empty)."""
    cfg = storage.layout.config
    sink_pos, quant_pos, float_pos = storage.layout.slot_positions(storage.seq_lens.to(storage.device))
    ks, vs = [storage.sink_k.to(dtype)], [storage.sink_v.to(dtype)]
    if quant_pos.shape[1]:
        B, H, nq, bs, _ = storage.key_codes.shape
        ks.append(quant.dequantize_key_blocks(storage.key_codes, storage.key_scale, storage.key_zero, cfg.bits)
                  .reshape(B, H, nq * bs, -1).to(dtype))
        vs.append(quant.dequantize_values(storage.value_codes, storage.value_scale, storage.value_zero, cfg.bits,
                                          cfg.value_group_size).reshape(B, H, nq * bs, -1).to(dtype))
    ks.append(storage.float_k.to(dtype))
    vs.append(storage.float_v.to(dtype))
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2), torch.cat((sink_pos, quant_pos, float_pos), dim=1)
