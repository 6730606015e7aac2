"""Decode attention over a ``LayerStorage`` in C on the CPU, the codes dequantized inside the dot
products (``decode_c.c``): the "c" backend's decode, what ``backend="auto"`` runs on a CPU. Same
contract as ``decode.decode_attention_torch`` (absolute positions, ``q [B, H, D]`` -> ``[B, H, D]``);
its reference is ``decode.decode_attention_reference``.

Why C: on the CPU the PyTorch path writes the whole window into a float32 buffer at every layer of
every step and reads it back (several passes over 4 bytes per element, and many small ops per call); this
reads each code once (0.5 or 1 byte per element) in one call. The file is compiled once per machine
with the system C compiler (``cc``, or ``$CC``; ``-O3 -march=native``, or without ``-march=native``
where the compiler refuses it) into ``models.cache_dir()`` (``$QSINKKV_CACHE``, else
``$XDG_CACHE_HOME/qsinkkv``, else ``~/.cache/qsinkkv``) and loaded with ctypes. ``available()`` says
whether that worked and, if not, why (``backend="auto"`` then takes the PyTorch path). ``QSINKKV_C=0``
turns it off.
"""
from __future__ import annotations

import ctypes
import enum
import hashlib
import math
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from . import checks, quant, trace, write
from .checks import window_bound
from .models import cache_dir
from .storage import QUANT_TENSORS, LayerStorage

_SOURCE = Path(__file__).with_name("decode_c.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 512  # decode_c.c's fixed arrays (MAX_D)


class _Args(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("Hkv", "B", "G", "D", "S", "bs", "quant_slots", "float_slots", "bits",
                                               "groups", "float_rows", "fr", "sink_blocks", "float_blocks",
                                               "quant_blocks")]
                + [(n, ctypes.c_void_p) for n in ("sink_k", "sink_v", "float_k", "float_v", "key_scale", "key_zero",
                                                  "value_scale", "value_zero", "key_codes", "value_codes")]
                + [(n, ctypes.c_int64) for n in ("sink_dtype", "window_dtype", "scale_dtype")]
                + [(n, ctypes.c_void_p) for n in ("sink_table", "float_table", "quant_table", "q", "bias",
                                                  "sink_logits")]
                + [("scale", ctypes.c_float), ("out", ctypes.c_void_p), ("st", ctypes.c_int64 * 2 * 10)]
                + [(n, ctypes.c_int64) for n in ("q_dtype", "q_stride", "out_dtype")])

class _Complete(ctypes.Structure):
    _fields_ = ([("n", ctypes.c_int64)] + [(n, ctypes.c_void_p) for n in ("x_k", "x_v")]
                + [("x_dtype", ctypes.c_int64), ("x_stride", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("at", "seqs", "blocks", "first_new")]
                + [("float_rows", ctypes.c_int64), ("x_rows", ctypes.c_int64)])


class _Store(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("n", "H", "D")]
                + [(n, ctypes.c_void_p) for n in ("x_k", "x_v")]
                + [("x_dtype", ctypes.c_int64), ("x_stride", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("pool_k", "pool_v")]
                + [(n, ctypes.c_int64) for n in ("pool_dtype", "head_stride", "block_stride", "rows_per_block",
                                                 "num_blocks")]
                + [("table", ctypes.c_void_p), ("table_st0", ctypes.c_int64), ("table_st1", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("at", "seqs", "ring_rows")]
                + [(n, ctypes.c_int64) for n in ("x_rows", "table_rows", "table_cols")])


# the pools in the order of the C struct's pointers (and of its strides `st`)
_POOLS = ("sink_k", "sink_v", "float_k", "float_v", "key_scale", "key_zero", "value_scale", "value_zero",
          "key_codes", "value_codes")


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_why_not: str | None = None


class Status(enum.IntEnum):
    """What every C entry point returns (``decode_c.c``'s ``QSK_STATUSES``, the same names and values: compared
    when the library is opened). Any but ``OK``: the call read or wrote nothing."""
    OK = 0
    TOO_LARGE = -1       # a size beyond the C code's fixed arrays
    NO_MEMORY = -2       # a scratch allocation failed
    SCALE_OVERFLOW = -3  # a block's scale or zero overflows the scale dtype
    VALUE_REFUSED = -4   # q holds NaN/inf, or k, v a value the value checks refuse
    NO_BLOCK = -5        # a table names no block (-1) where a write goes or reads
    PAST_POOL = -6       # a table entry past its pool
    OUT_OF_RANGE = -7    # an index outside what it indexes
    NO_SINK_PAGE = -8    # a row whose sinks are visible has no sink page


class NoCompiler(RuntimeError):
    """There is no C compiler to run (``cc``, or ``$CC``): the expected reason to decode in PyTorch."""


class TurnedOff(RuntimeError):
    """``QSINKKV_C=0``."""


def available() -> tuple[bool, str]:
    """(True, path of the library) once compiled and loaded, else (False, why not). Compiles on the
    first call on a machine (a few seconds; later processes load the cached library) and remembers
    the answer. Warns (once) when the reason is neither a missing compiler nor ``QSINKKV_C=0``: a
    build that fails, or a library that does not load even rebuilt, leaves ``backend="auto"`` on the
    slower PyTorch decode."""
    global _lib, _why_not
    with _lock:
        if _lib is None and _why_not is None:
            try:
                _lib = _load()
            except Exception as e:  # no compiler, a failed build, a library that does not load
                _why_not = f"{type(e).__name__}: {e}"
                if not isinstance(e, (NoCompiler, TurnedOff)):
                    warnings.warn(f"qsinkkv: the C decode is unavailable ({_why_not}); backend='auto' decodes "
                                  "with the slower PyTorch path on the CPU", RuntimeWarning, stacklevel=2)
    return (True, _lib._name) if _lib is not None else (False, _why_not)


def _load() -> ctypes.CDLL:
    if os.environ.get("QSINKKV_C", "1") == "0":
        raise TurnedOff("turned off by QSINKKV_C=0")
    cc = shlex.split(os.environ.get("CC") or "cc")  # as a shell would: CC='ccache gcc', CC='gcc -O2'
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise NoCompiler(f"no C compiler: {cc[0]!r} not found (install one, or set CC)") from None
    # the library holds code for one instruction set: this machine's (-march=native, the default) or the target
    # QSINKKV_MARCH names (x86-64: the scalar bodies; x86-64-v3: AVX2; a CI matrix tests each); the CPU's flags and
    # the build's are part of the key
    march = os.environ.get("QSINKKV_MARCH") or "native"
    cpu = next((line for line in _cpuinfo() if line.startswith(("flags", "Features"))), platform.processor())
    cache = cache_dir()
    errors = []
    # (some compilers take no -march=native: then the compiler's default target; a named target is never dropped)
    for flags in (["-O3", f"-march={march}"], *([["-O3"]] if march == "native" else [])):
        flags = [*flags, "-fopenmp-simd", "-fPIC", "-shared"]
        key = hashlib.sha256("\n".join([_SOURCE.read_text(), " ".join(flags), " ".join(cc), version, cpu,
                                        platform.machine()]).encode()).hexdigest()[:16]
        lib = cache / f"decode_c-{key}.so"
        if lib.exists():
            try:
                return _open(lib)
            except (OSError, AttributeError, _StaleLibrary):  # empty, truncated, not ours: rebuilt once, below
                pass
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then one atomic rename
            built = Path(tmp) / lib.name
            run = subprocess.run([*cc, *flags, str(_SOURCE), "-o", str(built), "-lm"], capture_output=True,
                                 text=True)
            if run.returncode:
                errors.append(f"{' '.join(cc)} {' '.join(flags)} failed: {run.stderr.strip()[-300:]}")
                continue
            os.replace(built, lib)
        return _open(lib)
    raise RuntimeError("; ".join(errors))


class _StaleLibrary(RuntimeError):
    pass


def _open(lib: Path) -> ctypes.CDLL:
    dll = ctypes.CDLL(str(lib))
    dll.qsinkkv_decode.argtypes = [ctypes.POINTER(_Args), ctypes.c_int64, ctypes.c_int64]
    dll.qsinkkv_decode.restype = ctypes.c_int
    dll.qsinkkv_store_rows.argtypes = [ctypes.POINTER(_Store)]
    dll.qsinkkv_store_rows.restype = ctypes.c_int
    dll.qsinkkv_complete_blocks.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_Complete)]
    dll.qsinkkv_complete_blocks.restype = ctypes.c_int
    dll.qsinkkv_engine_write.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_Complete), ctypes.POINTER(_Store),
                                         ctypes.c_float]
    dll.qsinkkv_engine_write.restype = ctypes.c_int
    dll.qsinkkv_peak.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    dll.qsinkkv_peak.restype = ctypes.c_float
    for size in ("args", "store", "complete"):
        getattr(dll, f"qsinkkv_{size}_size").restype = ctypes.c_int64
    if (dll.qsinkkv_args_size(), dll.qsinkkv_store_size(), dll.qsinkkv_complete_size()) != (
            ctypes.sizeof(_Args), ctypes.sizeof(_Store), ctypes.sizeof(_Complete)):
        raise _StaleLibrary(f"{lib}: decode_c.c's structs and decode_c.py's disagree in size")
    dll.qsinkkv_field.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    dll.qsinkkv_field.restype = ctypes.c_char_p
    for which, struct in enumerate((_Args, _Store, _Complete)):
        if _c_fields(dll, which) != _py_fields(struct):
            raise _StaleLibrary(f"{lib}: decode_c.c's {struct.__name__[1:]} and decode_c.py's {struct.__name__} "
                                f"disagree: C {_c_fields(dll, which)}, Python {_py_fields(struct)}")
    dll.qsinkkv_isa.restype = ctypes.c_char_p
    dll.qsinkkv_status.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    dll.qsinkkv_status.restype = ctypes.c_char_p
    if _c_statuses(dll) != {s.name: s.value for s in Status}:
        raise _StaleLibrary(f"{lib}: decode_c.c's return codes and decode_c.py's Status disagree: C "
                            f"{_c_statuses(dll)}, Python {({s.name: s.value for s in Status})}")
    return dll


