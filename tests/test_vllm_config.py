"""The vLLM plugin's config checks (``qsinkkv.integrations.vllm.config``: plain Python, no vLLM import), so every
refusal is checked here in the main suite; ``tests_vllm`` checks that an engine stops on them at start."""
import pytest
import torch

from qsinkkv import CacheConfig
from qsinkkv.integrations.vllm.config import (
    PluginConfigError,
    check_engine,
    decode_variant,
    parse_config,
    raw_config,
    to_jsonable,
)

GOOD = {"sink_tokens": 4, "recent_tokens": 252, "bits": 4, "block_size": 32, "value_group_size": 32}
ENGINE = dict(block_size=None, user_block_size=False, head_dim=64, enable_prefix_caching=False, speculative=False,
              max_model_len=1024)


def test_a_good_config_round_trips_and_gives_vllm_our_block_size():
    cfg = parse_config({**GOOD, "sink_dtype": "float32"})
    assert isinstance(cfg, CacheConfig) and cfg.sink_dtype == torch.float32 and cfg.bits == 4
    assert parse_config(to_jsonable(cfg)) == cfg
    assert check_engine(cfg, **ENGINE) == 32
    assert raw_config(None) is None and raw_config({"other": 1}) is None  # stock vLLM: the plugin stays out
    assert raw_config({"qsinkkv": GOOD}) == GOOD


@pytest.mark.parametrize("raw, field", [
    ({**GOOD, "bits": 3}, "bits"),
    ({**GOOD, "bits": 2}, "bits"),                      # a CacheConfig value the plugin does not serve
    ({**GOOD, "windw": 8}, "windw"),                     # an unknown field
    ({**GOOD, "positions": "cache_index"}, "positions"),
    ({**GOOD, "residual_tokens": 8}, "residual_tokens"),
    ({**GOOD, "sink_dtype": "int8"}, "sink_dtype"),
    ({**GOOD, "decode_variant": "fast"}, "decode_variant"),                  # the plugin's own field
    ({**GOOD, "bits": 16, "decode_variant": "fp16"}, "bits 8 or 4 only"),  # no quantized block to read
    ({**GOOD, "decode_variant": "fp16", "scale_dtype": "float32"}, "needs scale_dtype=torch.float16"),
])
def test_parse_refuses_naming_the_field(raw, field):
    with pytest.raises(PluginConfigError, match=field):
        parse_config(raw)


def test_the_decode_body_is_the_plugins_own_field():
    """``decode_variant`` (the Triton decode's body on CUDA) rides beside the CacheConfig fields: the config is the
    same with or without it, "dequantize" unless picked, and a head_dim that the body cannot read is refused by name
    where it is known (the engine's model, at start)."""
    fp16 = {**GOOD, "decode_variant": "fp16"}
    assert parse_config(fp16) == parse_config(GOOD)
    assert decode_variant(fp16, parse_config(fp16), 64) == "fp16"
    assert decode_variant(GOOD, parse_config(GOOD)) == "dequantize"
    with pytest.raises(PluginConfigError, match=r"value_group_size a multiple of head_dim // 2 = 64"):
        decode_variant(fp16, parse_config(fp16), 128)


def test_raw_config_must_be_a_dict():
    with pytest.raises(PluginConfigError, match="must be a dict"):
        raw_config({"qsinkkv": "bits=4"})


@pytest.mark.parametrize("change, field", [
    ({"block_size": 16, "user_block_size": True}, "block_size"),   # --block-size differs from ours
    ({"head_dim": 63}, "head_dim"),                                  # int4 packs two channels a byte
    ({"head_dim": 48}, "head_dim"),                                  # value groups of 32 do not divide 48
    ({"enable_prefix_caching": True}, "enable_prefix_caching"),
    ({"speculative": True}, "speculative_config"),
    ({"kv_heads": 8, "tensor_parallel_size": 3}, "tensor_parallel_size=3"),   # splits 8 KV heads unevenly
    ({"kv_heads": 3, "tensor_parallel_size": 4}, "tensor_parallel_size=4"),   # replicates 3 unevenly
    ({"positions": 512}, "max_model_len=1024 is past the model's 512 positions"),  # the rotary table's
])
def test_engine_settings_refused_naming_the_field(change, field):
    with pytest.raises(PluginConfigError, match=field):
        check_engine(parse_config(GOOD), **{**ENGINE, **change})


@pytest.mark.parametrize("kv_heads, tp", [(3, 3), (8, 2), (8, 8), (2, 4), (3, 9), (8, 1)])
def test_a_tensor_parallel_degree_that_splits_or_replicates_whole_kv_heads_is_taken(kv_heads, tp):
    assert check_engine(parse_config(GOOD), **{**ENGINE, "kv_heads": kv_heads, "tensor_parallel_size": tp}) == 32


def test_block_size_must_be_a_multiple_of_16():
    cfg = parse_config({**GOOD, "block_size": 24, "value_group_size": 8, "recent_tokens": 240})  # a CacheConfig
    with pytest.raises(PluginConfigError, match="block_size must be a multiple of 16"):
        check_engine(cfg, **ENGINE)
