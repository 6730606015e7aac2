"""Input checks (qsinkkv/checks.py): bad input gets a clear error that names the argument, and the cache exactly
as it was; values are checked in the dtype they are stored in, and on the real tokens only (padding is never
stored). Several pin defects an adversarial probe found."""
from functools import partial

import helpers
import pytest
import torch
from helpers import HKV, D, G, assert_unchanged, run_rows, snapshot

from qsinkkv import CacheConfig, SinkQuantCache, checks
from qsinkkv.paged import PagedCache

B, H = 2, HKV * G
make = partial(helpers.make, B=B, Hkv=HKV)  # this file's caches: B sequences of HKV KV heads, head_dim D


@pytest.fixture
def cache():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    c = make(cfg, layers=2)
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


# --- shapes, dtypes, devices, finiteness of k, v and q -------------------------------------------------------------

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


# --- scale, sink_logits and q are checked before the token is stored -----------------------

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


# --- finiteness is checked in the dtype the values are stored in (defects 5, 16) -----------------------------------

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


# --- a quantized window refuses, when it arrives, a value its block could not quantize ------

@pytest.mark.parametrize("backend", ["torch", "c"])
@pytest.mark.parametrize("how", ["append", "attend_packed", "paged"])
def test_a_value_its_block_cannot_quantize_is_refused_when_it_arrives(backend, how):
    """|v| = 1e5 fits the bf16 filling block but not the fp16 zero of the block it will complete into. It is
    refused at once, naming v and its row, with the cache unchanged; the rows go on, and the step that completes
    the block is not refused (before: accepted, then every retry of that later step refused for the whole
    batch). The bound is exact: the largest bf16 below fp16's overflow (65280) is accepted."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=4, value_group_size=4,
                      window_dtype=torch.bfloat16, scale_dtype=torch.float16)
    if how == "paged":
        cache = PagedCache(cfg, 1, HKV, D, max_seqs=B, float_blocks=8, quant_blocks=16, backend=backend,
                           dtype=torch.float32)
        for _ in range(B):
            cache.admit()
    else:
        cache = make(cfg, backend=backend)
    g = torch.Generator().manual_seed(3)

    def step(bad=None, value=1e5):
        q, k, v = (torch.randn(B, h, 1, D, generator=g) for h in (H, HKV, HKV))
        if bad is not None:
            v[1, 0, 0, 3] = value
        if how == "append":
            return cache.append(0, k, v)
        qsl = torch.arange(B + 1)
        return cache.attend_packed(0, q[:, :, 0], k[:, :, 0], v[:, :, 0], qsl)

    for _ in range(3):                       # the sinks and a first window token
        step()
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=r"v contains .*scale_dtype=torch.float16.*refused: rows \[1\]"):
        step(bad=True)
    assert_unchanged(cache, snap)
    step(bad=True, value=-65280.0)           # stored as bf16 -65280: its block's zero fits fp16
    for _ in range(6):                       # the blocks complete: nothing is refused
        step()
    assert int(cache.layers[0].seq_lens.min()) == 10


def test_the_window_bound_keeps_every_block_quantizable():
    """``window_bound``: the largest value accepted, alone in a block with its opposite, quantizes to finite
    fp16 scales; for bits=16 only the window dtype bounds it."""
    from qsinkkv import quant
    from qsinkkv.checks import window_bound
    cfg = CacheConfig(bits=4, window_dtype=torch.bfloat16, scale_dtype=torch.float16)
    bound = window_bound(cfg, torch.float32)
    top = torch.nextafter(torch.tensor(bound), torch.tensor(0.0)).item()   # the largest float32 accepted
    block = torch.tensor([top, -top, 0.0, 1.0]).to(torch.bfloat16).view(1, 4, 1).expand(1, 4, 2)
    quant.quantize_key_blocks(block, 4, torch.float16)                      # raises if it overflowed
    with pytest.raises(ValueError, match="overflow scale_dtype"):
        refused = (torch.tensor(top).to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16)  # next bf16
        quant.quantize_key_blocks(torch.stack([-refused, refused, refused, refused]).view(1, 4, 1).expand(1, 4, 2),
                                  4, torch.float16)
    assert window_bound(CacheConfig(bits=16, window_dtype=torch.bfloat16), torch.float32) > 1e38


# --- per-sequence arguments: lengths, a batch index, packed offsets ------------------------------------------------

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


@pytest.mark.parametrize("lengths,msg", [
    ([1, 2], r"lengths must be a 1-D int tensor \(or list\) of B=3 counts in \[0, T=4\]"),
    ([1, 2, 5], r"got \[1, 2, 5\]"),
    ([1, -1, 2], r"got \[1, -1, 2\]"),
    (torch.tensor([1.0, 2.0, 3.0]), "got torch.float32"),
    (torch.tensor([True, False, True]), "got torch.bool"),
    ("abc", "lengths must be"),
])
def test_bad_lengths_change_nothing(lengths, msg):
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    cache = SinkQuantCache(cfg, 1, 3, HKV, D, dtype=torch.float32)
    draw = run_rows(cfg)
    cache.append(0, *draw(5)[1:], [5, 2, 0])
    snap = snapshot(cache)
    with pytest.raises(ValueError, match=msg):
        cache.attend(0, *draw(4), lengths)
    assert_unchanged(cache, snap)


def test_nan_in_padding_is_not_refused_nan_in_a_real_token_is():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    cache = SinkQuantCache(cfg, 1, 2, HKV, D, dtype=torch.float32)
    q, k, v = run_rows(cfg, B=2)(4)
    k[1, :, 3] = float("nan")  # row 1 holds 2 tokens: its slot 3 is padding, never stored
    q[1, :, 3] = float("nan")
    out = cache.attend(0, q, k, v, [4, 2])
    assert torch.isfinite(out).all()
    snap = snapshot(cache)
    k[1, 0, 1, 0] = float("inf")
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        cache.attend(0, q, k, v, [4, 2])
    assert_unchanged(cache, snap)


BAD_OFFSETS = [None, "0,1", 1.5, torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 1j, 2]), [0, 1.0, 2],
               torch.zeros(3, dtype=torch.int64, device="meta"), torch.tensor([True, False, True])]


@pytest.mark.parametrize("qsl", BAD_OFFSETS, ids=lambda x: type(x).__name__ + str(getattr(x, "dtype", "")))
def test_bad_query_start_loc_is_named_and_changes_nothing(qsl):
    """None, a str, a complex or a meta tensor raised RuntimeError/TypeError naming nothing."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=8, bits=4, block_size=2, value_group_size=4)
    pool = PagedCache(cfg, 1, HKV, D, max_seqs=2, float_blocks=2, quant_blocks=4, dtype=torch.float32)
    pool.admit(), pool.admit()
    pool.attend_packed(0, torch.randn(3, HKV * G, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D), [0, 2, 3])
    snap = snapshot(pool)
    with pytest.raises(ValueError, match="query_start_loc must be"):
        pool.attend_packed(0, torch.randn(2, HKV * G, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D), qsl)
    assert_unchanged(pool, snap)
    with pytest.raises(ValueError, match="lengths must be .*meta tensor"):
        pool.attend(0, *(torch.randn(2, h, 1, D) for h in (HKV * G, HKV, HKV)),
                    lengths=torch.ones(2, dtype=torch.int64, device="meta"))
    assert_unchanged(pool, snap)


