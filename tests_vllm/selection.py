"""vLLM's choice of attention backend for engine configs made one after another in this one process (vLLM's
per-process state shared: the plugin's hooks, the ``CUSTOM`` registration, the selection cache
``_cached_get_attn_backend``), for ``test_vllm_selection.py``. No model is loaded: each config is built by
``EngineArgs.create_engine_config`` (what ``LLM`` and ``vllm serve`` call) and a decoder layer of the model's shapes
asks vLLM's own selector, ``get_attn_backend``, as vLLM's ``Attention`` does.

    python tests_vllm/selection.py '[{"qsinkkv": {...} | null, "args": {EngineArgs fields}}, {"custom": PATH}, ...]'

With "ask_qsinkkv", also what qsinkkv's backend does when asked to build this engine's layer
(``"qsinkkv_impl"``). A step with "custom" registers vLLM's ``CUSTOM`` member to PATH (another holder of it). Each
config step gives
``{"backend": class path}`` (and ``"impl"``: the class the backend builds a layer with, or its refusal), or
``{"error": message}`` where the engine stopped at start. Prints one line ``QSINKKV_RESULT [...]``.
"""
from __future__ import annotations

import json
import os
import sys

from engine import default_model


def main(steps: list[dict]) -> list[dict]:
    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/qsinkkv-vllm-cache")
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import get_attn_backend
    out = []
    for step in steps:
        if "custom" in step:
            register_backend(AttentionBackendEnum.CUSTOM, step["custom"])
            out.append({"custom": step["custom"]})
            continue
        kwargs = dict(model=step.get("model") or default_model(), dtype="float32", enforce_eager=True,
                      max_model_len=256, seed=0, **step.get("args", {}))
        if step.get("qsinkkv") is not None:
            kwargs["additional_config"] = {"qsinkkv": step["qsinkkv"]}
        extra = {}
        try:
            config = EngineArgs(**kwargs).create_engine_config()
            model = config.model_config
            with set_current_vllm_config(config):
                backend = get_attn_backend(model.get_head_size(), model.dtype, config.cache_config.cache_dtype)
                impl = _impl(backend)
                if step.get("ask_qsinkkv"):  # qsinkkv's backend, asked for this engine's layer whatever was chosen
                    from qsinkkv.integrations.vllm.backend import QSinkKVBackend
                    extra = {"qsinkkv_impl": _impl(QSinkKVBackend)}
        except Exception as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
            continue
        out.append({"backend": f"{backend.__module__}.{backend.__qualname__}", "impl": impl,
                    "attention_backend": getattr(config.attention_config.backend, "name", None), **extra})
    return out


def _impl(backend) -> str:
    """The impl class ``backend`` builds a layer with under the current config, or its refusal."""
    try:
        return backend.get_impl_cls().__name__
    except Exception as e:
        return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("QSINKKV_RESULT " + json.dumps(result), flush=True)
    os._exit(0)
