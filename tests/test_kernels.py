"""The Triton kernels (qsinkkv/kernels: quantize, decode, prefill) vs their PyTorch references, on the same
storage, and how a cache chooses them (the Triton backend, its decode variants).

On a CPU-only machine the kernels run under TRITON_INTERPRET=1 (set in conftest.py);
on a CUDA machine the same tests run natively.
"""
import dataclasses
import functools
import importlib

import pytest
import torch
from conftest import DEVICE, KERNEL_TOL
from helpers import CASES, assert_same_state, filled_layer, random_storage_layer, rel, rel_rms, scattered_pool
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.runtime.errors import OutOfResources

from qsinkkv import CacheConfig, Rotary, SinkQuantCache, quant
from qsinkkv import ops as ops_mod
from qsinkkv.kernels import quantize as kq
from qsinkkv.kernels.api import decode_attention, decode_attention_reference
from qsinkkv.ops import select_ops

decode_mod = importlib.import_module("qsinkkv.kernels.decode_attention")  # the module, not the function
launch_mod = importlib.import_module("qsinkkv.kernels.launch")
prefill_mod = importlib.import_module("qsinkkv.kernels.prefill_attention")


def decode(q, layer, **kwargs):
    """The decode kernel as these tests launch it: its partial-state workspace and output filled with NaN
    first (``_poison``), so that any element a kernel forgets to write fails loudly."""
    return decode_attention(q, layer, _poison=True, **kwargs)


def poisoned(cache):
    """``cache`` with its decode op launching as ``decode`` does."""
    cache.ops = dataclasses.replace(cache.ops, decode=functools.partial(cache.ops.decode, _poison=True))
    return cache


FP16_TOL = 3e-3  # fp16 tensor-core operands, in the interpreter as on a GPU


@pytest.fixture(params=list(decode_mod.VARIANTS))
def variant(request):
    """The decode kernel's bodies for quantized blocks (``decode_attention(variant=...)``): dequantize per
    element, the value scales folded out ("folded"), or dequantized in fp16 onto fp16 tensor-core dots ("fp16")."""
    return request.param


def tol(variant):
    """The tolerance a decode variant is held to against the reference."""
    return max(KERNEL_TOL, FP16_TOL) if variant == "fp16" else KERNEL_TOL


def check_decode(q, layer, ref, variant, *, rotary=None, splits=(1, 3)):
    """The kernel's decode of ``q`` over ``layer`` at each split count, finite and equal to ``ref`` within the variant's
    tolerance, or its refusal where the variant cannot fold the layout's value groups: the outputs ([] if refused)."""
    outs = []
    for n in splits:
        out = decode_or_refused(q.to(DEVICE), layer, variant, rotary=rotary, num_splits=n)
        if out is None:
            return outs
        out = out.cpu()
        assert torch.isfinite(out).all()
        assert rel_rms(out, ref) < tol(variant), f"{variant}, splits={n}: {rel_rms(out, ref):.2e}"
        outs.append(out)
    return outs


def decode_or_refused(q, layer, variant, **kwargs):
    """``decode(q, layer, variant=variant, ...)``, or None where the variant cannot read this layout's blocks: "folded"
    and "fp16" fold a value group's scale out of each half of the head (``value_group_size`` a multiple of
    ``head_dim // 2``, or bits=16: no quantized block), and elsewhere are refused by name (checked here)."""
    cfg = layer.layout.config
    if variant != "dequantize" and cfg.bits != 16 and cfg.value_group_size % (layer.head_dim // 2):
        with pytest.raises(ValueError, match=rf"variant='{variant}' folds each value group's scale out of a half"):
            decode(q, layer, variant=variant, **kwargs)
        return None
    return decode(q, layer, variant=variant, **kwargs)


# --- block quantize + pack: codes, scales and zeros bit-identical ----------------------------

@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([8, 4]), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), nblk=st.integers(1, 4),
       bs=st.sampled_from([1, 3, 4, 16]), d=st.sampled_from([4, 12, 64]), seed=st.integers(0, 2**31),
       spread=st.sampled_from([1e-3, 1.0, 40.0]))
def test_quantize_key_blocks_bit_identical(bits, scale_dtype, dtype, nblk, bs, d, seed, spread):
    g = torch.Generator().manual_seed(seed)
    k = ((torch.randn(2, nblk, bs, d, generator=g) + torch.randn(1, generator=g)) * spread).to(dtype)
    got = kq.quantize_key_blocks(k.to(DEVICE), bits, scale_dtype)
    ref = quant.quantize_key_blocks(k, bits, scale_dtype)
    for name, a, b in zip(("codes", "scale", "zero"), got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b), name


