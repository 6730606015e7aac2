"""Prefill attention in PyTorch (qsinkkv/prefill.py): the reference and the SDPA-per-tile path on ragged chunks,
long chunks whose tiles read only what they see, and padding (NaN/Inf included) that never reaches a real row.
(The Triton kernel: test_kernels.py.)"""
import pytest
import torch
from helpers import HKV, D, G, draw, rel
from oracle import attention_oracle

from qsinkkv import CacheConfig, Rotary, SinkQuantCache

ROT = Rotary.from_schedule(D, base=100.0)


@pytest.mark.parametrize("rope", [False, True], ids=["absolute", "cache_index"])
def test_long_prefill_reads_only_what_each_tile_sees(rope):
    """A prefill of 700 tokens (3 query tiles of 256) with W = 100: each tile reads the stored slots,
    the chunk's sinks and the W keys before it; rows start at different lengths, so the chunk holds
    sinks for one row and not the other. Equal to the float64 oracle."""
    cfg = CacheConfig(sink_tokens=3, recent_tokens=100, bits=16, sink_dtype=torch.float32,
                      window_dtype=torch.float32, positions="cache_index" if rope else "absolute")
    rotary = ROT if rope else None
    g = torch.Generator().manual_seed(4)
    cache = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float32, rotary=rotary)
    k, v, q = (torch.randn(2, h, 702, D, generator=g) for h in (HKV, HKV, HKV * G))
    cache.append(0, k[:, :, :2], v[:, :, :2], [0, 2])                      # row 1 holds 2 tokens, row 0 none
    chunk = [torch.cat((x[:1, :, :700], x[1:, :, 2:702])) for x in (q, k, v)]
    out = cache.attend(0, *chunk, [700, 650])
    for b, (n0, t) in enumerate(((0, 700), (2, 650))):
        ref = attention_oracle(q[b:b + 1, :, n0:n0 + t], lambda i: (k[b:b + 1].double(), v[b:b + 1].double()),
                               3, 100, range(n0, n0 + t), rotary)
        assert rel(out[b:b + 1, :, :t], ref) < 1e-5


@pytest.mark.parametrize("bits,S,W,bs", [(4, 3, 20, 4), (16, 0, 9, 2), (8, 4, 300, 16)])
def test_torch_prefill_equals_the_reference(bits, S, W, bs):
    """The torch backend's prefill (SDPA per tile under the visible set as a mask) against the reference
    and its float64 run, on a ragged chunk into rows holding different lengths, with NaN in the padding,
    tiles past the window (T > 256), a scale of its own and sink logits (SDPA's too: one more key): the torch
    kernel ran, not the reference."""
    from qsinkkv import trace
    from qsinkkv.prefill import prefill_attention_reference, prefill_attention_torch
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=4)
    cache = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(bits + W)
    cache.attend(0, *(torch.randn(3, h, 40, D, generator=g) for h in (HKV * G, HKV, HKV)), [40, 2, 0])
    layer = cache.layers[0]
    q, k, v = (torch.randn(3, h, 600, D, generator=g) for h in (HKV * G, HKV, HKV))
    lengths = torch.tensor([600, 333, 7])
    k[1, :, 333:], v[2, :, 7:] = float("nan"), float("inf")
    for kw in (dict(scale=0.3), dict(sink_logits=torch.randn(HKV * G, generator=g))):
        ref = prefill_attention_reference(q, k, v, layer, lengths, **kw)
        ref64 = prefill_attention_reference(q.double(), k.double(), v.double(), layer, lengths,
                                            **{n: x.double() if torch.is_tensor(x) else x for n, x in kw.items()})
        with trace.recording() as ran:
            got = prefill_attention_torch(q, k, v, layer, lengths, **kw)
        assert ran == [("prefill", "torch")], ran
        assert torch.isfinite(got).all()
        assert rel(got, ref) < 1e-5 and rel(got, ref64) < 1e-5, kw


