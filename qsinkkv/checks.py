"""Input checks: pure functions the cache calls once per call, before anything changes. Each turns what a
caller passed into host values or raises an error naming the argument and what it must be.

Shapes, dtypes, devices and counts first (``chunk``, ``packed``, ``per_sequence``, ``batch_index``,
``layer_index``); then the values' primitives (``storable``, ``peaks_fit``, ``packed_tokens_fit``, the bounds):
nothing NaN/Inf, or that becomes so once cast to the dtype it is stored in, reaches a block (it would poison the
block's scales); ``step.check_values`` runs them over a step's row groups, with one device sync per call. A leaf:
it imports the config, the layout and the trace only (tests/test_layering.py)."""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from . import trace
from .config import CacheConfig
from .layout import token_positions


@dataclass(frozen=True)
class Holds:
    """What a cache holds, as the checks read it: ``batch`` sequences of ``kv_heads`` x ``head_dim`` in
    ``dtype`` on ``device``."""
    batch: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


def host_ints(name: str, value, expected: str) -> Tensor:
    """``value`` (an int tensor on any real device, a list or tuple of ints) as a 1-D or scalar int64
    tensor on the host. Refuses None, strings, floats, bools, complex numbers and meta tensors (which
    hold no values) with a ``ValueError`` naming ``name`` and ``expected``."""
    if isinstance(value, Tensor):
        if value.device.type == "meta":
            raise ValueError(f"{name} must be {expected}, got a meta tensor (it holds no values)")
        t = value
    elif isinstance(value, (list, tuple)) and all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                                                  for x in value):
        t = torch.tensor(list(value), dtype=torch.int64)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        t = torch.tensor(int(value), dtype=torch.int64)
    else:
        raise ValueError(f"{name} must be {expected}, got {type(value).__name__} {value!r:.80}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be {expected}, got {t.dtype} of shape {tuple(t.shape)}")
    return t.detach().to("cpu", torch.int64)


def layer_index(layer, num_layers: int) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise IndexError(f"layer must be an int in [0, {num_layers}), got {layer!r}")


