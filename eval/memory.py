"""``qsinkkv-eval stream --memory-of``: each scheme at the largest capacity its real cache fits in a
memory budget.

    budgets = parse_memory_of("bf16:128,256")     # argparse type: ArgumentTypeError naming the flag
    fit = largest_fit(budget_bytes, scheme, sink_tokens, geometry)  # -> Fit (capacity, bytes, ...)

A budget ``DTYPE:N`` is the bytes of a ``DTYPE`` cache of N tokens: the K and V of N tokens in that
dtype, all layers (read off a tensor of that shape, as a plain transformers ``DynamicLayer``
holds them; a trained window layer's ``DynamicSlidingWindowLayer`` at most its window). On such a model every
configuration's window layers hold their whole window whatever the capacity (``footprint.py``), so
the budget left for the full-attention layers is what the window layers leave.

Each scheme is sized by the bytes its real cache **allocates**, read from the storage's own
allocation on the meta device (no memory is touched, so the search is exact and costs microseconds per capacity tried):

* qsinkkv (``sinks + int8`` / ``int4``): the dense ``LayerStorage`` a ``SinkQuantCache`` of batch 1
  allocates per layer (``LayerStorage.allocate``: the sink page, the quantized ring and the bf16
  float ring of whole blocks, the filling block included), times the layers. Its recent tokens
  step in whole blocks (``block_size``): within one block count the bytes do not change, so the
  largest recent window of n quantized blocks is n blocks.
* bf16 windows (``window, no sinks`` / ``sinks + bf16 window``): a bf16 K/V tensor of exactly the
  capacity per layer (``footprint.bf16``: transformers' ``DynamicLayer``), which steps in tokens.

``Fit.next_bytes`` is what one more step (block or token) would allocate: more than the budget.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import torch

from . import footprint
from .schemes import Scheme, cache_config

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
CANONICAL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
FLAG = "--memory-of"
HELP = ("memory budgets as DTYPE:N[,N...]: the bytes of a DTYPE cache of N tokens (K and V, all layers), "
        f"DTYPE one of {', '.join(sorted(set(DTYPES)))}; e.g. bf16:256, or bf16:128,256,512,1024 for the "
        "memory curve. Each scheme runs at the largest capacity whose allocated bytes fit the budget")


@dataclass(frozen=True)
class Budget:
    dtype: str   # bf16, fp16 or fp32
    tokens: int  # N

    @property
    def text(self) -> str:
        return f"{self.dtype}:{self.tokens}"

    def nbytes(self, geo: footprint.Geometry) -> int:
        """K and V of ``tokens`` tokens in ``dtype``, all layers, as transformers' own cache holds them (meta
        tensors: a ``DynamicLayer`` per full-attention layer, a ``DynamicSlidingWindowLayer`` per window layer)."""
        return sum(sub.num_layers * footprint.stock_layer_bytes(sub, self.tokens, DTYPES[self.dtype],
                                                                geo.window if kind == footprint.SLIDING else None)
                   for kind, sub in geo.split())


def parse_memory_of(text: str) -> list[Budget]:
    """``DTYPE:N[,N...]`` -> budgets, ascending, each once. argparse ``type``: a bad value raises
    ``ArgumentTypeError`` (argparse prints it after ``argument --memory-of:`` and exits 2)."""
    expected = "expected DTYPE:N[,N...] (e.g. bf16:256 or bf16:128,256,512)"
    dtype, colon, sizes = text.strip().partition(":")
    dtype = dtype.strip().lower()
    if not colon or not dtype or not sizes.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: {expected}")
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown dtype {dtype!r}; known: "
                                         f"{', '.join(sorted(set(DTYPES)))}")
    out = []
    for item in sizes.split(","):
        item = item.strip()
        if not re.fullmatch(r"[+-]?\d+", item):
            raise argparse.ArgumentTypeError(f"{text!r}: {item!r} is not a whole number of tokens; {expected}")
        n = int(item)
        if n < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a budget must be >= 1 token, got {n}")
        out.append(n)
    return [Budget(CANONICAL.get(dtype, dtype), n) for n in sorted(set(out))]


def text_of(budgets: list[Budget]) -> str:
    """``bf16:128,256`` (the dtype once)."""
    return f"{budgets[0].dtype}:{','.join(str(b.tokens) for b in budgets)}"


@dataclass(frozen=True)
class Fit:
    capacity: int     # S + W
    sink_tokens: int
    recent_tokens: int
    bytes: int        # what the cache allocates at this capacity (all layers)
    next_bytes: int   # what it would allocate one step (block or token) further: over the budget
    step: int         # tokens per step of the recent window


def _sizer(scheme: Scheme, sink_tokens: int, geo: footprint.Geometry):
    """(step, bytes of the cache holding ``S + n * step`` tokens) for ``scheme``."""
    if scheme.family == "bf16":
        return 1, lambda n: footprint.bf16(geo, sink_tokens + n, device="meta").total
    probe = cache_config(scheme, sink_tokens, sink_tokens + 1)
    if probe is None or probe.residual_tokens:
        raise ValueError(f"{scheme.name}: --memory-of sizes bf16 windows and qsinkkv caches without a residual")
    bs = probe.block_size
    return bs, lambda n: footprint.allocated(cache_config(scheme, sink_tokens, sink_tokens + n * bs), geo)


def largest_fit(budget_bytes: int, scheme: Scheme, sink_tokens: int, geo: footprint.Geometry,
                name: str | None = None, budget_text: str = "") -> Fit:
    """The largest capacity ``S + n * step`` (n >= 1) whose allocated bytes are <= ``budget_bytes``;
    a ValueError naming ``--memory-of`` when even one step does not fit. Bytes grow with n, so an
    exponential then a binary search finds it exactly."""
    step, size = _sizer(scheme, sink_tokens, geo)
    if size(1) > budget_bytes:
        what = f"{sink_tokens} sinks + {step} recent token{'s' if step > 1 else ''}"
        raise ValueError(f"{FLAG} {budget_text}: {budget_bytes:,} bytes is less than the smallest cache of "
                         f"'{name or scheme.name}' ({what}: {size(1):,} bytes); raise the budget")
    lo, hi = 1, 2  # size(lo) fits; find hi that does not
    while size(hi) <= budget_bytes:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget_bytes else (lo, mid)
    return Fit(sink_tokens + lo * step, sink_tokens, lo * step, size(lo), size(lo + 1), step)