# From a review, a defect now fixed: prefill_attention_reference masked the padding keys from the
# scores, but the padding *values* still entered ``probs @ v``, so a NaN/Inf value in a row's padding (which the
# cache accepts: it is never stored or seen) turned every real query of that row into NaN (0 * NaN = NaN).
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_value_in_padding_does_not_poison_the_rows_prefill(value):
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    batch = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float32)
    alone = SinkQuantCache(cfg, 1, 1, HKV, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    q, k, v = draw(g, 2, 4)
    v[1, :, 3] = value                                  # row 1 holds 2 tokens: slot 3 is padding
    out = batch.attend(0, q, k, v, [4, 2])              # accepted (padding is not checked), but:
    own = alone.attend(0, q[1:, :, :2], k[1:, :, :2], v[1:, :, :2])
    assert torch.isfinite(out).all()
    assert rel(out[1:, :, :2], own) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prefill_on_packed_tokens(dtype):
    """``prefill_causal_packed`` (a packed step's rows that start fresh within S + W, read where they lie): row by
    row the bits of the padded prefill's own fresh path, and equal to the float64 oracle of the sink + window
    mask (S + W reaches past every chunk: the causal mask)."""
    from qsinkkv.layout import WindowLayout
    from qsinkkv.prefill import prefill_attention_torch, prefill_causal_packed
    from qsinkkv.storage import LayerStorage
    cfg = CacheConfig(sink_tokens=2, recent_tokens=14, bits=16)
    g = torch.Generator().manual_seed(3)
    lens, starts = [5, 16, 1, 9], [3, 8, 24, 25]                      # in a packed step of 34 tokens, any order
    q, k, v = (torch.randn(34, h, D, generator=g).to(dtype) for h in (HKV * G, HKV, HKV))
    out = prefill_causal_packed(q, k, v, starts, lens, scale=0.4)
    assert out.shape == (sum(lens), HKV * G, D) and out.dtype == dtype
    layer = LayerStorage.allocate(WindowLayout(cfg), 1, HKV, D, torch.device("cpu"))
    at = 0
    for s, t in zip(starts, lens):
        row = [x[s:s + t].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]         # [1, heads, t, D]
        padded = prefill_attention_torch(*row, layer, torch.tensor([t]), scale=0.4)[0].transpose(0, 1)
        assert torch.equal(out[at:at + t], padded)
        ref = attention_oracle(row[0], lambda i, row=row: (row[1].double(), row[2].double()), 2, 14, range(t), None,
                               scale=0.4)
        assert rel(out[at:at + t].transpose(0, 1).unsqueeze(0), ref) < (1e-6 if dtype == torch.float32 else 1e-2)
        at += t


@pytest.mark.parametrize("bits", [16, 4])
def test_causal_prefill_after_what_the_rows_held(bits):
    """``prefill_causal_packed`` over rows that already hold tokens (a prompt's later chunk within S + W: the causal
    mask over what they held, read back as the reference reads it, and their chunk): equal to
    ``prefill_attention_reference`` over the same storage, and to itself row by row alone; ``causal_context`` gives
    every row its positions ``0 .. held - 1`` in order."""
    from qsinkkv import quant
    from qsinkkv.layout import WindowLayout
    from qsinkkv.prefill import causal_context, prefill_attention_reference, prefill_causal_packed
    from qsinkkv.storage import LayerStorage, gather
    from qsinkkv.write import append
    cfg = CacheConfig(sink_tokens=3, recent_tokens=29, bits=bits, block_size=4, value_group_size=8,
                      sink_dtype=torch.float32, window_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    held, lens = [0, 6, 13, 21], [9, 12, 19, 11]                      # held + lens <= S + W = 32
    layer = LayerStorage.allocate(WindowLayout(cfg), 4, HKV, D, torch.device("cpu"))
    k0, v0 = (torch.randn(4, HKV, max(held), D, generator=g) for _ in range(2))
    append(layer, k0, v0, held, quant)
    context = causal_context(layer)
    stored_k, _, pos = gather(layer, torch.float32)
    for b, n in enumerate(held):  # position order: slot of position p holds what gather puts there
        for p in range(n):
            assert torch.equal(context.k[b, :, p], stored_k[b, :, int((pos[b] == p).nonzero())])
    T = max(lens)
    q, k, v = (torch.randn(4, h, T, D, generator=g) for h in (HKV * G, HKV, HKV))
    expect = prefill_attention_reference(q, k, v, layer, torch.tensor(lens), scale=0.4)
    starts = [b * T for b in range(4)]                                # the padded chunk as packed tokens
    packed = [x.transpose(1, 2).reshape(4 * T, x.shape[1], D) for x in (q, k, v)]
    out = prefill_causal_packed(*packed, starts, lens, context, scale=0.4)
    at = 0
    for b, t in enumerate(lens):
        assert rel(out[at:at + t], expect[b, :, :t].transpose(0, 1)) < 1e-5, b
        alone = prefill_causal_packed(*packed, [starts[b]], [t], causal_context(layer.select_rows([b])), scale=0.4)
        assert torch.equal(alone, out[at:at + t]), b
        at += t
