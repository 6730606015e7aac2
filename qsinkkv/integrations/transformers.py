"""Swap-in cache for HuggingFace transformers (full-attention models: Llama, Qwen2/3, SmolLM, OLMo 2; and models with
trained window layers: Gemma 3, gpt-oss, Cohere2, Mistral/Qwen2/Phi-3 with ``sliding_window``).

    from qsinkkv import CacheConfig
    from qsinkkv.hf import QSinkKVCache
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="qsinkkv")
    cache = QSinkKVCache(CacheConfig(sink_tokens=4, recent_tokens=508, bits=4), model.config)
    model.generate(input_ids, cache=cache, max_new_tokens=4000)

Two modes, chosen by the model's attention implementation at every forward:

* ``attn_implementation="qsinkkv"`` (registered on import; also ``model.set_attn_implementation``):
  ``update`` stores nothing and hands the new K/V to the registered attention function, which
  stores them and attends straight from the quantized storage (the kernels ``backend="auto"`` picks
  once: Triton's on CUDA, the C decode on the CPU where it compiles and serves the contract, else
  PyTorch's; ``qsinkkv.ops.resolve_backend``) under the exact sink + window mask. Prefill longer than the capacity
  is exact. Both position contracts; padded batches (left-padded by ``generate``, or any mask):
  the pads are never stored, each row keeps its own sinks, window and positions.
* any other implementation (sdpa, eager, ...) — portable: ``update`` stores the new tokens and
  returns the dequantized visible K/V, so the model's own attention works (slower: the window
  is dequantized every step). The model's mask can only express a contiguous span, so this
  mode takes batch size 1, positions="absolute", no padding, and prompts that fit in the capacity
  (decode then continues for any number of tokens when the cache is built with the model itself,
  ``QSinkKVCache(config, model)``, so that it sees each forward's attention_mask and can refuse pads,
  which would otherwise become sinks; built with ``model.config`` it stops at the capacity).

Models with trained window layers (Gemma 3/4, gpt-oss, Cohere2, Mistral/Qwen with ``sliding_window``) are served
under a ``LayerPolicy`` (``qsinkkv.policy``): each window layer keeps exactly its trained ``sliding_window`` tokens
and no sinks, each full-attention layer the ``CacheConfig`` (``HybridCache``: one ``SinkQuantCache`` per layer type),
with ``attn_implementation="qsinkkv"``. What the policy cannot serve exactly (chunked or linear attention, soft-capped
logits, ``cache_index`` positions there, the portable mode, a pool) is refused by name. Without a QSinkKVCache the
``qsinkkv`` attention runs the model as trained: SDPA under each layer's own causal, window and padding mask.

Transformers' cache API changes between releases: this module is tested with the range in
``SUPPORTED``, and refuses others with a clear error.
"""
from __future__ import annotations

import inspect
import weakref

import torch
import transformers
from packaging.version import Version
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from ..cache import SinkQuantCache
from ..config import CacheConfig
from ..hybrid import HybridCache
from ..ops import check_decode_variant
from ..paged import PagedCache
from ..policy import SLIDING, LayerPolicy, policy_for
from ..rope import Rotary, check_rope_type
from ..storage import gather

SUPPORTED = (Version("5.24.0"), Version("6.0.0"))
ATTN_IMPLEMENTATION = "qsinkkv"
_KWARG = "qsinkkv_cache"  # how update() hands the cache to the attention function

if not SUPPORTED[0] <= Version(transformers.__version__) < SUPPORTED[1]:
    raise ImportError(f"qsinkkv.integrations.transformers is tested with transformers "
                      f">={SUPPORTED[0]},<{SUPPORTED[1]}; "
                      f"found {transformers.__version__}. pip install 'transformers>={SUPPORTED[0]},<{SUPPORTED[1]}'")


