"""CacheConfig (qsinkkv/config.py): every size and format is checked once, at construction, and a bad one is
refused with an error naming the field."""
import pytest
import torch

from qsinkkv import CacheConfig


@pytest.mark.parametrize("field,value,msg", [
    ("sink_tokens", -1, r"CacheConfig.sink_tokens must be an int >= 0, got -1"),
    ("recent_tokens", 0, r"CacheConfig.recent_tokens must be an int >= 1, got 0"),
    ("bits", 3, r"CacheConfig.bits must be one of the ints 16, 8, 4, got 3"),
    ("bits", True, r"CacheConfig.bits must be one of the ints 16, 8, 4"),
    ("block_size", 0, r"CacheConfig.block_size must be an int >= 1, got 0"),
    ("value_group_size", 1.5, r"CacheConfig.value_group_size must be an int >= 1, got 1.5"),
    ("residual_tokens", 11, r"CacheConfig.residual_tokens must be <= recent_tokens \(10\), got 11"),
    ("positions", "relative", r"CacheConfig.positions must be 'absolute' or 'cache_index', got 'relative'"),
    ("sink_dtype", torch.int8, r"CacheConfig.sink_dtype must be one of"),
    ("window_dtype", "bf16", r"CacheConfig.window_dtype must be one of"),
    ("scale_dtype", torch.float64, r"CacheConfig.scale_dtype must be one of"),
])
def test_bad_config(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        CacheConfig(**dict(sink_tokens=2, recent_tokens=10) | {field: value})


def test_config_capacity():
    assert CacheConfig(sink_tokens=4, recent_tokens=508).capacity == 512


@pytest.mark.parametrize("bits", [8.0, 4.0, 16.0])
def test_float_bits_refused(bits):
    with pytest.raises(ValueError, match="CacheConfig.bits must be one of the ints 16, 8, 4"):
        CacheConfig(bits=bits)