def tensor(name: str, x, shape: str, holds: Holds, ndim: int = 4) -> None:
    """``x`` a tensor of ``ndim`` dims in the cache's dtype on its device (``shape`` says the rest)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims {shape}, got shape {tuple(x.shape)}")
    if x.dtype != holds.dtype:
        raise ValueError(f"{name}.dtype must be the cache dtype {holds.dtype}, got {x.dtype}")
    if x.device != holds.device:
        raise ValueError(f"{name}.device must be the cache device {holds.device}, got {x.device}")


def chunk(holds: Holds, k, v, lengths, q=None, scale=None, sink_logits=None) -> list[int]:
    """A padded chunk ``k, v [B, Hkv, T, D]`` (and ``q [B, H, T, D]`` for ``attend``): its new tokens per row."""
    B, Hkv, D = holds.batch, holds.kv_heads, holds.head_dim
    if not B:
        raise ValueError("the cache holds no sequence: admit() one first")
    shape = f"[B={B}, Hkv={Hkv}, T, D={D}]"
    for name, x in (("k", k), ("v", v)):
        tensor(name, x, shape, holds)
        if x.shape[0] != B or x.shape[1] != Hkv or x.shape[3] != D or x.shape[2] < 1:
            raise ValueError(f"{name} must have shape {shape} with T >= 1, got {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    T = k.shape[2]
    lens = [T] * B if lengths is None else _lengths(lengths, B, T)
    if q is not None:
        shape = f"[B={B}, H, T={T}, D={D}] with H a positive multiple of Hkv={Hkv}"
        tensor("q", q, shape, holds)
        if q.shape[0] != B or q.shape[2] != T or q.shape[3] != D or q.shape[1] % Hkv or q.shape[1] == 0:
            raise ValueError(f"q must have shape {shape}, got {tuple(q.shape)}")
        _scale_and_sinks(q.shape[1], scale, sink_logits, holds.device)
    return lens


def packed(holds: Holds, q, k, v, query_start_loc, scale=None, sink_logits=None) -> tuple[Tensor, list[int]]:
    """Packed tokens ``q [N, H, D]``, ``k, v [N, Hkv, D]`` and their offsets: ``query_start_loc`` on the host
    and the new tokens per row."""
    B, Hkv, D = holds.batch, holds.kv_heads, holds.head_dim
    if not B:
        raise ValueError("the cache holds no sequence: admit() one first")
    expected = f"a 1-D int tensor of B + 1 = {B + 1} offsets from 0 to N, non-decreasing"
    qsl = host_ints("query_start_loc", query_start_loc, expected)
    for name, x, heads in (("q", q, f"H (a positive multiple of Hkv={Hkv})"), ("k", k, f"Hkv={Hkv}"),
                           ("v", v, f"Hkv={Hkv}")):
        shape = f"[N, {heads}, D={D}]"
        if not isinstance(x, Tensor) or x.ndim != 3:
            raise ValueError(f"{name} must be a packed {shape} tensor, got "
                             f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        tensor(name, x, shape, holds, ndim=3)
        if x.shape[2] != D or (x.shape[1] != Hkv if name != "q" else x.shape[1] % Hkv or not x.shape[1]):
            raise ValueError(f"{name} must be a packed {shape} tensor, got {tuple(x.shape)}")
    N = q.shape[0]
    if (qsl.shape != (B + 1,) or int(qsl[0]) != 0
            or int(qsl[-1]) != N or bool((qsl.diff() < 0).any()) or k.shape[0] != N or v.shape[0] != N):
        raise ValueError(f"query_start_loc must be {expected} (N = {N} rows of q, k and v), got "
                         f"{qsl.tolist() if qsl.ndim == 1 else qsl}")
    _scale_and_sinks(q.shape[1], scale, sink_logits, holds.device)
    return qsl, qsl.diff().tolist()


def per_sequence(name: str, value, batch: int) -> list[int]:
    """An int for every sequence, or ``[B]`` ints."""
    expected = f"an int or {batch} ints (one per sequence)"
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * batch
    t = host_ints(name, value, expected)
    if t.shape != (batch,):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return t.tolist()


def batch_index(index, batch: int, device: torch.device, allow_repeats: bool = True) -> Tensor:
    """Rows ``[0, batch)`` as a 1-D int64 tensor on ``device``, from a list or int tensor of rows or a bool mask."""
    expected = f"a non-empty 1-D int tensor of rows in [0, {batch}) or a bool mask of length {batch}"
    try:
        index = torch.as_tensor(index, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"index must be {expected}, got {index!r}") from None
    if index.numel() == 0:  # (an empty list is read as float32)
        raise ValueError(f"index selects no sequence; it must be {expected}")
    if index.dtype == torch.bool:
        if index.shape != (batch,):
            raise ValueError(f"a bool index must be a mask of length {batch}, got shape {tuple(index.shape)}")
        index = index.nonzero().flatten()
    elif index.is_floating_point() or index.is_complex() or index.ndim != 1:
        raise ValueError(f"index must be {expected}, got {index.dtype} of shape {tuple(index.shape)}")
    if index.numel() == 0:
        raise ValueError(f"the mask selects no sequence; index must be {expected}")
    index = index.long()
    if bool(((index < 0) | (index >= batch)).any()) or (not allow_repeats and len(set(index.tolist())) < len(index)):
        raise ValueError(f"index must be {expected}, got rows {index.tolist()}")
    return index


def _lengths(lengths, batch: int, T: int) -> list[int]:
    expected = f"a 1-D int tensor (or list) of B={batch} counts in [0, T={T}]"
    t = host_ints("lengths", lengths, expected)
    if t.shape != (batch,):
        raise ValueError(f"lengths must be {expected}, got shape {tuple(t.shape)}")
    lens = t.tolist()
    if min(lens) < 0 or max(lens) > T:
        raise ValueError(f"lengths must be {expected}, got {lens}")
    return lens


def _scale_and_sinks(H: int, scale, sink_logits, device: torch.device) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a finite float > 0 (or None for D ** -0.5), got {scale!r}")
    if sink_logits is not None:
        if not isinstance(sink_logits, Tensor) or sink_logits.shape != (H,) or not sink_logits.is_floating_point():
            raise ValueError(f"sink_logits must be a float tensor of shape [H={H}], got "
                             f"{getattr(sink_logits, 'dtype', type(sink_logits).__name__)} "
                             f"{tuple(getattr(sink_logits, 'shape', ()))}")
        if sink_logits.device != device:
            raise ValueError(f"sink_logits.device must be the cache device {device}, got {sink_logits.device}")


# --- tables: an op reads and writes only inside its pools ------------------------------------------------------------

def table(name: str, table: Tensor, blocks: int, pool: str, none_ok: bool = True) -> None:
    """Every entry of ``table`` (an int tensor on the host or the CPU: one min/max) names one of the ``blocks``
    blocks of ``pool``, or is -1 (no block; only where ``none_ok``). A table is input: an entry past the pool would
    have an op read or write outside it."""
    table_dtype(name, table)
    if not table.numel():
        return
    least = -1 if none_ok else 0
    if table.device.type == "cpu" and table.numel() <= 64:  # (a decode step's few entries: Python's min/max)
        host = table.flatten().tolist()
        lo, hi = min(host), max(host)
    elif table.device.type == "cpu":  # numpy's min/max: a third of aminmax's cost on a step's small tables
        host = table.detach().numpy()
        lo, hi = int(host.min()), int(host.max())
    else:
        lo, hi = (int(x) for x in torch.aminmax(table))
    if lo < least or hi >= blocks:
        bad = sorted(set(table[(table < least) | (table >= blocks)].tolist()))[:8]
        raise ValueError(f"{name} must name blocks of {pool} in [0, {blocks})" + (" (or -1: none)" if none_ok else "")
                         + f"; got {bad}")


def table_dtype(name: str, table: Tensor) -> None:
    if table.dtype not in (torch.int64, torch.int32):  # (a float entry of 0.7 would be read as block 0)
        raise ValueError(f"{name} must be an int64 (or int32) tensor of block indices, got {table.dtype}")


def table_in_step(name: str, entries: Tensor, blocks: int, pool: str, none_ok: bool = True) -> None:
    """``table``'s check of ``entries`` without a host read, for a table an engine's step gathers on its device: one
    reduction and ``torch._assert_async``. On the CPU it is ``table`` (the error names the entries); on a GPU it is
    a device-side assert, raised at the next sync: the step stops the engine instead of
    touching a page outside the pool (its message is generic there; the condition is this one)."""
    table_dtype(name, entries)
    if not entries.numel():
        return
    if entries.device.type == "cpu":  # (no device to spare a read: table's numpy min/max, a few microseconds)
        return table(name, entries, blocks, pool, none_ok)
    fits = ((entries >= (-1 if none_ok else 0)) & (entries < blocks)).all()
    try:
        torch._assert_async(fits, f"qsinkkv: {name} names a block outside {pool} [0, {blocks})")
    except RuntimeError:  # (a device whose assert is synchronous)
        table(name, entries, blocks, pool, none_ok)
        raise


def condition_in_step(holds: Tensor, error) -> None:
    """``holds`` (a bool tensor on the step's device) must be true: ``torch._assert_async`` (no host read: on a GPU a
    device-side assert, which stops the engine at the next sync); on the CPU ``error()`` (a callable: the error is
    built only when raised) is raised at once."""
    try:
        torch._assert_async(holds, "qsinkkv: an engine step's condition failed")
    except RuntimeError:
        raise error() from None


# --- values: nothing that is NaN/Inf, or becomes so once stored, reaches a block -----------------------

def raise_refused(ok: dict[str, bool], config: CacheConfig, rows=None, kv: dict | None = None) -> None:
    """Raise for the first value check that failed (``ok``: check name -> passed); for k or v, ``rows(x)`` says
    which rows' tokens of ``kv[name]`` were refused."""
    bad = next((name for name, passed in ok.items() if not passed), None)
    if bad in ("k", "v"):
        limit = "" if config.bits == 16 else (
            f", or |x| >= {window_bound(config, torch.float64):.6g} in the window (its block's zero or scale "
            f"would overflow scale_dtype={config.scale_dtype}, or its max - min would overflow float32)")
        which = "" if rows is None else "; refused: rows {} ({} tokens, max |x| {:.4g})".format(*rows(kv[bad]))
        raise ValueError(f"{bad} contains NaN or Inf, or values that overflow the storage dtype "
                         f"(sink_dtype={config.sink_dtype}, window_dtype={config.window_dtype}){limit}; "
                         f"refusing to store it (it would poison a whole block's scales){which}")
    if bad == "q":
        raise ValueError("q contains NaN or Inf")
    if bad == "sink_logits":
        raise ValueError(SINK_LOGITS_REFUSED)


