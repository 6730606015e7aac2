"""Independent float64 oracles built from the design sheet's definitions, not from the cache's code.

The only thing shared with the library is the block quantizer itself (tested on its own in
test_quant.py): the oracle decides *which* tokens are quantized, from the definition
"a block is quantized once, when it is full and older than the residual".
"""
from __future__ import annotations

import torch

from qsinkkv import quant


def visible(i: int, S: int, W: int) -> list[int]:
    """Design sheet: [0..i] if i < S+W, else [0..S-1] ∪ [i-W+1 .. i]."""
    if i < S + W:
        return list(range(i + 1))
    return list(range(S)) + list(range(i - W + 1, i + 1))


def bf16_exact(*shape, generator=None, scale=1.0):
    """float32 random normals that are exactly representable in bf16."""
    x = torch.randn(*shape, generator=generator) * scale
    return x.to(torch.bfloat16).to(torch.float32)


def stored_history(k, v, n, cfg):
    """What the cache holds (dequantized, float64) for positions 0..n-1 of a stream whose
    full-precision history is ``k, v [B, Hkv, N, D]``, after n tokens were stored."""
    S, bs, R = cfg.sink_tokens, cfg.block_size, cfg.residual_tokens
    ks = k[:, :, :n].clone().to(torch.float64)
    vs = v[:, :, :n].clone().to(torch.float64)
    ns = min(S, n)
    ks[:, :, :ns] = k[:, :, :ns].to(cfg.sink_dtype).double()
    vs[:, :, :ns] = v[:, :, :ns].to(cfg.sink_dtype).double()
    m = max(n - S, 0)
    rk = k[:, :, S:n].to(cfg.window_dtype).double()
    rv = v[:, :, S:n].to(cfg.window_dtype).double()
    ks[:, :, S:n], vs[:, :, S:n] = rk, rv
    if cfg.bits == 16:
        return ks, vs
    nq = max(m - R, 0) // bs  # blocks that are full and older than the residual
    for b in range(nq):
        sl = slice(S + b * bs, S + (b + 1) * bs)
        kb = k[:, :, sl].to(cfg.window_dtype).float().unsqueeze(2)
        codes, sc, z = quant.quantize_key_blocks(kb, cfg.bits, cfg.scale_dtype)
        ks[:, :, sl] = quant.dequantize_key_blocks(codes, sc, z, cfg.bits).squeeze(2).double()
        vb = v[:, :, sl].to(cfg.window_dtype).float()
        codes, sc, z = quant.quantize_values(vb, cfg.bits, cfg.value_group_size, cfg.scale_dtype)
        vs[:, :, sl] = quant.dequantize_values(codes, sc, z, cfg.bits, cfg.value_group_size).double()
    return ks, vs


def attention_oracle(q, keys_for_query, S, W, q_positions, rotary=None, sink_logits=None, scale=None):
    """float64 attention, one query position at a time.

    q: ``[B, H, T, D]``; ``keys_for_query(i) -> (k, v)`` gives ``[B, Hkv, >= i+1, D]`` float64
    tensors indexed by absolute position. With ``rotary``, q and k are pre-RoPE and are
    rotated explicitly by their index in the visible list (StreamingLLM).
    """
    B, H, T, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty(B, H, T, D, dtype=torch.float64)
    for t, i in enumerate(q_positions):
        k, v = keys_for_query(i)
        Hkv = k.shape[1]
        vis = visible(i, S, W)
        kk = k[:, :, vis].repeat_interleave(H // Hkv, dim=1)
        vv = v[:, :, vis].repeat_interleave(H // Hkv, dim=1)
        qq = q[:, :, t:t + 1].double()
        if rotary is not None:
            local = torch.arange(len(vis))
            kk = rotary.rotate(kk, local)
            qq = rotary.rotate(qq, torch.tensor([len(vis) - 1]))
        s = (qq @ kk.transpose(-1, -2)).squeeze(2) * scale  # [B, H, n]
        if sink_logits is not None:
            s = torch.cat((s, sink_logits.double().view(1, H, 1).expand(B, H, 1)), dim=-1)
            p = torch.softmax(s, dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out[:, :, t] = (p.unsqueeze(2) @ vv).squeeze(2)
    return out
