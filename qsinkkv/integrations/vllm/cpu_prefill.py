"""A prompt's prefill on vLLM's CPU build through the attention kernel stock vLLM runs there (CPU_ATTN's
``cpu_attention_with_kv_cache``), in the model's dtype.

The rows it serves are ``Ops.prefill_causal``'s: each holds and brings at most S + W tokens in all, so every query
sees exactly its causal prefix (``layout.py``'s rule reduces to the causal mask): a new prompt, or a chunk of one
that continues within the capacity (vLLM's chunked prefill). Stock runs the same kernel over its pages; here a
small scratch cache of ``BLOCK``-token blocks in CPU_ATTN's layout (``[blocks, Hkv, 2 * BLOCK, D]``: a block's keys,
then its values, per head) holds one block run per row: what the row held (``prefill.causal_context``: its stored
tokens dequantized, as the reference reads them, rounded to the model's dtype) and then the step's K/V, the tails
zero (the kernel reads a block whole: a stale NaN there would reach the row). The scratch and the kernel's
scheduler metadata are made once per step (every layer of a step asks for the same rows) and reused by the step's
layers. The qsinkkv pages are written by the step's write as for any row: this kernel only computes the rows'
attention.

Against ``prefill_causal_packed`` (SDPA in float32, row by row) it differs by the model dtype's rounding (bf16: the
kernel's products, as stock's, and the held tokens' values); it is the faster of the two on vLLM's CPU build
(``benchmarks/vllm_profile.py``; docs/benchmarks.md, "vLLM with the plugin"). A row's output does not depend on the
other rows of its step (tested bit for bit)."""
from __future__ import annotations

import torch
from torch import Tensor
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm.v1.attention.backends.cpu_attn import ops as cpu_ops  # (0.32: vllm._custom_ops; 0.34: vllm._cpu_ops)

from ... import trace
from ...prefill import Context

BLOCK = 32  # tokens per scratch block (CPU_ATTN's block size for its vector ISAs)
# The last step's rows and their scratch, shared by every layer's instance: a layer rewrites every slot it reads
# (what its rows held, then its new tokens) before its kernel reads them, and the layers of a step run one by one.
_last: tuple[tuple, _Scratch] | None = None


