"""Progress bars (tqdm on stderr); silenced with ``QSINKKV_EVAL_QUIET=1`` or ``--quiet``."""
from __future__ import annotations

import os

from tqdm.auto import tqdm


def quiet() -> bool:
    return os.environ.get("QSINKKV_EVAL_QUIET", "0") == "1"


def bar(items, desc: str, leave: bool = True):
    return tqdm(items, desc=desc, leave=leave, disable=quiet(), dynamic_ncols=True)
