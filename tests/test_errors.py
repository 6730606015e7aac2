"""Bad input: a clear error that names the argument, and the cache exactly as it was."""
import pytest
import torch

from qsinkkv import CacheConfig, Rotary, SinkQuantCache

B, HKV, D = 2, 2, 8


def snapshot(cache):
    return [(layer.seq_lens.clone(), {n: t.clone() for n, t in layer.tensors().items()}) for layer in cache.layers]


def assert_unchanged(cache, snap):
    for layer, (seq_lens, tensors) in zip(cache.layers, snap):
        assert torch.equal(layer.seq_lens, seq_lens)
        for name, t in layer.tensors().items():
            assert torch.equal(t, tensors[name]), name


@pytest.fixture
def cache():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    c = SinkQuantCache(cfg, 2, B, HKV, D, dtype=torch.float32)
    for layer in range(2):
        c.append(layer, torch.randn(B, HKV, 9, D), torch.randn(B, HKV, 9, D))  # fills and wraps the ring
    return c


def kv(T=1, **kw):
    shape = kw.pop("shape", (B, HKV, T, D))
    return torch.randn(*shape, **kw)


def poisoned(value, T=3):
    x = kv(T)
    x[1, 0, T - 1, 5] = value
    return x


BAD_APPENDS = [
    (lambda: (2, kv(), kv()), IndexError, r"layer must be an int in \[0, 2\), got 2"),
    (lambda: (-1, kv(), kv()), IndexError, "layer must be"),
    (lambda: ("0", kv(), kv()), IndexError, "layer must be"),
    (lambda: (0, kv(shape=(B, HKV, D)), kv()), ValueError, "k must have 4 dims"),
    (lambda: (0, kv(shape=(B, 3, 1, D)), kv(shape=(B, 3, 1, D))), ValueError,
     r"k must have shape \[B=2, Hkv=2, T, D=8\]"),
    (lambda: (0, kv(shape=(B, HKV, 1, 4)), kv(shape=(B, HKV, 1, 4))), ValueError, "k must have shape"),
    (lambda: (0, kv(shape=(1, HKV, 1, D)), kv(shape=(1, HKV, 1, D))), ValueError, "k must have shape"),
    (lambda: (0, kv(shape=(B, HKV, 0, D)), kv(shape=(B, HKV, 0, D))), ValueError, "T >= 1"),
    (lambda: (0, kv(2), kv(3)), ValueError, "k and v must have the same shape"),
    (lambda: (0, kv(dtype=torch.bfloat16), kv(dtype=torch.bfloat16)), ValueError, "k.dtype must be the cache dtype"),
    (lambda: (0, kv(), kv(dtype=torch.float64)), ValueError, "v.dtype must be the cache dtype"),
    (lambda: (0, kv().to("meta"), kv()), ValueError, "k.device must be the cache device"),
    (lambda: (0, [[1.0]], kv()), TypeError, "k must be a torch.Tensor"),
    (lambda: (0, poisoned(float("nan")), kv(3)), ValueError, "k contains NaN or Inf"),
    (lambda: (1, kv(3), poisoned(float("inf"))), ValueError, "v contains NaN or Inf"),
    (lambda: (0, kv(3), poisoned(float("-inf"))), ValueError, "v contains NaN or Inf"),
]


@pytest.mark.parametrize("make_args,exc,msg", BAD_APPENDS)
@pytest.mark.parametrize("method", ["append", "attend"])
def test_bad_kv_leaves_cache_unchanged(cache, make_args, exc, msg, method):
    snap = snapshot(cache)
    layer, k, v = make_args()
    with pytest.raises(exc, match=msg):
        if method == "append":
            cache.append(layer, k, v)
        else:
            T = k.shape[2] if isinstance(k, torch.Tensor) and k.ndim == 4 else 1
            cache.attend(layer, torch.randn(B, 2 * HKV, T, D), k, v)
    assert_unchanged(cache, snap)


BAD_QUERIES = [
    (kv(shape=(B, 3, 1, D)), "q must have shape"),           # 3 heads is not a multiple of Hkv=2
    (kv(shape=(B, 4, 2, D)), "q must have shape"),           # T differs from k
    (kv(shape=(B, 4, 1, 4)), "q must have shape"),
    (kv(shape=(B, 4, 1, D), dtype=torch.float16), "q.dtype"),
]


@pytest.mark.parametrize("q,msg", BAD_QUERIES)
def test_bad_query_leaves_cache_unchanged(cache, q, msg):
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=msg):
        cache.attend(0, q, kv(), kv())
    assert_unchanged(cache, snap)


def test_bad_sink_logits(cache):
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"sink_logits must be a float tensor of shape \[H=4\]"):
        cache.attend(0, kv(shape=(B, 4, 1, D)), kv(), kv(), sink_logits=torch.zeros(3))
    assert_unchanged(cache, snap)


def test_scale_overflow_leaves_cache_unchanged():
    cfg = CacheConfig(sink_tokens=1, recent_tokens=4, bits=8, block_size=2, value_group_size=8)
    cache = SinkQuantCache(cfg, 1, 1, 1, D, dtype=torch.float32)
    cache.append(0, torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D))
    snap = snapshot(cache)
    huge = torch.randn(1, 1, 3, D)
    huge[0, 0, 0, 0] = -1e6  # finite, but its block's zero overflows float16
    with pytest.raises(ValueError, match="scale_dtype"):
        cache.append(0, huge, torch.randn(1, 1, 3, D))
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(head_dim=12), "value_group_size must divide head_dim=12"),
    (dict(head_dim=7, cfg=dict(value_group_size=2)), "even head_dim, got head_dim=7"),
    (dict(num_layers=0), "num_layers must be an int >= 1, got 0"),
    (dict(batch_size=2.0), "batch_size must be an int >= 1"),
    (dict(dtype=torch.int32), "dtype must be one of torch.bfloat16, torch.float16, torch.float32, torch.float64"),
    (dict(dtype=torch.float8_e4m3fn), "dtype must be one of"),
    (dict(dtype=torch.float8_e5m2), "dtype must be one of"),
    (dict(cfg=dict(positions="cache_index")), "positions='cache_index' needs rotary"),
    (dict(cfg=dict(positions="cache_index"), rotary=Rotary.from_schedule(16)), "rotary covers head_dim=16"),
    (dict(rotary=Rotary.from_schedule(8)), "rotary is only used with positions='cache_index'"),
])
def test_bad_construction(kwargs, msg):
    cfg = CacheConfig(**dict(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=8)
                      | kwargs.pop("cfg", {}))
    args = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=8, dtype=torch.float32) | kwargs
    with pytest.raises(ValueError, match=msg):
        SinkQuantCache(cfg, **args)


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
