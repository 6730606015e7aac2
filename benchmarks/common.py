"""What the benchmarks share: model shapes, timing, the device calls, JSON output and option names.

Option names follow the eval's (``qsinkkv-eval``): ``--sink-tokens``, ``--recent-tokens`` / ``--capacity``,
``--batch``, ``--context``, ``--bits``, ``--device``, ``--backend``, ``--json``; earlier spellings (``--sinks``,
``--sink``, ``--recent``, ``--batches``, ``--lengths``, ``--contexts``, ``--backends``) are still accepted,
unlisted (``option``, which examples/stream_generate.py and examples/tp_generate.py use too).

``--interpret`` runs a benchmark's GPU code path on CPU tensors, its Triton kernels in Triton's interpreter
(``TRITON_INTERPRET=1``, set here before any kernel is built): at tiny sizes a smoke test of that path
(tests/test_benchmarks_smoke.py), so that a stale call in it fails CI, not a GPU run. Its times mean
nothing. The CUDA-only calls (synchronize, memory statistics, the device name, ``do_bench``) go through
the helpers below, which do the CPU's nothing (or its wall clock) there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

SHAPES = {"llama": (32, 8, 128), "smollm2": (9, 3, 64)}  # H, Hkv, D: Llama-3-8B, SmolLM2-135M (the default)
SHAPE_NAMES = {"llama": "Llama-3-8B", "smollm2": "SmolLM2-135M"}  # the models whose attention shapes these are
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- options ---------------------------------------------------------------------------------------
def option(ap, name: str, *old: str, **kwargs) -> None:
    """``ap.add_argument(name, **kwargs)``, the spellings ``old`` accepted too but not listed (``ap``: a parser,
    or a group of one, e.g. a mutually exclusive group: an old spelling then excludes what ``name`` does)."""
    action = ap.add_argument(name, **kwargs)
    for spelling in old:
        ap.add_argument(spelling, **{**kwargs, "dest": action.dest, "default": argparse.SUPPRESS,
                                     "help": argparse.SUPPRESS})


def add_device_options(ap: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--device`` (default: ``default``, else cuda when there is one) and ``--interpret``."""
    ap.add_argument("--device", default=default or ("cuda" if torch.cuda.is_available() else "cpu"))
    ap.add_argument("--interpret", action="store_true",
                    help="run the GPU code path on CPU tensors, the Triton kernels in Triton's interpreter "
                         "(a smoke test at tiny sizes: its times mean nothing)")


def add_window_options(ap: argparse.ArgumentParser, capacity: int | None, *, old_sinks=("--sinks",),
                       old_recent=()) -> None:
    """``--sink-tokens`` (default 4) and ``--recent-tokens`` or ``--capacity`` (S + W, default ``capacity``;
    ``None``: set by the benchmark, e.g. from the context); ``old_sinks``/``old_recent``: the script's earlier
    spellings of the first two, accepted unlisted."""
    option(ap, "--sink-tokens", *old_sinks, type=int, default=4, help="sink tokens S (default 4)")
    window = ap.add_mutually_exclusive_group()
    option(window, "--recent-tokens", *old_recent, type=int, help="recent tokens W")
    default = f"; default {capacity}" if capacity else ""
    window.add_argument("--capacity", type=int, default=capacity, help=f"capacity S + W (instead of --recent-tokens)"
                                                                       f"{default}")


def recent_tokens(args, capacity: int | None = None) -> int:
    """W from ``--recent-tokens``, else ``--capacity`` (else ``capacity``) minus the sinks."""
    if args.recent_tokens is not None:
        return args.recent_tokens
    return (args.capacity or capacity) - args.sink_tokens


def gpu_path(args) -> bool:
    """Whether to take the GPU code path: a CUDA device, or ``--interpret`` (then on the CPU, the Triton
    kernels interpreted). Sets ``TRITON_INTERPRET=1`` for ``--interpret``: call it before any kernel import."""
    if getattr(args, "interpret", False):
        if torch.device(args.device).type != "cpu":
            sys.exit(f"--interpret runs on CPU tensors: pass --device cpu, not {args.device}")
        if "qsinkkv.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--interpret: the kernels were built before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return torch.device(args.device).type == "cuda"


# --- the device ------------------------------------------------------------------------------------
def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else "cpu"


def empty_cache(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    """Memory allocated at the peak since ``reset_peak`` (CUDA; None on the CPU), GiB."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if torch.device(device).type == "cuda" else None


def peak_mib(fn, device) -> float | None:
    """Memory ``fn`` allocates at its peak beyond what was allocated before it, MiB (CUDA; None on the CPU)."""
    if torch.device(device).type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


# --- timing --------------------------------------------------------------------------------------
def wall_ms(fn, reps: int, device="cpu", setup=None) -> float:
    """Median wall-clock ms of ``reps`` calls after one untimed call (the device synchronized around each).
    ``setup``: called untimed before each call, which then is ``fn(setup())`` (e.g. ``fn`` on a fresh copy of
    a cache that the call changes)."""
    times = []
    for i in range(reps + 1):
        args = () if setup is None else (setup(),)
        sync(device)
        t0 = time.perf_counter()
        fn(*args)
        sync(device)
        if i:  # the first call is untimed
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def bench_ms(fn, device, reps: int = 1, **do_bench) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` on CUDA, else ``wall_ms`` of ``reps`` calls."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench as bench
        return bench(fn, return_mode="median", **do_bench)
    return wall_ms(fn, reps, device)


# --- output --------------------------------------------------------------------------------------
def save_json(path: str | None, result) -> None:
    """Write ``result`` (a dict gets today's date) to ``path``, if given: benchmarks call it after every
    row, so that a run stopped by a timeout keeps its rows."""
    if path:
        if isinstance(result, dict):
            result = dict(result, date=time.strftime("%Y-%m-%d"))
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def table_header(cols: list[str], left: int = 0) -> None:
    """A markdown table header: ``left`` columns left-aligned, the rest right-aligned."""
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * left + "---:|" * (len(cols) - left))