def rotary_from_config(text_config) -> Rotary:
    """The model's fixed RoPE schedule, with the float32 inv_freq transformers itself uses."""
    params = getattr(text_config, "rope_parameters", None) or {}
    if "full_attention" in params:  # per-layer-type parameters
        params = params["full_attention"]
    rope_type = params.get("rope_type", "default")
    check_rope_type(rope_type)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported with "
                         "positions='cache_index'")
    head_dim = _head_dim(text_config)
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(text_config, "rope_theta", None))
        if theta is None:
            raise ValueError(f"positions='cache_index' needs the model's RoPE base: model_config.rope_parameters "
                             f"must hold 'rope_theta', got rope_parameters={params!r}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return Rotary(inv_freq, 1.0)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](text_config)
    return Rotary(inv_freq, float(attention_factor))


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class _LayerView(CacheLayerMixin):
    """transformers' Cache asks its layers what kind they are (``is_sliding``: a trained window layer, as the
    policy keeps it); the storage lives in SinkQuantCache."""

    is_compileable = False

    def __init__(self, owner: QSinkKVCache, idx: int):
        super().__init__()
        self.owner, self.idx = owner, idx
        self.is_sliding = owner.policy.layer_types[idx] == SLIDING

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner.update(key_states, value_states, self.idx, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length(self.idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_mask_sizes(query_length, self.idx)

    def get_max_length(self) -> int:
        return -1


class QSinkKVCache(Cache):
    """A ``transformers.Cache`` holding bf16 sinks and an int8/int4 recent window per layer.

    ``QSinkKVCache(config: CacheConfig, model_config, backend="auto")``. ``model_config`` is
    ``model.config``, or the model itself, which also checks its tensor-parallel degree: each
    rank must hold whole KV heads. Storage is allocated at the first update (batch size, KV
    heads, device and dtype are taken from the model's K/V, so under tensor parallelism each
    rank holds its own heads) and never grows; ``nbytes()`` reports it. ``get_seq_length()``
    is the batch's width: the columns fed so far, pads included (what ``DynamicCache`` reports),
    counted when the last layer has stored them.

    ``pool``: a ``qsinkkv.paged.PagedCache`` built with the same config and the model's layer
    count, for continuous batching (``examples/serve.py``): the batch's rows are the sequences
    the caller admitted into it, each at its own length (pass each row's ``position_ids`` and a
    2D ``attention_mask`` whose last columns mark the chunk's real tokens); needs
    ``attn_implementation="qsinkkv"``. ``decode_variant``: the storage's (``SinkQuantCache``), checked here.
    """

    is_compileable = False

    def __init__(self, config: CacheConfig, model_config, backend: str = "auto", pool: PagedCache | None = None,
                 decode_variant: str = "dequantize", window_bits: int | None = None):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a qsinkkv CacheConfig, got {type(config).__name__}")
        tp_size, model = 1, None
        if isinstance(model_config, torch.nn.Module):  # the model itself: its tensor-parallel degree is checked too
            model = model_config
            tp_size = getattr(model, "tp_size", None) or 1
            model_config = model.config
        if not hasattr(model_config, "get_text_config"):
            raise TypeError(f"model_config must be a transformers PretrainedConfig (model.config), "
                            f"got {type(model_config).__name__}")
        text = model_config.get_text_config(decoder=True)
        missing = [a for a in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")
                   if getattr(text, a, None) is None]
        if missing:
            raise ValueError(f"model_config ({getattr(text, 'model_type', '?')}) lacks {missing}: QSinkKVCache "
                             "supports decoder-only Llama-family attention")
        # one CacheConfig per layer type: trained window layers keep exactly their window, no sinks (``window_bits``:
        # their bits, default config's); what cannot be served exactly is refused here, by name
        self.policy: LayerPolicy = policy_for(text, config, window_bits)
        config.check_head_dim(_head_dim(text))
        if text.num_key_value_heads % tp_size:
            raise ValueError(f"the model is sharded over tp_size={tp_size} ranks but has num_key_value_heads="
                             f"{text.num_key_value_heads}: each rank must hold whole KV heads (and its cache their "
                             f"storage); use a tensor-parallel degree that divides {text.num_key_value_heads}")
        self.config, self.model_config, self.backend = config, model_config, backend
        self.decode_variant = decode_variant  # the storage's (SinkQuantCache); a pool has its own
        self.rotary = rotary_from_config(text) if config.positions == "cache_index" else None
        check_decode_variant(decode_variant, backend, self.rotary, config, _head_dim(text))  # a clear error now
        self.num_layers = text.num_hidden_layers
        self.max_positions = getattr(text, "max_position_embeddings", None)
        self.inner: SinkQuantCache | HybridCache | None = None
        if pool is not None:
            if self.policy.hybrid:
                raise ValueError(f"pool= serves models whose every layer is full attention; this one has "
                                 f"{self.policy.describe()}: use a QSinkKVCache without pool=")
            if not isinstance(pool, PagedCache):
                raise TypeError(f"pool must be a qsinkkv.paged.PagedCache, got {type(pool).__name__}")
            if (pool.config, pool.num_layers) != (config, self.num_layers) or (pool.rotary is None) != (
                    self.rotary is None):
                raise ValueError(f"pool must be built with this config and num_layers={self.num_layers} (and rotary "
                                 f"with positions='cache_index'), got {pool.config} with {pool.num_layers} layers")
            self.inner = pool
        self.width = 0  # columns fed (pads included); each row's own length lives in inner.seq_lens()
        # (width, 2D attention_mask or None) of the forward about to run, when the model is watched
        self._forward_mask: tuple[int, Tensor | None] | None = None
        self.watches_masks = model is not None and _watch_masks(model, self)
        super().__init__(layers=[_LayerView(self, i) for i in range(self.num_layers)])

    # --- storage ------------------------------------------------------------------------------
    def _storage(self, key_states: Tensor, layer_idx: int) -> SinkQuantCache:
        B, Hkv, _, D = key_states.shape
        inner = self.inner
        if isinstance(inner, PagedCache):  # its rows are the sequences the caller admitted
            return inner
        if inner is not None and layer_idx == 0 and (
                (inner.batch_size, inner.num_kv_heads, inner.head_dim, inner.device, inner.dtype)
                != (B, Hkv, D, key_states.device, key_states.dtype)) and not any(inner.layer_lengths()):
            self.inner = None  # an empty (new or reset) cache takes the next batch's size, device and dtype
        if self.inner is None and self.policy.hybrid:
            self.inner = HybridCache(self.policy, B, Hkv, D, device=key_states.device, dtype=key_states.dtype,
                                     backend=self.backend, decode_variant=self.decode_variant)
        elif self.inner is None:
            self.inner = SinkQuantCache(self.config, self.num_layers, B, Hkv, D, device=key_states.device,
                                        dtype=key_states.dtype, rotary=self.rotary, backend=self.backend,
                                        decode_variant=self.decode_variant)
        return self.inner

    def __repr__(self) -> str:
        return f"QSinkKVCache({self.policy.describe()})"

    @property
    def fused(self) -> bool:
        return getattr(self.model_config, "_attn_implementation", None) == ATTN_IMPLEMENTATION

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        if self.policy.hybrid and not self.fused:  # (before anything is stored)
            raise ValueError(f"a model with trained window layers ({self.policy.describe()}) is served with "
                             "attn_implementation='qsinkkv' only (model.set_attn_implementation('qsinkkv')): the "
                             "portable mode's single mask cannot show each layer type's window")
        inner = self._storage(key_states, layer_idx)
        forward_kwargs = kwargs.get("kwargs")
        if layer_idx == 0 and not inner.in_step():  # a new forward: every layer must hold the same stream
            lengths = inner.layer_lengths()
            raise RuntimeError(
                f"qsinkkv: the cache's layers are out of step (their longest sequences hold {sorted(set(lengths))} "
                "tokens): an earlier forward stopped part-way through the layers (an error or interrupt outside "
                f"the cache); call cache.crop({self.width}) or cache.reset() before the next forward")
        if isinstance(inner, PagedCache):
            if not self.fused:
                raise ValueError("a QSinkKVCache backed by a pool needs attn_implementation='qsinkkv' "
                                 "(model.set_attn_implementation('qsinkkv'))")
            B = key_states.shape[0]
            if B != inner.batch_size:
                if inner.batch_size and B % inner.batch_size == 0:
                    raise ValueError(f"the batch has {B} rows, {B // inner.batch_size}x the {inner.batch_size} "
                                     "sequences admitted into the pool: a pool cannot repeat sequences (beam search, "
                                     "num_return_sequences > 1 would share their blocks); use a QSinkKVCache without "
                                     "pool= (a SinkQuantCache) for beam search")
                raise ValueError(f"the batch has {B} rows but the pool has {inner.batch_size} sequences admitted: "
                                 "admit() one sequence per row, in row order, before the forward")
        if self.fused:
            if forward_kwargs is None:
                raise RuntimeError("attn_implementation='qsinkkv' needs a model that calls "
                                   "cache.update(k, v, layer_idx, kwargs=kwargs) (Llama-family models)")
            forward_kwargs[_KWARG] = self  # the same dict is expanded into the attention call
            return key_states, value_states
        return self._portable_update(inner, key_states, value_states, layer_idx, forward_kwargs or {})

    def _portable_update(self, inner, k, v, layer_idx, forward_kwargs):
        B, _, T, _ = k.shape
        held = inner.get_seq_length(layer_idx)
        if self.config.positions != "absolute":
            raise ValueError("positions='cache_index' needs attn_implementation='qsinkkv' "
                             "(model.set_attn_implementation('qsinkkv'))")
        if B != 1:
            raise ValueError(f"the portable mode takes batch size 1 (got {B}): the model's own mask cannot "
                             "show sinks + window per sequence; use attn_implementation='qsinkkv'")
        if T > 1 and held + T > self.config.capacity:
            raise ValueError(f"a chunk of {T} tokens after {held} exceeds the capacity {self.config.capacity} in the "
                             "portable mode (the model's mask cannot express sinks + window); use "
                             "attn_implementation='qsinkkv', or feed the prompt in pieces that fit")
        if layer_idx == 0:
            self._check_portable_padding(held, T, forward_kwargs.get("position_ids"))
        inner.append(layer_idx, k, v)
        self._stored(layer_idx, T)
        keys, values, _ = gather(inner.layers[layer_idx], k.dtype)
        slots = inner.layout.visible_slots(held + T)[0].to(keys.device)
        return keys[:, :, slots], values[:, :, slots]

    def _check_portable_padding(self, held: int, T: int, pos: Tensor | None) -> None:
        """The model's own mask cannot keep a padded row's pads out of the sinks and the window: refuse any
        sign of padding, and a step past the capacity when padding cannot be ruled out."""
        # generate() numbers a left-padded row from its first real token
        if pos is not None and not torch.equal(pos.reshape(-1, T)[:1],
                                               torch.arange(held, held + T, device=pos.device).unsqueeze(0)):
            raise ValueError(f"the portable mode needs position_ids {held}..{held + T - 1} (the cache's positions), "
                             f"got {pos.reshape(-1)[:8].tolist()}...: a left-padded prompt (its pads would become "
                             "sinks); drop the padding, or use attn_implementation='qsinkkv'")
        seen = self._forward_mask
        if seen is not None and seen[0] == self.width:  # the watched model's forward for this very step
            mask = seen[1]
            if mask is not None and not bool(mask.all()):
                raise ValueError("the portable mode takes no padding, and this forward's attention_mask has pads "
                                 "(a left-padded prompt: its pads would become sinks once the stream passes the "
                                 "capacity); drop the padding, or use attn_implementation='qsinkkv'")
        elif held + T > self.config.capacity:
            raise ValueError(f"the portable mode goes past the capacity {self.config.capacity} only when it can rule "
                             "out padding (pads would become sinks), and this cache cannot see the forward's "
                             "attention_mask: build it with the model itself, QSinkKVCache(config, model), or use "
                             "attn_implementation='qsinkkv'")

    def _stored(self, layer_idx: int, columns: int) -> None:
        """A layer stored a chunk of ``columns``: the last one completes the step."""
        if layer_idx == self.num_layers - 1:
            self.width += columns

    # --- what transformers asks of a cache ---------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """The K/V the portable update returns: the visible tokens, newest last."""
        n = self.get_seq_length(layer_idx) + query_length
        kv_length = min(n, self.config.capacity) if query_length == 1 else n
        return kv_length, n - kv_length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def nbytes(self) -> int:
        return 0 if self.inner is None else self.inner.nbytes()

    def reset(self) -> None:
        self.width = 0
        if self.inner is not None:
            self.inner.reset()

    def crop(self, max_length: int) -> None:
        """transformers' convention (``DynamicCache.crop``): a non-negative ``max_length`` is the length
        to keep (a no-op when the cache is not longer); a negative one removes that many of the newest
        tokens. Lengths count columns, pads included: a left-padded row whose real tokens are the
        last n columns loses min(removed, n) of them. Refused (nothing changed) past the retained
        window, or when removing more than the batch holds. Also brings layers left out of step
        by an interrupted forward back to the last completed step."""
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise ValueError(f"max_length must be an int (the length to keep, or minus the tokens to remove), "
                             f"got {max_length!r}")
        keep = self.width + max_length if max_length < 0 else max_length
        if keep < 0:
            raise ValueError(f"cannot remove {-max_length} tokens from a cache of {self.width} tokens")
        removed = max(self.width - keep, 0)
        if self.inner is not None:  # the last layer is never ahead of the completed steps
            self.inner.crop_to((self.inner.seq_lens(self.num_layers - 1) - removed).clamp(min=0))
        self.width -= removed

    def reorder_cache(self, beam_idx: Tensor) -> None:
        if self.inner is not None:
            self.inner.select_batch(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.inner is not None:
            self.inner.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.inner is not None:
            B = self.inner.batch_size
            self.inner.select_batch(torch.arange(B).repeat_interleave(repeats))


def _watch_masks(model: torch.nn.Module, cache: QSinkKVCache) -> bool:
    """Let ``cache`` see the 2D attention_mask of every forward of ``model`` it is passed to (a forward
    pre-hook; the portable mode's padding check). The hook holds the cache weakly and removes itself once
    the cache is gone. False where the model's forward cannot be read."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return False
    ref = weakref.ref(cache)

    def hook(module, args, kwargs):
        owner = ref()
        if owner is None:
            handle.remove()
            return None
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return None
        extra = bound.get("kwargs") or {}
        passed = next((x for x in (bound.get("cache"), bound.get("past_key_values"), extra.get("cache"),
                                   extra.get("past_key_values")) if x is not None), None)
        if passed is owner:
            mask = bound.get("attention_mask")
            owner._forward_mask = (owner.width, mask if isinstance(mask, Tensor) and mask.ndim == 2 else None)
        return None

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    return True


def qsinkkv_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                      dropout: float = 0.0, **kwargs):
    """transformers attention function: ``query [B, H, T, D]``, the new ``key/value [B, Hkv, T, D]``
    (post-RoPE) -> ``([B, T, H, D], None)``, attending from the cache's storage. ``attention_mask``: the model's 2D
    padding mask ``[B, columns]`` (``_padding_mask``), or None where every column is a real token."""
    if kwargs.get("softcap") is not None:  # (Gemma 2: refused by the policy too; never run without it)
        raise ValueError(f"attn_implementation='qsinkkv' does not soft-cap attention logits (softcap="
                         f"{kwargs['softcap']}): use 'sdpa' or 'eager' for this model")
    # the layer's trained window (Mistral passes it, Gemma 3 / Qwen2 / gpt-oss set it per layer; None: full) and
    # learned sink logits (gpt-oss's s_aux [H]: exp(s_h) joins each head's softmax denominator)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    sinks = kwargs.get("s_aux")
    cache: QSinkKVCache | None = kwargs.get(_KWARG)
    if cache is None:  # no QSinkKVCache (use_cache=False, or transformers' own cache): the model as trained
        return _trained_attention(module, query, key, value, attention_mask, scaling, dropout, window, sinks)
    layer = module.layer_idx
    kept = cache.policy.config(layer)
    if window is not None and cache.max_positions and window >= cache.max_positions:
        window = None  # (a window past every trained position drops nothing: full attention, as the policy has it)
    if (window is None) != (cache.policy.layer_types[layer] != SLIDING) or (
            window is not None and (kept.sink_tokens, kept.recent_tokens) != (0, window)):
        raise ValueError(f"layer {layer} has sliding_window={window} but the cache keeps {kept.sink_tokens} sinks + "
                         f"{kept.recent_tokens} recent tokens there ({cache.policy.describe()}): build the "
                         "QSinkKVCache with this model's config")
    if cache.rotary is not None:  # cache_index: back to pre-RoPE; the cache rotates by cache index
        pos = kwargs.get("position_ids")
        if pos is None:
            raise ValueError("positions='cache_index' needs position_ids in the attention call")
        pos = pos.unsqueeze(1)  # [B, 1, T]
        query = cache.rotary.unrotate(query, pos)
        key = cache.rotary.unrotate(key, pos)
    real = _chunk_mask(attention_mask, query.shape[2])
    if real is None:  # every token of the chunk is real (decode steps, unpadded prompts)
        out = cache.inner.attend(layer, query, key, value, scale=scaling, sink_logits=sinks)
    else:  # padded: real tokens first in each row (in order), the cache stores lengths[b] of them
        order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)            # [B, T]
        take = lambda x: x.gather(2, order[:, None, :, None].expand_as(x))  # noqa: E731
        out = cache.inner.attend(layer, take(query), take(key), take(value), real.sum(1), scale=scaling,
                                 sink_logits=sinks)
        out = torch.zeros_like(out).scatter_(2, order[:, None, :, None].expand_as(out), out)
    cache._stored(layer, query.shape[2])
    return out.transpose(1, 2).contiguous(), None


def _trained_attention(module, query: Tensor, key: Tensor, value: Tensor, columns: Tensor | None, scaling, dropout,
                       window: int | None, sinks: Tensor | None):
    """SDPA over the K/V the model hands in (``key [B, Hkv, L, D]``: the newest L tokens, a cache's prefix first)
    under the mask the layer was trained with: causal, aligned to the newest key (a chunk after a prefix), within its
    ``window`` (None: full attention), and the padding of ``columns [B, >= L]`` (the 2D mask; None: no pad); learned
    ``sinks [H]`` as one more key of zeros whose score is the head's logit (its value: zeros)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    T, L = query.shape[2], key.shape[2]
    if columns is None and sinks is None and (window is None or window >= L) and (T == L or T == 1):
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, dropout=dropout,
                                      is_causal=T > 1)  # plain causal (the fast path)
    q_at = torch.arange(L - T, L, device=query.device).unsqueeze(1)                 # [T, 1]
    k_at = torch.arange(L, device=query.device).unsqueeze(0)                        # [1, L]
    seen = (k_at <= q_at) & (k_at > q_at - window) if window is not None else k_at <= q_at
    mask = seen[None, None]                                                         # [1, 1, T, L]
    if columns is not None:
        mask = mask & columns[:, -L:].to(torch.bool)[:, None, None, :]
        mask = mask | ~mask.any(-1, keepdim=True)  # a pad's own query sees nothing: any row (unused) rather than NaN
    if sinks is not None:
        B, H = query.shape[:2]
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
        logit = sinks.to(query.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
        mask = torch.cat((bias.expand(B, H, T, L), logit), dim=-1)                  # [B, H, T, L + 1]
        key, value = (torch.cat((x, x.new_zeros(*x.shape[:2], 1, x.shape[3])), dim=2) for x in (key, value))
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, dropout=dropout, is_causal=False)


def _chunk_mask(attention_mask, T: int) -> Tensor | None:
    """The ``[B, T]`` bool mask of the chunk's real tokens (the last T columns of the 2D mask), or None when all are
    real."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.ndim != 2:
        raise ValueError("attn_implementation='qsinkkv' takes a 2D padding mask [batch, tokens] (or none), got "
                         f"{type(attention_mask).__name__} of shape {tuple(getattr(attention_mask, 'shape', ()))}")
    real = attention_mask[:, -T:].to(torch.bool)
    return None if bool(real.all()) else real


def _padding_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, **kwargs):
    """Mask builder for attn_implementation='qsinkkv': the cache applies each layer type's sink + window mask itself
    and needs only which tokens are real: the 2D padding mask as a bool ``[B, columns]`` (the attention function
    takes the chunk's last columns), or None when every column is real, so decode steps and unpadded prompts take
    the plain path."""
    if attention_mask is None or attention_mask.ndim != 2:
        return attention_mask  # None, or a prepared 4D mask the attention function refuses by name
    real = attention_mask.to(torch.bool)
    return None if bool(real.all()) else real


AttentionInterface.register(ATTN_IMPLEMENTATION, qsinkkv_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _padding_mask)