def isa() -> str:
    """The instruction set the loaded C library's vector paths use: "avx512", "avx2", "avx" or "scalar" (fixed when it
    was built, by the compiler's target: ``QSINKKV_MARCH``, default this machine's). Raises where there is none."""
    _require_lib()
    return _lib.qsinkkv_isa().decode()


def _c_statuses(dll: ctypes.CDLL) -> dict[str, int]:
    """The C library's return codes, name -> value (``qsinkkv_status``)."""
    out, value = {}, ctypes.c_int64()
    while (name := dll.qsinkkv_status(len(out), ctypes.byref(value))) is not None:
        out[name.decode()] = value.value
    return out


def _c_fields(dll: ctypes.CDLL, which: int) -> list[tuple[str, int, int, str]]:
    """(name, offset, size, kind) of every field of C struct ``which`` (0 Args, 1 Store, 2 Complete), in order;
    kind: "i" int64, "f" float, "a" the strides' int64 array, "p" a pointer."""
    out, offset_size_kind = [], (ctypes.c_int64 * 3)()
    while (name := dll.qsinkkv_field(which, len(out), offset_size_kind)) is not None:
        out.append((name.decode(), offset_size_kind[0], offset_size_kind[1], chr(offset_size_kind[2])))
    return out


_KINDS = {ctypes.c_int64: "i", ctypes.c_float: "f", ctypes.c_void_p: "p"}


def _py_fields(struct: type[ctypes.Structure]) -> list[tuple[str, int, int, str]]:
    """The same for a ctypes mirror: a swapped, missing or retyped field differs from the C side's list."""
    return [(name, getattr(struct, name).offset, getattr(struct, name).size,
             _KINDS.get(ctype, "a" if issubclass(ctype, ctypes.Array) else "?")) for name, ctype in struct._fields_]


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


THREAD_WORK = 1 << 20  # slot-channels (KV heads x sequences x slots x head_dim) each thread must get
_pool: ThreadPoolExecutor | None = None