@settings(max_examples=25, deadline=None)
@given(bits=st.sampled_from([8, 4]), scale_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       tokens=st.integers(1, 37),
       # (d, group): groups inside a half, a half per group, one group for both halves, groups that
       # straddle the halves the int4 nibbles hold (12, 4), odd groups (10, 5)
       shape=st.sampled_from([(8, 2), (8, 8), (12, 6), (64, 32), (16, 16), (12, 4), (20, 4), (10, 5), (6, 3)]),
       seed=st.integers(0, 2**31))
def test_quantize_values_bit_identical(bits, scale_dtype, tokens, shape, seed):
    d, group = shape
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(2, tokens, d, generator=g) * 3).to(torch.bfloat16)
    got = kq.quantize_values(v.to(DEVICE), bits, group, scale_dtype)
    ref = quant.quantize_values(v, bits, group, scale_dtype)
    for name, a, b in zip(("codes", "scale", "zero"), got, ref):
        assert torch.equal(a.cpu(), b), name


def test_quantize_int8_odd_group():
    v = torch.randn(5, 9)
    ref = quant.quantize_values(v, 8, 3, torch.float16)
    for a, b in zip(kq.quantize_values(v.to(DEVICE), 8, 3, torch.float16), ref):
        assert torch.equal(a.cpu(), b)


def test_quantize_overflow_is_refused():
    k = torch.tensor([-1e6, 1.0]).view(1, 2, 1).expand(1, 2, 4).contiguous().to(DEVICE)
    with pytest.raises(ValueError, match="scale_dtype"):
        kq.quantize_key_blocks(k, 8, torch.float16)


# --- decode attention ---------------------------------------------------------------------------

D = 16
ROT = Rotary.from_schedule(D, base=1000.0)


@pytest.mark.parametrize("rope", [False, True], ids=["absolute", "cache_index"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-S{c[1]}-W{c[2]}-bs{c[3]}-R{c[5]}-G{c[7]}")
def test_decode_matches_reference(variant, case, rope):
    bits, S, W, bs, group, R, Hkv, G, lengths = case
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=group,
                      residual_tokens=R, positions="cache_index" if rope else "absolute")
    rotary = ROT if rope else None
    layer, singles = filled_layer(cfg, lengths, Hkv, seed=len(lengths), rotary=rotary)
    q = torch.randn(len(lengths), Hkv * G, D, generator=torch.Generator().manual_seed(9))
    ref = decode_attention_reference(q, layer, rotary=rotary)
    # the batched reference equals each sequence's own reference (per-sequence lengths are honoured)
    for b, single in enumerate(singles):
        own = decode_attention_reference(q[b:b + 1], single, rotary=rotary)
        assert rel_rms(ref[b:b + 1], own) < 1e-6
    dev_layer = layer.to(DEVICE)
    if rope and variant == "fp16":  # keys turn by their own index: its fp16 body rotates none
        with pytest.raises(ValueError, match=r"variant='fp16' needs the absolute contract \(rotary=None\)"):
            decode(q.to(DEVICE), dev_layer, rotary=rotary, variant=variant)
        return
    check_decode(q, dev_layer, ref, variant, rotary=rotary)


@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_decode_gqa_and_sink_logits(variant, G):
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=4, block_size=4, value_group_size=4)
    layer, _ = filled_layer(cfg, [23, 11], 2, seed=G)
    q = torch.randn(2, 2 * G, D)
    logits = torch.randn(2 * G) * 2
    for sink_logits in (None, logits):
        ref = decode_attention_reference(q, layer, sink_logits=sink_logits)
        out = decode_or_refused(q.to(DEVICE), layer.to(DEVICE), variant, sink_logits=None if sink_logits is None
                                else sink_logits.to(DEVICE), num_splits=2)
        if out is None:
            return
        assert rel_rms(out.cpu(), ref) < tol(variant)
    no_logits = decode_attention_reference(q, layer)
    assert rel_rms(no_logits, ref) > 1e-3  # the logits do change the output


def test_decode_bf16_query_and_scale():
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=8, block_size=8, value_group_size=8)
    layer, _ = filled_layer(cfg, [70], 2)
    q = torch.randn(1, 4, D).to(torch.bfloat16)
    out = decode(q.to(DEVICE), layer.to(DEVICE), scale=0.3)
    assert out.dtype == torch.bfloat16
    ref = decode_attention_reference(q.float(), layer, scale=0.3)
    assert rel_rms(out.float().cpu(), ref) < 1e-2  # bf16 output rounding


