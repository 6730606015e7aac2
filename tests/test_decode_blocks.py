"""Decode over an engine's own float blocks named by a table (vLLM's bits=16 pages): the reference
(``decode.decode_blocks_torch``), the C kernel (``decode_c.decode_blocks_c``) and the Triton kernel
(``qsinkkv.kernels.decode_blocks``, interpreted here) against the float64 softmax over exactly the slots each row's
bias leaves visible, with and without learned sink logits; the kernel that is meant runs, a row alone gives what
it gives in the batch, a table entry outside the pool is refused by every kernel alike (and the Triton kernel
never follows one), and -1 names no block: its slots unseen."""
import pytest
import torch

from qsinkkv import decode_c, trace
from qsinkkv.decode import decode_blocks_torch
from qsinkkv.kernels.decode_blocks import _launch
from qsinkkv.kernels.decode_blocks import decode_blocks as decode_blocks_triton

C_OK = decode_c.available()[0]
KERNELS = {"torch": decode_blocks_torch, "triton": decode_blocks_triton}
if C_OK:
    KERNELS["c"] = decode_c.decode_blocks_c


def _case(Hkv, G, dtype, seed, bs=16, nblocks=20, B=5, nb=4, D=32):
    g = torch.Generator().manual_seed(seed)
    pages = torch.randn(nblocks, Hkv, 2 * bs, D, generator=g).to(dtype)            # vLLM: [blocks, Hkv, 2 bs, D]
    k_pool, v_pool = (x.transpose(0, 1) for x in pages.chunk(2, dim=2))            # [Hkv, blocks, bs, D] views
    table = torch.stack([torch.randperm(nblocks, generator=g)[:nb] for _ in range(B)])
    seen = torch.rand(B, nb * bs, generator=g) < 0.6
    seen[:, 0] = True
    seen[1, 2 * bs:3 * bs] = False
    table[1, 2] = 0                                                                # a slot of the null block
    bias = torch.zeros(B, nb * bs).masked_fill_(~seen, float("-inf"))
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype)
    return q, k_pool, v_pool, table, bias, seen


