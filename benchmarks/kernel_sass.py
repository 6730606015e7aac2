"""Offline codegen check of the Triton decode and prefill kernels for the H200 (sm_90a), no GPU needed.

    python benchmarks/kernel_sass.py [--dims 128 64] [--bits 16 8 4] [--decode-variant folded] [--warps N]
                                     [--pages] [--sass-dir out/sass]

Compiles ``_decode_kernel`` for ``GPUTarget("cuda", 90, 32)`` on this machine (Triton ships
ptxas and cuobjdump), then reads the cubin: registers, stack (spill) bytes, and the SASS of the
main loop (one block of BS tokens of the recent window per iteration: the quantized blocks' loop
for int8/int4, the second in address order; the float blocks' loop, the largest, for bf16), the longest path through
it, and how many of its loads are asynchronous copies (LDGSTS: the pipeliner prefetches the next
blocks; 0 means each iteration waits for its own loads; per loop in address order: the sinks', the
main one and, for int8/int4, the float blocks'), per decode variant (int8/int4: ``--decode-variant``,
default all of them; see kernels/decode_attention.py), calls in the main loop (a division routine, say),
the pools' strides as a launch passes them (the cache's own head-major pools, or ``--pages``: an engine's pages,
the float ring in pages of ``float_block_rows`` rows; strides that are multiples of 16 marked so, as the JIT does),
and shared memory per program: a launch that needs more than the GPU has (227 KB on an H200: the CUDA
C++ Programming Guide's limit for compute capability 9.0) retries with fewer stages (kernels/launch.py);
``--block``/``--dims``/``--stages`` show where that starts (benchmarks/results/cpu-2026-12-01g/kernel_sass_d256.md).

The yardstick: an H200 issues ~132 SMs x 4 schedulers x 1.98 GHz = 1.05e12 warp-instructions/s
(NVIDIA's H200 SXM figures: 132 SMs, a 1.98 GHz boost clock, and the Hopper whitepaper's four warp
schedulers per SM, one instruction each per clock) against ~4.3e12 B/s of HBM (the copy bandwidth
benchmarks/decode_attention.py measured on an H200: benchmarks/results/h200-2026-11-30/decode_attention.md),
so a loop at <= ~0.24 warp-instructions per KV byte (instructions x warps / bytes one iteration streams)
can run at full bandwidth; one at 1.0 cannot. A second table compiles ``_prefill_kernel`` (bf16 and fp16,
its default tiles and launch): registers, spills, tensor-core instructions (HGMMA), whether its tile loads became
asynchronous 16-byte copies (LDGSTS.128), and the size of each key-tile loop (one per run of
tiles: stored sinks, stored slots, chunk sinks, the window's masked edges and unmasked inside).
Not part of CI: Triton's NVIDIA backend must be importable (it is on x86 Linux).
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the caller's environment says

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from qsinkkv.ops import DECODE_VARIANTS as VARIANTS  # noqa: E402

H200_BOUND = 0.24  # warp-instructions per byte at full HBM bandwidth: 1.05e12 / 4.3e12 (the docstring)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_COPY = re.compile(r"\bLDGSTS\b")  # an asynchronous global-to-shared copy (cp.async)


def compile_decode(bits: int, head_dim: int, block: int, group: int, warps: int | None, stages: int, variant: str,
                   pages: bool = False):
    """The kernel and its warps (``warps``, or None: the launch's, ``decode_warps`` of the body that runs). variant: a
    decode variant (``VARIANTS`` of kernels/decode_attention.py); bits 16 has one body. pages: the pools of an
    engine's pages (``PageLayout``) instead of the cache's own head-major pools."""
    mod = importlib.import_module("qsinkkv.kernels.decode_attention")
    f = "*bf16"
    sig = dict(q_ptr=f, sink_k_ptr=f, sink_v_ptr=f, float_k_ptr=f, float_v_ptr=f, key_codes_ptr="*u8",
               key_scale_ptr="*fp16", key_zero_ptr="*fp16", value_codes_ptr="*u8", value_scale_ptr="*fp16",
               value_zero_ptr="*fp16", sink_table_ptr="*i64", float_table_ptr="*i64", quant_table_ptr="*i64",
               seq_lens_ptr="*i64", inv_freq_ptr="*fp32", part_acc_ptr="*fp32",
               part_ml_ptr="*fp32", qk_scale="fp32", H_KV="i32", G="i32", S="i32", W="i32", R="i32",
               NQ="i32", FS="i32", NF="i32", F_ROWS="i32", BLOCKS_PER_SPLIT="i32",
               SINK_PAGES="i32", FLOAT_BLOCKS="i32", QUANT_BLOCKS="i32")
    from qsinkkv import CacheConfig
    cfg = CacheConfig(sink_tokens=4, recent_tokens=4092, bits=bits, block_size=block, value_group_size=group)
    layer = meta_pools(cfg, head_dim, pages)
    names = mod._decode_kernel.arg_names  # the pools' (head, block) strides: the ints between these two
    strides = dict(zip(names[names.index("QUANT_BLOCKS") + 1:names.index("D")], mod.pool_strides(layer)))
    sig.update({name: "i32" for name in strides})
    const = mod.decode_constexprs(cfg, head_dim, group_heads=4, splits=4, rope=False, interpret=False,
                                  variant=variant, float_block_rows=layer.float_k.shape[2],
                                  contiguous=all(t.is_contiguous() for t in layer.tensors().values()))
    # the JIT marks an int argument that is a multiple of 16 as such (tt.divisibility): the strides a launch
    # on these pools passes, which is what lets the compiler prove a block's rows aligned (vector loads)
    warps = warps or mod.decode_warps(block, const["VARIANT"])
    return compile_sm90a(mod._decode_kernel, sig, const, dict(num_warps=warps, num_stages=stages),
                         divisible=[name for name, v in strides.items() if v % 16 == 0]), warps


def meta_pools(cfg, head_dim: int, pages: bool, kv_heads: int = 8):
    """One layer's pools as a launch passes them, on the meta device (shapes and strides, no memory): the cache's
    own head-major pools of 4 sequences, or an engine's 1024 pages (``PageLayout.views``: blocks a page apart,
    the float ring in pages of ``float_block_rows`` rows)."""
    import torch

    from qsinkkv import LayerStorage, WindowLayout
    if not pages:
        return LayerStorage.allocate(WindowLayout(cfg), 4, kv_heads, head_dim, torch.device("meta"))
    from qsinkkv.engine_pages import PageLayout
    pl = PageLayout.of(cfg, kv_heads, head_dim)
    views = pl.views(torch.empty(1024, pl.page_bytes, dtype=torch.uint8, device="meta"))
    table = lambda n: torch.zeros(1, n, dtype=torch.int64)  # noqa: E731
    return LayerStorage(pl.layout, **views, sink_table=table(1)[:, 0], float_table=table(pl.float_pages),
                        quant_table=table(pl.layout.quant_slots), seq_lens=table(1)[:, 0], dense=False)


def compile_prefill(head_dim: int, dtype: str, block_m: int, block_n: int, rope: bool):
    """The prefill kernel as its launcher would compile it on an H200 (dtype "bf16" or "fp16"; rope: the
    cache_index contract)."""
    import triton.language as tl
    mod = importlib.import_module("qsinkkv.kernels.prefill_attention")
    f = "*" + dtype
    sig = dict(q_ptr=f, k_ptr=f, v_ptr=f, sk_ptr=f, sv_ptr=f, spos_ptr="*i64", held_ptr="*i64", len_ptr="*i64",
               sink_logits_ptr="*fp32", inv_freq_ptr="*fp32", out_ptr=f)
    strides = "sq_b sq_h sq_t sk_b sk_h sk_t sv_b sv_h sv_t ss_b ss_h ss_n sp_b so_b so_h so_t".split()
    sig.update({n: "i32" for n in strides + "T H G N_STORED S W".split()}, qk_scale="fp32")
    const = dict(D=head_dim, DP=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
                 DOT_DTYPE=tl.bfloat16 if dtype == "bf16" else tl.float16, DOT_PRECISION="tf32", HAS_SINK_LOGITS=True,
                 ROPE=rope)
    # the strides of [B, H, T, D] tensors are multiples of 16 in a real launch (not the positions' row)
    return compile_sm90a(mod._prefill_kernel, sig, const, mod.prefill_launch(block_m, rope),
                         divisible=[n for n in strides if n != "sp_b"])


def compile_sm90a(fn, sig: dict, const: dict, options: dict, divisible: list[str] = ()):
    """``fn`` compiled for the H200 with the facts the JIT gives a launch on torch tensors: every pointer
    16-byte aligned (what lets the compiler vectorize loads; without it the offline code loads element
    by element), and the integer arguments ``divisible`` multiples of 16."""
    sig = {**sig, **{k: "constexpr" for k in const}}
    names = fn.arg_names
    aligned = {(names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
               if v.startswith("*") or k in divisible}
    return triton.compile(ASTSource(fn, sig, const, aligned), target=GPUTarget("cuda", 90, 32), options=options)


def prefill_table(dims: list[int]) -> None:
    mod = importlib.import_module("qsinkkv.kernels.prefill_attention")
    print("\n# _prefill_kernel for sm_90a, default tiles and launch (prefill_attention); cache_index: q, k pre-RoPE")
    print("| D | dtype | positions | BLOCK_M x BLOCK_N | warps, stages | regs | stack (spill) bytes | HGMMA "
          "| LDGSTS.128 | key-tile loops, instr each (the smallest: no mask) |")
    print("|---:|---|---|---|---|---:|---:|---:|---:|---|")
    for D, dtype, rope in [(D, t, r) for D in dims for t, r in (("bf16", False), ("fp16", False), ("bf16", True))]:
        block_m, block_n = mod.default_blocks(D, rope)
        k = compile_prefill(D, dtype, block_m, block_n, rope)
        regs, stack = resources(k.asm["cubin"])
        sass = cuobjdump(k.asm["cubin"], "-sass")
        launch = mod.prefill_launch(block_m, rope)
        copies = len(re.findall(r"LDGSTS[.A-Z]*\.128", sass))
        ins = instructions(sass)
        bodies = [[t for a, t in ins if lo <= a <= hi] for lo, hi in loops(ins)]
        tile_loops = [len(body) for body in bodies if any("HGMMA" in t for t in body)]  # the key-tile loops
        positions = "cache_index" if rope else "absolute"
        warps, stages = launch["num_warps"], launch["num_stages"]
        print(f"| {D} | {dtype} | {positions} | {block_m} x {block_n} | {warps}, {stages} | {regs} | {stack} | "
              f"{sass.count('HGMMA')} | {copies} | {', '.join(map(str, tile_loops))} |", flush=True)


def cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(BIN / "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread."""
    res = cuobjdump(cubin, "-res-usage")
    return tuple(int(re.search(rf"{key}:(\d+)", res).group(1)) for key in ("REG", "STACK"))