@pytest.mark.parametrize("where", ["none", "q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 1e38])
def test_q_k_v_read_as_one_buffer_give_each_tensors_own_answer(where, value):
    """An engine's q, k, v are column slices of one fused qkv row: ``peaks_fit`` reads them in one pass. Its answer
    must be each tensor's own (as separate copies give it), whatever tensor holds a NaN, an inf or a value past k's
    and v's bound (q may hold that); slices that are not q | k | v of one row take the per-tensor path."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=30, bits=4, block_size=8, value_group_size=8,
                      sink_dtype=torch.bfloat16, window_dtype=torch.bfloat16)
    H, Hkv, D, N = 6, 2, 16, 11
    qkv = torch.randn(N, (H + 2 * Hkv) * D + 8, generator=torch.Generator().manual_seed(0)).bfloat16()[:, 8:]
    q, k, v = (qkv[:, a:b].view(N, -1, D) for a, b in ((0, H * D), (H * D, (H + Hkv) * D), ((H + Hkv) * D, None)))
    assert checks._one_buffer(q, k, v) is not None
    assert checks._one_buffer(q, v, k) is None and checks._one_buffer(q, k, v.clone()) is None
    if where != "none":
        {"q": q, "k": k, "v": v}[where][N - 1, -1, 3] = value
    expect = checks.peaks_fit(k.clone(), v.clone(), q.clone(), None, cfg)
    assert checks.peaks_fit(k, v, q, None, cfg) == expect
    assert all(expect.values()) == (where == "none" or (where == "q" and value == 1e38))
