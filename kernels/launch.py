"""Launching a Triton kernel with the most pipeline stages whose tiles fit the device.

Every pipeline stage holds a tile of its own in shared memory, so a large block x head_dim can ask
for more than the GPU has (an H200, compute capability 9.0, gives a program at most 227 KB: the CUDA C++
Programming Guide's table of limits per compute capability): Triton's launcher then raises
``OutOfResources``. ``launch`` tries the stage counts in turn, keeps the first that fits per kernel,
configuration, argument dtypes and device (later launches start there), and refuses a
configuration that fits with none, saying what it needs. It runs at every launch, so its
bookkeeping is one dict lookup on what the caller already holds (no scan of the arguments).
"""
from __future__ import annotations

from triton.runtime.errors import OutOfResources

_fitting: dict = {}  # (name, key, options, constexprs) -> the stage count that fit


def launch(kernel, grid, args: tuple, constexprs: dict, *, key: tuple, stages: tuple[int, ...], name: str,
           what: str, fix: str, **options) -> None:
    """``kernel[grid](*args, **constexprs, **options, num_stages=s)`` for the first ``s`` of ``stages``
    (most first) that fits. ``key``: what else sets the compiled kernel's resources besides the
    constexprs and options: the device and the tensors' dtypes. ``what`` names the configuration in
    the error (e.g. "head_dim=256, block_size=128"), ``fix`` says what the user can change."""
    key = (name, key, tuple(options.items()), tuple(constexprs.items()))  # callers build the dicts in one order
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
