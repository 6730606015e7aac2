"""The Python around one fused engine decode step, per layer call, its two C calls stubbed out (int4, S 4, W 252,
block 32, Hkv 3, D 64, 32 rows, bf16): runs against whichever checkout's ``qsinkkv`` is first on the path."""
import timeit

import torch

from qsinkkv import CacheConfig, decode_c
from qsinkkv.engine_pages import EngineStep, LayerPools, PageLayout, step_tables
from qsinkkv.layout import WindowLayout
from qsinkkv.ops import select_ops


class Stubbed:
    """The C library with the engine write and the decode returning at once (0: done)."""

    def __init__(self, lib):
        self.lib = lib

    def __getattr__(self, name):
        return (lambda *args: 0) if name in ("qsinkkv_engine_write", "qsinkkv_decode") else getattr(self.lib, name)


def main():
    torch.set_num_threads(1)
    cfg = CacheConfig(sink_tokens=4, recent_tokens=252, bits=4, block_size=32, value_group_size=32,
                      sink_dtype=torch.bfloat16, window_dtype=torch.bfloat16, scale_dtype=torch.float16)
    Hkv, D, B = 3, 64, 32
    pages = PageLayout.of(cfg, Hkv, D)
    per = pages.pinned + 12
    layer = LayerPools(pages.views(torch.zeros(1 + B * per, pages.page_bytes, dtype=torch.uint8)))
    table = 1 + torch.arange(B * per).view(B, per)
    layout, ops = WindowLayout(cfg), select_ops("c", torch.device("cpu"), D, None)
    held, lens = torch.zeros(B, dtype=torch.int64), torch.full((B,), 100)
    N = int(lens.sum())
    prompt = [torch.randn(N, h, D).bfloat16() for h in (3 * Hkv, Hkv, Hkv)]
    EngineStep(layout, held, lens, step_tables(pages, table, held, lens)).attend(ops, layer, *prompt)
    held, lens = held + lens, torch.ones(B, dtype=torch.int64)
    step = EngineStep(layout, held, lens, step_tables(pages, table, held, lens))
    q, k, v = (torch.randn(B, h, D).bfloat16() for h in (3 * Hkv, Hkv, Hkv))
    out = torch.empty(B, 3 * Hkv, D, dtype=torch.bfloat16)
    step.attend(ops, layer, q, k, v, out=out)  # the first layer builds the step's structs
    decode_c._lib = Stubbed(decode_c._lib)
    n = 5000
    best = min(timeit.repeat(lambda: step.attend(ops, layer, q, k, v, out=out), number=n, repeat=5)) / n * 1e6
    print(f"EngineStep.attend, C stubbed: {best:.1f} us per layer call")


if __name__ == "__main__":
    main()