class CpuAttnPrefill:
    """``Ops.prefill_causal`` on vLLM's CPU build: ``(q [N, H, D], k, v [N, Hkv, D], starts, lens, context, *,
    scale)``, row i's tokens at ``[starts[i], starts[i] + lens[i])`` of the packed step after the ``context.held[i]``
    it held (``prefill.Context``: dequantized, rounded to the model's dtype here; None: every row fresh) ->
    ``[sum(lens), H, D]`` in q's dtype, the rows' tokens in order (into ``out``, such a contiguous tensor, if given).
    ``dtype``: the model's (the kernel's ISA is
    chosen for it once; another dtype is refused)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.isa = _get_attn_isa(dtype, BLOCK, head_dim)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, starts: list[int], lens: list[int],
                 context: Context | None = None, *, scale: float | None = None, out: Tensor | None = None) -> Tensor:
        trace.ran("prefill_causal", "vllm_cpu")
        if q.dtype != self.dtype or k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"vLLM's CPU prefill kernel was set up for {self.dtype}, got q, k, v of "
                             f"{q.dtype}, {k.dtype}, {v.dtype}")
        if q.shape[1:] != (self.num_heads, self.head_dim) or k.shape[1:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"q must be [N, {self.num_heads}, {self.head_dim}] and k, v [N, {self.num_kv_heads}, "
                             f"{self.head_dim}], got {tuple(q.shape)}, {tuple(k.shape)}")
        held = context.held if context is not None else [0] * len(lens)
        global _last
        key = (tuple(starts), tuple(lens), tuple(held), k.shape[0], self.num_heads, self.num_kv_heads, self.head_dim,
               self.dtype, self.isa)
        if _last is None or _last[0] != key:  # (each layer has its own instance: the scratch is the step's)
            _last = (key, _Scratch(self, starts, lens, held, k.shape[0]))
        s = _last[1]
        if s.context_slots is not None:  # what the rows held, packed row by row, in the model's dtype
            real = torch.arange(context.k.shape[2]) < torch.tensor(held).unsqueeze(1)          # [n, C]
            stored = [x.transpose(1, 2)[real].to(self.dtype) for x in (context.k, context.v)]  # [sum(held), Hkv, D]
            cpu_ops.cpu_attn_reshape_and_cache(*stored, s.key_cache, s.value_cache, s.context_slots, self.isa)
        cpu_ops.cpu_attn_reshape_and_cache(k, v, s.key_cache, s.value_cache, s.slot_mapping, self.isa)
        query = q.narrow(0, starts[0], s.tokens) if s.one_run else q.index_select(0, s.tokens_at)
        if (out is None or out.shape != (s.tokens, self.num_heads, self.head_dim) or out.dtype != q.dtype
                or not out.is_contiguous()):  # (the kernel writes rows of H x D densely, in q's dtype)
            out = q.new_empty((s.tokens, self.num_heads, self.head_dim))
        if query.stride(2) != 1 or query.stride(1) != self.head_dim:  # (rows any stride apart, as stock hands them)
            query = query.contiguous()
        cpu_ops.cpu_attention_with_kv_cache(query=query, key_cache=s.key_cache, value_cache=s.value_cache,
                                        output=out, query_start_loc=s.query_start_loc, seq_lens=s.seq_lens,
                                        scale=self.head_dim ** -0.5 if scale is None else float(scale), causal=True,
                                        alibi_slopes=None, sliding_window=-1, block_table=s.block_table, softcap=0.0,
                                        scheduler_metadata=s.metadata, s_aux=None)
        return out


class _Scratch:
    """One step's rows laid out for the kernel: ``query_start_loc [B + 1]`` (row i's queries: its new tokens) and
    ``seq_lens [B]`` (what it held and its new tokens) int32, ``block_table [B, max blocks]`` int32 (row i's blocks:
    one run), ``slot_mapping [N]`` int64 (a new token of row i -> its slot, after what the row held; the step's
    other tokens -1: not copied), ``context_slots`` (what the rows held, packed row by row -> their slots; None
    when no row held anything), the zeroed cache, the kernel's scheduler metadata, ``tokens_at`` (the rows' new
    tokens in the packed step, in order) and ``one_run`` (they lie in one run: q is read in place)."""

    def __init__(self, prefill: CpuAttnPrefill, starts: list[int], lens: list[int], held: list[int],
                 step_tokens: int) -> None:
        blocks = [-(-(n + t) // BLOCK) for n, t in zip(held, lens)]
        first = (torch.tensor([0] + blocks[:-1]).cumsum(0) * BLOCK).tolist()  # each row's first slot
        self.tokens = sum(lens)
        self.seq_lens = torch.tensor([n + t for n, t in zip(held, lens)], dtype=torch.int32)
        self.query_start_loc = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.block_table = (torch.tensor(first).unsqueeze(1) // BLOCK + torch.arange(max(blocks))).to(torch.int32)
        self.tokens_at = torch.cat([torch.arange(s, s + t) for s, t in zip(starts, lens)])
        self.one_run = starts == [starts[0] + sum(lens[:i]) for i in range(len(lens))]
        self.slot_mapping = torch.full((step_tokens,), -1, dtype=torch.int64)
        self.slot_mapping[self.tokens_at] = torch.cat([f + n + torch.arange(t) for f, n, t in zip(first, held, lens)])
        self.context_slots = torch.cat([f + torch.arange(n) for f, n in zip(first, held)]) if any(held) else None
        cache = torch.zeros(sum(blocks), prefill.num_kv_heads, 2 * BLOCK, prefill.head_dim, dtype=prefill.dtype)
        self.key_cache, self.value_cache = cache.chunk(2, dim=2)
        self.metadata = cpu_ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(lens), num_heads=prefill.num_heads, num_kv_heads=prefill.num_kv_heads,
            head_dim=prefill.head_dim, seq_lens=self.seq_lens, dtype=prefill.dtype,
            query_start_loc=self.query_start_loc, causal=True, sliding_window_size=-1, isa=prefill.isa,
            enable_kv_split=False)
