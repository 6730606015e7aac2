"""Triton kernels of qsinkkv (the folder ``kernels/``, installed as ``qsinkkv.kernels``), the fast versions of four
ops; this module gathers their entry points (``qsinkkv.ops`` takes it as the Triton backend's quantizer).

  kernel                                  its PyTorch reference (same layout, same rounding)
  quantize.quantize_key_blocks/_values    qsinkkv.quant (codes, scales and zeros bit-identical)
  decode_attention.decode_attention       qsinkkv.decode.decode_attention_reference
  prefill_attention.prefill_attention     qsinkkv.prefill.prefill_attention_reference
  write.complete_blocks / store_rows      qsinkkv.write.complete_blocks / store_rows (the same bits): WRITER_TRITON

Kernels read a ``qsinkkv.storage.LayerStorage`` and never the cache. On a machine without a
GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``, set before the kernels are
imported).

``kernels/`` has no ``__init__.py`` on purpose: a namespace package (PEP 420), so that a Python started in the
repo root, whose first path entry is the root, still imports HF's ``kernels`` library (which transformers imports)
instead of this folder. ``qsinkkv/kernels`` is a symlink to it, so that the source tree and an editable install
import it as ``qsinkkv.kernels`` (setuptools' editable finder does not find a namespace subpackage mapped from
outside its parent's folder, pypa/setuptools#4248); a wheel copies the folder to ``qsinkkv/kernels``
(``[tool.setuptools.package-dir]`` in pyproject.toml).
"""
from .decode_attention import decode_attention, decode_attention_reference
from .prefill_attention import prefill_attention, prefill_attention_reference
from .quantize import quantize_key_blocks, quantize_values
from .write import WRITER_TRITON

__all__ = ["decode_attention", "decode_attention_reference", "prefill_attention", "prefill_attention_reference",
           "quantize_key_blocks", "quantize_values", "WRITER_TRITON"]
