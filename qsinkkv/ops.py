"""The op implementations a cache uses, chosen once at construction (never per call).

Every op reads a ``LayerStorage`` record; each has a PyTorch reference beside its fast versions:

  op                 reference                                   fast
  quantize blocks    qsinkkv.quant                               qsinkkv.kernels.quantize (bit-identical)
  decode attention   decode.decode_attention_reference           decode.decode_attention_torch (CPU);
                                                                 decode_c.decode_attention_c (CPU, C);
                                                                 qsinkkv.kernels.decode_attention (Triton)
  prefill attention  prefill.prefill_attention_reference         prefill.prefill_attention_torch (SDPA per tile);
                                                                 qsinkkv.kernels.prefill_attention (Triton)
  causal prefill     (the same; rows that hold and bring at most  prefill.prefill_causal_packed (SDPA, causal);
                     S + W in all: the causal mask)              integrations.vllm.cpu_prefill (vLLM's CPU kernel)
  write              write.plan + write.commit: WRITER_TORCH      decode_c.WRITER_C (CPU, C; the same bits);
                     (complete_blocks, store_rows), with the     qsinkkv.kernels.write.WRITER_TRITON (Triton;
                     chosen quantizer                             the same bits)
  engine decode step (the checks, the write and the decode that   decode_c.EngineDecode (CPU, C)
                     step.run gives a plain decode step, StepPlan.decoding)
  value checks       checks.peaks_torch (max |x| per tensor,       decode_c.peaks_c (CPU, C: on the values'
                     step.check_values' host reduction)            bits, no conversion)

Each op has one kernel per backend, chosen here once (``Ops.kernels``, ``Ops.served_by``); every kernel notes
itself as it runs (``qsinkkv.trace``), and a case it cannot serve raises by name: no kernel hands a call to another.

Imports flow one way: config/layout -> checks -> storage -> ops (quant, decode, prefill, write, the C and Triton
kernels) -> this module -> plan -> step -> cache/engine_pages -> integrations/eval (tests/test_layering.py). What
an op needs from a step (the fused engine step's plan, its refusal) is handed to it as an argument."""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from . import checks, decode_c, quant, write
from .config import CacheConfig
from .decode import decode_attention_reference, decode_attention_torch
from .prefill import prefill_attention_reference, prefill_attention_torch, prefill_causal_packed
from .rope import Rotary

BACKENDS = ("auto", "torch", "c", "triton")
# How the Triton decode kernel reads a quantized block (kernels/decode_attention.py, one helper each):
# "dequantize" (the default: per element), "folded" (value scales folded into the probabilities), "fp16"
# (dequantized in fp16 onto fp16 tensor-core dots; scale_dtype fp16 and absolute positions only). Triton only: the
# torch and c backends have one decode each and refuse the others.
DECODE_VARIANTS = ("dequantize", "folded", "fp16")


@dataclass(frozen=True)
class Ops:
    """A cache's ops, each served by one kernel for its life: ``kernels`` names it per op (``trace.OPS`` ->
    ``trace.KERNELS``), and every kernel notes itself as it runs (``trace.ran``), so a test can assert that the
    kernel it means ran. A case a kernel cannot serve raises by name; none hands a call to another kernel."""
    backend: str          # "torch", "c" or "triton"
    kernels: dict[str, str]  # op -> the kernel that serves it (served_by)
    quantizer: ModuleType  # quantize_key_blocks / quantize_values: qsinkkv.quant or qsinkkv.kernels.api
    decode: Callable      # (q [B, H, D], storage, *, scale, sink_logits) -> [B, H, D]
    prefill: Callable     # (q, k, v, storage, lengths, *, scale, sink_logits) -> [B, H, T, D]
    writer: write.Writer = write.WRITER_TORCH  # how the write's blocks and rows are written
    engine_decode: type | None = None  # (store, plan) -> a plain decode step in one piece (EngineStep), if any
    # a packed step's prefill of rows that hold and bring at most S + W tokens in all, on its tokens where they lie
    # after what the rows held (the causal mask: prefill.prefill_causal_packed's signature), if the backend has one
    prefill_causal: Callable | None = None
    # the host value checks' whole-tensor reduction, max |x| of each tensor (step.check_values' ``peaks``)
    peaks: Callable = checks.peaks_torch

    def served_by(self) -> dict[str, str]:
        """op -> kernel, e.g. ``{"decode": "c", "prefill": "torch", ...}`` (a copy)."""
        return dict(self.kernels)