def instructions(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, sass.splitlines()) if m]


def _target(text: str) -> int | None:
    m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None


def loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(first, last) addresses of every loop: a backward branch and its target."""
    return [(t, a) for a, text in ins if (t := _target(text)) is not None and t < a]


def main_loop(ins: list[tuple[int, str]], bits: int) -> tuple[int, int]:
    """(first, last) addresses of the decode's main loop: for bits 8/4 the quantized blocks' loop, the second of
    the kernel's three block loops in address order (the sinks', the quantized blocks', the float blocks'; the
    float loop can be the larger: variant "fp16" makes the quantized one smaller), for bits 16 the largest."""
    found = loops(ins)
    if bits != 16:
        if len(found) != 3:
            raise RuntimeError(f"expected the decode's three block loops, found {len(found)}: read the SASS")
        return sorted(found)[1]
    return max(found, key=lambda lo_hi: sum(lo_hi[0] <= a <= lo_hi[1] for a, _ in ins))


def walk(ins: list[tuple[int, str]], first: int, last: int, take_first_branch: bool) -> list[str]:
    """One path through the loop body: conditional forward branches fall through, except the first
    one when ``take_first_branch``; unconditional ones are followed."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    i, path, taken = at[first], [], False
    while i < len(ins) and ins[i][0] <= last and len(path) < 100_000:
        a, text = ins[i]
        path.append(text)
        t = _target(text)
        if t is not None and first < t <= last and t > a:
            if not text.startswith("@") or (take_first_branch and not taken):
                taken = taken or text.startswith("@")
                i = at[t]
                continue
            taken = True
        i += 1
    return path


