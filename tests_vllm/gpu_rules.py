"""A GPU's rules on the CPU: tensors that stand for ones on vLLM's CUDA device, and a dispatch mode under which
reading them on the host fails, as a device sync would cost a GPU step.

``on_gpu(x)`` wraps a CPU tensor as a ``GpuTensor`` (its ``device`` is a stand-in for vLLM's GPU, ``meta``; the
values live in a CPU tensor inside). Under ``GpuRules()`` (a ``TorchDispatchMode``) every op on such tensors runs on
the values inside and gives ``GpuTensor`` results; a host tensor moved to the device (``.to(gpu_tensor.device)``,
``device=`` of a factory) becomes one (a host-to-device copy: allowed). What a GPU step may not do raises
``HostSync``:

* ``aten._local_scalar_dense`` of a device tensor (``.item()``, ``int()``, ``bool()``, a Python ``if`` on it);
* a device-to-host copy (``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``.numpy()``);
* an op mixing a host tensor of one or more dimensions with a device tensor (CUDA refuses it; a 0-dim host tensor
  is a scalar and allowed).

``torch._assert_async`` of a device tensor is allowed (a device-side assert: no sync); here it runs on the values.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# the stand-in device: "meta" (a CPU build of torch cannot make even a wrapper on "cuda": its indexing asks for the
# device's guard); it holds no values, so nothing but GpuRules can compute on these tensors
DEVICE = torch.device("meta")
CPU = torch.device("cpu")
aten = torch.ops.aten


class HostSync(AssertionError):
    """A GPU step read a device tensor on the host."""


class GpuTensor(torch.Tensor):
    """A tensor standing for one on vLLM's GPU: ``device`` is the stand-in, the values are in ``inner`` (CPU)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        wrapped = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
                                                      device=DEVICE, storage_offset=inner.storage_offset())
        wrapped.inner = inner
        return wrapped

    def __repr__(self) -> str:
        return f"GpuTensor({self.inner!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__):
            raise HostSync(f"{func.__name__}() of a device tensor: a device-to-host copy")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise HostSync(f"{func} of a device tensor outside GpuRules()")


def on_gpu(x: torch.Tensor) -> GpuTensor:
    return GpuTensor(x)


def _is_host_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, GpuTensor)


class GpuRules(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        on_device = any(isinstance(x, GpuTensor) for x in flat)
        to_device = kwargs.get("device") is not None and torch.device(kwargs["device"]) == DEVICE
        if func is aten._local_scalar_dense.default and on_device:
            raise HostSync("a device tensor read on the host (.item(), int(), bool(), float(), or `if` on it)")
        if func in (aten._to_copy.default, aten.copy_.default) and on_device:
            target = kwargs.get("device")
            into_host = func is aten.copy_.default and _is_host_tensor(args[0])
            if into_host or (target is not None and torch.device(target).type == "cpu"):
                raise HostSync(f"a device-to-host copy ({func})")
        if func is aten._to_copy.default and to_device and not on_device:  # host -> device: allowed
            kwargs["device"] = CPU
            return GpuTensor(func(*args, **kwargs))
        if on_device:
            mixed = [x for x in flat if _is_host_tensor(x) and x.dim() > 0]
            if mixed:
                raise HostSync(f"{func} mixes host tensors {[tuple(x.shape) for x in mixed]} with device tensors "
                               "(CUDA refuses it)")
        if to_device:
            kwargs["device"] = CPU
        if not on_device and not to_device:
            return func(*args, **kwargs)
        unwrapped = tree_map(lambda x: x.inner if isinstance(x, GpuTensor) else x, (args, kwargs))
        out = func(*unwrapped[0], **unwrapped[1])
        if func is aten._assert_async.msg or func is aten._assert_async.default:
            return out
        return tree_map(lambda x: GpuTensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, GpuTensor) else x,
                        out)


def values(x):
    """The values of a GpuTensor (or x itself), for the test's own comparisons outside GpuRules."""
    return x.inner if isinstance(x, GpuTensor) else x
