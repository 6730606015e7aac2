"""LayerStorage (qsinkkv/storage.py): allocated once, a fixed fraction of a bf16 cache however long the stream,
and ``nbytes`` counts every tensor."""
import pytest
import torch

from qsinkkv import CacheConfig, SinkQuantCache

D, CAP = 128, 4096


BOUND = {4: 0.30, 8: 0.55, 16: 1.05}


def bf16_bytes(capacity, head_dim, heads=1, layers=1, batch=1):
    return 2 * capacity * head_dim * 2 * heads * layers * batch  # K and V, 2 bytes each


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_nbytes_ratio_and_constant(bits):
    cfg = CacheConfig(sink_tokens=4, recent_tokens=CAP - 4, bits=bits, block_size=64, value_group_size=64)
    cache = SinkQuantCache(cfg, 1, 1, 1, D, dtype=torch.bfloat16)
    ptrs = {name: t.data_ptr() for name, t in cache.layers[0].tensors().items()}
    sizes = []
    chunk = torch.randn(1, 1, 1024, D, dtype=torch.bfloat16)
    for step in range(20 * CAP // 1024):
        cache.append(0, chunk, chunk)
        if (step + 1) * 1024 >= CAP:
            sizes.append(cache.nbytes())
    assert cache.seq_length == 20 * CAP
    assert len(set(sizes)) == 1, "nbytes must not change once the capacity is reached"
    ratio = sizes[0] / bf16_bytes(CAP, D)
    assert ratio <= BOUND[bits], f"int{bits}: {ratio:.4f}"
    # storage is allocated once: no tensor was ever reallocated
    assert ptrs == {name: t.data_ptr() for name, t in cache.layers[0].tensors().items()}


def test_nbytes_counts_every_tensor():
    cfg = CacheConfig(sink_tokens=4, recent_tokens=60, bits=4, block_size=16, value_group_size=32)
    cache = SinkQuantCache(cfg, 3, 2, 2, 64, dtype=torch.float32)
    per_layer = sum(t.numel() * t.element_size() for t in cache.layers[0].tensors().values())
    assert cache.nbytes() == 3 * per_layer
    # hand count of one layer: sinks, float ring (1 block), 4 quantized blocks
    B, H = 2, 2
    sinks = 2 * B * H * 4 * 64 * 2
    float_ring = 2 * B * H * 16 * 64 * 2
    codes = 2 * B * H * 4 * 16 * 32
    key_stats = 2 * B * H * 4 * 64 * 2
    value_stats = 2 * B * H * 4 * 16 * 2 * 2
    assert per_layer == sinks + float_ring + codes + key_stats + value_stats


@pytest.mark.parametrize("backend", ["torch", "c"])
@pytest.mark.parametrize("bits", [4, 16])
def test_a_sequence_never_reads_blocks_it_does_not_hold(bits, backend):
    """With every free block of a ``PagedCache`` pool filled with NaN, a sequence alone in the
    pool continuing with multi-token chunks (its table's -1 slots: blocks not yet written) gets finite rows, the
    same bits as with the free blocks holding zeros (before: every such chunk came back all NaN)."""
    from qsinkkv.paged import PagedCache
    from qsinkkv.storage import STORAGE_TENSORS
    cfg = CacheConfig(sink_tokens=2, recent_tokens=14, bits=bits, block_size=4, value_group_size=8)
    outs = []
    for fill in (float("nan"), 0.0):
        pool = PagedCache(cfg, 1, 2, 16, max_seqs=3, float_blocks=12, quant_blocks=12, dtype=torch.float32,
                          backend=backend)
        layer = pool.layers[0]
        for name in STORAGE_TENSORS:
            t = getattr(layer, name)
            t.fill_(fill if t.is_floating_point() else 255)
        pool.admit()
        g = torch.Generator().manual_seed(bits)
        rows = []
        for T in (3, 5, 2, 9, 1, 6):
            q, k, v = (torch.randn(1, h, T, 16, generator=g) for h in (6, 2, 2))
            rows.append(pool.attend(0, q, k, v))
        outs.append(torch.cat(rows, dim=2))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
