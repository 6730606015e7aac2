"""The C decode of two versions of ``qsinkkv/decode_c.c`` in one process: a git revision's and the working tree's,
each built as ``decode_c.py`` builds it, taking turns on the same layer (so a noisy host moves both alike).

    python benchmarks/decode_c_versions.py [--base HEAD] [--bits 4 8 16] [--dims 64 128] [--block 32]
                                           [--context 4096] [--rounds 8] [--write]

``--write``: the C write instead (``decode_c.WRITER_C`` through ``write.append_tokens``), on the prefill step of
``benchmarks/vllm_profile.py`` (32 new prompts of 24-148 tokens, 3 KV heads of 64, bf16, block 32, value groups of
64; bits 8 and 4): each version's best median over fresh copies of the same storage.

Prints, per case, each version's best median (of ``--rounds`` rounds of 30 calls), their ratio (working tree over
base) and whether the two outputs are the same bits. One torch thread, as vLLM's CPU worker runs. Shapes: D 64 is
the default model's layer at vLLM's long-context profile (8 sequences, 9 query heads over 3 KV heads), D 128 a
Llama-3-8B layer (4 sequences, 32 over 8).
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from qsinkkv import CacheConfig, SinkQuantCache, decode_c

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {64: (8, 9, 3), 128: (4, 32, 8)}  # D -> (B, H, Hkv)


def build(source: Path, out: Path):
    flags = ["-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared"]  # decode_c.py's first choice
    subprocess.run(["cc", *flags, str(source), "-o", str(out), "-lm"], check=True)
    return decode_c._open(out)


def best_median(lib, q, layer, calls: int = 30) -> tuple[float, torch.Tensor]:
    decode_c._lib = lib
    out = decode_c.decode_attention_c(q, layer)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        decode_c.decode_attention_c(q, layer)
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2], out


def write_case(libs: dict, bits: int, block: int, rounds: int) -> str:
    """One row of the --write table: the prefill step's C write under each library."""
    from qsinkkv import quant, write
    lens = [24 + 4 * i for i in range(32)]
    cfg = CacheConfig(sink_tokens=4, recent_tokens=252, bits=bits, block_size=block, value_group_size=64)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(sum(lens), 3, 64, generator=g).bfloat16() for _ in range(2))
    starts, rows = [sum(lens[:i]) for i in range(len(lens))], tuple(range(len(lens)))
    layer = SinkQuantCache(cfg, 1, len(lens), 3, 64, dtype=torch.bfloat16, backend="c").layers[0]
    fresh = {name: t.clone() for name, t in layer.tensors().items()}
    best, outs = {name: float("inf") for name in libs}, {}
    for _ in range(rounds):
        for name, lib in libs.items():
            decode_c._lib = lib
            times = []
            for _ in range(30):
                for t_name, t in layer.tensors().items():
                    t.copy_(fresh[t_name])
                layer.seq_lens.zero_()
                start = time.perf_counter()
                write.append_tokens(layer, k, v, rows, starts, lens, quant, keep_undo=False, writer=decode_c.WRITER_C)
                times.append(time.perf_counter() - start)
            best[name] = min(best[name], sorted(times)[15])
            outs[name] = {t_name: t.clone() for t_name, t in layer.tensors().items()}
    same = all(torch.equal(outs["base"][n].view(torch.uint8), outs["tree"][n].view(torch.uint8)) for n in fresh)
    return (f"| {bits} | {best['base'] * 1e6:,.0f} | {best['tree'] * 1e6:,.0f} | {best['tree'] / best['base']:.2f} | "
            f"{'yes' if same else 'no'} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="the git revision to compare with (default HEAD)")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], choices=sorted(SHAPES))
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--write", action="store_true", help="time the C write of a prefill step instead")
    a = p.parse_args()
    torch.set_num_threads(1)
    if not decode_c.available()[0]:
        raise SystemExit(f"the C decode is unavailable here: {decode_c.available()[1]}")
    with tempfile.TemporaryDirectory() as tmp:
        base_src = Path(tmp) / "base.c"
        base_src.write_text(subprocess.run(["git", "show", f"{a.base}:qsinkkv/decode_c.c"], cwd=ROOT, check=True,
                                           capture_output=True, text=True).stdout)
        libs = {"base": build(base_src, Path(tmp) / "base.so"),
                "tree": build(ROOT / "qsinkkv" / "decode_c.c", Path(tmp) / "tree.so")}
        if a.write:
            print(f"# the C write of a prefill step (32 new prompts of 24-148 tokens, Hkv 3, D 64, bf16, block "
                  f"{a.block}), {a.base} vs the working tree: best median of {a.rounds} x 30 calls, 1 thread")
            print("| bits | base us | tree us | tree / base | same bits |\n|---:|---:|---:|---:|---|")
            for bits in [b for b in a.bits if b != 16]:
                print(write_case(libs, bits, a.block, a.rounds), flush=True)
            return
        print(f"# the C decode, {a.base} vs the working tree: {a.context} tokens a sequence (S 4), block {a.block}, "
              f"best median of {a.rounds} x 30 calls, 1 thread")
        print("| D | B, H, Hkv | bits | base us | tree us | tree / base | same bits |")
        print("|---:|---|---:|---:|---:|---:|---|")
        for D in a.dims:
            B, H, Hkv = SHAPES[D]
            for bits in a.bits:
                cfg = CacheConfig(sink_tokens=4, recent_tokens=a.context + 256, bits=bits, block_size=a.block,
                                  value_group_size=min(64, D))
                cache = SinkQuantCache(cfg, 1, B, Hkv, D, dtype=torch.bfloat16, backend="c")
                g = torch.Generator().manual_seed(0)
                cache.append(0, *(torch.randn(B, Hkv, a.context, D, generator=g).bfloat16() for _ in range(2)))
                q = torch.randn(B, H, D, generator=g).bfloat16()
                best = {name: float("inf") for name in libs}
                outs = {}
                for _ in range(a.rounds):
                    for name, lib in libs.items():
                        t, outs[name] = best_median(lib, q, cache.layers[0])
                        best[name] = min(best[name], t)
                same = torch.equal(outs["base"], outs["tree"])
                print(f"| {D} | {B}, {H}, {Hkv} | {bits} | {best['base'] * 1e6:,.0f} | {best['tree'] * 1e6:,.0f} | "
                      f"{best['tree'] / best['base']:.2f} | {'yes' if same else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
