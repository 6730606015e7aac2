"""The plugin's configuration: ``vllm_config.additional_config["qsinkkv"]``, validated by
``qsinkkv.CacheConfig`` and against the engine's own settings.

Everything here is plain Python over the qsinkkv core (no vLLM import), so the checks run in the
front end before an engine core starts, and the error names the field at fault.
"""
from __future__ import annotations

import dataclasses

import torch

from ...config import CacheConfig
from ...ops import DECODE_VARIANTS, check_decode_variant

KEY = "qsinkkv"  # additional_config[KEY] holds CacheConfig fields, and the plugin's own (PLUGIN_FIELDS)
# The plugin's own fields: "decode_variant", the body of the Triton decode that reads quantized blocks on CUDA
# (kernels/decode_attention.py; "dequantize" unless the user picks another: "fp16" has the fewest instructions per KV
# byte offline and has not run on a GPU; the CPU's C decode has one body and refuses another at start)
PLUGIN_FIELDS = ("decode_variant",)
_DTYPE_FIELDS = ("sink_dtype", "window_dtype", "scale_dtype")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# What this increment serves (the rest is refused at start, naming the field)
SUPPORTED_BITS = (16, 8, 4)
SUPPORTED_POSITIONS = ("absolute",)  # vLLM hands the backend keys already rotated at their true positions


class PluginConfigError(ValueError):
    """additional_config["qsinkkv"] or an engine setting the plugin cannot serve (names the field)."""


def raw_config(additional_config) -> dict | None:
    """The plugin's dict, or None when the engine did not ask for qsinkkv (stock vLLM)."""
    if not additional_config or KEY not in additional_config:
        return None
    raw = additional_config[KEY]
    if not isinstance(raw, dict):
        raise PluginConfigError(f"additional_config[{KEY!r}] must be a dict of qsinkkv CacheConfig fields, "
                                f"got {type(raw).__name__}")
    return raw


def parse_config(raw: dict) -> CacheConfig:
    """A ``CacheConfig`` from the JSON-shaped dict (dtype fields as names: ``"float32"``)."""
    known = {f.name for f in dataclasses.fields(CacheConfig)}
    unknown = sorted(set(raw) - known - set(PLUGIN_FIELDS))
    if unknown:
        raise PluginConfigError(f"additional_config[{KEY!r}] has unknown field(s) {unknown}; the fields are "
                                f"{sorted(known)} and the plugin's {list(PLUGIN_FIELDS)}")
    kwargs = {name: value for name, value in raw.items() if name not in PLUGIN_FIELDS}
    for name in _DTYPE_FIELDS:
        if name in kwargs:
            value = kwargs[name]
            if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
                kwargs[name] = _DTYPES[value.removeprefix("torch.")]
            elif not isinstance(value, torch.dtype):
                raise PluginConfigError(f"CacheConfig.{name} must be one of {sorted(_DTYPES)}, got {value!r}")
    try:
        cfg = CacheConfig(**kwargs)
    except ValueError as e:  # CacheConfig names the field ("CacheConfig.bits must be ...")
        raise PluginConfigError(str(e)) from None
    if cfg.bits not in SUPPORTED_BITS:
        raise PluginConfigError(f"CacheConfig.bits={cfg.bits} is not served inside vLLM yet (this plugin serves bits "
                                f"{list(SUPPORTED_BITS)})")
    if cfg.positions not in SUPPORTED_POSITIONS:
        raise PluginConfigError(f"CacheConfig.positions={cfg.positions!r} is not supported inside vLLM: the engine "
                                "rotates keys at their true positions before attention, so only 'absolute' applies")
    if cfg.residual_tokens:
        raise PluginConfigError("CacheConfig.residual_tokens is not served inside vLLM (its pages hold the window as "
                                "quantized blocks and one filling block per request): use residual_tokens=0, got "
                                f"residual_tokens={cfg.residual_tokens}")
    decode_variant(raw, cfg)  # (refused here, in the front end, naming the field)
    return cfg


