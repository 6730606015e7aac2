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

import torch

from .blocks import KINDS, PagedBlocks, PoolExhausted, StepMetadata, step_metadata
from .cache import SinkQuantCache
from .config import CacheConfig
from .layout import WindowLayout
from .rope import Rotary
from .storage import KIND_TENSORS, LayerStorage

__all__ = ["PagedCache", "PoolExhausted", "StepMetadata", "block_bytes", "sequence_bytes", "device_bytes"]


class PagedCache(SinkQuantCache):
    """``PagedCache(config, num_layers, num_kv_heads, head_dim, *, max_seqs, float_blocks, quant_blocks,
    device="cpu", dtype=torch.bfloat16, rotary=None, backend="auto")``: pools of the given sizes in every
    layer (``for_bytes`` sizes them from a byte budget), and no sequence yet.

    A ``SinkQuantCache`` over a ``qsinkkv.blocks.PagedBlocks`` manager (``cache.blocks``), with what a
    scheduler needs on top: sequence ids (``admit``, ``release``), ``reserve`` with vLLM-shaped metadata, and
    the pool's accounting."""

    def __init__(self, config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 max_seqs: int, float_blocks: int, quant_blocks: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, rotary: Rotary | None = None, backend: str = "auto",
                 decode_variant: str = "dequantize"):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        blocks = PagedBlocks(WindowLayout(config), max_seqs=max_seqs, float_blocks=float_blocks,
                             quant_blocks=quant_blocks)
        super().__init__(config, num_layers, 0, num_kv_heads, head_dim, device=device, dtype=dtype, rotary=rotary,
                         backend=backend, decode_variant=decode_variant, blocks=blocks)
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

    # --- sequences ------------------------------------------------------------------------------
    def admit(self) -> int:
        """A new, empty sequence at the end of the batch: its id (its row is ``seq_ids.index(id)``)."""
        self.blocks.add()  # PoolExhausted when every sink page is taken
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
        rows = [r for r in range(self.batch_size) if r != row]
        self._keep_rows(rows)
        self.seq_ids = [self.seq_ids[r] for r in rows]

    def select_batch(self, index) -> None:
        """Keep (or reorder) sequences: the rows not kept are released. Repeating a row (beam search)
        would share its blocks between sequences, and is refused."""
        rows = self._batch_index(index).tolist()
        self._keep_rows(rows)
        self.seq_ids = [self.seq_ids[r] for r in rows]

    def _row_of(self, seq_id) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id not in self.seq_ids:
            raise KeyError(f"seq_id must be an admitted sequence id (one of {self.seq_ids}), got {seq_id!r}")
        return self.seq_ids.index(seq_id)

    # --- what a scheduler calls and reads --------------------------------------------------------
    def reserve(self, lengths) -> StepMetadata:
        """Take the blocks a step of ``lengths[b]`` new tokens per sequence will write (all or none:
        ``PoolExhausted`` leaves the pool as it was), and describe the step. ``attend`` and ``append``
        reserve by themselves; call this to schedule (or to fail) before the model runs. The blocks are
        held until the next step, which keeps only what its own lengths need (a step that brings fewer
        tokens than reserved gives the rest back), so held blocks never outlive what the lengths need.

        lengths: ``[B]`` in row order, or a dict ``{seq_id: new tokens}`` (absent ids: 0)."""
        if not self.batch_size:
            raise ValueError("the cache holds no sequence: admit() one first")
        if isinstance(lengths, dict):
            for seq_id in lengths:
                self._row_of(seq_id)  # KeyError naming the admitted ids
            lengths = [lengths.get(seq_id, 0) for seq_id in self.seq_ids]
        lens = self._per_sequence("lengths", lengths)
        if lens and min(lens) < 0:
            raise ValueError(f"lengths must be >= 0 (new tokens per sequence), got {lens}")
        self._reserve(0, lens)
        return step_metadata(self.layout, self.blocks.host, self.layers[0].seq_lens.tolist(), lens)

    def blocks_in_use(self) -> dict[str, int]:
        """Blocks held by sequences, per kind (sink pages, float blocks, quantized blocks)."""
        return self.blocks.in_use()

    def blocks_free(self) -> dict[str, int]:
        return {kind: len(self.blocks.free[kind]) for kind in KINDS}

    def nbytes_in_use(self) -> int:
        """Bytes of the blocks sequences hold, over all layers."""
        sizes = block_bytes(self.config, self.num_kv_heads, self.head_dim)
        return self.num_layers * sum(sizes[kind] * n for kind, n in self.blocks_in_use().items())


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
    return {kind: sum(getattr(one, n).numel() * getattr(one, n).element_size() for n in KIND_TENSORS[kind])
            for kind in KINDS}


def sequence_bytes(config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes one sequence holds at (and past) the capacity: its sink page and full rings, all layers."""
    sizes, layout = block_bytes(config, num_kv_heads, head_dim), WindowLayout(config)
    return num_layers * (sizes["sink"] + layout.float_slots * sizes["float"] + layout.quant_slots * sizes["quant"])
