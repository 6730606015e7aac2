"""Triton kernels of qsinkkv (installed as ``qsinkkv.kernels``).

Each kernel sits beside its launch wrapper; its PyTorch reference is the matching
function of ``qsinkkv.quant`` / ``qsinkkv.attention`` (same layout, same rounding).
On a machine without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``,
set before this module is imported).
"""
from .decode_attention import decode_attention, decode_attention_reference
from .quantize import quantize_key_blocks, quantize_values

__all__ = ["decode_attention", "decode_attention_reference", "quantize_key_blocks", "quantize_values"]