def decode_variant(raw: dict, cfg: CacheConfig, head_dim: int | None = None) -> str:
    """The decode body the config asks for (``raw["decode_variant"]``, default "dequantize"), refused by name where
    it does not apply: not one of ``DECODE_VARIANTS``, one other than the default at bits 16 (vLLM's own pages hold
    no quantized block), or one the config (and ``head_dim``, where known) cannot run (``check_decode_variant``)."""
    variant = raw.get("decode_variant", DECODE_VARIANTS[0])
    if variant not in DECODE_VARIANTS:
        raise PluginConfigError(f"additional_config[{KEY!r}]['decode_variant'] must be one of "
                                f"{list(DECODE_VARIANTS)}, got {variant!r}")
    if variant != DECODE_VARIANTS[0] and cfg.bits == 16:
        raise PluginConfigError(f"decode_variant={variant!r} picks how the decode reads quantized blocks: bits 8 or "
                                f"4 only, got bits=16")
    try:
        check_decode_variant(variant, None, None, cfg, head_dim)
    except ValueError as e:
        raise PluginConfigError(str(e)) from None
    return variant


def check_engine(cfg: CacheConfig, *, block_size: int | None, user_block_size: bool, head_dim: int | None,
                 enable_prefix_caching: bool, speculative: bool, max_model_len: int | None,
                 kv_heads: int | None = None, tensor_parallel_size: int = 1, positions: int | None = None) -> int:
    """Check the engine settings against ``cfg``; returns the vLLM block size to use (ours). ``kv_heads``: the
    model's KV heads; a tensor-parallel degree must split them evenly (each rank holds its own heads' K/V) or
    replicate them whole (a degree that is a multiple of them), as vLLM's QKV projection does. ``positions``: the
    positions the model's rotary table holds (``max_position_embeddings`` of a model without RoPE scaling), or None
    (not known): a ``max_model_len`` past it is refused."""
    if positions is not None and max_model_len is not None and max_model_len > positions:
        raise PluginConfigError(
            f"max_model_len={max_model_len} is past the model's {positions} positions: inside vLLM keys arrive rotated "
            "at their true positions by the model's rotary table, which holds that many (past it, vLLM reads beyond "
            f"the table: the keys are undefined, and qsinkkv's window cannot make them right). Use max_model_len <= "
            f"{positions}; a request's KV blocks stay a window's whatever its length")
    bs = cfg.block_size
    tp = tensor_parallel_size
    if kv_heads and tp > 1 and ((tp < kv_heads and kv_heads % tp) or (tp > kv_heads and tp % kv_heads)):
        raise PluginConfigError(f"tensor_parallel_size={tp} neither divides the model's {kv_heads} KV heads nor is a "
                                "multiple of them: each rank must hold whole KV heads (their sinks and window)")
    if bs % 16:  # vLLM's block tables and the CPU runner want whole 16-token kernel blocks
        raise PluginConfigError(f"CacheConfig.block_size must be a multiple of 16 inside vLLM (it is vLLM's block "
                                f"size), got block_size={bs}")
    if user_block_size and block_size is not None and block_size != bs:
        raise PluginConfigError(f"block_size: the engine's --block-size={block_size} differs from the qsinkkv "
                                f"CacheConfig.block_size={bs}; they are one size (give one of them, or both equal)")
    if head_dim is not None:
        try:
            cfg.check_head_dim(head_dim)
        except ValueError as e:
            raise PluginConfigError(f"head_dim: {e}") from None
    if enable_prefix_caching:
        raise PluginConfigError("enable_prefix_caching: prefix caching is not supported with the qsinkkv plugin yet "
                                "(blocks leave the window mid-request); pass enable_prefix_caching=False "
                                "(vllm serve: --no-enable-prefix-caching)")
    if speculative:
        raise PluginConfigError("speculative_config: speculative decoding is not supported with the qsinkkv plugin")
    return bs


def to_jsonable(cfg: CacheConfig) -> dict:
    """The dict form (dtype names), e.g. to pass the same config to a reference run."""
    out = dataclasses.asdict(cfg)
    for name in _DTYPE_FIELDS:
        out[name] = str(out[name]).removeprefix("torch.")
    return out
