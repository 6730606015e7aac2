"""Triton kernels of qsinkkv (installed as ``qsinkkv.kernels``), the fast versions of three ops.

  kernel                                  its PyTorch reference (same layout, same rounding)
  quantize.quantize_key_blocks/_values    qsinkkv.quant (codes, scales and zeros bit-identical)
  decode_attention.decode_attention       qsinkkv.decode.decode_attention_reference
  prefill_attention.prefill_attention     qsinkkv.prefill.prefill_attention_reference

Kernels read a ``qsinkkv.storage.LayerStorage`` and never the cache. On a machine without a
GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set before this module is
imported).
"""
from .decode_attention import decode_attention, decode_attention_reference
from .prefill_attention import prefill_attention, prefill_attention_reference
from .quantize import quantize_key_blocks, quantize_values

__all__ = ["decode_attention", "decode_attention_reference", "prefill_attention", "prefill_attention_reference",
           "quantize_key_blocks", "quantize_values"]
