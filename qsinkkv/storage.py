"""LayerStorage: one layer's KV storage as a plain record, the thing every op reads.

The ops (``write``, ``decode``, ``prefill``, the Triton kernels of ``qsinkkv.kernels``) take this record and never the
cache. Which recent token sits in which ring slot is ``layout.py``'s business; this record says
where each slot of each sequence lives: in a *block* of a pool, named by a block table (vLLM's
paging). The pools are head-major, so that a sequence's blocks of one head are one batch of a
matmul when its blocks are contiguous:

  sink_k, sink_v           [Hkv, sink_pages, S, D]           sink_dtype    one page per sequence
  float_k, float_v         [Hkv, float_blocks, fr, D]        window_dtype  (filling block + residual)
  key_codes, value_codes   [Hkv, quant_blocks, bs, D/cpb]    uint8         (cpb = 2 for int4, else 1)
  key_scale, key_zero      [Hkv, quant_blocks, D]            scale_dtype   (per block and channel)
  value_scale, value_zero  [Hkv, quant_blocks, bs, D/G]      scale_dtype   (per token and group)

  sink_table   [B]                 int64, device   sequence b's sink page
  float_table  [B, nf]             int64, device   the float blocks of each sequence's ring (-1: none yet)
  quant_table  [B, quant_slots]    int64, device   the block of each quantized-ring slot (-1: none yet)
  seq_lens     [B]                 int64, host     tokens stored per sequence

Float-ring row ``r`` of sequence b is row ``r % fr`` of block ``float_table[b, r // fr]``, where ``fr`` is the
float pool's own block (``float_k.shape[2]``, its one holder): ``block_size`` in the pools ``allocate`` makes
(``nf = float_slots``), fewer rows in an engine's pages (``engine_pages``: a page holds ``fr`` rows, a ring
``nf = cdiv(float_rows, fr)`` pages);
quantized-ring slot j is block ``quant_table[b, j]``. A slot whose table entry is -1 was never
written and holds no visible token: an op reads zeros there (``by_table``) or skips it, never another block
(a block the sequence does not hold may be another's, or NaN: the mask is no guard, 0 x NaN is NaN).

``dense`` storage (``allocate``: a fixed batch, the plain cache) gives sequence b the blocks
``b * n .. b * n + n - 1`` of each pool, so reading through the tables is a view; a paged
storage (``allocate_pool``) takes blocks from a shared pool as sequences grow (``qsinkkv.paged``).

``seq_lens`` lives on the host: the write path decides on the host which rows fill a block or a
sink (no device sync), and the kernels take a device copy.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from . import quant
from .layout import WindowLayout

STORAGE_TENSORS = ("sink_k", "sink_v", "float_k", "float_v", "key_codes", "key_scale", "key_zero",
                   "value_codes", "value_scale", "value_zero")
FLOAT_TENSORS = ("float_k", "float_v")
QUANT_TENSORS = ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")
SINK_TENSORS = ("sink_k", "sink_v")
KIND_TENSORS = {"sink": SINK_TENSORS, "float": FLOAT_TENSORS, "quant": QUANT_TENSORS}  # the pools of each block kind


@dataclass(eq=False)
class LayerStorage:
    layout: WindowLayout
    sink_k: Tensor
    sink_v: Tensor
    float_k: Tensor
    float_v: Tensor
    key_codes: Tensor
    key_scale: Tensor
    key_zero: Tensor
    value_codes: Tensor
    value_scale: Tensor
    value_zero: Tensor
    sink_table: Tensor
    float_table: Tensor
    quant_table: Tensor
    seq_lens: Tensor
    dense: bool

    @classmethod
    def allocate(cls, layout: WindowLayout, batch_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> LayerStorage:
        """A fixed batch: sequence b owns its blocks from the start (tables are the identity)."""
        B = batch_size
        storage = cls.allocate_pool(layout, num_kv_heads, head_dim, device, sink_pages=B,
                                    float_blocks=B * layout.float_slots, quant_blocks=B * layout.quant_slots)
        storage.sink_table, storage.float_table, storage.quant_table = _identity_tables(layout, B, device)
        storage.seq_lens = torch.zeros(B, dtype=torch.int64)
        storage.dense = True
        return storage

    @classmethod
    def allocate_pool(cls, layout: WindowLayout, num_kv_heads: int, head_dim: int, device: torch.device, *,
                      sink_pages: int, float_blocks: int, quant_blocks: int) -> LayerStorage:
        """Pools of the given sizes, zeroed, and no sequence yet (B = 0)."""
        cfg = layout.config
        H, D, S, bs = num_kv_heads, head_dim, cfg.sink_tokens, cfg.block_size
        zeros = lambda *shape, dtype: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        Dc = D // quant.codes_per_byte(cfg.bits)
        groups = D // cfg.value_group_size if cfg.bits != 16 else 0
        P, Q = float_blocks, quant_blocks
        table = lambda n: torch.empty(0, n, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            layout,
            sink_k=zeros(H, sink_pages, S, D, dtype=cfg.sink_dtype),
            sink_v=zeros(H, sink_pages, S, D, dtype=cfg.sink_dtype),
            float_k=zeros(H, P, bs, D, dtype=cfg.window_dtype), float_v=zeros(H, P, bs, D, dtype=cfg.window_dtype),
            key_codes=zeros(H, Q, bs, Dc, dtype=torch.uint8),
            key_scale=zeros(H, Q, D, dtype=cfg.scale_dtype), key_zero=zeros(H, Q, D, dtype=cfg.scale_dtype),
            value_codes=zeros(H, Q, bs, Dc, dtype=torch.uint8),
            value_scale=zeros(H, Q, bs, groups, dtype=cfg.scale_dtype),
            value_zero=zeros(H, Q, bs, groups, dtype=cfg.scale_dtype),
            sink_table=torch.empty(0, dtype=torch.int64, device=device),
            float_table=table(layout.float_slots), quant_table=table(layout.quant_slots),
            seq_lens=torch.zeros(0, dtype=torch.int64), dense=False)

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.sink_k.shape[0]

    @property
    def head_dim(self) -> int:
        return self.sink_k.shape[3]

    @property
    def device(self) -> torch.device:
        return self.sink_k.device

    def check_shapes(self) -> None:
        """Every pool and table has the shape and dtype the layout and the sink pool's ``[Hkv, _, S, D]`` say (blocks
        per pool may differ; the float pool's rows per block are its own, ``fr``), else a ValueError naming the
        tensor: the check of a record handed to an op that reads its buffers by these sizes (the C decode computes
        every offset from them)."""
        cfg, layout = self.layout.config, self.layout
        H, D, S, bs = self.num_kv_heads, self.head_dim, cfg.sink_tokens, cfg.block_size
        B, fr, Dc = self.batch_size, self.float_k.shape[2], D // quant.codes_per_byte(cfg.bits)
        groups = D // cfg.value_group_size if cfg.bits != 16 else 0
        want = {"sink_k": ((H, None, S, D), cfg.sink_dtype), "sink_v": ((H, None, S, D), cfg.sink_dtype),
                "float_k": ((H, None, fr, D), cfg.window_dtype), "float_v": ((H, None, fr, D), cfg.window_dtype),
                "key_codes": ((H, None, bs, Dc), torch.uint8), "value_codes": ((H, None, bs, Dc), torch.uint8),
                "key_scale": ((H, None, D), cfg.scale_dtype), "key_zero": ((H, None, D), cfg.scale_dtype),
                "value_scale": ((H, None, bs, groups), cfg.scale_dtype),
                "value_zero": ((H, None, bs, groups), cfg.scale_dtype),
                "sink_table": ((B,), torch.int64), "float_table": ((B, None), torch.int64),
                "quant_table": ((B, layout.quant_slots), torch.int64)}
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if (t.dim() != len(shape) or t.dtype != dtype
                    or any(n is not None and n != size for n, size in zip(shape, t.shape))):
                expected = ", ".join("blocks" if n is None else str(n) for n in shape)
                raise ValueError(f"{name} must be {dtype} [{expected}] for this storage (Hkv={H}, head_dim={D}, "
                                 f"sink_tokens={S}, block_size={bs}, {B} sequences), got {t.dtype} {list(t.shape)}")
        if fr < 1 or self.float_table.shape[1] * fr < layout.float_rows:
            raise ValueError(f"float_table's {self.float_table.shape[1]} blocks of float_k's {fr} rows must hold the "
                             f"float ring's {layout.float_rows} rows")

    def tensors(self) -> dict[str, Tensor]:
        """The storage tensors by name (not the tables or ``seq_lens``)."""
        return {name: getattr(self, name) for name in STORAGE_TENSORS}

    def nbytes(self) -> int:
        """Bytes of the pools (every block, held or free)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> LayerStorage:
        """A copy on ``device``: the pools and tables moved, ``seq_lens`` (host) copied."""
        moved = {name: getattr(self, name).to(device, copy=True) for name in (*STORAGE_TENSORS, "sink_table",
                                                                            "float_table", "quant_table")}
        return replace(self, **moved, seq_lens=self.seq_lens.clone())

    def rows(self, b: int) -> LayerStorage:
        """Sequence ``b`` alone: the same pools, its table rows and a view of its length (writing through
        it writes this storage)."""
        return replace(self, sink_table=self.sink_table[b:b + 1], float_table=self.float_table[b:b + 1],
                       quant_table=self.quant_table[b:b + 1], seq_lens=self.seq_lens[b:b + 1], dense=False)

    def select_rows(self, rows: list[int]) -> LayerStorage:
        """Sequences ``rows`` (any subset, in that order), for reading: the same pools, read through their
        table rows (copies, as are the lengths: writing through the result does not write this storage)."""
        index = torch.tensor(rows, dtype=torch.int64)
        on_device = index.to(self.sink_table.device)
        return replace(self, sink_table=self.sink_table[on_device], float_table=self.float_table[on_device],
                       quant_table=self.quant_table[on_device], seq_lens=self.seq_lens[index], dense=False)

    def part(self, heads: slice, rows: slice) -> LayerStorage:
        """KV heads ``heads`` of sequences ``rows`` (contiguous ranges), for reading: views of the pools
        (head-major, so a range of heads is one slice; a dense storage stays dense, its sequences'
        blocks being one run per head) and of the tables and lengths."""
        if not self.dense:
            return replace(self, **{name: getattr(self, name)[heads] for name in STORAGE_TENSORS},
                           sink_table=self.sink_table[rows], float_table=self.float_table[rows],
                           quant_table=self.quant_table[rows], seq_lens=self.seq_lens[rows])
        B, n = self.batch_size, len(range(*rows.indices(self.batch_size)))
        pools = {name: _per_sequence(getattr(self, name), B)[heads, rows].flatten(1, 2) for name in STORAGE_TENSORS}
        sink_table, float_table, quant_table = _identity_tables(self.layout, n, self.device)
        return replace(self, **pools, sink_table=sink_table, float_table=float_table, quant_table=quant_table,
                       seq_lens=self.seq_lens[rows])

    def select(self, index: Tensor) -> None:
        """Keep, reorder or repeat sequences (``index [B']`` of rows) of a dense storage: their blocks are
        copied into the new order, so the tables stay the identity."""
        if not self.dense:
            raise ValueError("select() reorders the blocks of a dense storage; a paged storage selects table rows")
        index = index.to(self.device)
        B, Bn = self.batch_size, index.shape[0]
        for name in STORAGE_TENSORS:
            setattr(self, name, _per_sequence(getattr(self, name), B).index_select(1, index).flatten(1, 2).contiguous())
        self.sink_table, self.float_table, self.quant_table = _identity_tables(self.layout, Bn, self.device)
        self.seq_lens = self.seq_lens.index_select(0, index.cpu())

    def clear(self, rows: Tensor) -> None:
        """Empty sequences ``rows``: length 0, and their blocks zeroed."""
        self.seq_lens[rows.cpu()] = 0
        rows = rows.to(self.device)
        tables = {"sink": self.sink_table[rows], "float": self.float_table[rows], "quant": self.quant_table[rows]}
        # (an engine's new rows name its null block many times)
        self.zero_blocks({kind: table[table >= 0].unique() for kind, table in tables.items()})

    def zero_blocks(self, blocks: dict[str, Tensor]) -> None:
        """Zero blocks of the pools: ``blocks[kind]`` (kind "sink", "float" or "quant"; 1-D int64, on any device)
        in every pool of that kind (``KIND_TENSORS``)."""
        for kind, index in blocks.items():
            index = torch.as_tensor(index, dtype=torch.int64).to(self.device)
            if index.numel():
                for name in KIND_TENSORS[kind]:
                    _as_words(getattr(self, name)).index_fill_(1, index, 0)


