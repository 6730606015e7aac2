"""HybridCache: a model's layers under a LayerPolicy. Each layer answers as the float64 oracle of its own type's
visible set (a window layer: exactly its trained window, no sinks) and as a SinkQuantCache of its type's config
alone, bit for bit; a step refused in any layer leaves every layer of every type as it was."""
import pytest
import torch
from helpers import assert_unchanged, rel_max, snapshot
from oracle import attention_oracle, bf16_exact, stored_history

from qsinkkv import CacheConfig, SinkQuantCache
from qsinkkv.hybrid import HybridCache
from qsinkkv.policy import FULL, SLIDING, LayerPolicy

B, HKV, G, D = 2, 2, 2, 16
TYPES = (SLIDING, SLIDING, FULL, SLIDING, FULL)


def policy(bits=4, window=12):
    full = CacheConfig(sink_tokens=3, recent_tokens=21, bits=bits, block_size=4, value_group_size=8)
    sliding = CacheConfig(sink_tokens=0, recent_tokens=window, bits=bits, block_size=4, value_group_size=8)
    return LayerPolicy(TYPES, ((SLIDING, sliding), (FULL, full)))


def draw(g, T):
    return tuple(bf16_exact(B, h, T, D, generator=g) for h in (HKV * G, HKV, HKV))


@pytest.mark.parametrize("bits", [16, 8, 4])
def test_each_layer_answers_as_its_types_oracle_and_its_types_cache_alone(bits):
    """A stream of a 30-token prompt and 40 decode steps (past both capacities) through every layer: each layer's
    output equals a SinkQuantCache of its type's config fed the same K/V (bit for bit), and the float64 oracle of
    its type's visible set over the K/V it stored."""
    pol = policy(bits)
    cache = HybridCache(pol, B, HKV, D, dtype=torch.float32, backend="torch")
    alone = {i: SinkQuantCache(pol.config(i), 1, B, HKV, D, dtype=torch.float32, backend="torch")
             for i in range(len(TYPES))}
    g = torch.Generator().manual_seed(bits)
    schedule = [30] + [1] * 40
    data = {i: draw(g, sum(schedule)) for i in range(len(TYPES))}
    n = 0
    for T in schedule:
        for i in range(len(TYPES)):
            q, k, v = (x[:, :, n:n + T] for x in data[i])
            out = cache.attend(i, q, k, v)
            assert torch.equal(out, alone[i].attend(0, q, k, v)), (i, n)
            if T == 1:
                cfg = pol.config(i)
                stored = stored_history(data[i][1], data[i][2], n + 1, cfg)
                ref = attention_oracle(q, lambda _: stored, cfg.sink_tokens, cfg.recent_tokens, [n])
                assert rel_max(out, ref) < 1e-5, (i, n)
        n += T
    assert cache.layer_lengths() == [n] * len(TYPES) and cache.in_step()
    assert cache.nbytes() == sum(c.nbytes() for c in cache.caches.values())
    window = cache.caches[SLIDING].layers[0]
    assert window.layout.config.capacity == 12 and window.layout.config.sink_tokens == 0


def test_a_step_refused_in_a_later_layer_rolls_back_every_type():
    """Layers 0-2 (two window layers and a full one) take a step; layer 3 refuses a NaN: every layer of both types
    is left exactly as it was, and the next step runs."""
    cache = HybridCache(policy(), B, HKV, D, dtype=torch.float32, backend="torch")
    g = torch.Generator().manual_seed(1)
    for i in range(len(TYPES)):
        cache.attend(i, *draw(g, 9))
    snaps = {kind: snapshot(c) for kind, c in cache.caches.items()}
    q, k, v = draw(g, 5)
    for i in range(3):
        cache.attend(i, q, k, v)
    bad = k.clone()
    bad[1, 0, 3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache.attend(3, q, bad, v)
    for kind, c in cache.caches.items():
        assert_unchanged(c, snaps[kind])
    for i in range(len(TYPES)):
        cache.attend(i, q, k, v)
    assert cache.layer_lengths() == [14] * len(TYPES) and cache.in_step()


def test_a_crop_any_layer_refuses_changes_no_layer():
    """Past its window a window layer has evicted what a shorter stream would see: a crop that a full-attention
    layer could take is refused for all, nothing changed; one every layer can take is taken by all."""
    cache = HybridCache(policy(bits=16, window=6), B, HKV, D, dtype=torch.float32, backend="torch")
    g = torch.Generator().manual_seed(2)
    for i in range(len(TYPES)):
        cache.attend(i, *draw(g, 20))
    snaps = {kind: snapshot(c) for kind, c in cache.caches.items()}
    with pytest.raises(ValueError, match="sliding_attention layers: cannot crop 15 tokens"):
        cache.crop_to(5)
    for kind, c in cache.caches.items():
        assert_unchanged(c, snaps[kind])
    cache.crop_to(19)
    assert cache.layer_lengths() == [19] * len(TYPES)


def test_layers_are_named_by_their_model_index():
    cache = HybridCache(policy(), B, HKV, D, dtype=torch.float32, backend="torch")
    assert cache.cache_of(2) == (cache.caches[FULL], 0) and cache.cache_of(3) == (cache.caches[SLIDING], 2)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 5\), got 5"):
        cache.attend(5, *draw(torch.Generator().manual_seed(0), 1))
