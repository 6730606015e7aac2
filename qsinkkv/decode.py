"""Decode attention in PyTorch: the reference, and the CPU fast path straight from the codes.

``decode_attention_reference`` dequantizes the whole window and runs the dense
``sink_window_attention``: the reference of both fast paths (this one and the Triton kernel).

``decode_attention_torch`` folds the affine dequantization into the two products instead:

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

from .attention import sink_window_attention, visible_mask
from .rope import Rotary


def decode_attention_torch(q: Tensor, layer, seq_lens: Tensor | None = None, *, scale: float | None = None,
                           sink_logits: Tensor | None = None) -> Tensor:
    """One query per sequence over a ``LayerCache``: ``q [B, H, D]`` -> ``[B, H, D]`` in q's dtype.
    Same contract as ``qsinkkv.kernels.decode_attention`` (absolute positions)."""
    cfg = layer.config
    B, Hkv, S, D = layer.sink_k.shape
    H = q.shape[1]
    G = H // Hkv
    seq_lens = layer.seq_lens() if seq_lens is None else seq_lens
    scale = D ** -0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, G, D) * scale
    sink_pos, quant_pos, float_pos = layer.layout.slot_positions(seq_lens)

    scores = [torch.einsum("bhgd,bhsd->bhgs", qf, layer.sink_k.float())]
    nq, bs = layer.key_codes.shape[2], cfg.block_size
    if nq:
        codes = _split_codes(layer.key_codes, cfg.bits)                          # [B, Hkv, nq, bs, D/k] each
        qs = qf.unsqueeze(3) * layer.key_scale.float().unsqueeze(2)              # [B, Hkv, G, nq, D]
        qs = _split_channels(qs, cfg.bits)
        s_q = sum(torch.einsum("bhgjd,bhjtd->bhgjt", a, c) for a, c in zip(qs, codes))
        s_q = s_q + torch.einsum("bhgd,bhjd->bhgj", qf, layer.key_zero.float()).unsqueeze(-1)
        scores.append(s_q.flatten(-2))
    scores.append(torch.einsum("bhgd,bhfd->bhgf", qf, layer.float_k.float()))
    scores = torch.cat(scores, dim=-1)
    pos = torch.cat((sink_pos, quant_pos, float_pos), dim=1)
    seen = visible_mask((seq_lens.long() - 1).unsqueeze(-1), pos, cfg.sink_tokens, cfg.recent_tokens)
    scores = scores.masked_fill(~seen.view(B, 1, 1, -1), float("-inf"))
    if sink_logits is None:
        p = torch.softmax(scores, dim=-1)
    else:
        s = sink_logits.float().view(1, Hkv, G, 1).expand(B, Hkv, G, 1)
        p = torch.softmax(torch.cat((scores, s), dim=-1), dim=-1)[..., :-1]

    p_sink, p_quant, p_float = p.split([S, nq * bs, p.shape[-1] - S - nq * bs], dim=-1)
    out = torch.einsum("bhgs,bhsd->bhgd", p_sink, layer.sink_v.float())
    out = out + torch.einsum("bhgf,bhfd->bhgd", p_float, layer.float_v.float())
    if nq:
        gs = cfg.value_group_size
        ng = D // gs
        p_quant = p_quant.reshape(B, Hkv, G, nq, bs)
        ps = p_quant.unsqueeze(-1) * layer.value_scale.float().unsqueeze(2)     # [B, Hkv, G, nq, bs, NG]
        codes = _split_codes(layer.value_codes, cfg.bits)
        k = len(codes)
        parts = [torch.einsum("bhgjtn,bhjtnc->bhgnc", ps, c.reshape(B, Hkv, nq, bs, ng, gs // k)) for c in codes]
        coded = torch.stack(parts, dim=-1).flatten(-3) if k == 2 else parts[0].flatten(-2)
        bias = torch.einsum("bhgjt,bhjtn->bhgn", p_quant, layer.value_zero.float())
        out = out + coded + bias.repeat_interleave(gs, dim=-1)
    return out.reshape(B, H, D).to(q.dtype)


def _split_codes(codes: Tensor, bits: int) -> list[Tensor]:
    """float codes: int8 as one tensor; int4 as (even channels, odd channels)."""
    if bits == 4:
        return [(codes & 0xF).float(), (codes >> 4).float()]
    return [codes.float()]


def _split_channels(x: Tensor, bits: int) -> list[Tensor]:
    return [x[..., 0::2], x[..., 1::2]] if bits == 4 else [x]


def decode_attention_reference(q: Tensor, layer, seq_lens: Tensor | None = None, *,
                               scale: float | None = None, rotary: Rotary | None = None,
                               sink_logits: Tensor | None = None) -> Tensor:
    """PyTorch reference of ``decode_attention`` on the same storage: dequantize everything, then
    dense masked attention. ``q [B, H, D]`` -> ``[B, H, D]``."""
    B = q.shape[0]
    seq_lens = layer.seq_lens() if seq_lens is None else seq_lens
    k, v, k_pos = layer.gather(torch.float32, seq_lens)
    q_pos = (seq_lens.long() - 1).view(B, 1)
    cfg = layer.config
    out = sink_window_attention(q.unsqueeze(2), k, v, q_pos, k_pos, sink_tokens=cfg.sink_tokens,
                                recent_tokens=cfg.recent_tokens, scale=scale, rotary=rotary, sink_logits=sink_logits)
    return out.squeeze(2)
