"""Decode attention in PyTorch over a ``LayerStorage``: the reference, and the folded CPU path.

One query token per sequence, at position ``seq_lens[b] - 1`` (the newest stored token).

``decode_attention_reference`` dequantizes every slot and runs the dense
``sink_window_attention``: the reference of both fast paths (the folded one below and the
Triton kernel, ``qsinkkv.kernels.decode_attention``).

``decode_attention_torch`` (the cache's CPU path for absolute positions) folds the affine
dequantization into the two products instead:

  scores[t] = sum_d q_d (c_td s_d + z_d)        = sum_d (q_d s_d) c_td + sum_d q_d z_d
  out_d     = sum_t p_t (c_td s_tg + z_tg)      = sum_t (p_t s_tg) c_td + sum_t p_t z_tg,  g = d // G

so the codes are only converted to float, never scaled or shifted (int4: the low nibbles are
the first half of the channels, the high nibbles the second; the query and the output are
split into the same halves). Absolute contract only: under ``cache_index`` every key is rotated by
its own index, which does not fold; the cache uses the reference there.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from .attention import sink_window_attention
from .rope import Rotary
from .storage import LayerStorage, by_table, gather


def decode_attention_torch(q: Tensor, layer: LayerStorage, *, scale: float | None = None,
                           sink_logits: Tensor | None = None) -> Tensor:
    """``q [B, H, D]`` -> ``[B, H, D]`` in q's dtype, straight from the codes. Same contract as
    ``qsinkkv.kernels.decode_attention`` (absolute positions).

    Works head-major, as the pools are stored (``[Hkv, B, ...]``), with scores as ``[Hkv, B, G, N]``
    (query heads before tokens): every product then has the G query heads as its few rows,
    ``q [.., G, D] @ keys^T [.., D, N]`` and ``p [.., G, N] @ values [.., N, D]``, the shape BLAS runs
    fast (with G as the columns, ``keys [N, D] @ q [D, G]``, MKL ran several times slower at G = 3
    on 2 AMD cores); a dense storage is read through views, with no copy of the window."""
    cfg, s = layer.layout.config, layer
    read = lambda name, table: by_table(getattr(s, name), table, s.dense)  # noqa: E731
    Hkv, B, D = s.num_kv_heads, s.batch_size, s.head_dim
    S = cfg.sink_tokens
    G = q.shape[1] // Hkv
    nq, bs = s.quant_table.shape[1], cfg.block_size
    scale = D ** -0.5 if scale is None else scale
    qh = (q.float().view(B, Hkv, G, D) * scale).transpose(0, 1)                 # [Hkv, B, G, D]
    keysT = lambda name, table: read(name, table).float().flatten(2, -2).transpose(-1, -2)  # noqa: E731

    scores = [qh @ keysT("sink_k", s.sink_table)]                              # [Hkv, B, G, S]
    if nq:
        t = s.quant_table
        # q * s_k per block, one contiguous [Hkv, B, nq, G, D / cpb] per plane of the codes
        qs = [qc.unsqueeze(2) * sc.unsqueeze(3) for qc, sc in
              zip(_split_channels(qh, cfg.bits), _split_channels(read("key_scale", t).float(), cfg.bits))]
        planes = zip(_split_codes(read("key_codes", t), cfg.bits, "key"), qs)
        s_q = None                                                              # [Hkv, B, nq, G, bs]
        for c, qc in planes:  # accumulate in place: one [.., G, bs] buffer for every plane
            if s_q is None:
                s_q = qc @ c.transpose(-1, -2)
            else:
                s_q.view(-1, G, bs).baddbmm_(qc.reshape(-1, G, qc.shape[-1]), c.reshape(-1, bs, c.shape[-1]).mT)
        s_q += (qh @ read("key_zero", t).float().transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)
        scores.append(s_q.transpose(2, 3).flatten(3, 4))                        # [Hkv, B, G, nq * bs]
    scores.append(qh @ keysT("float_k", s.float_table))                        # [Hkv, B, G, F]
    scores = torch.cat(scores, dim=-1)                                          # [Hkv, B, G, N]
    scores += layer.layout.visible_bias(layer.seq_lens, q.device).view(1, B, 1, -1)  # -inf: not seen
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
        p_q = pT[..., S:S + nq * bs]                                            # [Hkv, B, G, Nq]
        v_scale = read("value_scale", t).float().flatten(2, 3)                  # [Hkv, B, Nq, ng]
        v_zero = read("value_zero", t).float().flatten(2, 3)
        planes = [c.flatten(2, 3) for c in _split_codes(read("value_codes", t), cfg.bits, "value")]
        folded = {}                                                             # group -> (p * s_v, sum p z_v)
        parts = []                                                              # [Hkv, B, G, width], in channel order
        for plane, lo, hi, n in _plane_groups(D, cfg.value_group_size, len(planes)):
            if n not in folded:
                folded[n] = (p_q * v_scale[..., n].unsqueeze(2),                # [Hkv, B, G, Nq]
                             torch.linalg.vecdot(p_q, v_zero[..., n].unsqueeze(2)).unsqueeze(-1))  # [Hkv, B, G, 1]
            ps, bias = folded[n]
            parts.append((ps @ planes[plane][..., lo:hi]).add_(bias))
        out += torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    return out.transpose(0, 1).reshape(B, Hkv * G, D).to(q.dtype)


def _split_codes(codes: Tensor, bits: int, role: str) -> list[Tensor]:
    """float codes as planes of channels: int8 as one tensor; int4 as (first half, second half):
    the low and the high nibbles. Written into workspace buffers that live across calls: a
    window's worth of float codes allocated afresh at every layer of every step costs more in
    page faults than the conversion itself."""
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
    """``x [..., D]`` as the codes' planes: int4 (first half, second half) as views."""
    return list(x.chunk(2, dim=-1)) if bits == 4 else [x]


@functools.lru_cache(maxsize=64)
def _plane_groups(D: int, group_size: int, num_planes: int) -> tuple[tuple[int, int, int, int], ...]:
    """``(plane, lo, hi, group)`` for each run of channels of one value group inside one plane
    (``num_planes`` equal, consecutive ranges of the D channels), in channel order: plane columns
    ``[lo, hi)`` share the scale and zero of ``group``. A group may span two planes."""
    width, runs = D // num_planes, []
    for ch in range(D):
        plane, col, n = ch // width, ch % width, ch // group_size
        if runs and runs[-1][0] == plane and runs[-1][3] == n:
            runs[-1][2] = col + 1
        else:
            runs.append([plane, col, col + 1, n])
    return tuple(tuple(r) for r in runs)


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
