"""The torch writer's cases of benchmarks/write_op.py with two checkouts in one process, call by call interleaved
(which goes first alternating), so the host's drift between runs falls on both alike: base's ``qsinkkv`` loaded
as ``qsinkkv_base`` from BASE (a checkout's package folder), main's as installed.

    python ab_write.py BASE        # BASE: a checkout's package folder (28b3338's here)
"""
import importlib
import importlib.util
import sys
import time

import torch


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path + "/__init__.py", submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def setup(package: str, lengths: list[int], T: int, B: int = 8):
    """A dense int4 storage of SmolLM2's shape filled to ``lengths``, and a call that writes T tokens a row."""
    top = importlib.import_module(package)
    write, storage, layout, quant = (importlib.import_module(f"{package}.{m}")
                                     for m in ("write", "storage", "layout", "quant"))
    cfg = top.CacheConfig(sink_tokens=4, recent_tokens=252, bits=4, block_size=32, value_group_size=32)
    g = torch.Generator().manual_seed(0)
    s = storage.LayerStorage.allocate(layout.WindowLayout(cfg), B, 3, 64, torch.device("cpu"))
    for b, n in enumerate(lengths):
        write.append(s.rows(b), torch.randn(1, 3, n, 64, generator=g), torch.randn(1, 3, n, 64, generator=g), [n],
                     quant)
    k, v = torch.randn(B, 3, T, 64, generator=g), torch.randn(B, 3, T, 64, generator=g)
    held = s.seq_lens.clone()

    def call():
        s.seq_lens.copy_(held)
        write.append(s, k, v, [T] * B, quant)
    return call


def main() -> None:
    load("qsinkkv_base", sys.argv[1])
    torch.set_num_threads(1)
    cases = {"decode, equal lengths": ([150] * 8, 1),
             "decode, different lengths": ([150 + 5 * b for b in range(8)], 1),
             "decode completing a block": ([35] * 8, 1), "64-token chunk per row": ([150] * 8, 64)}
    print("| case | base us | main us | main / base |\n|---|---:|---:|---:|")
    for name, (lengths, T) in cases.items():
        calls = {"base": setup("qsinkkv_base", lengths, T), "main": setup("qsinkkv", lengths, T)}
        times = {"base": [], "main": []}
        for _ in range(20):
            calls["base"]()
            calls["main"]()
        for i in range(600):
            for tree in (("base", "main") if i % 2 else ("main", "base")):
                t0 = time.perf_counter()
                calls[tree]()
                times[tree].append(time.perf_counter() - t0)
        med = {tree: sorted(x)[len(x) // 2] * 1e6 for tree, x in times.items()}
        print(f"| {name} | {med['base']:.1f} | {med['main']:.1f} | {med['main'] / med['base']:.2f} |")


if __name__ == "__main__":
    main()
