"""Decode attention in PyTorch over a ``LayerStorage``: the reference, and the PyTorch CPU path.

One query token per sequence, at position ``seq_lens[b] - 1`` (the newest stored token).

``decode_attention_reference`` dequantizes every slot (``gather``) and runs the dense
``sink_window_attention``: the reference of the three fast paths (the one below, the C one in
``decode_c.py``, and the Triton kernel, ``qsinkkv.kernels.decode_attention``).

``decode_attention_torch`` (the "torch" backend's CPU path for absolute positions; the "c"
backend's C decode reads the codes inside its products instead) dequantizes every slot
with the same ``gather_into`` into one float32 buffer that lives across calls and layers (the
keys, then the values), and attends in three large ops (scores, softmax, values), with the G
query heads of a KV head as G rows over its keys and the visible set (built once per model
step) as an additive mask. On the CPU a handful of large ops beat folding the scales into the
products: the folded path runs one small batched product per window block plus a few small ops
each, and their per-call overhead outweighs the work (``benchmarks/decode_attention.py``; docs/benchmarks.md,
"Decode attention on the CPU").
Not PyTorch's fused SDPA: its CPU kernel gives a row of a batch a result a rounding apart from
the same row alone, and these products are bit-identical either way.
Absolute contract only: under ``cache_index`` every key is rotated by its own index; the cache
uses the reference there.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor

from . import checks, trace
from .attention import sink_window_attention
from .rope import Rotary
from .storage import LayerStorage, gather, gather_into

# The float32 buffer of one chunk of (KV heads, sequences): small enough to stay in the last-level
# cache while it is filled and read (one buffer for a whole llama-shaped layer at 4,096 tokens and 4
# sequences would be 8 heads x 4 x 4096 x 128 x 4 bytes = 64 MiB for K alone, more than a CPU's L3),
# large enough that the chunks' small ops do not add up.
BUFFER_BYTES = 8 << 20


def decode_attention_torch(q: Tensor, layer: LayerStorage, *, scale: float | None = None,
                           sink_logits: Tensor | None = None) -> Tensor:
    """``q [B, H, D]`` -> ``[B, H, D]`` in q's dtype, computed in float32. Same contract as
    ``qsinkkv.kernels.decode_attention`` (absolute positions).

    Works head-major, as the pools are stored: keys and values ``[Hkv, B, N, D]``, queries
    ``[Hkv, B, G, D]``, so the G query heads that share a KV head are G rows of one product and
    no key is repeated; in chunks of KV heads and sequences whose buffer holds about
    ``BUFFER_BYTES`` (at least one head of one sequence: its keys, then its values, in float32 --
    the transient memory of this path; the Triton kernel needs none)."""
    trace.ran("decode", "torch")
    Hkv, B, D, N = layer.num_kv_heads, layer.batch_size, layer.head_dim, layer.layout.num_slots
    G = q.shape[1] // Hkv
    qh = q.float().view(B, Hkv, G, D).transpose(0, 1) * (D ** -0.5 if scale is None else scale)  # [Hkv, B, G, D]
    bias = layer.layout.visible_bias(layer.seq_lens, q.device)                  # [B, N]: 0 seen, -inf not
    sinks = None if sink_logits is None else sink_logits.float().view(Hkv, 1, G, 1)
    one = N * D * 4                                                             # buffer bytes of one head, one row
    rows = max(1, min(B, BUFFER_BYTES // one))
    heads = max(1, min(Hkv, BUFFER_BYTES // (one * rows)))
    if heads == Hkv and rows == B:
        out = _attend(qh, layer, bias, sinks)
    else:
        out = torch.empty_like(qh)
        for h in range(0, Hkv, heads):
            for b in range(0, B, rows):
                hs, bs = slice(h, h + heads), slice(b, b + rows)
                out[hs, bs] = _attend(qh[hs, bs], layer.part(hs, bs), bias[bs], None if sinks is None else sinks[hs])
    return out.transpose(0, 1).reshape(B, Hkv * G, D).to(q.dtype)


def _attend(qh: Tensor, layer: LayerStorage, bias: Tensor, sink_logits: Tensor | None) -> Tensor:
    """Scaled queries ``qh [h, b, G, D]`` over the slots of ``layer`` (h KV heads, b sequences),
    ``bias [b, N]``: ``[h, b, G, D]`` float32."""
    h, b, G, D = qh.shape
    N = bias.shape[-1]
    numel = h * b * N * D
    buf = _workspace(numel, qh.device)[:numel].view(h, b, N, D)                 # the keys, then the values
    scores = torch.matmul(qh, gather_into(layer, "k", buf).mT).add_(bias.view(1, b, 1, N))  # [h, b, G, N]
    if sink_logits is None:
        p = torch.softmax(scores, dim=-1)
    else:  # the sink logit: one more softmax term, with no value
        p = torch.softmax(torch.cat((scores, sink_logits.expand(h, b, G, 1)), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, gather_into(layer, "v", buf))                       # the keys are spent


_WORKSPACE = threading.local()  # per thread: two threads decoding at once must not share a buffer


def _workspace(numel: int, device: torch.device) -> Tensor:
    """A flat float32 buffer of at least ``numel`` elements, reused across calls and layers (one per
    thread and device, grown when a larger one is needed): a window's worth of floats allocated afresh
    at every layer of every step costs more in page faults than filling it."""
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    buf = buffers.get(device)
    if buf is None or buf.numel() < numel:
        buffers[device] = buf = torch.empty(numel, dtype=torch.float32, device=device)
    return buf


def decode_attention_reference(q: Tensor, layer: LayerStorage, *, scale: float | None = None,
                               rotary: Rotary | None = None, sink_logits: Tensor | None = None) -> Tensor:
    """Dequantize every slot, then dense masked attention: ``q [B, H, D]`` -> ``[B, H, D]``.
    With ``rotary`` (the ``cache_index`` contract) q and the stored keys are pre-RoPE."""
    trace.ran("decode", "reference")
    B = q.shape[0]
    k, v, k_pos = gather(layer, torch.float32)
    q_pos = (layer.seq_lens.to(q.device) - 1).view(B, 1)
    cfg = layer.layout.config
    out = sink_window_attention(q.unsqueeze(2), k, v, q_pos, k_pos, sink_tokens=cfg.sink_tokens,
                                recent_tokens=cfg.recent_tokens, scale=scale, rotary=rotary, sink_logits=sink_logits)
    return out.squeeze(2)


# --- over an engine's own float blocks, named by a table (vLLM's position-aligned pages, bits=16) ----------------

def decode_blocks_torch(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, bias: Tensor, *,
                        scale: float, sink_logits: Tensor | None = None) -> Tensor:
    """Decode over float blocks named by a table, what each query sees given by a bias: ``q [B, H, D]``;
    ``k_pool, v_pool [Hkv, blocks, bs, D]`` (any strides); ``block_table [B, nb]`` int64, the blocks row b reads in
    order (an entry past the visible set may name any block of the pool: its bias is -inf; -1: no block, its slots
    unseen; an entry outside ``[-1, blocks)`` is refused by name, a device-side assert on a GPU); ``bias [B, nb * bs]``
    float32, 0 where the query sees the slot, -inf where not; ``sink_logits [H]``: learned sinks, or None ->
    ``[B, H, D]`` float32. The reference of ``decode_c.decode_blocks_c`` and ``qsinkkv.kernels.decode_blocks``: one
    batched gather and three large ops, the G query heads of a KV head as G rows."""
    trace.ran("decode", "torch")
    checks.table_in_step("block_table", block_table, min(k_pool.shape[1], v_pool.shape[1]), "k_pool and v_pool")
    B, H, D = q.shape
    Hkv, bs = k_pool.shape[0], k_pool.shape[2]
    G = H // Hkv
    none = block_table < 0  # no block: its slots unseen, as the C and Triton kernels read them (not pool[-1])
    bias = bias.masked_fill(none.repeat_interleave(bs, dim=1), float("-inf"))
    block_table = block_table.clamp(min=0)
    # a slot the row does not see (past its length in a reused page, masked, no block) reads as zeros in k and v, as
    # the kernels skip it: the bias alone does not isolate an inf or NaN left there (0 x inf is NaN, so is inf + -inf)
    unseen = (bias == float("-inf")).view(B, 1, -1, 1)

    def read(pool):  # the rows' blocks [B, Hkv, nb * bs, D], unseen slots zero (in place: the gather's own copy)
        return pool[:, block_table].permute(1, 0, 2, 3, 4).reshape(B, Hkv, -1, D).float().masked_fill_(unseen, 0)

    qh = q.float().view(B, Hkv, G, D) * scale
    scores = torch.matmul(qh, read(k_pool).mT).add_(bias.view(B, 1, 1, -1))             # [B, Hkv, G, nb * bs]
    if sink_logits is None:
        p = torch.softmax(scores, dim=-1)
    else:  # one more logit per head, whose value is zero: its mass leaves the output
        sinks = sink_logits.float().view(1, Hkv, G, 1).expand(B, Hkv, G, 1)
        p = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, read(v_pool)).view(B, H, D)
