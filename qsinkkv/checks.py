"""Input checks shared by the caches: pure functions that turn what a caller passed into host values,
or raise an error naming the argument and what it must be (nothing is changed before they pass)."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor


def host_ints(name: str, value, expected: str) -> Tensor:
    """``value`` (an int tensor on any real device, a list or tuple of ints) as a 1-D or scalar int64
    tensor on the host. Refuses None, strings, floats, bools, complex numbers and meta tensors (which
    hold no values) with a ``ValueError`` naming ``name`` and ``expected``."""
    if isinstance(value, Tensor):
        if value.device.type == "meta":
            raise ValueError(f"{name} must be {expected}, got a meta tensor (it holds no values)")
        t = value
    elif isinstance(value, (list, tuple)) and all(isinstance(x, numbers.Integral) and not isinstance(x, bool)
                                                  for x in value):
        t = torch.tensor(list(value), dtype=torch.int64)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        t = torch.tensor(int(value), dtype=torch.int64)
    else:
        raise ValueError(f"{name} must be {expected}, got {type(value).__name__} {value!r:.80}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must be {expected}, got {t.dtype} of shape {tuple(t.shape)}")
    return t.detach().to("cpu", torch.int64)