SINK_LOGITS_REFUSED = "sink_logits must be free of NaN and +inf (-inf means no sink for that head)"


def sink_logits_fit(logits) -> bool:
    """No NaN and no +inf in the host array (numpy) ``logits``, float32 (the ops' dtype): -inf is a head with no
    sink."""
    return not (logits != logits).any() and not (logits == math.inf).any()


def sink_logits_ok(sink_logits: Tensor) -> Tensor:
    """A bool tensor (no host read): ``sink_logits`` free of NaN and +inf once in float32, the dtype every op
    computes them in (a float64 logit of 1e300 is finite, in float32 it is inf); -inf is a head with no sink. (amax
    of a tensor holding a NaN is NaN, which fails the comparison.)"""
    return torch.amax(sink_logits.float()) < math.inf


def peaks_fit(k: Tensor, v: Tensor, q: Tensor | None, sink_logits: Tensor | None,
              config: CacheConfig, bound: float | None = None,
              peaks: Callable[[list[Tensor]], list[float]] | None = None) -> dict[str, bool]:
    """Every token of ``k, v`` goes to the window: one reduction per tensor and one sync (one reduction over
    all of them when they share one bound: a small step's cost is its ops). |x| below ``window_bound`` means
    finite once stored and quantizable in any block (NaN fails every comparison). ``bound``: a tighter one to hold
    k and v to instead (``packed_tokens_fit``'s first try). ``peaks``: the reduction (``values``'). Returns check
    name -> passed."""
    peaks = peaks or peaks_torch
    bound = window_bound(config, k.dtype) if bound is None else bound
    named = {"k": (k, bound), "v": (v, bound)}
    if q is not None:
        named["q"] = (q, math.inf)
    # max |x| is one of x's own values: exact in x's dtype (q, k, v share the cache dtype)
    ok = None
    qkv = None if q is None else _one_buffer(q, k, v)
    if qkv is not None and peaks([qkv])[0] < bound:  # (q's own limit, inf, is above every bound)
        ok = dict.fromkeys(named, True)
    if ok is None and bound == math.inf:
        whole = torch.cat([x.reshape(-1) for x, _ in named.values()])
        if peaks([whole])[0] < math.inf:
            ok = dict.fromkeys(named, True)
    if ok is None:  # (or one of them is not finite: which)
        tops = peaks([x for x, _ in named.values()])
        ok = {name: p < limit for (name, (_, limit)), p in zip(named.items(), tops)}
    if sink_logits is not None:
        ok["sink_logits"] = bool(sink_logits_ok(sink_logits))
    return ok


