"""The engine's qsinkkv config as this process knows it (read from the current ``VllmConfig``)."""
from __future__ import annotations

from ...config import CacheConfig
from ...policy import policy_for
from .config import KEY, PluginConfigError, parse_config, raw_config

_ACTIVE: dict = {}  # id(VllmConfig) -> (CacheConfig | None, in-flight tokens, every layer type's CacheConfig)


def from_vllm_config(vllm_config) -> CacheConfig | None:
    """The CacheConfig of ``vllm_config`` (None: the engine runs stock vLLM), remembered for the backend's
    static hooks (``customize_spec``), which vLLM calls without a config."""
    if vllm_config is None:
        return None
    key = id(vllm_config)
    if key not in _ACTIVE:
        raw = raw_config(getattr(vllm_config, "additional_config", None))
        cfg = None if raw is None else parse_config(raw)
        try:
            in_flight = int(vllm_config.max_in_flight_tokens)
        except Exception:  # older configs: one step's token budget
            in_flight = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
        types = (cfg,)
        text = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
        if cfg is not None and text is not None:  # (the front end refused what policy_for refuses: _validate)
            types = tuple(c for _, c in policy_for(text, cfg).configs)
        _ACTIVE.clear()
        _ACTIVE[key] = (cfg, in_flight, types)
    return _ACTIVE[key][0]


def active() -> CacheConfig | None:
    from vllm.config import get_current_vllm_config_or_none
    current = get_current_vllm_config_or_none()
    if current is not None:
        return from_vllm_config(current)
    return next(iter(_ACTIVE.values()))[0] if _ACTIVE else None


def required() -> CacheConfig:
    """The engine's CacheConfig, or ``PluginConfigError`` where qsinkkv's backend was handed an engine without one
    (``AttentionBackendEnum.CUSTOM`` is qsinkkv's in this process; the front end refuses such an engine first)."""
    cfg = active()
    if cfg is None:
        raise PluginConfigError(f"qsinkkv's attention backend (vLLM's CUSTOM member in this process) was selected "
                                f"for an engine without additional_config[{KEY!r}]: pass the qsinkkv config, or "
                                "another --attention-backend")
    return cfg


def layer_configs() -> tuple[CacheConfig, ...]:
    """The CacheConfig of each layer type of the engine's model (``qsinkkv.policy.policy_for``: the full-attention
    layers' is the engine's, a trained window layer's keeps its window and no sinks)."""
    active()
    return next(iter(_ACTIVE.values()))[2] if _ACTIVE else ()


def in_flight_tokens() -> int:
    active()
    return next(iter(_ACTIVE.values()))[1] if _ACTIVE else 0


def current_vllm_config():
    from vllm.config import get_current_vllm_config_or_none
    return get_current_vllm_config_or_none()
