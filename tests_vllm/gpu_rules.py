"""A GPU's rules on the CPU: tensors that stand for ones on vLLM's CUDA device, and a dispatch mode under which
reading them on the host fails, as a device sync would cost a GPU step.

``on_gpu(x)`` wraps a CPU tensor as a ``GpuTensor`` (its ``device`` is a stand-in for vLLM's GPU, ``meta``; the
values live in a CPU tensor inside). Under ``GpuRules()`` (a ``TorchDispatchMode``) every op on such tensors runs on
the values inside and gives ``GpuTensor`` results; a host tensor moved to the device (``.to(gpu_tensor.device)``,
``device=`` of a factory) becomes one (a host-to-device copy: allowed). What a GPU step may not do raises
``HostSync``:

* ``aten._local_scalar_dense`` of a device tensor (``.item()``, ``int()``, ``bool()``, a Python ``if`` on it);
* a device-to-host copy (``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``.numpy()``);
* an op whose output's shape depends on a device tensor's values (``nonzero``, ``unique``, ``masked_select``,
  indexing with a bool mask, ``repeat_interleave`` by counts): the host must learn the size, a sync;
* an op mixing a host tensor of one or more dimensions with a device tensor (CUDA refuses it; a 0-dim host tensor
  is a scalar and allowed).

``torch._assert_async`` of a device tensor is allowed (a device-side assert: no sync); here it runs on the values.
A Triton kernel launched on device tensors is device work too: under the rules its tensor arguments are handed to
Triton's interpreter as the CPU tensors inside (the interpreter's own copies in and out are its business, not the
step's).
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


# ops whose output's size the host learns from the values (on CUDA: a sync)
_SIZED_BY_VALUES = {aten.nonzero.default, aten._unique2.default, aten.unique_dim.default,
                    aten.unique_consecutive.default, aten.masked_select.default, aten.repeat_interleave.Tensor}


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
        if func is torch.Tensor.data_ptr:  # (an address, not a read: the values' own)
            return args[0].inner.data_ptr()
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
    def __enter__(self):
        from triton.runtime import interpreter
        self._grid_call = interpreter.GridExecutor.__call__
        grid_call = self._grid_call

        def launch(executor, *args, **kwargs):  # a kernel launch: the values inside, outside the rules
            args, kwargs = tree_map(lambda x: x.inner if isinstance(x, GpuTensor) else x, (args, kwargs))
            with torch.utils._python_dispatch._disable_current_modes():
                return grid_call(executor, *args, **kwargs)

        interpreter.GridExecutor.__call__ = launch
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime import interpreter
        interpreter.GridExecutor.__call__ = self._grid_call
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        on_device = any(isinstance(x, GpuTensor) for x in flat)
        to_device = kwargs.get("device") is not None and torch.device(kwargs["device"]) == DEVICE
        if func is aten._local_scalar_dense.default and on_device:
            raise HostSync("a device tensor read on the host (.item(), int(), bool(), float(), or `if` on it)")
        bool_index = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
            isinstance(x, torch.Tensor) and x.dtype == torch.bool for x in tree_flatten(args[1])[0])
        if on_device and (func in _SIZED_BY_VALUES or bool_index):
            raise HostSync(f"{func}: its output's size depends on a device tensor's values (the host learns it)")
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
