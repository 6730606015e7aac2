"""LayerPolicy: which cache each layer of a model keeps, one ``CacheConfig`` per layer type.

Models people serve mix layer types (Gemma 2/3/4, gpt-oss, Cohere2, Mistral/Qwen with ``sliding_window``): most
layers attend over a *trained window* of the newest ``sliding_window`` tokens, every few layers one attends over
everything. The two want different caches:

* a window layer keeps exactly its trained window and nothing else: ``sink_tokens=0``, ``recent_tokens =
  sliding_window`` (the visible set ``[i-W+1 .. i]``, transformers' ``kv_idx > q_idx - sliding_window``). Sinks
  added to a layer trained without them change what it sees (docs/benchmarks.md: Gemma 3 270M breaks);
* a full-attention layer keeps the user's ``CacheConfig``: bf16 sinks + an int8/int4 window, or every token
  (``recent_tokens`` at least the stream's length).

Both quantize the window alike (``window_bits``, default the config's). ``policy_for`` derives the policy from a
model's config; what it cannot serve exactly (chunked or linear attention, soft-capped logits, ``cache_index``
positions on a model with window layers) it refuses by name.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .config import CacheConfig

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class LayerPolicy:
    """``layer_types[i]``: layer i's type; ``configs``: ``(type, CacheConfig)`` pairs, one per type present."""

    layer_types: tuple[str, ...]
    configs: tuple[tuple[str, CacheConfig], ...]

    def __post_init__(self) -> None:
        known = dict(self.configs)
        missing = sorted(set(self.layer_types) - known.keys())
        if missing or not self.layer_types:
            raise ValueError(f"LayerPolicy needs a CacheConfig for every layer type of its {len(self.layer_types)} "
                             f"layers; missing {missing}")

    @classmethod
    def uniform(cls, config: CacheConfig, num_layers: int) -> LayerPolicy:
        """Every layer full attention under ``config`` (Llama-family models)."""
        return cls((FULL,) * num_layers, ((FULL, config),))

    def config(self, layer: int) -> CacheConfig:
        return dict(self.configs)[self.layer_types[layer]]

    def groups(self) -> dict[str, list[int]]:
        """Layer type -> its layers, in the order of ``configs``."""
        return {kind: [i for i, t in enumerate(self.layer_types) if t == kind] for kind, _ in self.configs}

    @property
    def hybrid(self) -> bool:
        """Has a layer that is not full attention (a model-wide window counts: its layers keep the window's config)."""
        return any(kind != FULL for kind in self.layer_types)

    def describe(self) -> str:
        """One line per layer type: its layers and what they keep (``repr`` and the eval's report print it)."""
        return "; ".join(f"{kind} (layers {spans(layers)}): {_keeps(dict(self.configs)[kind])}"
                         for kind, layers in self.groups().items())

    def __repr__(self) -> str:
        return f"LayerPolicy({self.describe()})"


def _keeps(cfg: CacheConfig) -> str:
    window = {16: str(cfg.window_dtype).removeprefix("torch."), 8: "int8", 4: "int4"}[cfg.bits]
    sinks = f"{cfg.sink_tokens} {str(cfg.sink_dtype).removeprefix('torch.')} sinks + " if cfg.sink_tokens else ""
    return f"{sinks}{cfg.recent_tokens} recent tokens in {window}" + ("" if cfg.sink_tokens else " (no sinks)")


