"""PagedCache: a ``SinkQuantCache`` whose storage is one pool of blocks shared by sequences that
join and leave (continuous batching).

Every layer has three pools (``storage.py``): sink pages (one per sequence, S tokens), float
blocks (the filling block and the residual: the whole window with bits=16) and quantized blocks.
A sequence holds a sink page from ``admit`` to ``release`` and takes float and quantized blocks as
it grows, never more than its ring has slots (``float_slots`` and ``quant_slots``): once the
window is full, a block that leaves it is the one the next block overwrites, so a stream of any
length holds at most ``1 + float_slots + quant_slots`` blocks, and memory in use follows
``min(len, C)`` per sequence. The block tables are shared by all layers (as in vLLM): a step
takes its blocks once, before layer 0 stores anything.

The rows of the cache (its batch) are the admitted sequences, in order of admission; ``seq_ids``
names them. A step covers every admitted sequence, each with its own number of new tokens
(0: it waits), decode and prefill chunks mixed. Everything ``SinkQuantCache`` guarantees holds:
inputs are checked before anything is stored, a refused step changes nothing in any layer, and
a step that would need more blocks than are free raises ``PoolExhausted`` before any is taken.

    cache = PagedCache.for_bytes(config, num_layers, num_kv_heads, head_dim, pool_bytes=2**30)
    a = cache.admit()                        # a sequence id; its row is cache.seq_ids.index(a)
    meta = cache.reserve([len(prompt_a)])    # optional: blocks now, and vLLM-shaped metadata
    out = cache.attend(layer, q, k, v, lengths)           # padded [B, H, T, D] + lengths [B]
    out = cache.attend_packed(layer, q, k, v, query_start_loc)  # packed [N, H, D]
    cache.release(a)                         # its blocks go back to the pool
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import SinkQuantCache
from .checks import host_ints
from .config import CacheConfig
from .layout import WindowLayout, cdiv
from .rope import Rotary
from .storage import FLOAT_TENSORS, QUANT_TENSORS, SINK_TENSORS, LayerStorage

KINDS = ("sink", "float", "quant")
_KIND_TENSORS = {"sink": SINK_TENSORS, "float": FLOAT_TENSORS, "quant": QUANT_TENSORS}


class PoolExhausted(RuntimeError):
    """A step or admission needs more blocks than the pool has free; nothing was changed."""


@dataclass(frozen=True)
class StepMetadata:
    """One step's batch, shaped like vLLM's attention metadata (rows = ``seq_ids`` order).

    query_start_loc [B + 1] int64: row b's new tokens are packed rows ``[qsl[b], qsl[b+1])``.
    seq_lens        [B] int64:     tokens each sequence holds after the step.
    sink_table      [B] int64:     each sequence's sink page.
    float_table     [B, float_slots], quant_table [B, quant_slots] int64: the block of each ring
                    slot (-1: not taken).
    slot_mapping    [N] int64:     where each new token's K/V is written in the float pools, as
                    ``block * block_size + row``; -1 for a token that goes to the sink page, is
                    quantized straight from the chunk, or leaves the window within the chunk.
    """
    query_start_loc: Tensor
    seq_lens: Tensor
    sink_table: Tensor
    float_table: Tensor
    quant_table: Tensor
    slot_mapping: Tensor


class PagedCache(SinkQuantCache):
    """``PagedCache(config, num_layers, num_kv_heads, head_dim, *, max_seqs, float_blocks, quant_blocks,
    device="cpu", dtype=torch.bfloat16, rotary=None, backend="auto")``: pools of the given sizes in every
    layer (``for_bytes`` sizes them from a byte budget), and no sequence yet."""

    def __init__(self, config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 max_seqs: int, float_blocks: int, quant_blocks: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, rotary: Rotary | None = None, backend: str = "auto",
                 decode_variant: str = "dequantize"):
        layout = WindowLayout(config) if isinstance(config, CacheConfig) else None
        for name, value, least in (("max_seqs", max_seqs, 1),
                                   ("float_blocks", float_blocks, layout.float_slots if layout else 0),
                                   ("quant_blocks", quant_blocks, layout.quant_slots if layout else 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an int >= {least} (one sequence's ring), got {value!r}")
        self._sizes = {"sink": max_seqs, "float": float_blocks, "quant": quant_blocks}
        super().__init__(config, num_layers, max_seqs, num_kv_heads, head_dim, device=device, dtype=dtype,
                         rotary=rotary, backend=backend, decode_variant=decode_variant)
        # LIFO free lists: a released block is the next one taken (warm in cache)
        self._free = {kind: list(range(n - 1, -1, -1)) for kind, n in self._sizes.items()}
        # the block tables as edited, on the host (the layers read device copies), and how many ring slots
        # of each sequence hold a block (always a prefix of its ring)
        self._host = {"sink": torch.empty(0, dtype=torch.int64),
                      "float": torch.empty(0, self.layout.float_slots, dtype=torch.int64),
                      "quant": torch.empty(0, self.layout.quant_slots, dtype=torch.int64)}
        self._held: dict[str, list[int]] = {"float": [], "quant": []}
        self.seq_ids: list[int] = []
        self._next_id = 0

    @classmethod
    def for_bytes(cls, config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int, pool_bytes: int,
                  *, max_seqs: int | None = None, **kwargs) -> PagedCache:
        """Pools of at most ``pool_bytes`` over all layers. The blocks are split as full-capacity
        sequences use them, so ``pool_bytes // sequence_bytes`` sequences fit at any length; ``max_seqs``
        (default: that many) sets the sink pages, for more sequences that stay shorter."""
        sizes = block_bytes(config, num_kv_heads, head_dim)
        layout = WindowLayout(config)
        per_seq = sequence_bytes(config, num_layers, num_kv_heads, head_dim)
        full = pool_bytes // per_seq if isinstance(pool_bytes, int) and not isinstance(pool_bytes, bool) else 0
        if full < 1:
            raise ValueError(f"pool_bytes must be an int >= {per_seq} (one sequence at capacity {config.capacity} "
                             f"over {num_layers} layers), got {pool_bytes!r}")
        device = torch.empty(0, device=kwargs.get("device", "cpu")).device
        limit = device_bytes(device)
        if limit is not None and pool_bytes > limit:
            raise ValueError(f"pool_bytes={pool_bytes} is more than {device} has ({limit} bytes): the largest pool "
                             f"this device can hold is under {limit} bytes")
        max_seqs = full if max_seqs is None else max_seqs
        if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs must be an int >= 1, got {max_seqs!r}")
        rest = pool_bytes - max_seqs * num_layers * sizes["sink"]
        ring = per_seq - num_layers * sizes["sink"]                   # one sequence's float + quantized blocks
        if rest < ring:
            raise ValueError(f"max_seqs={max_seqs} sink pages leave {rest} of pool_bytes={pool_bytes}, less than "
                             f"one sequence's blocks ({ring} bytes)")
        n = rest / ring                                               # full rings that fit
        return cls(config, num_layers, num_kv_heads, head_dim, max_seqs=max_seqs,
                   float_blocks=int(n * layout.float_slots), quant_blocks=int(n * layout.quant_slots), **kwargs)

    def _allocate(self, num_layers, batch_size, num_kv_heads, head_dim):
        pools = [LayerStorage.allocate_pool(self.layout, num_kv_heads, head_dim, self.device,
                                            sink_pages=self._sizes["sink"], float_blocks=self._sizes["float"],
                                            quant_blocks=self._sizes["quant"]) for _ in range(num_layers)]
        for layer in pools[1:]:  # one set of tables for every layer
            layer.sink_table, layer.float_table, layer.quant_table = (
                pools[0].sink_table, pools[0].float_table, pools[0].quant_table)
        return pools

    # --- sequences ------------------------------------------------------------------------------
    def admit(self) -> int:
        """A new, empty sequence at the end of the batch: its id (its row is ``seq_ids.index(id)``)."""
        if not self._free["sink"]:
            raise PoolExhausted(f"no free sequence slot: all max_seqs={self._sizes['sink']} are admitted; "
                                "release one first")
        page = self._free["sink"].pop()
        self._host["sink"] = torch.cat((self._host["sink"], torch.tensor([page])))
        for kind, slots in (("float", self.layout.float_slots), ("quant", self.layout.quant_slots)):
            self._host[kind] = torch.cat((self._host[kind], torch.full((1, slots), -1, dtype=torch.int64)))
            self._held[kind].append(0)
        for layer in self.layers:
            layer.seq_lens = torch.cat((layer.seq_lens, torch.zeros(1, dtype=torch.int64)))
        self._push_tables()
        self._undo = [None] * self.num_layers  # an undo record holds the old rows' lengths
        self.seq_ids.append(self._next_id)
        self._next_id += 1
        return self.seq_ids[-1]

    def release(self, seq_id: int) -> None:
        """Forget sequence ``seq_id``: its blocks go back to the pool, later rows move up one."""
        row = self._row_of(seq_id)
        self._keep_rows([r for r in range(self.batch_size) if r != row])

    def select_batch(self, index) -> None:
        """Keep (or reorder) sequences: the rows not kept are released. Repeating a row (beam search)
        would share its blocks between sequences, and is refused."""
        rows = self._batch_index(index).tolist()
        if len(set(rows)) < len(rows):
            raise ValueError(f"a paged cache cannot repeat sequences (beam search would share their blocks), got "
                             f"rows {rows}; use SinkQuantCache for beam search")
        self._keep_rows(rows)

    def _row_of(self, seq_id) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id not in self.seq_ids:
            raise KeyError(f"seq_id must be an admitted sequence id (one of {self.seq_ids}), got {seq_id!r}")
        return self.seq_ids.index(seq_id)

    def _keep_rows(self, rows: list[int]) -> None:
        dropped = sorted(set(range(self.batch_size)) - set(rows))
        index = torch.tensor(rows, dtype=torch.int64)
        for kind in KINDS:
            held = self._host[kind][dropped]
            self._give(kind, held[held >= 0].tolist())
            self._host[kind] = self._host[kind][index]
        for kind in ("float", "quant"):
            self._held[kind] = [self._held[kind][r] for r in rows]
        self._push_tables()
        for i, layer in enumerate(self.layers):
            layer.seq_lens = layer.seq_lens[index]
            self._undo[i] = None  # rows moved: an undo record names the old ones
        self.seq_ids = [self.seq_ids[r] for r in rows]

    # --- blocks ---------------------------------------------------------------------------------
    def _needed(self, lengths: list[int]) -> dict[str, list[int]]:
        """Float and quantized ring slots a sequence of each length uses (always a prefix of the ring)."""
        L, bs = self.layout, self.config.block_size
        m = [L.recent_count(n) for n in lengths]
        return {"float": [min(cdiv(x, bs), L.float_slots) for x in m],
                "quant": [min(L.quantized_blocks(x), L.quant_slots) for x in m]}

    def reserve(self, lengths) -> StepMetadata:
        """Take the blocks a step of ``lengths[b]`` new tokens per sequence will write (all or none:
        ``PoolExhausted`` leaves the pool as it was), and describe the step. ``attend`` and ``append``
        reserve by themselves; call this to schedule (or to fail) before the model runs. The blocks are
        held until the next step, which keeps only what its own lengths need (a step that brings fewer
        tokens than reserved gives the rest back), so held blocks never outlive what the lengths need.

        lengths: ``[B]`` in row order, or a dict ``{seq_id: new tokens}`` (absent ids: 0)."""
        if isinstance(lengths, dict):
            for seq_id in lengths:
                self._row_of(seq_id)  # KeyError naming the admitted ids
            lengths = [lengths.get(seq_id, 0) for seq_id in self.seq_ids]
        lens = self._per_sequence("lengths", lengths)
        if lens and min(lens) < 0:
            raise ValueError(f"lengths must be >= 0 (new tokens per sequence), got {lens}")
        self._reserve(0, lens)
        return self._metadata(lens)

    def _reserve(self, layer: int, lens: list[int]) -> None:
        """Hold exactly the blocks this step needs: what ``layer`` holds after it, or what a layer that already
        took the step holds. Blocks an earlier ``reserve`` took for more tokens than the step brings go back
        (they hold nothing yet), so a reservation lasts until the next step and never starves others."""
        if not self.batch_size:
            raise ValueError("the cache holds no sequence: admit() one first")
        after = [max(longest, n + t) for longest, n, t in
                 zip(self._longest(), self.layers[layer].seq_lens.tolist(), lens)]
        need = self._needed(after)
        held = self._held
        grow = {kind: [(b, held[kind][b], n) for b, n in enumerate(need[kind]) if n > held[kind][b]]
                for kind in ("float", "quant")}
        shrink = {kind: [(b, n, held[kind][b]) for b, n in enumerate(need[kind]) if n < held[kind][b]]
                  for kind in ("float", "quant")}
        count = {kind: sum(n - h for _, h, n in rows) for kind, rows in grow.items()}
        free = {kind: len(self._free[kind]) + sum(h - n for _, n, h in shrink[kind]) for kind in count}
        if any(count[kind] > free[kind] for kind in count):
            raise PoolExhausted(
                "the pool has too few free blocks for this step: it needs "
                + ", ".join(f"{count[k]} more {k} blocks ({free[k]} free)" for k in count)
                + "; release a sequence or give it fewer new tokens")
        if not any(grow.values()) and not any(shrink.values()):  # (every layer after the first, and most steps)
            return
        for kind, rows in shrink.items():
            for b, n, h in rows:
                self._give(kind, self._host[kind][b, n:h].tolist())
                self._host[kind][b, n:h] = -1
                held[kind][b] = n
        for kind, rows in grow.items():
            for b, h, n in rows:
                self._host[kind][b, h:n] = torch.tensor([self._free[kind].pop() for _ in range(n - h)])
                held[kind][b] = n
        self._push_tables()

    def _release_unneeded(self) -> None:
        need = self._needed(self._longest())
        changed = False
        for kind in ("float", "quant"):
            for b, n in enumerate(need[kind]):
                h = self._held[kind][b]
                if h > n:
                    self._give(kind, self._host[kind][b, n:h].tolist())
                    self._host[kind][b, n:h] = -1
                    self._held[kind][b] = n
                    changed = True
        if changed:
            self._push_tables()

    def _longest(self) -> list[int]:
        """Per sequence, the most tokens any layer holds (layers differ only inside a step)."""
        return torch.stack([layer.seq_lens for layer in self.layers]).amax(0).tolist() if self.batch_size else []

    def _give(self, kind: str, blocks: list[int]) -> None:
        self._free[kind].extend(reversed(blocks))

    def _push_tables(self) -> None:
        """Copy the host tables (the ones edited) to the device tables every layer reads."""
        sink, fl, qu = (self._host[k].to(self.device, copy=True).contiguous() for k in KINDS)
        for layer in self.layers:
            layer.sink_table, layer.float_table, layer.quant_table = sink, fl, qu

    # --- what a scheduler reads -------------------------------------------------------------
    def blocks_in_use(self) -> dict[str, int]:
        """Blocks held by sequences, per kind (sink pages, float blocks, quantized blocks)."""
        return {kind: self._sizes[kind] - len(self._free[kind]) for kind in KINDS}

    def blocks_free(self) -> dict[str, int]:
        return {kind: len(self._free[kind]) for kind in KINDS}

    def nbytes_in_use(self) -> int:
        """Bytes of the blocks sequences hold, over all layers."""
        sizes = block_bytes(self.config, self.num_kv_heads, self.head_dim)
        return self.num_layers * sum(sizes[kind] * n for kind, n in self.blocks_in_use().items())

    def _metadata(self, lens: list[int]) -> StepMetadata:
        L, bs, S = self.layout, self.config.block_size, self.config.sink_tokens
        n0 = self.layers[0].seq_lens.tolist()
        tables = {kind: t.clone() for kind, t in self._host.items()}
        slots = []
        for b, (n, t) in enumerate(zip(n0, lens)):
            m1 = L.recent_count(n + t)
            float_from = max(L.quantized_blocks(m1) * bs, L.first_visible(m1))  # tokens the float ring keeps
            for p in range(n, n + t):
                r = p - S
                if r < float_from:
                    slots.append(-1)
                else:
                    row = r % L.float_rows
                    slots.append(int(tables["float"][b, row // bs]) * bs + row % bs)
        qsl = torch.tensor([0] + lens).cumsum(0)
        return StepMetadata(qsl, torch.tensor(n0) + torch.tensor(lens, dtype=torch.int64), tables["sink"],
                            tables["float"], tables["quant"], torch.tensor(slots, dtype=torch.int64))

    # --- packed ragged input (vLLM's layout) ------------------------------------------------------
    def attend_packed(self, layer: int, q: Tensor, k: Tensor, v: Tensor, query_start_loc, *,
                      scale: float | None = None, sink_logits: Tensor | None = None) -> Tensor:
        """``attend`` on packed tokens: ``q [N, H, D]``, ``k, v [N, Hkv, D]``, row b's new tokens at
        ``[query_start_loc[b], query_start_loc[b+1])`` -> ``[N, H, D]``."""
        B = self.batch_size
        if not B:
            raise ValueError("the cache holds no sequence: admit() one first")
        expected = f"a 1-D int tensor of B + 1 = {B + 1} offsets from 0 to N, non-decreasing"
        qsl = host_ints("query_start_loc", query_start_loc, expected)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.ndim != 3:
                raise ValueError(f"{name} must be a packed [N, heads, D] tensor, got "
                                 f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        N = q.shape[0]
        if (qsl.shape != (B + 1,) or int(qsl[0]) != 0
                or int(qsl[-1]) != N or bool((qsl.diff() < 0).any()) or k.shape[0] != N or v.shape[0] != N):
            raise ValueError(f"query_start_loc must be {expected} (N = {N} rows of q, k and v), got "
                             f"{qsl.tolist() if qsl.ndim == 1 else qsl}")
        lens = qsl.diff()
        T = max(int(lens.max()), 1)
        t = torch.arange(T)
        real = t < lens.unsqueeze(1)                                              # [B, T]
        rows = (qsl[:-1].unsqueeze(1) + t).clamp(max=max(N - 1, 0)).to(q.device)  # pads repeat a real token
        pad = lambda x: x[rows].transpose(1, 2) if N else x.new_zeros(B, x.shape[1], T, x.shape[2])  # noqa: E731
        out = self.attend(layer, pad(q), pad(k), pad(v), lens, scale=scale, sink_logits=sink_logits)
        return out.transpose(1, 2)[real.to(out.device)]


def device_bytes(device: torch.device) -> int | None:
    """The memory of ``device`` in bytes (a CUDA device's total, the host's physical memory for the CPU),
    or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # (no sysconf: Windows)
            return None
    return None


def block_bytes(config: CacheConfig, num_kv_heads: int, head_dim: int) -> dict[str, int]:
    """Bytes of one sink page, float block and quantized block of one layer (read off the storage's own
    allocation, on the meta device)."""
    one = LayerStorage.allocate_pool(WindowLayout(config), num_kv_heads, head_dim, torch.device("meta"),
                                     sink_pages=1, float_blocks=1, quant_blocks=1)
    return {kind: sum(getattr(one, n).numel() * getattr(one, n).element_size() for n in _KIND_TENSORS[kind])
            for kind in KINDS}


def sequence_bytes(config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one sequence holds at (and past) the capacity: its sink page and full rings, all layers."""
    sizes, layout = block_bytes(config, num_kv_heads, head_dim), WindowLayout(config)
    return num_layers * (sizes["sink"] + layout.float_slots * sizes["float"] + layout.quant_slots * sizes["quant"])