def _as_words(pool: Tensor) -> Tensor:
    """``pool``'s bytes as int64 words where its rows allow (the same zeros, an eighth of the elements to fill:
    index_fill_ goes element by element), else the pool."""
    row_bytes = pool.shape[-1] * pool.element_size()
    if pool.stride(-1) != 1 or row_bytes % 8 or any(st * pool.element_size() % 8 for st in pool.stride()[:-1]) \
            or pool.storage_offset() * pool.element_size() % 8:
        return pool
    return pool.view(torch.uint8).view(torch.int64)


def _per_sequence(pool: Tensor, batch_size: int) -> Tensor:
    """A dense storage's pool ``[Hkv, B * n, ...]`` as ``[Hkv, B, n, ...]``: sequence b's n blocks."""
    return pool.view(pool.shape[0], batch_size, pool.shape[1] // batch_size, *pool.shape[2:])


def _identity_tables(layout: WindowLayout, batch_size: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """A dense storage's sink, float and quantized tables: sequence b owns blocks ``b * n .. b * n + n - 1``."""
    arange = lambda n: torch.arange(batch_size * n, dtype=torch.int64, device=device).view(batch_size, n)  # noqa: E731
    return arange(1)[:, 0], arange(layout.float_slots), arange(layout.quant_slots)


def by_table(pool: Tensor, table: Tensor, dense: bool) -> Tensor:
    """Read a pool ``[Hkv, blocks, ...]`` through a table ``[B, n]`` (or ``[B]``): ``[Hkv, B, n, ...]``
    (``[Hkv, B, ...]``); a view when the storage is dense, else a gather in which a -1 entry (no block) reads
    zeros. Never another block: a block the sequence does not hold may belong to another sequence or hold
    anything, and the mask is no guard (0 x NaN is NaN)."""
    if dense:
        return pool.view(pool.shape[0], *table.shape, *pool.shape[2:])
    out = pool[:, table.clamp(min=0)]
    none = (table < 0).view(1, *table.shape, *(1,) * (pool.dim() - 2))
    return out.masked_fill_(none, 0)


def gather(storage: LayerStorage, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Every slot, dequantized (the reference read): k, v ``[B, Hkv, N, D]`` in ``dtype`` and
    their positions ``[B, N]`` (-1: empty)."""
    s = storage
    buf = torch.empty(s.num_kv_heads, s.batch_size, s.layout.num_slots, s.head_dim, dtype=torch.float32,
                      device=s.device)
    k = gather_into(s, "k", buf).transpose(0, 1).to(dtype)
    if dtype == torch.float32:  # k is the buffer itself
        buf = torch.empty_like(buf)
    v = gather_into(s, "v", buf).transpose(0, 1).to(dtype)  # (other dtypes: one float32 buffer at a time)
    positions = torch.cat(s.layout.slot_positions(s.seq_lens.to(s.device)), dim=1)
    return k, v, positions


def gather_into(storage: LayerStorage, part: str, out: Tensor) -> Tensor:
    """Dequantize every key (``part="k"``) or value (``"v"``) slot into float32 ``out [Hkv, B, N, D]``
    (head-major, as the pools): the sinks, then the quantized ring, then the float ring, the slot
    order of ``slot_positions``. Returns ``out``."""
    s, cfg = storage, storage.layout.config
    S, bs, nq = cfg.sink_tokens, cfg.block_size, s.layout.quant_slots
    read = lambda name, table: by_table(getattr(s, name), table, s.dense)  # noqa: E731
    sink, codes, scale, zero, ring = _PARTS[part]
    out[:, :, :S] = read(sink, s.sink_table)
    if nq:
        t, blocks = s.quant_table, out[:, :, S:S + nq * bs].unflatten(2, (nq, bs))
        if part == "k":
            quant.dequantize_key_blocks(read(codes, t), read(scale, t), read(zero, t), cfg.bits, out=blocks)
        else:
            quant.dequantize_values(read(codes, t), read(scale, t), read(zero, t), cfg.bits, cfg.value_group_size,
                                    out=blocks)
    out[:, :, S + nq * bs:] = read(ring, s.float_table).flatten(2, 3)[:, :, :s.layout.float_rows]
    return out


_PARTS = {"k": ("sink_k", "key_codes", "key_scale", "key_zero", "float_k"),
          "v": ("sink_v", "value_codes", "value_scale", "value_zero", "float_v")}
