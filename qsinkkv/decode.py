"""Decode attention in PyTorch over a ``LayerStorage``: the reference, and the folded CPU path.

One query token per sequence, at position ``seq_lens[b] - 1`` (the newest stored token).

``decode_attention_reference`` dequantizes every slot and runs the dense
``sink_window_attention``: the reference of both fast paths (the folded one below and the
Triton kernel, ``qsinkkv.kernels.decode_attention``).

``decode_attention_torch`` (the cache's CPU path for absolute positions) folds the affine
dequantization into the two products instead:

  scores[t] = sum_d q_d (c_td s_d + z_d)        = sum_d (q_d s_d) c_td + sum_d q_d z_d
  out_d     = sum_t p_t (c_td s_tg + z_tg)      = sum_t (p_t s_tg) c_td + sum_t p_t z_tg,  g = d // G

so the codes are only converted to float, never scaled, shifted or interleaved (int4:
even channels are the low nibbles, odd ones the high nibbles; the query and the output are
split the same way). Absolute contract only: under ``cache_index`` every key is rotated by
its own index, which does not fold; the cache uses the reference there.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .attention import sink_window_attention
from .rope import Rotary
from .storage import LayerStorage, by_table, gather


def decode_attention_torch(q: Tensor, layer: LayerStorage, *, scale: float | None = None,
                           sink_logits: Tensor | None = None) -> Tensor:
    """``q [B, H, D]`` -> ``[B, H, D]`` in q's dtype, straight from the codes. Same contract as
    ``qsinkkv.kernels.decode_attention`` (absolute positions).

    Works head-major, as the pools are stored (``[Hkv, B, ...]``), with scores kept as
    ``[Hkv, B, N, G]`` (tokens before query heads) so that every product reads the stored tensors
    in their own row-major order: ``codes [.., bs, D] @ q [.., D, G]`` and ``p [.., G, N] @ codes
    [.., N, D]``; a dense storage is read through views, with no copy of the window."""
    cfg, s = layer.layout.config, layer
    read = lambda name, table: by_table(getattr(s, name), table, s.dense)  # noqa: E731
    Hkv, B, D = s.num_kv_heads, s.batch_size, s.head_dim
    S = cfg.sink_tokens
    G = q.shape[1] // Hkv
    nq, bs = s.quant_table.shape[1], cfg.block_size
    scale = D ** -0.5 if scale is None else scale
    qT = (q.float().view(B, Hkv, G, D) * scale).permute(1, 0, 3, 2).contiguous()  # [Hkv, B, D, G]

    scores = [read("sink_k", s.sink_table).float() @ qT]                        # [Hkv, B, S, G]
    if nq:
        t = s.quant_table
        qsT = qT.unsqueeze(2) * read("key_scale", t).float().unsqueeze(-1)      # [Hkv, B, nq, D, G]
        planes = list(zip(_split_codes(read("key_codes", t), cfg.bits, "key"), _split_channels(qsT, cfg.bits)))
        s_q = planes[0][0] @ planes[0][1]                                       # [Hkv, B, nq, bs, G]
        s_q += (read("key_zero", t).float() @ qT).unsqueeze(3)
        for c, qc in planes[1:]:  # accumulate in place: one [.., bs, G] buffer for every plane
            s_q.view(-1, bs, G).baddbmm_(c.reshape(-1, bs, c.shape[-1]), qc.reshape(-1, *qc.shape[-2:]))
        scores.append(s_q.flatten(2, 3))
    scores.append(read("float_k", s.float_table).flatten(2, 3).float() @ qT)    # [Hkv, B, F, G]
    # softmax along the last, contiguous axis: [Hkv, B, G, N]
    scores = torch.cat(scores, dim=2).transpose(-1, -2).contiguous()
    seen = layer.layout.visible_slots(layer.seq_lens, q.device)                 # [B, N]
    scores.masked_fill_(~seen.view(1, B, 1, -1), float("-inf"))
    if sink_logits is None:
        pT = torch.softmax(scores, dim=-1)                                      # [Hkv, B, G, N]
    else:
        sl = sink_logits.float().view(Hkv, 1, G, 1).expand(Hkv, B, G, 1)
        pT = torch.softmax(torch.cat((scores, sl), dim=-1), dim=-1)[..., :-1]
    # (each float copy made where it is used: one live at a time, so the allocator reuses its pages)
    out = pT[..., :S] @ read("sink_v", s.sink_table).float()
    out += pT[..., S + nq * bs:] @ read("float_v", s.float_table).flatten(2, 3).float()
    if nq:
        t = s.quant_table
        gs = cfg.value_group_size
        ng = D // gs
        p_q = pT[..., S:S + nq * bs]                                            # [Hkv, B, G, Nq]
        v_scale = read("value_scale", t).float().flatten(2, 3)                  # [Hkv, B, Nq, ng]
        v_zero = read("value_zero", t).float().flatten(2, 3)
        bias = p_q @ v_zero                                                     # [Hkv, B, G, ng]
        codes = [c.flatten(2, 3).unflatten(-1, (ng, -1))
                 for c in _split_codes(read("value_codes", t), cfg.bits, "value")]
        parts = []                                                              # per group: [Hkv, B, G, gs]
        for n in range(ng):
            ps = p_q * v_scale[..., n].unsqueeze(2)                             # [Hkv, B, G, Nq]
            planes = [ps @ c[..., n, :] for c in codes]                         # [Hkv, B, G, gs / k] each
            part = torch.stack(planes, dim=-1).flatten(-2) if len(planes) == 2 else planes[0]
            parts.append(part.add_(bias[..., n:n + 1]))
        out += torch.cat(parts, dim=-1) if ng > 1 else parts[0]
    return out.transpose(0, 1).reshape(B, Hkv * G, D).to(q.dtype)


def _split_codes(codes: Tensor, bits: int, role: str) -> list[Tensor]:
    """float codes: int8 as one tensor; int4 as (even channels, odd channels). Written into
    workspace buffers that live across calls: a window's worth of float codes allocated afresh at
    every layer of every step costs more in page faults than the conversion itself."""
    shape, dev = codes.shape, codes.device
    if bits != 4:
        return [_workspace((role, "f0"), shape, torch.float32, dev).copy_(codes)]
    lo = torch.bitwise_and(codes, 0xF, out=_workspace((role, "u0"), shape, torch.uint8, dev))
    hi = torch.bitwise_right_shift(codes, 4, out=_workspace((role, "u1"), shape, torch.uint8, dev))
    return [_workspace((role, "f0"), shape, torch.float32, dev).copy_(lo),
            _workspace((role, "f1"), shape, torch.float32, dev).copy_(hi)]


_WORKSPACE: dict = {}


def _workspace(name: tuple, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A buffer reused across calls (one per name; reallocated when the shape changes)."""
    key = (name, dtype, device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.shape != shape:
        _WORKSPACE[key] = buf = torch.empty(shape, dtype=dtype, device=device)
    return buf


def _split_channels(x: Tensor, bits: int) -> list[Tensor]:
    """``x [..., D, G]`` as the codes' planes: int4 (even channels, odd channels) as row views."""
    return [x[..., 0::2, :], x[..., 1::2, :]] if bits == 4 else [x]


def decode_attention_reference(q: Tensor, layer: LayerStorage, *, scale: float | None = None,
                               rotary: Rotary | None = None, sink_logits: Tensor | None = None) -> Tensor:
    """Dequantize every slot, then dense masked attention: ``q [B, H, D]`` -> ``[B, H, D]``.
    With ``rotary`` (the ``cache_index`` contract) q and the stored keys are pre-RoPE."""
    B = q.shape[0]
    k, v, k_pos = gather(layer, torch.float32)
    q_pos = (layer.seq_lens.to(q.device) - 1).view(B, 1)
    cfg = layer.layout.config
    out = sink_window_attention(q.unsqueeze(2), k, v, q_pos, k_pos, sink_tokens=cfg.sink_tokens,
                                recent_tokens=cfg.recent_tokens, scale=scale, rotary=rotary, sink_logits=sink_logits)
    return out.squeeze(2)