def test_decode_bad_arguments():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=4)
    layer, _ = filled_layer(cfg, [9], 2)
    layer = layer.to(DEVICE)
    with pytest.raises(ValueError, match=r"q must be \[B=1, H, D=16\] with H a multiple of Hkv=2"):
        decode(torch.randn(1, 3, D, device=DEVICE), layer)
    with pytest.raises(ValueError, match=r"sink_logits must be a tensor of shape \[H=2\]"):
        decode(torch.randn(1, 2, D, device=DEVICE), layer, sink_logits=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="num_splits must be an int >= 1"):
        decode(torch.randn(1, 2, D, device=DEVICE), layer, num_splits=0)


class SharedMemoryShort:
    """A kernel as launched on a GPU whose shared memory holds the tiles of at most ``fits`` pipeline
    stages: more raise Triton's OutOfResources, as its launcher does; every launch is logged."""

    def __init__(self, real, fits: int, log: list):
        self.real, self.fits, self.log = real, fits, log

    def __getitem__(self, grid):
        def launch(*args, num_stages, **kw):
            self.log.append(num_stages)
            if num_stages > self.fits:
                raise OutOfResources(1000 * num_stages, 1000 * self.fits, "shared memory")
            self.real[grid](*args, num_stages=num_stages, **kw)
        return launch


def test_decode_fewer_stages_where_shared_memory_is_short(monkeypatch):
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=4, block_size=4, value_group_size=4)
    layer, _ = filled_layer(cfg, [23, 11], 2, seed=5)
    q = torch.randn(2, 4, D)
    ref = decode_attention_reference(q, layer)
    real, log = decode_mod._decode_kernel, []
    monkeypatch.setattr(launch_mod, "_fitting", {})
    for fits in (2, 2, 1):  # the last: what fitted no longer does (say, another process took memory)
        monkeypatch.setattr(decode_mod, "_decode_kernel", SharedMemoryShort(real, fits, log))
        out = decode(q.to(DEVICE), layer.to(DEVICE), num_splits=2)
        assert rel_rms(out.cpu(), ref) < KERNEL_TOL
    assert log == [3, 2, 2, 2, 1]  # the first launch finds what fits, later ones start there and go lower