def spans(layers: list[int]) -> str:
    """``[0, 1, 2, 4, 5]`` -> ``"0-2, 4-5"``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def layer_types(text_config) -> list[str]:
    """Each layer's type as trained, from a (text) model config: its ``layer_types``; else, where the model has a
    model-wide ``sliding_window`` it uses (Mistral v0.1, Phi-3 4k, Starcoder2; not Qwen2 with
    ``use_sliding_window=False``), every layer ``sliding_attention``; else every layer full attention. A window of
    at least ``max_position_embeddings`` tokens never drops a token the model was trained on: full attention."""
    n = text_config.num_hidden_layers
    types = getattr(text_config, "layer_types", None)
    if types:
        return list(types)
    window = getattr(text_config, "sliding_window", None)
    positions = getattr(text_config, "max_position_embeddings", None)
    if window is None or getattr(text_config, "use_sliding_window", True) is False or (
            positions and window >= positions):
        return [FULL] * n
    return [SLIDING] * n


def policy_for(text_config, config: CacheConfig, window_bits: int | None = None) -> LayerPolicy:
    """The policy of a model (``text_config``: ``model.config.get_text_config(decoder=True)``): full-attention
    layers keep ``config``; trained window layers keep exactly ``sliding_window`` tokens, no sinks, quantized to
    ``window_bits`` (default ``config.bits``) in ``config``'s block size, groups and dtypes. Refuses by name what it
    cannot serve exactly."""
    types = layer_types(text_config)
    model = getattr(text_config, "model_type", "this")
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        where = spans([i for i, t in enumerate(types) if t in other])
        raise ValueError(f"{model} model has {', '.join(other)} layers ({where}): qsinkkv serves full-attention and "
                         "trained sliding-window layers only (chunked and linear attention / state-space layers are "
                         "refused, never run as full attention)")
    if getattr(text_config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{model} model soft-caps its attention logits (attn_logit_softcapping="
                         f"{text_config.attn_logit_softcapping}, Gemma 2): qsinkkv's attention does not soft-cap, so "
                         "it is refused rather than served wrongly")
    if SLIDING not in types:
        return LayerPolicy(tuple(types), ((FULL, config),))
    window = max(trained_windows(text_config).values())  # (refuses a missing or bad sliding_window by name)
    if config.positions != "absolute":
        raise ValueError(f"positions={config.positions!r} on a model with trained window layers ({model}): only "
                         "'absolute' is served there (a window layer's keys keep their true rotation, and Gemma 3's "
                         "two RoPE bases would need a schedule per layer type)")
    configs = [(kind, config if kind == FULL else window_config(config, window, window_bits))
               for kind in dict.fromkeys(types)]
    return LayerPolicy(tuple(types), tuple(configs))


def window_config(config: CacheConfig, window: int, window_bits: int | None = None) -> CacheConfig:
    """What a trained window layer keeps beside full-attention layers keeping ``config``: exactly ``window``
    tokens, no sinks, quantized to ``window_bits`` (default ``config.bits``) in ``config``'s block size, groups and
    dtypes (the residual at most the window)."""
    bits = config.bits if window_bits is None else window_bits
    return replace(config, sink_tokens=0, recent_tokens=window, bits=bits,
                   residual_tokens=min(config.residual_tokens, window))


def trained_windows(text_config) -> dict[int, int]:
    """``{layer: its trained window in tokens}`` for each ``sliding_attention`` layer (``layer_types``) of a (text)
    model config; empty when every layer is full attention. The eval's replay and footprint read it."""
    types = layer_types(text_config)
    if SLIDING not in types:
        return {}
    window = getattr(text_config, "sliding_window", None)
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{getattr(text_config, 'model_type', 'this')} model has sliding_attention layers but "
                         f"sliding_window={window!r}")
    return {i: window for i, t in enumerate(types) if t == SLIDING}


def _text(model_config):
    """The decoder's config of ``model_config`` (a transformers config, or already its text config)."""
    return model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config


def hybrid_layers(model_config) -> dict[int, str]:
    """``{layer index: its layer type}`` for every layer of ``model_config`` (``model.config``) that is not full
    attention as trained (``layer_types``: its ``layer_types``, or a model-wide ``sliding_window``);
    empty when every layer is. A trained ``sliding_attention`` window: Gemma 2/3/4, gpt-oss, Cohere2, Qwen2/3 with
    use_sliding_window, Mistral v0.1, Phi-3 4k, Starcoder2; ``chunked_attention``: Llama 4; ``linear_attention``:
    Qwen3-Next; or any other kind."""
    types = layer_types(_text(model_config))
    return {i: t for i, t in enumerate(types) if t != FULL}


def check_servable(model_config, what: str, positions: tuple[str, ...] = ("absolute",)) -> None:
    """A ValueError starting ``what`` (who asks: the eval's ``--model M``, ...) when ``model_config`` (``model.config``)
    has layers qsinkkv cannot serve exactly under each position contract of ``positions`` (``policy_for``'s
    refusals: chunked or linear attention, soft-capped logits, ``cache_index`` on a model with window layers).
    Read from the config alone: the eval calls it before any weight loads."""
    text = _text(model_config)
    for contract in positions:
        try:
            policy_for(text, CacheConfig(positions=contract))
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
