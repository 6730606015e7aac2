"""Launching a Triton kernel with the most pipeline stages whose tiles fit the device.

Every pipeline stage holds a tile of its own in shared memory, so a large block x head_dim can ask
for more than the GPU has (an H200 gives a program 227 KB): Triton's launcher then raises
``OutOfResources``. ``launch`` tries the stage counts in turn, keeps the first that fits per kernel,
configuration, argument dtypes and device (later launches start there), and refuses a
configuration that fits with none, saying what it needs.
"""
from __future__ import annotations

from torch import Tensor
from triton.runtime.errors import OutOfResources

_fitting: dict = {}  # (name, device, options, constexprs, dtypes) -> the stage count that fit


def launch(kernel, grid, device, args: tuple, constexprs: dict, *, stages: tuple[int, ...], name: str, what: str,
           fix: str, **options) -> None:
    """``kernel[grid](*args, **constexprs, **options, num_stages=s)`` for the first ``s`` of ``stages``
    (most first) that fits. ``what`` names the configuration in the error (e.g. "head_dim=256,
    block_size=128"), ``fix`` says what the user can change."""
    dtypes = tuple(a.dtype for a in args if isinstance(a, Tensor))  # Triton compiles per dtype too
    key = (name, device, tuple(sorted(options.items())), tuple(sorted(constexprs.items())), dtypes)
    tried = stages[stages.index(_fitting[key]):] if key in _fitting else stages
    for s in tried:
        try:
            kernel[grid](*args, **constexprs, **options, num_stages=s)
        except OutOfResources as e:
            short = e
            continue
        _fitting[key] = s
        return
    unit = " bytes" if "memory" in short.name else ""
    raise RuntimeError(
        f"the Triton {name} kernel for {what} does not fit this device even with num_stages={tried[-1]} "
        f"({short.name}: needs {short.required}{unit}, the device has {short.limit}{unit}): {fix}") from short