def select_ops(backend: str, device: torch.device, head_dim: int, rotary: Rotary | None,
               decode_variant: str = "dequantize", *, config: CacheConfig | None = None,
               dtype: torch.dtype | None = None) -> Ops:
    """backend: "torch" (PyTorch ops), "c" (the torch backend with decode attention in C: CPU tensors,
    absolute positions, a C compiler on the machine), "triton" (CUDA tensors, or CPU tensors under
    TRITON_INTERPRET=1), or "auto" (Triton on CUDA when it is installed and head_dim % 4 == 0; on the
    CPU "c" where it applies and compiles, else torch). ``rotary`` (the ``cache_index`` contract) and
    ``decode_variant`` (one of ``DECODE_VARIANTS``, checked by ``check_decode_variant`` against ``config`` when
    given) are bound into the ops here; ``dtype``, the q/k/v dtype the cache takes, where known (the C kernels read
    float32, bfloat16 and float16: "auto" takes torch for another, "c" refuses it)."""
    backend = resolve_backend(backend, device, head_dim, rotary, dtype)
    check_decode_variant(decode_variant, backend, rotary, config, head_dim)
    if backend == "c":
        return Ops("c", dict(write_blocks="c", write_rows="c", decode="c", prefill="torch", engine_step="c",
                             prefill_causal="torch", value_checks="c"), quant,
                   decode_c.decode_attention_c, prefill_attention_torch, decode_c.WRITER_C, decode_c.EngineDecode,
                   prefill_causal_packed, decode_c.peaks_c)
    if backend == "triton":
        from .kernels import api as kernels
        # (the write's blocks quantized inside its kernel, as the C writer's: no separate quantize op)
        return Ops("triton", dict(write_blocks="triton", write_rows="triton", decode="triton", prefill="triton",
                                  value_checks="torch"),
                   kernels, functools.partial(kernels.decode_attention, rotary=rotary, variant=decode_variant),
                   functools.partial(kernels.prefill_attention, rotary=rotary), kernels.WRITER_TRITON)
    # the CPU decode's products and SDPA's prefill need keys at their final rotation; under cache_index
    # each key turns by its index
    if rotary is None:
        return Ops("torch", dict(write_blocks="torch", write_rows="torch", quantize="torch", decode="torch",
                                 prefill="torch", prefill_causal="torch", value_checks="torch"), quant,
                   decode_attention_torch, prefill_attention_torch, prefill_causal=prefill_causal_packed)
    return Ops("torch", dict(write_blocks="torch", write_rows="torch", quantize="torch", decode="reference",
                             prefill="reference", value_checks="torch"), quant,
               functools.partial(decode_attention_reference, rotary=rotary),
               functools.partial(prefill_attention_reference, rotary=rotary))


def check_decode_variant(decode_variant: str, backend: str | None = None, rotary: Rotary | None = None,
                         config: CacheConfig | None = None, head_dim: int | None = None) -> None:
    """Refuse a ``decode_variant`` that is not one of ``DECODE_VARIANTS``, that the (resolved) ``backend``
    has no such body for (torch and c: only the default), that cannot apply under the ``cache_index``
    contract (``rotary`` given: "fp16" rotates no key), or, given the ``config`` and ``head_dim``, whose blocks it
    cannot read ("folded" and "fp16" take one value scale a token and half of the head: ``value_group_size`` must be
    a multiple of ``head_dim // 2``; "fp16" dequantizes in fp16: ``scale_dtype`` fp16; bits=16 stores no quantized
    block, so every variant reads the same float blocks)."""
    if decode_variant not in DECODE_VARIANTS:
        raise ValueError(f"decode_variant must be one of {', '.join(map(repr, DECODE_VARIANTS))}, "
                         f"got {decode_variant!r}")
    if backend is not None and backend not in ("auto", "triton") and decode_variant != DECODE_VARIANTS[0]:
        raise ValueError(f"decode_variant={decode_variant!r} selects a body of the Triton decode kernel; "
                         f"backend={backend!r} has one decode: use decode_variant='dequantize' or backend='triton'")
    if rotary is not None and decode_variant == "fp16":
        raise ValueError("decode_variant='fp16' needs positions='absolute' (under 'cache_index' each key turns by "
                         "its own index in the kernel, which its fp16 body does not do): use 'folded'")
    if config is not None and decode_variant == "fp16" and config.bits != 16 and config.scale_dtype != torch.float16:
        raise ValueError(f"decode_variant='fp16' dequantizes in fp16: it needs scale_dtype=torch.float16 (which keeps "
                         f"every stored window value within fp16's range), got scale_dtype={config.scale_dtype}: use "
                         f"decode_variant='dequantize'")
    if (config is not None and head_dim is not None and decode_variant != DECODE_VARIANTS[0] and config.bits != 16
            and config.value_group_size % (head_dim // 2)):
        raise ValueError(f"decode_variant={decode_variant!r} folds each value group's scale out of a half of the head: "
                         f"it needs value_group_size a multiple of head_dim // 2 = {head_dim // 2}, got "
                         f"value_group_size={config.value_group_size}: use decode_variant='dequantize'")


def resolve_backend(backend: str, device: torch.device, head_dim: int, rotary: Rotary | None = None,
                    dtype: torch.dtype | None = None) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto', 'torch', 'c' or 'triton', got {backend!r}")
    if backend == "c" or (backend == "auto" and device.type == "cpu"):
        why = _why_not_c(device, head_dim, rotary, dtype)
        if why is None:
            return "c"
        if backend == "c":
            raise ValueError(f"backend='c' {why}")
        return "torch"
    try:
        import triton  # noqa: F401
        has_triton = True
    except ImportError:
        has_triton = False
    if backend == "auto":
        return "triton" if device.type == "cuda" and has_triton and head_dim % 4 == 0 else "torch"
    if backend == "triton":
        if not has_triton:
            raise ValueError("backend='triton' needs the triton package: pip install 'qsinkkv[triton]'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' needs CUDA tensors (device={device}), or TRITON_INTERPRET=1 "
                             "set before import to run the kernels in Triton's interpreter")
        if head_dim % 4:
            raise ValueError(f"backend='triton' needs head_dim % 4 == 0, got head_dim={head_dim}")
    return backend


def _why_not_c(device: torch.device, head_dim: int, rotary: Rotary | None, dtype: torch.dtype | None) -> str | None:
    """Why the C kernels cannot serve this cache, or None."""
    if device.type != "cpu":
        return f"needs CPU tensors, got device={device}"
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"reads float32, bfloat16 or float16 tensors, got dtype={dtype}"
    if rotary is not None:
        return "decodes absolute positions; positions='cache_index' decodes with backend='torch'"
    if head_dim > decode_c.MAX_HEAD_DIM:
        return f"needs head_dim <= {decode_c.MAX_HEAD_DIM}, got head_dim={head_dim}"
    ok, why = decode_c.available()
    return None if ok else f"could not build its C library ({why})"
