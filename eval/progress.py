"""Progress bars (tqdm on stderr): shown when stderr is a terminal, never in a log or a captured run;
``qsinkkv-eval --quiet`` runs its command inside ``silenced()``."""
from __future__ import annotations

from contextlib import contextmanager

from tqdm.auto import tqdm

_silenced = False  # set only inside `silenced()`, the scope of one CLI command


@contextmanager
def silenced():
    """No progress bar inside this block (restored after it)."""
    global _silenced
    before, _silenced = _silenced, True
    try:
        yield
    finally:
        _silenced = before


def bar(items, desc: str, leave: bool = True):
    # disable=None: tqdm's own rule, no bar unless stderr is a terminal
    return tqdm(items, desc=desc, leave=leave, disable=True if _silenced else None, dynamic_ncols=True)
