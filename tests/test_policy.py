"""LayerPolicy and policy_for: one CacheConfig per layer type, derived from a model's config; what cannot be served
exactly is refused by name."""
from types import SimpleNamespace

import pytest
import torch

from qsinkkv import CacheConfig
from qsinkkv.policy import FULL, SLIDING, LayerPolicy, layer_types, policy_for

CFG = CacheConfig(sink_tokens=4, recent_tokens=60, bits=4, block_size=8, value_group_size=8)


def text(**kw):
    base = dict(model_type="toy", num_hidden_layers=6, max_position_embeddings=4096)
    return SimpleNamespace(**{**base, **kw})


def test_gemma3_pattern_window_layers_keep_their_trained_window_and_no_sinks():
    types = [SLIDING] * 5 + [FULL]
    policy = policy_for(text(layer_types=types, sliding_window=512), CFG)
    assert policy.layer_types == tuple(types) and policy.hybrid
    assert policy.config(5) == CFG
    window = policy.config(0)
    assert (window.sink_tokens, window.recent_tokens, window.bits, window.block_size) == (0, 512, 4, 8)
    assert window.capacity == 512
    assert policy.groups() == {SLIDING: [0, 1, 2, 3, 4], FULL: [5]}
    assert policy_for(text(layer_types=types, sliding_window=512), CFG, window_bits=8).config(0).bits == 8
    assert repr(policy) == ("LayerPolicy(sliding_attention (layers 0-4): 512 recent tokens in int4 (no sinks); "
                            "full_attention (layers 5): 4 bfloat16 sinks + 60 recent tokens in int4)")


def test_model_wide_windows_and_full_models():
    assert layer_types(text(sliding_window=16)) == [SLIDING] * 6                        # Mistral v0.1
    assert layer_types(text(sliding_window=16, use_sliding_window=False)) == [FULL] * 6  # Qwen2 default
    assert layer_types(text(sliding_window=4096)) == [FULL] * 6                          # Phi-3 128k: never drops
    assert layer_types(text()) == [FULL] * 6
    uniform = policy_for(text(), CFG)
    assert not uniform.hybrid and uniform == LayerPolicy.uniform(CFG, 6)


@pytest.mark.parametrize("kw, match", [
    (dict(layer_types=["chunked_attention", FULL] * 3), "chunked_attention layers"),
    (dict(layer_types=["linear_attention", FULL] * 3), "linear_attention layers"),
    (dict(layer_types=[SLIDING, FULL] * 3, sliding_window=8, attn_logit_softcapping=50.0), "soft-caps"),
    (dict(layer_types=[SLIDING, FULL] * 3, sliding_window=None), "sliding_window=None"),
])
def test_what_cannot_be_served_exactly_is_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        policy_for(text(**kw), CFG)


def test_cache_index_positions_are_refused_on_window_models():
    with pytest.raises(ValueError, match="positions='cache_index' on a model with trained window layers"):
        policy_for(text(layer_types=[SLIDING, FULL] * 3, sliding_window=8),
                   CacheConfig(sink_tokens=4, recent_tokens=60, positions="cache_index"))


def test_a_policy_must_configure_every_layer_type():
    with pytest.raises(ValueError, match=r"missing \['sliding_attention'\]"):
        LayerPolicy((SLIDING, FULL), ((FULL, CFG),))
    with pytest.raises(ValueError, match="CacheConfig.bits"):
        policy_for(text(layer_types=[SLIDING, FULL] * 3, sliding_window=8), CFG, window_bits=3)


def test_window_layers_keep_the_configs_dtypes_and_groups():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=30, bits=8, block_size=4, value_group_size=4, residual_tokens=20,
                      window_dtype=torch.float32, scale_dtype=torch.float32)
    window = policy_for(text(layer_types=[SLIDING, FULL] * 3, sliding_window=12), cfg).config(0)
    assert (window.window_dtype, window.scale_dtype, window.value_group_size, window.residual_tokens) == (
        torch.float32, torch.float32, 4, 12)