def _float64(q, k_pool, v_pool, table, seen, scale, logits):
    B, H, D = q.shape
    Hkv = k_pool.shape[0]
    out = []
    for b in range(B):
        k = k_pool[:, table[b]].reshape(Hkv, -1, D).double()
        v = v_pool[:, table[b]].reshape(Hkv, -1, D).double()
        scores = (q[b].double().view(Hkv, H // Hkv, D) @ k.mT * scale).masked_fill(~seen[b], float("-inf"))
        if logits is not None:  # the sink's value is zero: its mass leaves the output
            scores = torch.cat((scores, logits.double().view(Hkv, -1, 1)), dim=-1)
            v = torch.cat((v, v.new_zeros(Hkv, 1, D)), dim=1)
        out.append((torch.softmax(scores, dim=-1) @ v).reshape(H, D))
    return torch.stack(out)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("learned_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(2, 3), (1, 5)])
def test_decode_blocks_matches_float64(kernel, heads, dtype, learned_sinks):
    Hkv, G = heads
    q, k_pool, v_pool, table, bias, seen = _case(Hkv, G, dtype, seed=Hkv * 10 + G)
    logits = None
    if learned_sinks:
        logits = torch.randn(Hkv * G, generator=torch.Generator().manual_seed(1)) + 2
        logits[-1] = float("-inf")
    with trace.recording() as ran:
        out = KERNELS[kernel](q, k_pool, v_pool, table, bias, scale=0.3, sink_logits=logits)
    assert ran == [("decode", kernel)]
    expect = _float64(q, k_pool, v_pool, table, seen, 0.3, logits)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expect, rtol=tol, atol=tol)
    for b in range(q.shape[0]):  # a row alone: the same bits (torch: the CPU's batched GEMM picks its kernel by
        # the batch, so a row alone is a rounding apart; the reference, served only where C cannot compile)
        alone = KERNELS[kernel](q[b:b + 1], k_pool, v_pool, table[b:b + 1], bias[b:b + 1], scale=0.3,
                                sink_logits=logits)
        if kernel == "torch":
            torch.testing.assert_close(alone[0], out[b], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(alone[0], out[b]), b


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_an_entry_outside_the_pool_is_refused_and_none_is_unseen(kernel):
    """Every kernel alike: an entry past the pool is refused by name (the reference read a -1 entry as the pool's
    last block, the Triton kernel skipped a past one); -1 names no block, its slots unseen, whatever the bias says;
    and the kernel that is meant runs."""
    q, k_pool, v_pool, table, bias, seen = _case(2, 2, torch.float32, seed=3)
    past = table.clone()
    past[2, 3] = 20
    with trace.recording() as ran, pytest.raises(ValueError, match=r"block_table must name blocks of k_pool and "
                                                                   r"v_pool in \[0, 20\) \(or -1: none\); got \[20\]"):
        KERNELS[kernel](q, k_pool, v_pool, past, bias, scale=0.3)
    assert ran == [("decode", kernel)], ran
    none = table.clone()
    none[0, 1] = -1
    out = KERNELS[kernel](q, k_pool, v_pool, none, bias, scale=0.3)
    unseen = seen.clone()
    unseen[0, 16:32] = False
    torch.testing.assert_close(out.double(), _float64(q, k_pool, v_pool, table, unseen, 0.3, None), rtol=1e-5,
                               atol=1e-5)


def test_the_triton_blocks_kernel_never_follows_an_entry_outside_the_pool():
    """The kernel's own guard, under the refusal (on a GPU the refusal is a device-side assert, raised after the
    launch): an entry past the pool (or -1) reads no byte there: its slots count as unseen (and the pool's neighbour
    in memory, NaN here, never reaches the output)."""
    q, k_pool, v_pool, table, bias, seen = _case(2, 2, torch.float32, seed=3)
    raw = torch.full((2, 2, 21, 16, 32), float("nan"))   # one block more than the pools: NaN past them
    raw[0, :, :20], raw[1, :, :20] = k_pool, v_pool
    k_in, v_in = raw[0, :, :20], raw[1, :, :20]
    bad = table.clone()
    bad[0, 1], bad[2, 3] = 20, -1
    out = _launch(q, k_in, v_in, bad, bias, scale=0.3, sink_logits=None, out=None)
    assert torch.isfinite(out).all()
    unseen = seen.clone()
    unseen[0, 16:32] = False
    unseen[2, 48:64] = False
    torch.testing.assert_close(out.double(), _float64(q, k_pool, v_pool, table, unseen, 0.3, None), rtol=1e-5,
                               atol=1e-5)


def test_the_triton_blocks_decode_refuses_what_it_cannot_read_by_name():
    q, k_pool, v_pool, table, bias, _ = _case(2, 2, torch.float32, seed=4, bs=8)
    with pytest.raises(ValueError, match="power of two >= 16 rows, got 8"):
        decode_blocks_triton(q, k_pool, v_pool, table, bias, scale=0.3)
    q, k_pool, v_pool, table, bias, _ = _case(2, 2, torch.float32, seed=4)
    with pytest.raises(ValueError, match="bias must be float32"):
        decode_blocks_triton(q, k_pool, v_pool, table, bias[:, 1:], scale=0.3)
    with pytest.raises(ValueError, match="rows of D contiguous"):
        decode_blocks_triton(q, k_pool.transpose(2, 3).contiguous().transpose(2, 3)[:, :, :, :],
                             k_pool.mT.contiguous().mT, table, bias, scale=0.3)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("stale", [1e38, float("-inf"), float("nan")])
def test_a_stale_non_finite_slot_a_row_does_not_see_never_reaches_its_output(kernel, stale):
    """bits=16 stores K/V unchecked, so a reused page can hold an earlier request's overflowed row (fp16's 1e38 is
    inf) or a NaN. A slot a row does not see -- past its length in its last block, masked by its bias, or in the block
    a -1 entry stands for -- holding one in both K and V changes no bit of the output (it equals the output with that
    slot zero) and the output is finite: the mask alone does not isolate it (0 x inf is NaN, and so is an inf score
    plus a -inf bias)."""
    q, k_pool, v_pool, _, bias, seen = _case(2, 2, torch.float16, seed=5, nblocks=21)
    table = torch.randperm(20, generator=torch.Generator().manual_seed(5)).view(5, 4) + 1  # no block in two rows
    seen[:, 3 * 16 + 9:] = False             # each row's length ends in its last block: the rest is an earlier one's
    table[2, 1] = -1                         # no block: it reads nothing (block 0 here holds only stale rows)
    bias = torch.zeros(bias.shape).masked_fill_(~seen, float("-inf"))
    unseen = torch.zeros(21, 16, dtype=torch.bool)
    unseen[0] = True
    for b in range(5):
        for j in range(4):
            if table[b, j] >= 0:
                unseen[table[b, j]] |= ~seen[b, j * 16:(j + 1) * 16]
    outs = []
    for value in (stale, 0.0):
        for pool in (k_pool, v_pool):
            pool[:, unseen] = value
        outs.append(KERNELS[kernel](q, k_pool, v_pool, table, bias, scale=0.3))
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()