def _threads(n: int) -> ThreadPoolExecutor:
    """The pool that runs the calling thread's helpers (the C calls release the GIL)."""
    global _pool
    if _pool is None or _pool._max_workers < n:
        _pool = ThreadPoolExecutor(n, thread_name_prefix="qsinkkv-decode")
    return _pool


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def decode_attention_c(q: Tensor, layer: LayerStorage, *, scale: float | None = None,
                       sink_logits: Tensor | None = None) -> Tensor:
    """``q [B, H, D]`` -> ``[B, H, D]`` in q's dtype, computed in float32, reading the storage where it
    lies (dense or paged). Same contract as ``decode.decode_attention_torch``. The (KV head, sequence)
    units are split over up to ``torch.get_num_threads()`` threads (this one and a pool's), as many as
    get at least ``THREAD_WORK`` slot-channels each."""
    _require_lib()
    s = layer
    if s.device.type != "cpu" or not isinstance(q, Tensor) or q.device.type != "cpu":
        raise ValueError(f"the C decode reads CPU tensors, got the storage on {s.device} and q on "
                         f"{getattr(q, 'device', type(q).__name__)}")
    s.check_shapes()  # (every offset the C code computes comes from these sizes)
    Hkv, D = s.num_kv_heads, s.head_dim
    if (q.dim() != 3 or q.shape[0] != s.batch_size or q.shape[1] % Hkv or not q.shape[1] or q.shape[2] != D
            or not q.is_floating_point()):
        raise ValueError(f"q must be a float [B={s.batch_size}, H (a multiple of Hkv={Hkv}), D={D}] tensor for this "
                         f"storage, got {q.dtype} {list(q.shape)}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"the C decode takes head_dim <= {MAX_HEAD_DIM}, got {D}")
    trace.ran("decode", "c")
    B, H, _ = q.shape
    bias = s.layout.visible_bias(s.seq_lens, s.device)
    keep = [bias]  # alive until the call returns
    logits = _sink_logits(sink_logits, H, keep)
    qr, q_stride = _rows(q if q.dtype in _DTYPES else q.float(), keep)
    out = torch.empty(B, H, D, dtype=qr.dtype)  # written in q's dtype, rounded as .to() rounds
    a = _args(s, keep, B=B, G=H // Hkv, q=qr.data_ptr(), q_dtype=_DTYPES[qr.dtype], q_stride=q_stride,
              bias=bias.data_ptr(), sink_logits=logits,
              scale=D ** -0.5 if scale is None else scale, out=out.data_ptr(), out_dtype=_DTYPES[out.dtype])
    _decode_units(a, Hkv * B, s.layout.num_slots * D, s)
    return out.to(q.dtype)


def decode_blocks_c(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, bias: Tensor, *, scale: float,
                    out: Tensor | None = None, sink_logits: Tensor | None = None) -> Tensor:
    """Decode over float blocks named by a table, what each query sees given by a bias (an engine's own
    position-aligned pages: vLLM's, bits=16): ``q [B, H, D]``; ``k_pool, v_pool [Hkv, blocks, bs, D]`` (any head
    and block strides, each block's rows ``D`` apart); ``block_table [B, nb]`` int64, the blocks row b reads in
    order (-1: none); ``bias [B, nb * bs]`` float32, 0 where the query sees the slot, -inf where not ->
    ``[B, H, D]`` in q's dtype (or into ``out``, contiguous, float32/bf16/fp16), computed in float32. The C decode
    with no sink segment and no quantized ring: the same loops, the same bits for a row alone or in a batch.
    ``sink_logits [H]`` (a layer's learned sinks, gpt-oss): ``exp(s_h)`` joins head h's softmax denominator."""
    return BlocksDecode(block_table, bias).run(q, k_pool, v_pool, scale=scale, out=out, sink_logits=sink_logits)


class BlocksDecode:
    """``decode_blocks_c`` for one engine step: the table and bias are the step's, checked once; ``run`` per layer
    (that layer's pools, q and out). The first layer's C struct is the template of the later ones (their pools, q
    and out lie the same way): its sizes, strides and dtypes are kept, every pointer is set afresh at each call."""

    def __init__(self, block_table: Tensor, bias: Tensor):
        if not isinstance(block_table, Tensor) or block_table.dim() != 2:
            raise ValueError(f"block_table must be a 2-D [B, nb] tensor, got "
                             f"{list(getattr(block_table, 'shape', [type(block_table).__name__]))}")
        checks.table_dtype("block_table", block_table)  # (its entries: against each layer's pools, in run)
        self.table, self.bias = block_table.long().contiguous(), bias.contiguous()  # the struct points into them
        self.B, nb = self.table.shape
        # the blocks the table names, checked against each layer's pools in run (one min/max per step)
        self.least, self.most = (int(x) for x in torch.aminmax(self.table)) if self.table.numel() else (-1, -1)
        if bias.dtype != torch.float32 or bias.dim() != 2 or bias.shape[0] != self.B or bias.shape[1] % max(nb, 1):
            raise ValueError(f"bias must be float32 [B={self.B}, nb * bs] (nb={nb}), got bias {bias.dtype} "
                             f"{list(bias.shape)}, block_table {list(block_table.shape)}")
        self._template = None  # (how the first layer's tensors lay, its _Args)

    def run(self, q: Tensor, k_pool: Tensor, v_pool: Tensor, *, scale: float, out: Tensor | None = None,
            sink_logits: Tensor | None = None) -> Tensor:
        _require_lib()
        trace.ran("decode", "c")
        B, H, D = q.shape
        Hkv, _, bs, _ = k_pool.shape
        nb = self.table.shape[1]
        if B != self.B or self.bias.shape[1] != nb * bs:
            raise ValueError(f"q must be [B={self.B}, H, D] over blocks of bs={self.bias.shape[1] // max(nb, 1)} "
                             f"rows (the bias's), got q {list(q.shape)} and pools of blocks of {bs} rows")
        if D > MAX_HEAD_DIM or k_pool.shape != v_pool.shape or k_pool.shape[3] != D or H % Hkv:
            raise ValueError(f"k_pool, v_pool must be [Hkv, blocks, bs, D={D}] (D <= {MAX_HEAD_DIM}, H={H} a multiple "
                             f"of Hkv), got {list(k_pool.shape)} and {list(v_pool.shape)}")
        if k_pool.dtype not in _DTYPES or v_pool.dtype != k_pool.dtype:
            raise ValueError(f"k_pool, v_pool must be float32, bfloat16 or float16 (one dtype), got {k_pool.dtype} "
                             f"and {v_pool.dtype}")
        if self.least < -1 or self.most >= k_pool.shape[1] or v_pool.shape[1] != k_pool.shape[1]:
            checks.table("block_table", self.table, min(k_pool.shape[1], v_pool.shape[1]), "k_pool and v_pool")
        if not (q.is_cpu and k_pool.is_cpu and v_pool.is_cpu):
            raise ValueError(f"the C decode reads CPU tensors, got q, k_pool and v_pool on {q.device}, "
                             f"{k_pool.device} and {v_pool.device}")
        _check_out(out, q)
        keep = []
        logits = _sink_logits(sink_logits, H, keep)
        k_read, v_read = (t if _blocks_contiguous(t) else t.contiguous() for t in (k_pool, v_pool))  # (one copy)
        keep += [k_read, v_read]
        pointers, strides, pools_lie = _pools(_blocks_pools(k_read, v_read), keep)
        qr, q_stride = _rows(q if q.dtype in _DTYPES else q.float(), keep)
        out = torch.empty(B, H, D, dtype=qr.dtype) if out is None else out
        lies = (pools_lie, k_pool.dtype, qr.shape, q_stride, qr.dtype, out.dtype, scale)
        if self._template is None or self._template[0] != lies:
            dt, table = _DTYPES[k_pool.dtype], self.table.data_ptr()  # (the step's own: set with the template)
            a = _Args(Hkv=Hkv, B=B, G=H // Hkv, D=D, S=0, bs=bs, quant_slots=0, float_slots=nb, bits=16, groups=1,
                      float_rows=nb * bs, fr=bs, float_blocks=min(k_pool.shape[1], v_pool.shape[1]), st=strides,
                      sink_dtype=dt, window_dtype=dt, scale_dtype=dt,
                      sink_table=table, float_table=table, quant_table=table, bias=self.bias.data_ptr(),
                      sink_logits=None, q_dtype=_DTYPES[qr.dtype], q_stride=q_stride, scale=scale,
                      out_dtype=_DTYPES[out.dtype])
            self._template = (lies, a)
        a = self._template[1]
        _point(a, **pointers, q=qr.data_ptr(), out=out.data_ptr(), sink_logits=logits)
        _decode_units(a, Hkv * B, nb * bs * D)
        return out


def _sink_logits(sink_logits: Tensor | None, H: int, keep: list) -> int | None:
    """The address of ``sink_logits [H]`` as the C code reads them (float32, contiguous, on the host; a copy kept
    alive in ``keep``), or None (no learned sinks). Refuses, by name, another shape, NaN and +inf (``checks``')."""
    if sink_logits is None:
        return None
    if not isinstance(sink_logits, Tensor) or sink_logits.shape != (H,) or not sink_logits.is_floating_point():
        raise ValueError(f"sink_logits must be a float tensor of shape [H={H}], got "
                         f"{getattr(sink_logits, 'dtype', type(sink_logits).__name__)} "
                         f"{tuple(getattr(sink_logits, 'shape', ()))}")
    logits = sink_logits.detach().to("cpu", torch.float32).contiguous()
    if not checks.sink_logits_fit(logits.numpy()):
        raise ValueError(checks.SINK_LOGITS_REFUSED)
    keep.append(logits)
    return logits.data_ptr()


def _require_lib() -> None:
    """The library is loaded, or the C kernels cannot run: raise, saying why."""
    if _lib is None:
        ok, why = available()
        if not ok:
            raise RuntimeError(f"the C kernels are not available: {why}")


def _blocks_pools(k: Tensor, v: Tensor) -> list:
    """The pools of ``_POOLS`` for a decode over float blocks only: k and v as the sink and float pools (no sink
    segment is read), k in the quantized pools' places (none is read)."""
    return [k, v, k, v, k, k, k, k, k, k]


def _check_out(out: Tensor | None, q: Tensor) -> None:
    """``out``, where given, is what the C decode writes: contiguous, on the CPU, q's shape, a float dtype."""
    if out is not None and (out.shape != q.shape or out.dtype not in _DTYPES or not out.is_contiguous()
                            or out.device.type != "cpu"):
        raise ValueError(f"out must be a contiguous CPU {list(q.shape)} tensor of float32, bfloat16 or float16, "
                         f"got {out.dtype} {list(out.shape)} (contiguous: {out.is_contiguous()})")


def _decode_units(args: _Args, units: int, per_unit: int, storage: LayerStorage | None = None) -> None:
    """Run the decode's ``units`` (KV head, sequence) pairs, each ``per_unit`` slot-channels of work, on this thread
    and, when each gets ``THREAD_WORK``, on up to ``torch.get_num_threads() - 1`` more."""
    # threads only for large work: inside a model the handoff to a pool thread competes with PyTorch's own
    # spinning OpenMP workers (on 2 cores it made a 2k-token step of the default model slower: an A/B not
    # recorded in the repository; rerun benchmarks/generate.py with THREAD_WORK lowered to check)
    threads = min(torch.get_num_threads(), units, units * per_unit // THREAD_WORK)
    if threads > 1:
        cuts = [units * i // threads for i in range(threads + 1)]
        rest = [_threads(threads - 1).submit(_lib.qsinkkv_decode, ctypes.byref(args), cuts[i], cuts[i + 1])
                for i in range(1, threads)]
        codes = [_lib.qsinkkv_decode(ctypes.byref(args), 0, cuts[1])] + [f.result() for f in rest]
    else:
        codes = [_lib.qsinkkv_decode(ctypes.byref(args), 0, units)]
    if any(codes):
        if Status.PAST_POOL in codes and storage is not None:  # a table entry past its pool: name it
            _check_tables(storage)
        if Status.NO_SINK_PAGE in codes:  # a row whose sinks are visible (it holds a token) has no sink page
            rows = [] if storage is None else ((storage.sink_table.cpu() < 0) & (storage.seq_lens > 0)).nonzero()
            raise ValueError(f"sink_table names no sink page (-1) for rows {[int(r) for r in rows]}, which hold "
                             f"tokens: every sequence's sinks are read from its page (nothing was read)")
        raise RuntimeError(f"the C decode failed ({Status(min(codes)).name})")


def _args(storage: LayerStorage, keep: list, pools: tuple | None = None, **call) -> _Args:
    """The C struct over ``storage`` (its pools, tables, sizes and dtypes; ``pools``: ``_pools``' answer for it if
    the caller has it) and the call's own fields."""
    cfg = storage.layout.config
    pointers, strides, _ = pools or _pools([getattr(storage, name) for name in _POOLS], keep)
    ptr = lambda t: _contiguous(t, keep).data_ptr()  # noqa: E731
    # (the C code checks every table entry it reads against these before touching a pool: tables_fit)
    return _Args(Hkv=storage.num_kv_heads, D=storage.head_dim, S=cfg.sink_tokens, bs=cfg.block_size,
                 quant_slots=storage.layout.quant_slots, float_slots=storage.float_table.shape[1], bits=cfg.bits,
                 float_rows=storage.layout.float_rows, fr=storage.float_k.shape[2], sink_blocks=storage.sink_k.shape[1],
                 float_blocks=min(storage.float_k.shape[1], storage.float_v.shape[1]),
                 quant_blocks=min(getattr(storage, name).shape[1] for name in QUANT_TENSORS),
                 groups=storage.value_scale.shape[-1], **pointers, st=strides, sink_dtype=_DTYPES[cfg.sink_dtype],
                 window_dtype=_DTYPES[cfg.window_dtype], scale_dtype=_DTYPES[cfg.scale_dtype],
                 sink_table=ptr(storage.sink_table), float_table=ptr(storage.float_table),
                 quant_table=ptr(storage.quant_table), **call)


def _check_tables(storage: LayerStorage) -> None:
    """Every table of ``storage`` names blocks of its pools or -1, else a ValueError naming the table: the error of a
    call the C code refused (``Status.PAST_POOL``: its own check of every entry it reads, at every call, before any
    pool is touched)."""
    checks.table("sink_table", storage.sink_table, storage.sink_k.shape[1], "its pool (sink blocks)")
    checks.table("float_table", storage.float_table, storage.float_k.shape[1], "its pool (float blocks)")
    checks.table("quant_table", storage.quant_table, storage.key_codes.shape[1], "its pool (quant blocks)")


# The pointer fields of each C struct, in two kinds. A struct kept as the template of a step's later layers holds
# pointers only into what the step itself owns (its tables, visible bias, write plan: alive as long as the step);
# every pointer into a caller's tensors (a layer's pools, q, k, v, out, its learned sink logits) is set at each call,
# by ``_point``.
_POINTERS = {struct: frozenset(name for name, ctype in struct._fields_ if ctype is ctypes.c_void_p)
             for struct in (_Args, _Store, _Complete)}
_PER_CALL = {_Args: frozenset(_POOLS) | {"q", "out", "sink_logits"}, _Complete: frozenset({"x_k", "x_v"}),
             _Store: frozenset({"x_k", "x_v", "pool_k", "pool_v"})}
_STEP_OWNED = {_Args: frozenset({"sink_table", "float_table", "quant_table", "bias"}),
               _Complete: frozenset({"at", "seqs", "blocks", "first_new"}),
               _Store: frozenset({"table", "at", "seqs", "ring_rows"})}


def _point(struct: ctypes.Structure, **addresses: int) -> None:
    """Set the pointers of ``struct`` into this call's tensors: exactly ``_PER_CALL``'s fields, or raise (one left out
    would keep an earlier call's address)."""
    if addresses.keys() != _PER_CALL[type(struct)]:
        raise RuntimeError(f"{type(struct).__name__}: pointers {sorted(addresses)} are not its per-call fields "
                           f"{sorted(_PER_CALL[type(struct)])}")
    for name, address in addresses.items():
        setattr(struct, name, address)


_POOL_LAYOUTS: dict = {}  # (shape, stride) of the pools -> (which are copied, the struct's strides): no address


def _pools(tensors: list[Tensor], keep: list, in_place: bool = False) -> tuple[dict, ctypes.Array, tuple]:
    """The pools (``_POOLS`` order) as the C struct reads them: ``({name: address}, their (head, block) strides, how
    they lie)``. A pool whose blocks are contiguous is read as it lies (the C code steps heads and blocks by its own
    strides: an engine's pages, a view, are read in place), another through a contiguous copy (alive in ``keep``;
    ``in_place``: refused, as a write into the copy would not reach the pool). The addresses are read at each call;
    what follows from the shapes and strides alone is computed once per layout."""
    lie = tuple((t.shape, t.stride()) for t in tensors)  # (their dtypes: the config's, the storage's one holder)
    layout = _POOL_LAYOUTS.get(lie)
    if layout is None:
        copied = tuple(not _blocks_contiguous(t) for t in tensors)
        strides = [_contiguous_strides(t.shape) if c else t.stride() for t, c in zip(tensors, copied)]
        if len(_POOL_LAYOUTS) >= 256:  # a few models' layers; a new set of pools starts over
            _POOL_LAYOUTS.clear()
        layout = _POOL_LAYOUTS[lie] = (copied, (ctypes.c_int64 * 2 * 10)(*[(ctypes.c_int64 * 2)(*st[:2])
                                                                             for st in strides]))
    copied, strides = layout
    if any(copied):
        if in_place:
            name = _POOLS[copied.index(True)]
            raise ValueError(f"the C writers write the pools in place: {name} must be [Hkv, blocks, ...] with each "
                             f"block contiguous, got strides {tensors[copied.index(True)].stride()}")
        tensors = [t.contiguous() if c else t for t, c in zip(tensors, copied)]
        keep += tensors
    return {name: t.data_ptr() for name, t in zip(_POOLS, tensors)}, strides, lie


def _blocks_contiguous(pool: Tensor) -> bool:
    """Each block of ``pool [Hkv, blocks, ...]`` is contiguous (its own dims, innermost first, step densely)."""
    step = 1
    for size, st in zip(reversed(pool.shape[2:]), reversed(pool.stride()[2:])):
        if size != 1 and st != step:
            return False
        step *= size
    return True


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _contiguous(t: Tensor, keep: list) -> Tensor:
    if not t.is_contiguous():
        t = t.contiguous()
        keep.append(t)
    return t


def _rows(x: Tensor, keep: list) -> tuple[Tensor, int]:
    """``x [tokens, H, D]`` as the C code reads it (rows of D contiguous, tokens any stride apart) and its token
    stride: a view as it lies (an engine's key, a slice of its fused qkv) or a contiguous copy."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
        keep.append(x)
    return x, x.stride(0)


def _kv_rows(k: Tensor, v: Tensor, keep: list) -> tuple[Tensor, Tensor, int]:
    """``_rows`` of k and v with one token stride for both."""
    (k, k_stride), (v, v_stride) = _rows(k, keep), _rows(v, keep)
    if k_stride != v_stride:
        (k, k_stride), (v, _) = _rows(k.contiguous(), keep), _rows(v.contiguous(), keep)
    return k, v, k_stride


def _store_struct(pool_k: Tensor, pool_v: Tensor, table: Tensor, k: Tensor, v: Tensor, index: list,
                  rows_per_block: int, keep: list) -> _Store:
    k, v, stride = _kv_rows(k, v, keep)
    table2 = table if table.dim() == 2 else table.unsqueeze(1)
    keep += [k, v, table2, *index]
    return _Store(n=index[0].shape[0], H=k.shape[1], D=k.shape[2], x_k=k.data_ptr(), x_v=v.data_ptr(),
                  x_dtype=_DTYPES[k.dtype], x_stride=stride, pool_k=pool_k.data_ptr(), pool_v=pool_v.data_ptr(),
                  pool_dtype=_DTYPES[pool_k.dtype], head_stride=pool_k.stride(0), block_stride=pool_k.stride(1),
                  rows_per_block=rows_per_block, num_blocks=min(pool_k.shape[1], pool_v.shape[1]),
                  table=table2.data_ptr(), table_st0=table2.stride(0),
                  table_st1=table2.stride(1), at=index[0].data_ptr(), seqs=index[1].data_ptr(),
                  ring_rows=index[2].data_ptr(), x_rows=k.shape[0], table_rows=table2.shape[0],
                  table_cols=table2.shape[1])


def _index_rows(names: tuple[str, ...], index: tuple) -> None:
    """The index tensors of a C write: 1-D int64 of one length on the CPU (the C code reads them as int64 arrays of
    that many entries), else a ValueError naming them."""
    n = getattr(index[0], "shape", (None,))[0]
    for name, t in zip(names, index):
        if not isinstance(t, Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] != n or not t.is_cpu:
            raise ValueError(f"{', '.join(names)} must be 1-D int64 CPU tensors of one length, got {name} "
                             f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")


def _store_shapes(pool_k: Tensor, pool_v: Tensor, table: Tensor, k: Tensor, v: Tensor, index: tuple,
                  rows_per_block: int) -> None:
    """The shapes ``store_rows_c`` reads and writes by, each against the buffer it sizes, else a ValueError naming
    it: ``k, v [N, Hkv, D]`` of the pools' heads and head_dim, ``pool_k, pool_v [Hkv, blocks, rows, D]`` alike,
    ``rows_per_block`` in ``[1, rows]``, ``table [B, slots]`` (or ``[B]``) of ints, the three index tensors."""
    if pool_k.dim() != 4 or pool_v.shape != pool_k.shape:
        raise ValueError(f"pool_k, pool_v must be [Hkv, blocks, rows_per_block, D] alike, got {list(pool_k.shape)} "
                         f"and {list(pool_v.shape)}")
    Hkv, _, rows, D = pool_k.shape
    if k.dim() != 3 or k.shape[1:] != (Hkv, D) or v.shape != k.shape:
        raise ValueError(f"k, v must be [N, Hkv={Hkv}, D={D}] (the pools' heads and head_dim), got {list(k.shape)} "
                         f"and {list(v.shape)}")
    if isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int) or not 1 <= rows_per_block <= rows:
        raise ValueError(f"rows_per_block must be an int in [1, {rows}] (the pools' rows per block), got "
                         f"{rows_per_block!r}")
    checks.table_dtype("table", table)
    if table.dim() not in (1, 2):
        raise ValueError(f"table must be [B, slots] (or [B]), got {list(table.shape)}")
    _index_rows(("at", "seqs", "ring_rows"), index)


def _store_refusal(pool_k: Tensor, pool_v: Tensor, table: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why the C row write cannot serve these tensors, or None."""
    D = k.shape[2]
    if not (pool_k.is_cpu and pool_v.is_cpu and table.is_cpu and k.is_cpu and v.is_cpu):
        return "needs CPU tensors"
    if (pool_k.stride(3), pool_k.stride(2)) != (1, D) or pool_k.stride() != pool_v.stride():
        return (f"needs pools whose blocks' rows are D={D} elements apart, one layout for K and V; got strides "
                f"{pool_k.stride()} and {pool_v.stride()}")
    if pool_k.dtype != pool_v.dtype or k.dtype != v.dtype or not {pool_k.dtype, k.dtype} <= _DTYPES.keys():
        return (f"needs float32, bfloat16 or float16 pools and tokens (one dtype each for K and V), got pools "
                f"{pool_k.dtype}/{pool_v.dtype}, tokens {k.dtype}/{v.dtype}")
    if D > MAX_HEAD_DIM:
        return f"needs head_dim <= {MAX_HEAD_DIM}, got {D}"
    return None


def store_rows_c(pool_k: Tensor, pool_v: Tensor, table: Tensor, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor,
                 ring_rows: Tensor, rows_per_block: int) -> None:
    """``write.store_rows`` in one C call (a decode step writes a few rows per layer, where
    PyTorch's indexed writes cost more than the bytes), the same bits: the casts round as torch's ``.to()`` does.
    Raises ValueError, writing nothing, where it does not apply (tensors off the CPU, a pool whose blocks' rows
    are not ``D`` apart, a dtype it does not read), and for any shape, index or table entry outside the buffer it
    indexes (``_store_shapes``; the indices and entries checked in C before the first write)."""
    _require_lib()
    _store_shapes(pool_k, pool_v, table, k, v, (at, seqs, ring_rows), rows_per_block)
    why = _store_refusal(pool_k, pool_v, table, k, v)
    if why:
        raise ValueError(f"the C row write {why}")
    trace.ran("write_rows", "c")
    keep = []
    index = [t.contiguous() for t in (at, seqs, ring_rows)]
    s = _store_struct(pool_k, pool_v, table, k, v, index, rows_per_block, keep)
    code = _lib.qsinkkv_store_rows(ctypes.byref(s))  # (it checks each index and table entry first)
    if code == Status.OUT_OF_RANGE:
        raise _index_error((("at", index[0], s.x_rows, "k's tokens"), ("seqs", index[1], s.table_rows, "table's rows"),
                            ("ring_rows // rows_per_block", index[2] // rows_per_block, s.table_cols,
                             "table's columns")), "the C row write refused an index")
    if code:
        raise _store_error(code, table, seqs, ring_rows, rows_per_block, s.num_blocks, "the C row write")


def _index_error(entries: tuple, otherwise: str) -> ValueError:
    """The error of a C write that refused an index (``Status.OUT_OF_RANGE``): the first of ``entries``
    ``(name, index tensor, bound, what it indexes)`` with an entry outside ``[0, bound)``, by name, else
    ``otherwise``."""
    for name, t, bound, of in entries:
        bad = t[(t < 0) | (t >= bound)]
        if bad.numel():
            return ValueError(f"{name} must lie in [0, {bound}) ({of}), got {sorted(set(bad.tolist()))[:8]}: nothing "
                              f"was written")
    return ValueError(f"{otherwise}: nothing was written")


def _store_error(code: int, table: Tensor, seqs: Tensor, ring_rows: Tensor, rows_per_block: int, num_blocks: int,
                 what: str) -> Exception:
    """The error of a refused row write (``qsinkkv_store_rows``' code), naming the table entries it refused."""
    table2 = table if table.dim() == 2 else table.unsqueeze(1)
    used = table2[seqs.to(table.device), ring_rows.to(table.device) // rows_per_block].cpu()
    bad = sorted(set(used[(used < 0) | (used >= num_blocks)].tolist()))  # (-1, no block, as the others refuse it)
    if code in (Status.NO_BLOCK, Status.PAST_POOL) and bad:  # (write.check_rows' words: every writer refuses alike)
        return ValueError(f"table must name blocks of pool_k and pool_v (the rows this write stores) in "
                          f"[0, {num_blocks}); got {bad}: nothing was written")
    return RuntimeError(f"{what} failed ({Status(code).name})")


def _complete_struct(storage: LayerStorage, k: Tensor, v: Tensor, index: list, keep: list) -> _Complete:
    k, v, stride = _kv_rows(k, v, keep)
    keep += [k, v, *index]
    return _Complete(n=index[0].shape[0], x_k=k.data_ptr(), x_v=v.data_ptr(), x_dtype=_DTYPES[k.dtype],
                     x_stride=stride, at=index[0].data_ptr(), seqs=index[1].data_ptr(), blocks=index[2].data_ptr(),
                     first_new=index[3].data_ptr(), float_rows=storage.layout.float_rows, x_rows=k.shape[0])


def _complete_refusal(storage: LayerStorage, k: Tensor, v: Tensor, quantizer) -> str | None:
    """Why the C block completion cannot serve this write, or None."""
    cfg = storage.layout.config
    if storage.device.type != "cpu" or k.device.type != "cpu":
        return "needs CPU tensors"
    if quantizer is not quant:
        return f"quantizes as qsinkkv.quant does; got the quantizer {getattr(quantizer, '__name__', quantizer)}"
    if k.dtype != v.dtype or not {k.dtype, cfg.window_dtype, cfg.scale_dtype} <= _DTYPES.keys():
        return (f"needs float32, bfloat16 or float16 tokens (one dtype for K and V), window_dtype and scale_dtype; "
                f"got tokens {k.dtype}/{v.dtype}, window_dtype={cfg.window_dtype}, scale_dtype={cfg.scale_dtype}")
    if storage.head_dim > MAX_HEAD_DIM:
        return f"needs head_dim <= {MAX_HEAD_DIM}, got {storage.head_dim}"
    return None


def complete_blocks_c(storage: LayerStorage, k: Tensor, v: Tensor, at: Tensor, seqs: Tensor, blocks: Tensor,
                      first_new: Tensor, quantizer) -> None:
    """``write.complete_blocks`` in one C call: gathered, quantized (quant.py's rounding rule, the same codes and
    scales) and written to the pages with no PyTorch op, whose small indexed reads and writes cost more than the
    bytes (and, on a core another process shares, each wait for OpenMP's threads). Raises ValueError, writing
    nothing, for a block whose scale overflows ``scale_dtype`` (``quant.scale_overflow``'s error) and for a write it
    does not serve (off the CPU, the Triton quantizer, a dtype it does not read)."""
    _require_lib()
    storage.check_shapes()
    Hkv, D = storage.num_kv_heads, storage.head_dim
    if (not all(isinstance(x, Tensor) and x.dim() == 3 and x.shape[1:] == (Hkv, D) for x in (k, v))
            or k.shape != v.shape):
        raise ValueError(f"k, v must be [N, Hkv={Hkv}, D={D}] (the storage's heads and head_dim), got "
                         f"{list(getattr(k, 'shape', []))} and {list(getattr(v, 'shape', []))}")
    _index_rows(("at", "seqs", "blocks", "first_new"), (at, seqs, blocks, first_new))
    why = _complete_refusal(storage, k, v, quantizer)
    if why:
        raise ValueError(f"the C block completion {why}")
    trace.ran("write_blocks", "c")
    keep = []
    # (in place: codes written into a copy of a pool would never reach it)
    pools = _pools([getattr(storage, name) for name in _POOLS], keep, in_place=True)
    a = _args(storage, keep, pools, B=storage.batch_size, G=1)
    c = _complete_struct(storage, k, v, [t.contiguous() for t in (at, seqs, blocks, first_new)], keep)
    code = _lib.qsinkkv_complete_blocks(ctypes.byref(a), ctypes.byref(c))
    if code == Status.PAST_POOL:  # (nothing written): name the entry
        _check_tables(storage)
    if code == Status.SCALE_OVERFLOW:
        raise write.overflow_error(storage, k, v, at, seqs, blocks, first_new)
    if code == Status.NO_BLOCK:  # a table naming no block (-1) where the write goes or reads: every writer's words
        write.check_blocks(storage, seqs, blocks, first_new)
        raise ValueError("a table names no block (-1) for a block this write completes: nothing was written")
    if code == Status.OUT_OF_RANGE:
        raise _index_error((("seqs", seqs, storage.batch_size, "the storage's sequences"),
                            ("blocks", blocks, math.inf, "recent block indices")),
                           f"at must name the tokens of k (N={k.shape[0]}) each completing block reads, got at "
                           f"{at.tolist()[:8]} for blocks {blocks.tolist()[:8]}")
    if code:
        raise RuntimeError(f"the C block completion failed ({Status(code).name})")


WRITER_C = write.Writer("c", complete_blocks_c, store_rows_c)


def peaks_c(tensors: list[Tensor]) -> list[float]:
    """``checks.peaks_torch`` in C (``qsinkkv_peak``): max |x| of each CPU tensor of float32, bfloat16 or float16, exact
    (one of its values, as a float), NaN where any value is NaN; one pass over the values' bits as integers, no
    temporary, where ``torch.aminmax`` converts (docs/benchmarks.md, "Decisions in the code"). Reads a tensor whose
    rows (dims 1..) are dense as it lies, rows any stride apart (a column slice of the fused qkv); another through a
    contiguous copy."""
    _require_lib()
    trace.ran("value_checks", "c")
    out = []
    for x in tensors:
        if x.device.type != "cpu" or x.dtype not in _DTYPES:
            raise ValueError(f"the C value checks read CPU float32, bfloat16 or float16 tensors, got {x.dtype} on "
                             f"{x.device}")
        if not x.numel():
            out.append(0.0)
            continue
        if x.dim() < 2 or x.stride()[1:] != _contiguous_strides(x.shape[1:]):
            x = x.contiguous().view(1, -1)
        out.append(_lib.qsinkkv_peak(x.data_ptr(), _DTYPES[x.dtype], x.shape[0], x[0].numel(), x.stride(0)))
    return out


class EngineDecode:
    """One decode step of an engine's pages for every layer (every row one new token, past its sinks: vLLM's
    common step): prepared once from the first layer's ``store`` record (the plan of the write, the tables, the
    visible bias), then ``run`` per layer: the value checks, the write (the blocks that complete, the float rows)
    and the decode in two C calls, the bits ``engine_pages.attend_packed`` gives for such a step. A step the
    checks or a block's scale refuse raises by name, nothing written; so does a layer the C code cannot read in
    place.

    ``step_plan``: the step's ``plan.StepPlan`` (its ``decoding``, ``lens``, ``held`` and ``write`` are read);
    ``refuse(q, k, v)``: raises the value checks' own error for a step the C check refused (``step.check_values``).
    The engine step hands both in: an op never imports the plan or the step (tests/test_layering.py)."""

    def __init__(self, store: LayerStorage, step_plan, refuse: Callable[[Tensor, Tensor, Tensor], None]):
        _require_lib()
        if not step_plan.decoding or step_plan.batch_size != store.batch_size:
            raise ValueError(f"the C engine step serves a plain decode step of the store's {store.batch_size} rows "
                             f"(every row one new token past its sinks), got a plan of {step_plan.batch_size} rows "
                             f"bringing {list(step_plan.lens)} tokens after {step_plan.held.tolist()}")
        layout, held, wrote = store.layout, step_plan.held, step_plan.write
        self.refuse = refuse
        self.bias = layout.visible_bias(held + 1, store.device)
        self.index = [t.contiguous() for t in (wrote.full_at, wrote.full_rows, wrote.full_block, wrote.full_from,
                                                wrote.float_at, wrote.float_rows, wrote.float_row)]
        # a later layer's record: this one with that layer's pools (the tables as the C structs read them)
        self.store = replace(store, **{name: getattr(store, name).contiguous()
                                       for name in ("sink_table", "float_table", "quant_table")})
        self.layout = layout
        # the first layer's C structs, the template of the later layers whose tensors lie the same way (every layer
        # of an engine has pools of one shape, so the structs are built once a step, not once a layer): their sizes,
        # strides, dtypes and pointers into this step's own tensors; those into a layer's pools, q, k, v and out are
        # set at each call (_point)
        self._template = None

    def run(self, layer, q: Tensor, k: Tensor, v: Tensor, scale: float | None,
            out: Tensor | None = None, sink_logits: Tensor | None = None) -> Tensor:
        """``q [B, H, D]``, ``k, v [B, Hkv, D]`` (row b's new token) -> ``[B, H, D]`` in q's dtype (or into ``out``, a
        contiguous ``[B, H, D]`` float32/bf16/fp16 tensor, rounded as ``.to()`` rounds), stored into ``layer``'s pools
        (an ``engine_pages.LayerPools``: ``pools`` by name). Raises ValueError, nothing written, for a value the
        checks refuse (their own error, ``refuse``), a block whose scale overflows, q, k or v of a dtype the C code does
        not read, or pools it would read through a copy. ``sink_logits [H]``: the layer's learned sinks (gpt-oss), or
        None."""
        B, Hkv, D = self.store.batch_size, self.store.num_kv_heads, self.store.head_dim
        pool_tensors = [layer.pools[name] for name in _POOLS]
        if (q.dim() != 3 or q.shape[0] != B or q.shape[1] % Hkv or q.shape[2] != D or k.shape != (B, Hkv, D)
                or v.shape != k.shape):
            raise ValueError(f"q must be [B={B}, H (a multiple of Hkv={Hkv}), D={D}] and k, v [B, Hkv, D], got q "
                             f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
        if q.dtype not in _DTYPES or k.dtype not in _DTYPES or v.dtype != k.dtype:
            raise ValueError(f"the C engine step reads float32, bfloat16 or float16 q, and k and v of one such dtype; "
                             f"got {q.dtype}, {k.dtype} and {v.dtype}")
        if not (q.is_cpu and k.is_cpu and v.is_cpu and pool_tensors[0].is_cpu):
            raise ValueError(f"the C engine step reads CPU tensors, got q, k, v and the pools on {q.device}, "
                             f"{k.device}, {v.device} and {pool_tensors[0].device}")
        _check_out(out, q)
        keep = []  # (copies of q, k, v or the sink logits the C code reads: alive until the call returns)
        logits = _sink_logits(sink_logits, q.shape[1], keep)
        pools = _pools(pool_tensors, keep, in_place=True)
        trace.ran("engine_step", "c")
        q_rows, q_stride = _rows(q, keep)
        k_rows, v_rows, kv_stride = _kv_rows(k, v, keep)
        out = torch.empty(q.shape, dtype=q.dtype) if out is None else out
        scale = q.shape[2] ** -0.5 if scale is None else scale
        lies = (pools[2], q.shape, q_stride, q.dtype, k.shape, kv_stride, k.dtype, v.dtype, out.dtype, scale)
        if self._template is None or self._template[0] != lies:
            store = replace(self.store, **layer.pools)
            a = _args(store, keep, pools, B=q.shape[0], G=q.shape[1] // store.num_kv_heads, q=q_rows.data_ptr(),
                      q_dtype=_DTYPES[q.dtype], q_stride=q_stride, bias=self.bias.data_ptr(), sink_logits=None,
                      scale=scale, out=out.data_ptr(), out_dtype=_DTYPES[out.dtype])
            c = _complete_struct(store, k_rows, v_rows, self.index[:4], keep)
            st = _store_struct(store.float_k, store.float_v, store.float_table, k_rows, v_rows, self.index[4:],
                               store.float_k.shape[2], keep)
            self._template = (lies, a, c, st, window_bound(self.layout.config, k.dtype))
        _, a, c, st, bound = self._template
        pointers, x_k, x_v = pools[0], k_rows.data_ptr(), v_rows.data_ptr()
        _point(a, **pointers, q=q_rows.data_ptr(), out=out.data_ptr(), sink_logits=logits)
        _point(c, x_k=x_k, x_v=x_v)
        _point(st, x_k=x_k, x_v=x_v, pool_k=pointers["float_k"], pool_v=pointers["float_v"])
        code = _lib.qsinkkv_engine_write(ctypes.byref(a), ctypes.byref(c), ctypes.byref(st), bound)
        if code == Status.VALUE_REFUSED:  # the value checks' own error names it
            self.refuse(q, k, v)
            raise RuntimeError("the C engine step refused a value that the value checks accept: the two disagree")
        if code == Status.SCALE_OVERFLOW:
            raise write.overflow_error(replace(self.store, **layer.pools), k, v, *self.index[:4])
        if code:
            raise RuntimeError(f"the C engine step failed ({Status(code).name})")
        _decode_units(a, a.Hkv * a.B, self.layout.num_slots * a.D)
        return out