def test_decode_refused_where_no_stages_fit(monkeypatch):
    """A configuration too large for the device even unpipelined: a clear error at the step, and the
    cache as its twin that never saw the step (layer 0 had taken it; layer 1 is refused). A prefill
    chunk likewise."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=8, block_size=4, value_group_size=4)
    a, b = (poisoned(SinkQuantCache(cfg, 2, 2, 2, D, dtype=torch.float32, backend="triton", device=DEVICE))
            for _ in range(2))
    for layer in range(2):
        k, v = torch.randn(2, 2, 19, D, device=DEVICE), torch.randn(2, 2, 19, D, device=DEVICE)
        a.append(layer, k, v)
        b.append(layer, k, v)
    step = [torch.randn(2, n, 1, D, device=DEVICE) for n in (4, 2, 2)]
    a.attend(0, *step)
    real = decode_mod._decode_kernel
    monkeypatch.setattr(launch_mod, "_fitting", {})  # forget layer 0's launch (3 stages fitted)
    monkeypatch.setattr(decode_mod, "_decode_kernel", SharedMemoryShort(real, 0, []))
    with pytest.raises(RuntimeError, match=r"the Triton decode kernel for head_dim=16, block_size=4, bits=8 does not "
                                           r"fit this device even with num_stages=1 \(shared memory: needs 1000 bytes, "
                                           r"the device has 0 bytes\): use a smaller block_size, or backend='torch'"):
        a.attend(1, *step)
    assert a.layer_lengths() == b.layer_lengths() == [19, 19]
    assert_same_state(a, b)
    monkeypatch.setattr(decode_mod, "_decode_kernel", real)
    for layer in range(2):  # and the two go on identically
        assert torch.equal(a.attend(layer, *step), b.attend(layer, *step))
    monkeypatch.setattr(launch_mod, "_fitting", {})  # forget any earlier prefill launch of this configuration
    monkeypatch.setattr(prefill_mod, "_prefill_kernel", SharedMemoryShort(prefill_mod._prefill_kernel, 0, []))
    chunk = [torch.randn(2, n, 5, D, device=DEVICE) for n in (4, 2, 2)]
    with pytest.raises(RuntimeError, match=r"the Triton prefill kernel for head_dim=16, block_m=\d+, block_n=\d+ does "
                                           r"not fit this device even with num_stages=1"):
        a.attend(0, *chunk)
    assert a.layer_lengths() == b.layer_lengths() == [20, 20]
    assert_same_state(a, b)


@pytest.mark.skipif(DEVICE != "cuda", reason="shared memory runs short on a GPU only")
def test_decode_large_tiles_fit_by_fewer_stages():
    """head_dim 256, block 128, int8 compiled here for sm_90a (triton 3.9) needs 232 KB of shared memory at
    Triton's default 3 stages, more than an H100/H200 gives a program: the launch must fit it with the
    stages that fit (printed for the GPU check's log) and stay the reference's."""
    cfg = CacheConfig(sink_tokens=4, recent_tokens=508, bits=8, block_size=128, value_group_size=128)
    cache = SinkQuantCache(cfg, 1, 2, 2, 256, dtype=torch.float32, backend="triton", device=DEVICE)
    cache.append(0, torch.randn(2, 2, 700, 256, device=DEVICE), torch.randn(2, 2, 700, 256, device=DEVICE))
    q = torch.randn(2, 8, 256, device=DEVICE)
    out = decode(q, cache.layers[0])
    assert rel_rms(out, decode_attention_reference(q, cache.layers[0])) < KERNEL_TOL
    print("stages that fit:", {dict(key[3])["D"]: s for key, s in launch_mod._fitting.items() if key[0] == "decode"})


def test_backend_choice():
    cfg = CacheConfig(sink_tokens=2, recent_tokens=6, bits=4, block_size=2, value_group_size=2)
    auto = SinkQuantCache(cfg, 1, 1, 1, D, backend="auto", device=DEVICE)
    # on the CPU: the C decode where it builds (tests/test_decode_c.py), else the PyTorch ops
    from qsinkkv import decode_c
    assert auto.backend == ("triton" if DEVICE == "cuda" else "c" if decode_c.available()[0] else "torch")
    assert SinkQuantCache(cfg, 1, 1, 1, D, backend="triton", device=DEVICE).backend == "triton"
    with pytest.raises(ValueError, match="backend must be 'auto', 'torch', 'c' or 'triton', got 'cuda'"):
        SinkQuantCache(cfg, 1, 1, 1, D, backend="cuda")
    with pytest.raises(ValueError, match="head_dim % 4 == 0"):
        SinkQuantCache(cfg, 1, 1, 1, 6, backend="triton", device=DEVICE)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("head_dim, group", [(12, 4), (12, 12), (20, 4), (24, 6), (12, 3)])
def test_decode_value_groups_across_the_halves(variant, bits, head_dim, group):
    """Value groups that straddle the two halves of the channels (the int4 nibble planes and the
    kernel's halves: head_dim 12, group 4 puts channels 4-7 in one group across the halves), a group
    spanning both halves, and groups inside them (odd ones too, now that int4 packs the halves):
    the CPU path and the kernel vs the reference."""
    from qsinkkv.decode import decode_attention_torch
    cfg = CacheConfig(sink_tokens=2, recent_tokens=17, bits=bits, block_size=4, value_group_size=group)
    g = torch.Generator().manual_seed(head_dim * group + bits)
    cache = SinkQuantCache(cfg, 1, 2, 2, head_dim, dtype=torch.float32, backend="torch")
    cache.append(0, torch.randn(2, 2, 30, head_dim, generator=g), torch.randn(2, 2, 30, head_dim, generator=g),
                 lengths=[30, 23])
    layer = cache.layers[0]
    q = torch.randn(2, 6, head_dim, generator=g)
    ref = decode_attention_reference(q, layer)
    assert rel_rms(decode_attention_torch(q, layer), ref) < 1e-5
    out = decode_or_refused(q.to(DEVICE), layer.to(DEVICE), variant, num_splits=2)
    assert out is None or rel_rms(out.cpu(), ref) < tol(variant)


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_fp16_keeps_range(bits):
    """Variant "fp16" dequantizes in fp16: window values at the edge of what scale_dtype fp16 stores (blocks from
    -65000 to 65000, where ``code * scale + zero`` with the stats' rounding would pass fp16's 65504 unhalved), values
    of ~1e-3 beside them, and queries of ~1e6 and ~1e-6 (their rows brought to fp16's range by a power of two) stay
    finite and within the GPU tolerance of the reference."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=24, bits=bits, block_size=4, value_group_size=D // 2)
    g = torch.Generator().manual_seed(bits)
    cache = SinkQuantCache(cfg, 1, 2, 2, D, dtype=torch.float32, backend="torch")
    k = torch.empty(2, 2, 40, D).uniform_(-6.5e4, 6.5e4, generator=g)
    k[..., 0], k[..., 1] = -6.5e4, 6.5e4  # every block's channels 0 and 1 span the whole range
    v = torch.randn(2, 2, 40, D, generator=g) * 1e-3
    v[:, 1] *= 1e4  # the second head's values span ~+-40
    cache.append(0, k, v)
    layer = cache.layers[0]
    q = torch.randn(2, 6, D, generator=g)
    q[0] *= 1e6
    q[1] *= 1e-6
    for row in range(2):  # a scale that gives row's scores a spread of ~2 (11-bit operands: errors ~2^-11 of it)
        scale = 2.0 / (q[row].norm(dim=-1).mean().item() * k.pow(2).mean().sqrt().item())
        ref = decode_attention_reference(q, layer, scale=scale)
        out = decode(q.to(DEVICE), layer.to(DEVICE), scale=scale, num_splits=2, variant="fp16").cpu()
        assert torch.isfinite(out).all()
        assert rel_rms(out[row], ref[row]) < max(KERNEL_TOL, FP16_TOL)


def test_decode_fp16_refuses_scales_it_cannot_hold():
    """Variant "fp16" needs scale_dtype fp16, which bounds every stored window value within fp16's range; other
    scale dtypes are refused by name, at the kernel and at construction."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=12, bits=4, block_size=4, value_group_size=D // 2,
                      scale_dtype=torch.float32)
    cache = SinkQuantCache(cfg, 1, 2, 2, D, dtype=torch.float32, backend="torch")
    cache.append(0, torch.randn(2, 2, 20, D), torch.randn(2, 2, 20, D))
    with pytest.raises(ValueError, match=r"variant='fp16' dequantizes in fp16: it needs scale_dtype=torch.float16"):
        decode(torch.randn(2, 4, D).to(DEVICE), cache.layers[0].to(DEVICE), variant="fp16")
    with pytest.raises(ValueError, match=r"decode_variant='fp16' dequantizes in fp16: it needs "
                                         r"scale_dtype=torch.float16 .*got scale_dtype=torch.float32"):
        SinkQuantCache(cfg, 1, 2, 2, D, dtype=torch.float32, backend="triton", device=DEVICE, decode_variant="fp16")


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_decode_positions_past_2_31(variant, bits):
    """Streams are unbounded: lengths past 2^31 and 2^32 (int32 positions would wrap)."""
    from qsinkkv.decode import decode_attention_torch
    cfg = CacheConfig(sink_tokens=3, recent_tokens=13, bits=bits, block_size=4, value_group_size=8, residual_tokens=2)
    layer = random_storage_layer(cfg, 3, 2, seed=bits)
    layer.seq_lens.copy_(torch.tensor([2**31 + 5, 2**32 + 78, 2**31 - 1]))
    q = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(1))
    ref = decode_attention_reference(q, layer)
    assert ref.abs().amax() > 0.1
    assert rel_rms(decode_attention_torch(q, layer), ref) < 1e-5
    out = decode_or_refused(q.to(DEVICE), layer.to(DEVICE), variant, num_splits=2)
    assert out is None or rel_rms(out.cpu(), ref) < tol(variant)


def test_decode_sink_logits_any_layout(variant):
    """Strided and expanded (stride 0) sink_logits are read as the values they show."""
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=4, block_size=4, value_group_size=4)
    layer, _ = filled_layer(cfg, [23, 11], 2, seed=5)
    q = torch.randn(2, 6, D)
    for logits in ((torch.randn(12) * 3)[::2], torch.tensor(1.5).expand(6), torch.randn(6, 2)[:, 1]):
        assert not logits.is_contiguous()
        ref = decode_attention_reference(q, layer, sink_logits=logits.contiguous())
        out = decode_or_refused(q.to(DEVICE), layer.to(DEVICE), variant, sink_logits=logits.to(DEVICE), num_splits=2)
        if out is None:
            return
        assert rel_rms(out.cpu(), ref) < tol(variant)


# --- prefill attention ----------------------------------------------------------------------------

def prefilled_layer(cfg, prior, Hkv, Dh, seed, rotary=None):
    """A batch layer whose row b already holds ``prior[b]`` tokens (one ragged chunk, torch backend)."""
    g = torch.Generator().manual_seed(seed)
    cache = SinkQuantCache(cfg, 1, len(prior), Hkv, Dh, dtype=torch.float32, backend="torch", rotary=rotary)
    if max(prior):
        cache.attend(0, *(torch.randn(len(prior), Hkv, max(prior), Dh, generator=g) for _ in range(3)), prior)
    return cache.layers[0]


ROT_SCALED = Rotary(ROT.inv_freq, attention_scaling=1.25)  # yarn's factor on cos and sin


def check_prefill(bits, S, W, bs, R, prior, T, lengths, G, logits, blocks, rope, seed):
    """The kernel against the reference in float32 and its float64 run on the same storage (every slot
    dequantized exactly); padding rows zero. rope: the cache_index contract."""
    from qsinkkv.kernels.api import prefill_attention
    from qsinkkv.prefill import prefill_attention_reference
    cfg = CacheConfig(sink_tokens=S, recent_tokens=W, bits=bits, block_size=bs, value_group_size=8,
                      residual_tokens=min(R, W), positions="cache_index" if rope else "absolute")
    Hkv, B = 2, len(prior)
    rotary = ROT_SCALED if rope else None
    layer = prefilled_layer(cfg, prior, Hkv, D, seed, rotary)
    lengths = torch.tensor(lengths)
    g = torch.Generator().manual_seed(seed + 1)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (Hkv * G, Hkv, Hkv))
    sink_logits = torch.randn(Hkv * G, generator=g) if logits else None
    ref = prefill_attention_reference(q, k, v, layer, lengths, sink_logits=sink_logits, rotary=rotary)
    ref64 = prefill_attention_reference(q.double(), k.double(), v.double(), layer, lengths, rotary=rotary,
                                        sink_logits=None if sink_logits is None else sink_logits.double())
    out = prefill_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layer.to(DEVICE), lengths, rotary=rotary,
                            sink_logits=None if sink_logits is None else sink_logits.to(DEVICE),
                            block_m=blocks[0], block_n=blocks[1]).cpu()
    pad = (torch.arange(T).view(1, 1, T, 1) >= lengths.view(B, 1, 1, 1)).expand_as(out)
    assert torch.count_nonzero(out[pad]) == 0  # padding rows are zero
    assert rel_rms(out, ref) < KERNEL_TOL
    assert rel_rms(out, ref64) < KERNEL_TOL


PREFILL_CASES = [
    # bits, S, W, bs, R, prior, T, lengths, G, logits, (block_m, block_n)
    # chunk sinks (rows holding fewer than S), tiles past the window whose window starts inside a key tile,
    # a row whose last key starts a key tile
    (4, 4, 20, 4, 0, [0, 2, 30], 90, [90, 60, 49], 3, True, (16, 16)),
    # the tile at t0 = 16 < W = 18 still sees the newest stored slots; the next one sees only the sinks
    (8, 2, 18, 4, 0, [40], 40, [40], 1, False, (16, 16)),
    # a window shorter than a key tile, odd block, residual; an idle row
    (8, 3, 7, 5, 2, [12, 0, 9], 50, [50, 0, 31], 3, True, (32, 16)),
    # no sinks: a plain sliding window
    (16, 0, 33, 4, 0, [5, 70], 64, [64, 64], 1, False, (16, 32)),
    # a window wider than a query tile and a key tile: the inner key tiles run without a mask
    (4, 2, 40, 4, 0, [0, 50], 90, [90, 77], 3, False, (16, 16)),
]


@pytest.mark.parametrize("rope", [False, True], ids=["absolute", "cache_index"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"int{c[0]}-S{c[1]}-W{c[2]}-T{c[6]}")
def test_prefill_matches_reference_and_float64(case, rope):
    check_prefill(*case, rope=rope, seed=11)


@settings(max_examples=8, deadline=None)
@given(bits=st.sampled_from([16, 8, 4]), S=st.integers(0, 5), W=st.integers(1, 40), bs=st.sampled_from([1, 4, 5]),
       R=st.integers(0, 4), prior=st.lists(st.integers(0, 60), min_size=1, max_size=3), T=st.integers(2, 90),
       cut=st.lists(st.floats(0, 1), min_size=3, max_size=3), G=st.sampled_from([1, 3]),
       logits=st.booleans(), blocks=st.sampled_from([(16, 16), (32, 16), (16, 32)]), rope=st.booleans(),
       seed=st.integers(0, 2**31))
def test_prefill_random_layouts(bits, S, W, bs, R, prior, T, cut, G, logits, blocks, rope, seed):
    """Ragged chunks (row b holds lengths[b] <= T real tokens after prior[b] stored ones; 0 = idle, but
    not every row) into random layouts, both position contracts."""
    lengths = [max(1, round(T * c)) if i == 0 else round(T * c) for i, c in zip(range(len(prior)), cut)]
    check_prefill(bits, S, W, bs, R, prior, T, lengths, G, logits, blocks, rope, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_inputs(dtype):
    """fp16 (tensor-core operands in the interpreter as on a GPU) and bf16 (widened in the interpreter)
    queries and chunks over a bf16-sink int4 layer, at the GPU tolerance."""
    from qsinkkv.kernels.api import prefill_attention
    from qsinkkv.prefill import prefill_attention_reference
    cfg = CacheConfig(sink_tokens=4, recent_tokens=28, bits=4, block_size=8, value_group_size=8)
    layer = prefilled_layer(cfg, [50, 3], 2, 32, seed=7)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, h, 70, 32, generator=g).to(dtype) for h in (6, 2, 2))
    lengths = torch.tensor([70, 41])
    ref = prefill_attention_reference(q, k, v, layer, lengths)
    out = prefill_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layer.to(DEVICE), lengths, block_m=32)
    assert out.dtype == dtype
    assert rel_rms(out.cpu(), ref) < max(KERNEL_TOL, FP16_TOL)


def test_prefill_strided_chunk_and_nonfinite_padding():
    """A value chunk laid out as HF's transpose view gives (strides unlike the keys'), NaN/Inf in the
    padding of k and v: the kernel reads neither, and the real rows equal the reference's."""
    from qsinkkv.kernels.api import prefill_attention
    from qsinkkv.prefill import prefill_attention_reference
    cfg = CacheConfig(sink_tokens=2, recent_tokens=12, bits=8, block_size=4, value_group_size=8)
    layer = prefilled_layer(cfg, [9, 30], 2, D, seed=3)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, 40, D, generator=g), torch.randn(2, 2, 40, D, generator=g)
    v = torch.randn(2, 40, 2, D, generator=g).transpose(1, 2)      # [B, T, Hkv, D] -> [B, Hkv, T, D]
    lengths = torch.tensor([40, 17])
    ref = prefill_attention_reference(q, k, v, layer, lengths)
    k[1, :, 17:], v[1, :, 17:] = float("nan"), float("inf")
    out = prefill_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layer.to(DEVICE), lengths, block_m=16,
                            block_n=16).cpu()
    assert torch.isfinite(out).all()
    assert rel_rms(out, ref) < KERNEL_TOL
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        prefill_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layer.to(DEVICE), lengths, block_m=24)
    huge = torch.zeros(2, 4, 1, D, device=DEVICE).expand(2, 4, 65535 * 16 + 1, D)  # a view: no memory
    with pytest.raises(ValueError, match="split it into chunks"):
        prefill_attention(huge, huge[:, :2], huge[:, :2], layer.to(DEVICE), lengths, block_m=16)


