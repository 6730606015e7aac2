"""Which kernel ran: every op's kernels say so here, and a test that means one kernel asserts it ran.

An op has one kernel per device, chosen once (``ops.select_ops``; ``Ops.served_by`` names them) and never switched
per call: a case a kernel cannot serve raises by name. ``recording`` is how a parity test proves it compared the
kernel it meant (a C-vs-torch test that quietly ran torch twice would pass). Off (the default) it costs one global
read per kernel call.

  with trace.recording() as ran:
      cache.attend(...)
  assert ("decode", "c") in ran and ("decode", "torch") not in ran
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

OPS = ("quantize", "write_blocks", "write_rows", "decode", "prefill", "prefill_causal", "engine_step",
       "value_checks")
KERNELS = ("reference", "torch", "c", "triton", "vllm_cpu")  # vllm_cpu: vLLM's own CPU attention kernel

_ran: list[tuple[str, str]] | None = None


def ran(op: str, kernel: str) -> None:
    """Note that ``kernel`` served ``op`` (while recording)."""
    if _ran is not None:
        _ran.append((op, kernel))


@contextmanager
def recording() -> Iterator[list[tuple[str, str]]]:
    """The ``(op, kernel)`` of every kernel call inside the block, in order (nested blocks share one list)."""
    global _ran
    outer = _ran
    _ran = [] if outer is None else outer
    try:
        yield _ran
    finally:
        _ran = outer
