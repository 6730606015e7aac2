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
