"""Regressions from the adversarial probe (issue 9): a refused call changes nothing, a refused model
step leaves no layer ahead of the others, and every input is checked before anything is stored."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_errors import assert_unchanged, snapshot

from qsinkkv import CacheConfig, SinkQuantCache, gather, visible_mask

B, HKV, H, D = 2, 2, 4, 8


def make(cfg, layers=3, dtype=torch.float32):
    return SinkQuantCache(cfg, layers, B, HKV, D, dtype=dtype)


def visible_state(cache):
    """What any query can read: per layer, its length and the visible (position, k, v) of each sequence."""
    out = []
    for layer in cache.layers:
        k, v, pos = gather(layer, torch.float32)
        n = layer.seq_lens.clone()
        seen = visible_mask((n - 1).unsqueeze(1), pos, cache.config.sink_tokens, cache.config.recent_tokens)[:, 0]
        rows = []
        for b in range(B):
            order = torch.argsort(torch.where(seen[b], pos[b], pos[b].max() + 1))[: int(seen[b].sum())]
            rows.append((pos[b, order], k[b][:, order], v[b][:, order]))
        out.append((n, rows))
    return out


def assert_same_state(a, b):
    for (na, rows_a), (nb, rows_b) in zip(visible_state(a), visible_state(b)):
        assert torch.equal(na, nb)
        for ra, rb in zip(rows_a, rows_b):
            assert all(torch.equal(x, y) for x, y in zip(ra, rb))


# --- defect 2: a refused step in layer l rolls back the layers that already took it -----------------

@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), S=st.integers(0, 3), W=st.integers(1, 12), bs=st.integers(1, 4),
       R=st.integers(0, 3), prefix=st.lists(st.integers(1, 9), min_size=0, max_size=5), T=st.integers(1, 7),
       fail_layer=st.integers(0, 2), how=st.sampled_from(["nan", "scale_overflow", "bad_q"]),
       seed=st.integers(0, 2**31))
def test_refused_step_rolls_back_every_layer(bits, S, W, bs, R, prefix, T, fail_layer, how, seed):
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=2,
                      residual_tokens=min(R, W))
    g = torch.Generator().manual_seed(seed)
    a, b = make(cfg), make(cfg)  # b is the twin that never sees the refused step
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    for n in prefix:
        for layer in range(3):
            k, v = rnd(B, HKV, n, D), rnd(B, HKV, n, D)
            a.append(layer, k, v)
            b.append(layer, k, v)
    for layer in range(3):
        q, k, v = rnd(B, H, T, D), rnd(B, HKV, T, D), rnd(B, HKV, T, D)
        if layer == fail_layer:
            if how == "nan":
                k[1, 0, T - 1, 3] = float("nan")
            elif how == "scale_overflow":
                k[0, 1, :, 2] = -1e6  # finite, but the key zero of every block it completes overflows fp16
            else:
                q[0, 0, 0, 0] = float("inf")
            before = a.get_seq_length(layer)
            try:
                a.attend(layer, q, k, v)
            except ValueError:
                break
            assert how == "scale_overflow" and a.get_seq_length(layer) == before + T  # no block was completed
            b.attend(layer, q, k, v)
            continue
        a.attend(layer, q, k, v)
    else:
        return  # nothing was refused (the huge key completed no block): nothing to roll back
    assert len(set(a.layer_lengths())) == 1
    assert a.layer_lengths() == b.layer_lengths()
    assert_same_state(a, b)
    for _ in range(3):  # and the two caches go on identically
        for layer in range(3):
            q, k, v = rnd(B, H, 1, D), rnd(B, HKV, 1, D), rnd(B, HKV, 1, D)
            assert torch.equal(a.attend(layer, q, k, v), b.attend(layer, q, k, v))
    assert_same_state(a, b)


def test_rollback_note_when_a_layer_cannot_be_restored():
    cfg = CacheConfig(sink_tokens=1, recent_tokens=6, bits=8, block_size=2, value_group_size=2)
    cache = make(cfg)
    cache.append(0, torch.randn(B, HKV, 3, D), torch.randn(B, HKV, 3, D))
    cache.append(0, torch.randn(B, HKV, 2, D), torch.randn(B, HKV, 2, D))  # layer 0 two appends ahead of layer 1
    bad = torch.randn(B, HKV, 1, D)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="contains NaN") as err:
        cache.append(1, bad, bad)
    assert "layers [0] could not be rolled back to the refused step" in "\n".join(err.value.__notes__)
    assert cache.layer_lengths() == [5, 0, 0]


# --- defects 3, 4: scale, sink_logits and q are checked before the token is stored --------------------

@pytest.fixture
def cache():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    c = make(cfg, layers=2)
    for layer in range(2):
        c.append(layer, torch.randn(B, HKV, 9, D), torch.randn(B, HKV, 9, D))
    return c


def nan_at(shape, value):
    x = torch.randn(*shape)
    x.view(-1)[3] = value
    return x


BAD_ATTEND = [
    (dict(scale="x"), "scale must be a finite float > 0"),
    (dict(scale=torch.tensor([1.0, 2.0])), "scale must be a finite float > 0"),
    (dict(scale=float("nan")), "scale must be a finite float > 0"),
    (dict(scale=float("inf")), "scale must be a finite float > 0"),
    (dict(scale=0.0), "scale must be a finite float > 0"),
    (dict(scale=True), "scale must be a finite float > 0"),
    (dict(sink_logits=torch.zeros(H, device="meta")), "sink_logits.device must be the cache device"),
    (dict(sink_logits=torch.zeros(H, dtype=torch.int64)), r"sink_logits must be a float tensor of shape \[H=4\]"),
    (dict(sink_logits=torch.zeros(2, H)), r"sink_logits must be a float tensor of shape \[H=4\]"),
    (dict(sink_logits=nan_at((H,), float("nan"))), "sink_logits must be free of NaN and \\+inf"),
    (dict(sink_logits=nan_at((H,), float("inf"))), "sink_logits must be free of NaN and \\+inf"),
    (dict(q=lambda T: nan_at((B, H, T, D), float("nan"))), "q contains NaN or Inf"),
    (dict(q=lambda T: nan_at((B, H, T, D), float("-inf"))), "q contains NaN or Inf"),
    (dict(q=lambda T: torch.randn(B, 0, T, D)), "H a positive multiple of Hkv=2"),
]


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("kwargs,msg", BAD_ATTEND)
def test_bad_attend_arguments_store_nothing(cache, kwargs, msg, T):
    snap = snapshot(cache)
    kwargs = dict(kwargs)
    q = kwargs.pop("q", lambda T: torch.randn(B, H, T, D))(T)
    with pytest.raises(ValueError, match=msg):
        cache.attend(1, q, torch.randn(B, HKV, T, D), torch.randn(B, HKV, T, D), **kwargs)
    assert_unchanged(cache, snap)


def test_minus_inf_sink_logit_means_no_sink(cache):
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, HKV, 1, D), torch.randn(B, HKV, 1, D)
    twin = make(cache.config, layers=2)
    for a, b in zip(twin.layers, cache.layers):
        for name, t in a.tensors().items():
            t.copy_(b.tensors()[name])
        a.seq_lens.copy_(b.seq_lens)
    without = twin.attend(0, q, k, v)
    with_minus_inf = cache.attend(0, q, k, v, sink_logits=torch.full((H,), float("-inf")))
    torch.testing.assert_close(with_minus_inf, without)


# --- defect 5: finiteness is checked in the dtype the values are stored in ----------------------------

@pytest.mark.parametrize("dtype,cfg,value,n_before", [
    (torch.bfloat16, dict(window_dtype=torch.float16), 1e5, 9),           # a window token: fp16 overflows
    (torch.bfloat16, dict(sink_dtype=torch.float16), 1e5, 0),             # a sink token
    (torch.float32, dict(), 3.4e38, 0),                                   # float32 > bf16 max, into bf16 sinks
    (torch.float32, dict(), -3.4e38, 9),                                  # into the bf16 window
])
def test_values_that_overflow_the_storage_dtype_are_refused(dtype, cfg, value, n_before):
    config = CacheConfig(sink_tokens=2, recent_tokens=6, bits=16, **cfg)
    cache = SinkQuantCache(config, 1, B, HKV, D, dtype=dtype)
    if n_before:
        cache.append(0, torch.randn(B, HKV, n_before, D, dtype=dtype), torch.randn(B, HKV, n_before, D, dtype=dtype))
    snap = snapshot(cache)
    bad = torch.randn(B, HKV, 1, D, dtype=dtype)
    bad[1, 1, 0, 7] = value
    with pytest.raises(ValueError, match="v contains NaN or Inf, or values that overflow the storage dtype"):
        cache.append(0, torch.randn(B, HKV, 1, D, dtype=dtype), bad)
    assert_unchanged(cache, snap)


def test_largest_storable_values_are_accepted():
    config = CacheConfig(sink_tokens=1, recent_tokens=6, bits=16, sink_dtype=torch.float32,
                         window_dtype=torch.float16)
    cache = SinkQuantCache(config, 1, 1, 1, D, dtype=torch.bfloat16)
    big = torch.full((1, 1, 2, D), 1e5, dtype=torch.bfloat16)
    big[:, :, 1] = 6.5e4  # position 1 is a window token: fits fp16 (max 65504) once rounded
    cache.append(0, big, big)  # position 0 (1e5) goes to the float32 sinks: fine
    assert torch.isfinite(cache.layers[0].float_v).all()


# --- defect 6: select_batch reads a bool mask as a mask and refuses floats and empty selections --------

def test_select_batch_bool_mask_and_bad_indices():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=8, block_size=2, value_group_size=4)
    cache = SinkQuantCache(cfg, 2, 3, HKV, D, dtype=torch.float32)
    cache.append(0, torch.randn(3, HKV, 5, D), torch.randn(3, HKV, 5, D))
    rows = [t.clone() for t in cache.layers[0].tensors().values()]
    for bad, msg in [(torch.tensor([0.0, 2.0]), "got torch.float32"), ([], "selects no sequence"),
                     (torch.tensor([0, 3]), r"rows in \[0, 3\)"), (torch.tensor([-1]), r"rows in \[0, 3\)"),
                     (torch.tensor([[0, 1]]), "1-D"), (torch.tensor([True, False]), "mask of length 3"),
                     (torch.tensor([False, False, False]), "selects no sequence"), ("ab", "index must be")]:
        snap = snapshot(cache)
        with pytest.raises(ValueError, match=msg):
            cache.select_batch(bad)
        assert_unchanged(cache, snap)
        assert cache.batch_size == 3
    cache.select_batch(torch.tensor([True, False, True]))
    assert cache.batch_size == 2
    for before, after in zip(rows, cache.layers[0].tensors().values()):  # pools [Hkv, B * blocks, ...]
        per_row = lambda t, B: t.view(t.shape[0], B, t.shape[1] // B, *t.shape[2:])  # noqa: E731
        assert torch.equal(per_row(after, 2), per_row(before, 3)[:, [0, 2]])
    cache.attend(0, torch.randn(2, 4, 1, D), torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))


# --- defects 7, 8, 16: config and dtypes refused at construction; the overflow hint is true -------------

@pytest.mark.parametrize("bits", [8.0, 4.0, 16.0])
def test_float_bits_refused(bits):
    with pytest.raises(ValueError, match="CacheConfig.bits must be one of the ints 16, 8, 4"):
        CacheConfig(bits=bits)


def test_float32_scale_overflow_does_not_suggest_float32():
    cfg = CacheConfig(sink_tokens=0, recent_tokens=4, bits=8, block_size=2, value_group_size=8,
                      scale_dtype=torch.float32)
    cache = SinkQuantCache(cfg, 1, 1, 1, D, dtype=torch.float32)
    k = torch.randn(1, 1, 2, D)
    k[0, 0, 0, 0], k[0, 0, 1, 0] = -3e38, 3e38  # their range overflows float32
    with pytest.raises(ValueError, match="float32 is the widest scale_dtype") as err:
        cache.append(0, k, torch.randn(1, 1, 2, D))
    assert "use CacheConfig(scale_dtype=torch.float32)" not in str(err.value)
    assert cache.layer_lengths() == [0]


@pytest.mark.parametrize("window_dtype,at", [
    (torch.float16, 65520.0),                       # 65504 + half an ulp: rounds up to inf
    (torch.bfloat16, float.fromhex("0x1.ffp+127")),  # bf16 max + half an ulp
])
def test_overflow_boundary_is_exact(window_dtype, at):
    """A decode step checks one peak per tensor against the window dtype's overflow bound: the largest
    value that still rounds to a finite number is accepted, the next one refused."""
    cfg = CacheConfig(sink_tokens=1, recent_tokens=6, bits=16, window_dtype=window_dtype)
    cache = SinkQuantCache(cfg, 1, 1, 1, D, dtype=torch.float32)
    cache.append(0, torch.randn(1, 1, 2, D), torch.randn(1, 1, 2, D))
    below = torch.nextafter(torch.tensor(at), torch.tensor(0.0)).item()  # the float32 just under it
    ok = torch.randn(1, 1, 1, D)
    ok[0, 0, 0, 1] = -below
    assert torch.isfinite(ok.to(window_dtype)).all()
    cache.append(0, ok, ok)
    snap = snapshot(cache)
    bad = torch.randn(1, 1, 1, D)
    bad[0, 0, 0, 1] = at
    assert not torch.isfinite(bad.to(window_dtype)).all()
    with pytest.raises(ValueError, match="k contains NaN or Inf, or values that overflow"):
        cache.append(0, bad, ok)
    assert_unchanged(cache, snap)
