"""Decode attention in PyTorch (qsinkkv/decode.py) and in C on the CPU: each fast path against the dequantizing
reference, on every layout, in chunks of heads and rows, and each row of a batch bit-identical to the row alone.
(The Triton kernel: test_kernels.py; the C decode on its own: test_decode_c.py.)"""
import pytest
import torch
from helpers import CASES, filled_layer, rel_rms

from qsinkkv import CacheConfig, SinkQuantCache
from qsinkkv.decode import decode_attention_reference

D = 16


@pytest.mark.parametrize("op", ["torch", "c"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-S{c[1]}-W{c[2]}-bs{c[3]}-R{c[5]}-G{c[7]}")
def test_cpu_decode_matches_reference_and_rows_alone(case, op):
    """The CPU paths (torch: reused buffers, three products; c: qsinkkv/decode_c.c) vs
    dequantize-then-attend, with and without sink logits (also -inf); each sequence alone gets the
    bits it gets in the batch."""
    from qsinkkv import decode_c
    from qsinkkv.decode import decode_attention_torch
    if op == "c" and not decode_c.available()[0]:
        pytest.skip(f"no C decode: {decode_c.available()[1]}")
    decode = decode_attention_torch if op == "torch" else decode_c.decode_attention_c
    bits, S, W, bs, group, R, Hkv, G, lengths = case
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=group,
                      residual_tokens=R)
    layer, _ = filled_layer(cfg, lengths, Hkv, seed=3)
    q = torch.randn(len(lengths), Hkv * G, D)
    for logits in (None, torch.randn(Hkv * G), torch.full((Hkv * G,), float("-inf"))):
        ref = decode_attention_reference(q, layer, sink_logits=logits)
        out = decode(q, layer, sink_logits=logits)
        assert rel_rms(out, ref) < 1e-5
        for b in range(len(lengths)):
            assert torch.equal(decode(q[b:b + 1], layer.rows(b), sink_logits=logits), out[b:b + 1])


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_torch_decode_row_in_a_batch_is_bitwise_the_row_alone(bits):
    """The CPU decode op on a ragged batch (D 64, 3 KV heads of 3 query heads: the shape at which
    PyTorch's fused CPU SDPA gave one row of a batch a result a rounding apart from the row alone):
    each row bit-identical to that row's storage on its own, and to the reference at 1e-5."""
    from qsinkkv.decode import decode_attention_reference, decode_attention_torch
    cfg = CacheConfig(sink_tokens=4, recent_tokens=40, bits=bits, block_size=8)
    g = torch.Generator().manual_seed(bits)
    cache = SinkQuantCache(cfg, 1, 3, 3, 64, dtype=torch.float32, backend="torch")
    cache.append(0, torch.randn(3, 3, 61, 64, generator=g), torch.randn(3, 3, 61, 64, generator=g),
                 lengths=[61, 17, 40])
    layer = cache.layers[0]
    for _ in range(3):
        q = torch.randn(3, 9, 64, generator=g)
        out = decode_attention_torch(q, layer)
        for b in range(3):
            assert torch.equal(out[b:b + 1], decode_attention_torch(q[b:b + 1], layer.rows(b))), b
        ref = decode_attention_reference(q, layer)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5
        cache.append(0, torch.randn(3, 3, 1, 64, generator=g), torch.randn(3, 3, 1, 64, generator=g))


@pytest.mark.parametrize("bits", [4, 16])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "tables"])
def test_torch_decode_in_chunks_of_heads_and_rows(bits, dense, monkeypatch):
    """The CPU decode op's chunks of (KV heads, sequences) -- one head of one row, rows 2 + 1, heads
    2 + 1 -- on a dense storage and through block tables, with and without sink logits: bitwise
    equal to one chunk, and to the reference at 1e-5."""
    import dataclasses

    from qsinkkv import decode
    from qsinkkv.decode import decode_attention_reference
    cfg = CacheConfig(sink_tokens=3, recent_tokens=30, bits=bits, block_size=4, residual_tokens=2, value_group_size=8)
    g = torch.Generator().manual_seed(11 + bits)
    cache = SinkQuantCache(cfg, 1, 3, 3, 16, dtype=torch.float32, backend="torch")
    cache.append(0, torch.randn(3, 3, 41, 16, generator=g), torch.randn(3, 3, 41, 16, generator=g),
                 lengths=[41, 9, 26])
    layer = cache.layers[0] if dense else dataclasses.replace(cache.layers[0], dense=False)
    q, logits = torch.randn(3, 6, 16, generator=g), torch.randn(6, generator=g)
    one = cache.layout.num_slots * 16 * 4                              # buffer bytes of one head of one row
    for sinks in (None, logits):
        whole = decode.decode_attention_torch(q, layer, sink_logits=sinks)
        ref = decode_attention_reference(q, cache.layers[0], sink_logits=sinks)
        assert ((whole - ref).norm() / ref.norm()).item() < 1e-5
        for budget in (1, 2 * one, 3 * 2 * one):
            monkeypatch.setattr(decode, "BUFFER_BYTES", budget)
            assert torch.equal(decode.decode_attention_torch(q, layer, sink_logits=sinks), whole), budget
        monkeypatch.undo()
