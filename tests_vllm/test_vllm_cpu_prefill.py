"""``cpu_prefill.CpuAttnPrefill``: a packed step's causal rows (fresh, or after what they held) through vLLM's own CPU
attention kernel, against a float64 dense causal oracle, a row alone against the same row in a step, and a step
after a different one."""
from __future__ import annotations

import pytest
import torch

from qsinkkv import trace
from qsinkkv.integrations.vllm.cpu_prefill import BLOCK, CpuAttnPrefill
from qsinkkv.prefill import Context

H, Hkv, D = 6, 2, 64
LENS = [40, 1, 70, 1, BLOCK, 1, 3]  # fresh rows beside one-token rows (a decode's), a row of exactly one block
FRESH = [0, 2, 4, 6]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # the kernel's float32 exp; bf16: its products in bf16, as stock's


def _step(dtype, lens=LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = sum(lens)
    q, k, v = (torch.randn(N, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    starts = torch.tensor([0, *lens]).cumsum(0).tolist()
    return q, k, v, starts


def _oracle(q, k, v, start, t, scale):
    """Causal attention of one row in float64: ``[t, H, D]``."""
    qs, ks, vs = (x[start:start + t].double() for x in (q, k, v))
    ks, vs = (x.repeat_interleave(H // Hkv, dim=1) for x in (ks, vs))
    s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_rows_equal_the_float64_oracle_and_alone_equals_in_a_step(dtype):
    q, k, v, starts = _step(dtype)
    prefill = CpuAttnPrefill(H, Hkv, D, dtype)
    rows_at, rows_len = [starts[r] for r in FRESH], [LENS[r] for r in FRESH]
    with trace.recording() as ran:
        out = prefill(q, k, v, rows_at, rows_len, scale=0.3)
    assert ran == [("prefill_causal", "vllm_cpu")]
    assert out.dtype == dtype and out.shape == (sum(rows_len), H, D)
    at = 0
    for s, t in zip(rows_at, rows_len):
        expect = _oracle(q, k, v, s, t, 0.3)
        assert (out[at:at + t].double() - expect).abs().max() < TOL[dtype], (s, t)
        alone = CpuAttnPrefill(H, Hkv, D, dtype)(q, k, v, [s], [t], scale=0.3)
        assert torch.equal(alone, out[at:at + t]), f"row at {s} ({t} tokens): alone != in the step"
        at += t


def test_a_step_after_another_reads_only_its_own_tokens():
    """The scratch is the step's: a second step of other rows, then the first step again (its scratch remade), each
    equals a fresh instance's; scale None is head_dim ** -0.5."""
    prefill = CpuAttnPrefill(H, Hkv, D, torch.float32)
    first = _step(torch.float32, seed=1)
    second = _step(torch.float32, lens=[90, 5], seed=2)
    for q, k, v, starts in (first, second, first):
        lens = [t for t in torch.tensor(starts).diff().tolist()]
        got = prefill(q, k, v, starts[:-1], lens)
        assert torch.equal(got, CpuAttnPrefill(H, Hkv, D, torch.float32)(q, k, v, starts[:-1], lens, scale=D ** -0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_after_what_they_held_equal_the_float64_oracle_and_alone_equals_in_a_step(dtype):
    """Rows that held tokens (a prompt's later chunk within the capacity: ``Context``, float32 as the reference reads
    them) beside fresh ones: each query sees what its row held and its chunk up to itself (the float64 oracle over
    the held tokens rounded to the model's dtype, as the kernel reads them); a row alone gives the bits it gives in
    the step."""
    q, k, v, starts = _step(dtype)
    held = [37, 0, 5, BLOCK]                          # FRESH's rows: past a block's end, fresh, a few, a block's worth
    g = torch.Generator().manual_seed(7)
    C = max(held)
    ctx_k, ctx_v = (torch.randn(len(held), Hkv, C, D, generator=g) for _ in range(2))
    context = Context(ctx_k, ctx_v, held)
    prefill = CpuAttnPrefill(H, Hkv, D, dtype)
    rows_at, rows_len = [starts[r] for r in FRESH], [LENS[r] for r in FRESH]
    with trace.recording() as ran:
        out = prefill(q, k, v, rows_at, rows_len, context, scale=0.3)
    assert ran == [("prefill_causal", "vllm_cpu")]
    at = 0
    for i, (s, t) in enumerate(zip(rows_at, rows_len)):
        n = held[i]
        keys = [torch.cat((c[i, :, :n].transpose(0, 1).to(dtype), x[s:s + t])) for c, x in ((ctx_k, k), (ctx_v, v))]
        whole = [torch.cat((torch.zeros(n, H, D, dtype=dtype), q[s:s + t]))] + keys   # queries at n .. n + t - 1
        expect = _oracle(*whole, 0, n + t, 0.3)[n:]
        assert (out[at:at + t].double() - expect).abs().max() < TOL[dtype], (s, t, n)
        alone = CpuAttnPrefill(H, Hkv, D, dtype)(q, k, v, [s], [t], Context(ctx_k[i:i + 1], ctx_v[i:i + 1], [n]),
                                                 scale=0.3)
        assert torch.equal(alone, out[at:at + t]), f"row at {s} ({t} tokens after {n}): alone != in the step"
        at += t


def test_refuses_another_dtype_or_shape_by_name():
    prefill = CpuAttnPrefill(H, Hkv, D, torch.bfloat16)
    q, k, v, starts = _step(torch.float32)
    with pytest.raises(ValueError, match="set up for torch.bfloat16"):
        prefill(q, k, v, [0], [LENS[0]])
    q, k, v, _ = _step(torch.bfloat16)
    with pytest.raises(ValueError, match=r"q must be \[N, 6, 64\]"):
        prefill(q[:, :3], k, v, [0], [LENS[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_as_a_slice_of_the_fused_qkv_reads_as_a_contiguous_copy(dtype):
    """vLLM hands q, k, v as column slices of one qkv row (rows ``(H + 2 Hkv) D`` apart): the kernel reads q's rows
    in place (as stock passes them); the bits equal those of contiguous copies, rows in one run (q read as it lies)
    and not (gathered)."""
    g = torch.Generator().manual_seed(5)
    N = sum(LENS)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q, k, v = qkv[:, :H * D].view(N, H, D), qkv[:, H * D:(H + Hkv) * D].view(N, Hkv, D), qkv[:, (H + Hkv) * D:].view(
        N, Hkv, D)
    starts = torch.tensor([0, *LENS]).cumsum(0).tolist()
    for rows in (range(len(LENS)), FRESH):
        at, lens = [starts[r] for r in rows], [LENS[r] for r in rows]
        got = CpuAttnPrefill(H, Hkv, D, dtype)(q, k, v, at, lens, scale=0.3)
        expect = CpuAttnPrefill(H, Hkv, D, dtype)(q.contiguous(), k.contiguous(), v.contiguous(), at, lens, scale=0.3)
        assert torch.equal(got, expect)
        assert (got[:LENS[0]].double() - _oracle(q, k, v, 0, LENS[0], 0.3)).abs().max() < TOL[dtype]
