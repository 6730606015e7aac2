"""Input checks shared by the caches: pure functions that turn what a caller passed into host values,
or raise an error naming the argument and what it must be (nothing is changed before they pass)."""
from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .config import CacheConfig


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


# --- values: nothing that is NaN/Inf, or becomes so once stored, reaches a block -----------------------

def peaks_fit(k: Tensor, v: Tensor, q: Tensor | None, sink_logits: Tensor | None,
              window_dtype: torch.dtype) -> dict[str, bool]:
    """Every token of ``k, v`` goes to the window: one reduction per tensor and one sync. |x| below the
    window dtype's overflow bound means finite once stored (NaN fails every comparison).
    Returns check name -> passed."""
    bound = overflow_bound(window_dtype, k.dtype)
    named = {"k": (k, bound), "v": (v, bound)}
    if q is not None:
        named["q"] = (q, math.inf)
    # max |x| is one of x's own values: exact in x's dtype (q, k, v share the cache dtype)
    peaks = torch.stack([torch.linalg.vector_norm(x, float("inf")) for x, _ in named.values()]).tolist()
    ok = {name: p < limit for (name, (_, limit)), p in zip(named.items(), peaks)}
    if sink_logits is not None:  # -inf is allowed, NaN and +inf are not
        ok["sink_logits"] = torch.amax(sink_logits).item() < math.inf
    return ok


def storable(x: Tensor, pos: Tensor, real: Tensor | None, config: CacheConfig) -> Tensor:
    """0-dim bool: the tokens of ``x [B, heads, T, D]`` that will be stored stay finite once cast to the dtype
    they are stored in. ``pos [B, T]`` (host) is each token's position in its sequence (the first
    ``sink_tokens`` go to the sinks in ``sink_dtype``, later ones to the window in ``window_dtype``);
    ``real [B, T]`` (host, or None: all) the tokens that are stored at all."""
    if real is None and int(pos.min()) >= config.sink_tokens:  # the common case: every token to the window
        return all_finite(_cast(x, config.window_dtype))
    stored = torch.ones_like(pos, dtype=torch.bool) if real is None else real
    ok = []
    for where, dtype in ((stored & (pos < config.sink_tokens), config.sink_dtype),
                         (stored & (pos >= config.sink_tokens), config.window_dtype)):
        if bool(where.any()):
            ok.append(all_finite(_cast(x, dtype), where))
    return torch.stack(ok).all() if ok else torch.ones((), dtype=torch.bool, device=x.device)


def all_finite(x: Tensor, where: Tensor | None = None) -> Tensor:
    """0-dim bool: ``x [B, heads, T, D]`` finite (only at the ``[B, T]`` positions ``where``, if given)."""
    if where is None:
        return torch.isfinite(x).all()
    bad = ~torch.isfinite(x).all(dim=-1).all(dim=1)                     # [B, T]
    return ~(bad & where.to(x.device)).any()


def overflow_bound(dtype: torch.dtype, source: torch.dtype) -> float:
    """|x| of a ``source`` value at or above this is inf once cast to ``dtype``: its max plus half an
    ulp (round to nearest even: the max has an odd mantissa, so the halfway point rounds up)."""
    if not narrower(dtype, source):
        return math.inf
    fi = torch.finfo(dtype)
    return fi.max + fi.eps * 2.0 ** math.floor(math.log2(fi.max)) / 2


def narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """Can a finite ``than`` value overflow to inf in ``dtype``?"""
    return torch.finfo(dtype).max < torch.finfo(than).max


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.to(dtype) if narrower(dtype, x.dtype) else x