def test_backend_prefill_choice():
    """The Triton backend prefills through the kernel under both contracts (the rotary bound in), the torch
    backend through SDPA per tile (absolute) or the reference (cache_index)."""
    from qsinkkv.kernels.api import prefill_attention
    from qsinkkv.ops import select_ops
    assert select_ops("triton", torch.device(DEVICE), D, None).prefill.func is prefill_attention
    rope = select_ops("triton", torch.device(DEVICE), D, ROT).prefill
    assert rope.func is prefill_attention and rope.keywords["rotary"] is ROT
    assert select_ops("torch", torch.device(DEVICE), D, None).prefill.__name__ == "prefill_attention_torch"
    assert select_ops("torch", torch.device(DEVICE), D, ROT).prefill.func.__name__ == "prefill_attention_reference"


def test_decode_variant_is_an_argument():
    """``decode_variant`` is bound into the Triton decode op by ``select_ops`` (two caches in one process may
    differ), checked once with a clear error, and refused where it cannot apply."""
    assert ops_mod.DECODE_VARIANTS == decode_mod.VARIANTS
    dev = torch.device(DEVICE)
    for name in ops_mod.DECODE_VARIANTS:
        op = select_ops("triton", dev, D, None, decode_variant=name).decode
        assert op.func is decode_attention and op.keywords == {"rotary": None, "variant": name}
    assert select_ops("triton", dev, D, None).decode.keywords["variant"] == "dequantize"  # today's default
    assert select_ops("triton", dev, D, ROT, decode_variant="folded").decode.keywords["rotary"] is ROT
    with pytest.raises(ValueError, match=r"decode_variant must be one of 'dequantize', 'folded', 'fp16', "
                                         r"got 'fold'"):
        select_ops("triton", dev, D, None, decode_variant="fold")
    with pytest.raises(ValueError, match=r"decode_variant must be one of"):
        select_ops("torch", dev, D, None, decode_variant=None)
    with pytest.raises(ValueError, match=r"decode_variant='fp16' needs positions='absolute'"):
        select_ops("triton", dev, D, ROT, decode_variant="fp16")
    # a variant that cannot fold the config's value groups is refused at construction (it used to run "dequantize")
    halves = CacheConfig(sink_tokens=2, recent_tokens=10, bits=4, block_size=4, value_group_size=D // 4)
    for name in ("folded", "fp16"):
        with pytest.raises(ValueError, match=rf"decode_variant='{name}' folds each value group's scale out of a "
                                             rf"half of the head: it needs value_group_size a multiple of "
                                             rf"head_dim // 2 = {D // 2}"):
            SinkQuantCache(halves, 1, 2, 2, D, dtype=torch.float32, backend="triton", device=DEVICE,
                           decode_variant=name)
    assert select_ops("triton", dev, D, None, decode_variant="folded",
                      config=dataclasses.replace(halves, bits=16)).backend == "triton"  # no quantized block
    from qsinkkv import decode_c
    for backend in ("torch", "c") if decode_c.available()[0] else ("torch",):
        assert select_ops(backend, torch.device("cpu"), D, None, decode_variant="dequantize").backend == backend
        with pytest.raises(ValueError, match=rf"decode_variant='folded' selects a body of the Triton decode "
                                             rf"kernel; backend='{backend}' has one decode"):
            select_ops(backend, torch.device("cpu"), D, None, decode_variant="folded")
    # the cache constructors take it, and the kernel checks a direct call's
    cfg = CacheConfig(sink_tokens=2, recent_tokens=10, bits=4, block_size=4, value_group_size=D // 2)
    caches = {name: poisoned(SinkQuantCache(cfg, 1, 2, 2, D, dtype=torch.float32, backend="triton", device=DEVICE,
                                            decode_variant=name)) for name in ops_mod.DECODE_VARIANTS}
    from qsinkkv.paged import PagedCache
    pool = PagedCache(cfg, 1, 2, D, max_seqs=2, float_blocks=4, quant_blocks=8, dtype=torch.float32,
                      backend="triton", device=DEVICE, decode_variant="folded")
    assert pool.ops.decode.keywords["variant"] == "folded"
    with pytest.raises(ValueError, match="decode_variant must be one of"):
        SinkQuantCache(cfg, 1, 2, 2, D, backend="torch", decode_variant="fast")
    twin = SinkQuantCache(cfg, 1, 2, 2, D, dtype=torch.float32, backend="torch")  # the reference, on the CPU
    g = torch.Generator().manual_seed(2)
    kv = [torch.randn(2, 2, 23, D, generator=g) for _ in range(2)]
    step = [torch.randn(2, n, 1, D, generator=g) for n in (4, 2, 2)]
    twin.append(0, *kv)
    ref = twin.attend(0, *step)
    for name, cache in caches.items():
        assert cache.ops.decode.keywords["variant"] == name
        cache.append(0, *(t.to(DEVICE) for t in kv))
        assert rel_rms(cache.attend(0, *(t.to(DEVICE) for t in step)).cpu(), ref) < tol(name), name
    with pytest.raises(ValueError, match=r"variant must be one of 'dequantize', 'folded', 'fp16', got 'x'"):
        decode(step[0][:, :, 0].to(DEVICE), caches["fp16"].layers[0], variant="x")


def test_prefill_positions_past_2_31():
    """A chunk into streams longer than 2^31 and 2^32 tokens: the kernel's relative int32 positions."""
    from qsinkkv.kernels.api import prefill_attention
    from qsinkkv.prefill import prefill_attention_reference
    cfg = CacheConfig(sink_tokens=3, recent_tokens=13, bits=4, block_size=4, value_group_size=8, residual_tokens=2)
    layer = random_storage_layer(cfg, 3, 2, seed=2)
    layer.seq_lens.copy_(torch.tensor([2**31 + 5, 2**32 + 78, 2**31 - 1]))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, h, 20, D, generator=g) for h in (4, 2, 2))
    lengths = torch.tensor([20, 7, 12])
    ref = prefill_attention_reference(q, k, v, layer, lengths)
    out = prefill_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), layer.to(DEVICE), lengths, block_m=16,
                            block_n=16).cpu()
    assert rel_rms(out, ref) < KERNEL_TOL


# --- paged storage: blocks read through the tables -----------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 16])
def test_triton_kernel_reads_the_block_table(bits):
    """The decode and prefill kernels on a paged storage whose blocks are scattered (sequences admitted and
    released in between) equals the reference read through the same tables."""
    from conftest import DEVICE, KERNEL_TOL

    from qsinkkv.decode import decode_attention_reference
    from qsinkkv.kernels.api import decode_attention, prefill_attention
    from qsinkkv.prefill import prefill_attention_reference
    pool, draw = scattered_pool(bits, "triton", DEVICE)
    layer = pool.layers[0]
    q = draw(3, 1)[0][:, :, 0]
    ref = decode_attention_reference(q.cpu(), layer.to("cpu"))
    out = decode_attention(q, layer, num_splits=2).cpu()
    assert rel(out, ref) < KERNEL_TOL
    # the prefill kernel reads the same scattered blocks (through gather)
    q, k, v = draw(3, 20)
    lens = torch.tensor([20, 3, 11])
    ref = prefill_attention_reference(q.cpu(), k.cpu(), v.cpu(), layer.to("cpu"), lens)
    out = prefill_attention(q, k, v, layer, lens, block_m=16, block_n=16).cpu()
    assert rel(out, ref) < KERNEL_TOL