def kv_bytes_per_block(bits: int, head_dim: int, block: int, group: int) -> int:
    if bits == 16:
        return 2 * block * head_dim * 2                           # K and V, bf16
    codes = 2 * block * head_dim * bits // 8
    key_stats = 2 * head_dim * 2                                  # scale + zero per channel, fp16
    value_stats = 2 * block * (head_dim // group) * 2             # scale + zero per token and group
    return codes + key_stats + value_stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--bits", nargs="+", type=int, default=[16, 8, 4])
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--warps", type=int, help="warps per program (default: the launch's, decode_warps(block, variant))")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--decode-variant", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                    help="int8/int4: the decode variants to compile (default: all)")
    ap.add_argument("--pages", action="store_true",
                    help="compile for an engine's pages (engine_pages.PageLayout; bits 8 and 4 only) instead of the "
                         "cache's own head-major pools")
    ap.add_argument("--sass-dir", help="also write each kernel's SASS here")
    a = ap.parse_args()
    if a.pages:  # a page holds quantized blocks: bits 16 keeps the engine's own pages
        a.bits = [b for b in a.bits if b != 16]
    pools = "an engine's pages" if a.pages else "head-major pools"
    print(f"# _decode_kernel for sm_90a (triton {triton.__version__}), block {a.block}, group {a.group}, "
          f"{a.stages} stages, {pools}; H200 full bandwidth needs <= {H200_BOUND} warp-instr/byte")
    print("| D | bits | variant | warps | regs | stack (spill) bytes | shared KB | loop instr | path instr "
          "| LDL+STL in path | LDGSTS in path | LDGSTS per loop | calls in loop | KV bytes/iter | warp-instr/byte |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    variants = lambda bits: a.decode_variant if bits != 16 else ["-"]  # noqa: E731
    for D, bits, variant in [(D, b, v) for D in a.dims for b in a.bits for v in variants(b)]:
        k, warps = compile_decode(bits, D, a.block, a.group, a.warps, a.stages,
                                  "dequantize" if variant == "-" else variant, a.pages)
        regs, stack = resources(k.asm["cubin"])
        sass = cuobjdump(k.asm["cubin"], "-sass")
        if a.sass_dir:
            Path(a.sass_dir).mkdir(parents=True, exist_ok=True)
            (Path(a.sass_dir) / f"decode_d{D}_int{bits}_{variant.strip('-') or 'float'}.sass").write_text(sass)
        ins = instructions(sass)
        first, last = main_loop(ins, bits)
        loop = sum(first <= addr <= last for addr, _ in ins)
        path = max((walk(ins, first, last, taken) for taken in (False, True)), key=len)
        copies = sum(bool(_COPY.search(t)) for t in path)
        per_loop = " / ".join(str(sum(lo <= a <= hi and bool(_COPY.search(t)) for a, t in ins))
                              for lo, hi in loops(ins))
        calls = sum(first <= a <= last and bool(re.search(r"\bCALL\b", t)) for a, t in ins)
        spills = sum(bool(re.search(r"\b(LDL|STL)\b", t)) for t in path)
        nbytes = kv_bytes_per_block(bits, D, a.block, a.group)
        per_byte = len(path) * warps / nbytes
        print(f"| {D} | {bits} | {variant} | {warps} | {regs} | {stack} | {k.metadata.shared / 1024:.0f} | {loop} | "
              f"{len(path)} | {spills} | {copies} | {per_loop} | {calls} | "
              f"{nbytes:,} | {per_byte:.2f} |", flush=True)
    prefill_table(a.dims)


if __name__ == "__main__":
    main()