def _one_buffer(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """``q [N, H, D]``, ``k, v [N, Hkv, D]`` as an engine hands them, column slices of one row of its fused qkv
    projection (q, then k, then v, each row's D contiguous): the ``[N, (H + 2 Hkv) D]`` view of the three, so one
    contiguous reduction reads them all (a reduction over each strided slice is slower); else None."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or not (q.dtype == k.dtype == v.dtype):
        return None
    N, D, size = q.shape[0], q.shape[2], q.element_size()
    rows = q.stride(0)
    if (k.shape[0] != N or v.shape[0] != N or k.shape[2] != D or v.shape[2] != D
            or q.stride()[1:] != (D, 1) or k.stride() != (rows, D, 1) or v.stride() != (rows, D, 1)
            or k.data_ptr() != q.data_ptr() + q.shape[1] * D * size
            or v.data_ptr() != k.data_ptr() + k.shape[1] * D * size
            or not (q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
                    == v.untyped_storage().data_ptr())):
        return None
    return q.as_strided((N, (q.shape[1] + k.shape[1] + v.shape[1]) * D), (rows, 1))


def packed_tokens_fit(config: CacheConfig, seq_lens: Tensor, lens: list[int], k: Tensor, v: Tensor,
                      q: Tensor | None, sink_logits: Tensor | None,
                      peaks: Callable[[list[Tensor]], list[float]] | None = None) -> dict[str, bool]:
    """The value checks of a packed step: ``k, v [N, Hkv, D]``, ``q [N, H, D]``, row b's ``lens[b]`` tokens next
    (``seq_lens [B]`` host: tokens each row held before). Past every row's sinks, ``peaks_fit``; else each
    token's max |x| (one reduction per tensor, over the packed tokens where they lie: no padding, no gather)
    against the bound of the dtype it is stored in (a row's first ``sink_tokens`` in ``sink_dtype``). One sync.
    ``peaks``: the whole-tensor reduction (``values``'). Returns check name -> passed."""
    S = config.sink_tokens
    busy = [n for n, t in zip(seq_lens.tolist(), lens) if t]
    if not k.shape[0] or min(busy) >= S:
        return peaks_fit(k, v, q, sink_logits, config, peaks=peaks) if k.numel() else {}
    # a prompt's step: one reduction per tensor first -- below both bounds, every token fits wherever it goes
    both = min(overflow_bound(config.sink_dtype, k.dtype), window_bound(config, k.dtype))
    ok = peaks_fit(k, v, q, sink_logits, config, bound=both, peaks=peaks)
    if all(ok.values()):
        return ok
    to_sinks = (token_positions(seq_lens, torch.tensor(lens)) < S).to(k.device)             # [N]
    named = {}
    for name, x in (("k", k), ("v", v)):
        top = peak(x.flatten(1), dim=1).double()                                        # [N]
        bound = torch.where(to_sinks, overflow_bound(config.sink_dtype, x.dtype),
                            window_bound(config, x.dtype))
        named[name] = (top < bound).all()
    if q is not None:
        named["q"] = peak(q) < math.inf
    if sink_logits is not None:
        named["sink_logits"] = sink_logits_ok(sink_logits)
    return dict(zip(named, torch.stack(list(named.values())).tolist()))


def peaks_torch(tensors: list[Tensor]) -> list[float]:
    """max |x| of each tensor (``peak``), exact, NaN where any value is NaN, read back in one sync: the value
    checks' whole-tensor reduction (the reference; ``decode_c.peaks_c`` is its C version, ``Ops.peaks``)."""
    trace.ran("value_checks", "torch")
    return torch.stack([peak(x) if x.numel() else x.new_zeros(()) for x in tensors]).tolist()


def peak(x: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """max |x| (over ``dim``, or all of x) in x's dtype: exact, NaN where any is NaN (PyTorch's max and aminmax
    propagate it). Over all of x, ``max(-min, max)`` from one ``aminmax`` pass (no |x| temporary); over ``dim``,
    ``abs().amax(dim)`` (the faster of the exact ones over a dim: ``aminmax`` and ``linalg.vector_norm(x, inf)`` are
    slower)."""
    if dim is None:
        lo, hi = torch.aminmax(x)
        return torch.maximum(-lo, hi)
    return x.abs().amax(dim)


def storable(x: Tensor, pos: Tensor, real: Tensor | None, config: CacheConfig) -> Tensor:
    """0-dim bool: the tokens of ``x [B, heads, T, D]`` that will be stored stay finite once cast to the dtype
    they are stored in (and, in a quantized window, below ``window_bound``). ``pos [B, T]`` (host) is each
    token's position in its sequence (the first ``sink_tokens`` go to the sinks in ``sink_dtype``, later ones to
    the window in ``window_dtype``); ``real [B, T]`` (host, or None: all) the tokens that are stored at all."""
    if real is None and int(pos.min()) >= config.sink_tokens:  # the common case: every token to the window
        return all_below(x, window_bound(config, x.dtype))
    stored = torch.ones_like(pos, dtype=torch.bool) if real is None else real
    ok = []
    for where, bound in ((stored & (pos < config.sink_tokens), overflow_bound(config.sink_dtype, x.dtype)),
                         (stored & (pos >= config.sink_tokens), window_bound(config, x.dtype))):
        if bool(where.any()):
            ok.append(all_below(x, bound, where))
    return torch.stack(ok).all() if ok else torch.ones((), dtype=torch.bool, device=x.device)


def all_below(x: Tensor, bound: float, where: Tensor | None = None) -> Tensor:
    """0-dim bool: ``x [B, heads, T, D]`` below ``bound`` in magnitude (only at the ``[B, T]`` positions ``where``,
    if given; NaN is not below anything)."""
    if where is None:
        return peak(x) < bound
    below = peak(x, dim=(1, 3)) < bound                                 # [B, T] (NaN: False)
    return ~(~below & where.to(x.device)).any()


def all_finite(x: Tensor, where: Tensor | None = None) -> Tensor:
    """0-dim bool: ``x [B, heads, T, D]`` finite (only at the ``[B, T]`` positions ``where``, if given)."""
    return all_below(x, math.inf, where)


def overflow_bound(dtype: torch.dtype, source: torch.dtype) -> float:
    """|x| of a ``source`` value at or above this is inf once cast to ``dtype``: its max plus half an
    ulp (round to nearest even: the max has an odd mantissa, so the halfway point rounds up)."""
    if not narrower(dtype, source):
        return math.inf
    fi = torch.finfo(dtype)
    return fi.max + fi.eps * 2.0 ** math.floor(math.log2(fi.max)) / 2


@functools.lru_cache(maxsize=64)  # (a pure function of its arguments, asked at every step of every layer)
def window_bound(config: CacheConfig, source: torch.dtype) -> float:
    """|x| of a ``source`` value at or above this is refused for the window, when it arrives: it would be inf once
    cast to ``window_dtype``, or (bits 8/4) its block's quantization would overflow whatever the block's other
    tokens. A block's zero is its min and its scale (max - min) / (2^bits - 1) <= 2 max|x| / 15 < max|x|, both
    computed in float32 from the stored values: every stored |x| below ``scale_dtype``'s bound keeps both finite
    once stored, and every |x| <= float32's max / 2 keeps ``max - min`` itself finite in float32 (a block of 3e38
    and -3e38 would overflow there first, whatever ``scale_dtype``). So a token is refused as it arrives, naming it,
    never a block later for the whole batch."""
    bound = overflow_bound(config.window_dtype, source)
    if config.bits != 16:
        stats = min(overflow_bound(config.scale_dtype, torch.float32), torch.finfo(torch.float32).max / 2)
        bound = min(bound, rounds_below(config.window_dtype, stats))
    return bound


def rounds_below(dtype: torch.dtype, limit: float) -> float:
    """A bound for ``|x| < bound`` that accepts exactly the values of float32 (or narrower) at most the largest
    ``dtype`` value below ``limit`` (so stored below ``limit``): that value's float32 successor, one bound that the
    C code's float32 comparison reads the same. (A value just above it that would still round down is refused.)"""
    if limit > torch.finfo(dtype).max:  # every finite value of dtype
        return math.inf
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty(0, dtype=dtype).element_size()]
    m = torch.tensor(limit, dtype=torch.float64).to(dtype)
    while float(m) >= limit:  # the largest value of dtype below limit
        m = (m.view(ints) - 1).view(dtype)
    return float((m.float().view(torch.int32) + 1).view(torch.float32))


def narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Can a finite ``than`` value overflow to inf in ``dtype``?"""
    return torch.finfo(dtype).max < torch.finfo(than).max
