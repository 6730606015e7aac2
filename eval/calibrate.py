"""``qsinkkv-eval calibrate``: where each layer and head parks its attention, and how many sink
tokens to keep.

From one bf16 forward over the text (every query sees every earlier token):

* ``first_mass [L, H, F]``: mean attention mass on each of the first F positions, over the
  queries at F or later (which see all of them);
* ``value_norm_ratio [L, F]``: value norm at each of those positions / the median value norm
  of the layer (sinks tend to carry small values: mass parked there adds little);
* ``heavy_hitters``: (layer, head, position) past the recommended sinks that draw at least
  ``HEAVY`` of the mass, and more than the sinks do, from queries at least ``FAR`` tokens
  later: a head whose sink is not at the start (a windowed cache evicts it);
* the recommendation: S = 1 + the last of the first F positions that is a sink, i.e. draws
  (averaged over layers and heads) at least ``SINK_FACTOR`` times the mass a uniform
  distribution would give it;
* warnings for models a sink + window cache does not fit as is: learned per-head sink logits
  (gpt-oss ``sinks`` parameters) and trained sliding-window layers.

Sinks are a full-attention layer's: a trained window layer keeps its window and no sinks
(``qsinkkv.policy``), so on a model with window layers only its full-attention layers are measured
(``layers``: which), each with its learned sink logits if it has them.
"""
from __future__ import annotations

import torch

from qsinkkv.policy import trained_windows

from . import replay
from .kv import capture
from .progress import bar

F = 16       # leading positions examined
FAR = 64           # a heavy hitter must draw mass from queries at least this far away
HEAVY = 0.1        # ... and at least this much of it
SINK_FACTOR = 10   # a sink draws this many times a uniform share of the mass


def run(model, ids, tokenizer=None, captured: dict | None = None) -> dict:
    T = ids.shape[1]
    if T < F + FAR + 1:
        raise ValueError(f"calibrate needs --tokens >= {F + FAR + 1}, got {T}")
    cfg = model.config.get_text_config(decoder=True)
    windows = trained_windows(cfg)
    layers = [i for i in range(cfg.num_hidden_layers) if i not in windows]
    if not layers:
        raise ValueError(f"calibrate: every layer of this {getattr(cfg, 'model_type', '')} model keeps a trained "
                         f"window of {max(windows.values())} tokens and no sinks: there is no sink to calibrate")
    captured = captured or capture(model, ids, 0, T)
    first_mass, vnorm_ratio, far_mass = [], [], []
    for layer in bar(layers, "calibrate layers"):
        q, k, v, sink_logits = captured[layer]
        _, p = replay.attend(q, k, v, None, 0, T, want_probs=True, sink_logits=sink_logits)  # [1, H, T, T]
        p = p[0]
        first_mass.append(p[:, F:, :F].mean(1))                           # [H, F]
        # mean mass each position draws from queries >= FAR tokens later: [H, T - FAR]
        cum = p.flip(1).cumsum(1).flip(1)                                  # cum[h, i, j] = sum_{i' >= i} p[h, i', j]
        j = torch.arange(T - FAR)
        far_mass.append(cum[:, j + FAR, j] / (T - FAR - j).float())
        norms = v[0].float().norm(dim=-1).mean(0)                          # [T], over kv heads
        vnorm_ratio.append(norms[:F] / norms.median())
    first_mass = torch.stack(first_mass)                                   # [L, H, F]
    far_mass = torch.stack(far_mass)                                       # [L, H, T - FAR]
    cover = first_mass.sum(-1).mean().item()
    cum_first = first_mass.cumsum(-1).mean((0, 1))                         # [F]
    uniform = (1.0 / torch.arange(F + 1, T + 1).float()).mean().item()    # a uniform share, queries >= F
    is_sink = first_mass.mean((0, 1)) >= SINK_FACTOR * uniform
    rec = int(is_sink.nonzero().max().item()) + 1 if is_sink.any() else 0
    sink_mass = first_mass[..., :rec].sum(-1)                              # [L, H]
    heavy = []
    strong = (far_mass[:, :, rec:].amax(-1) >= HEAVY) & (far_mass[:, :, rec:].amax(-1) > sink_mass)
    for i, h in strong.nonzero().tolist():
        pos = int(far_mass[i, h, rec:].argmax().item()) + rec
        tok = tokenizer.decode(ids[0, pos:pos + 1]) if tokenizer is not None else None
        heavy.append(dict(layer=layers[i], head=h, position=pos, token=tok, mass=far_mass[i, h, pos].item(),
                          sink_mass=sink_mass[i, h].item()))
    return dict(tokens=T, positions=F, layers=layers, recommended_sink_tokens=rec, mass_first_positions=cover,
                uniform_share=uniform, sink_positions=is_sink.nonzero().flatten().tolist(),
                mean_mass=[round(x, 5) for x in first_mass.mean((0, 1)).tolist()],
                cumulative_mass=[round(x, 4) for x in cum_first.tolist()],
                first_mass=first_mass.tolist(), value_norm_ratio=torch.stack(vnorm_ratio).tolist(),
                heavy_hitters=heavy, warnings=model_warnings(model))


def model_warnings(model) -> list[str]:
    """What in the model's design a sink + window cache does not capture."""
    out = []
    sinks = [n for n, _ in model.named_parameters() if n.split(".")[-1] == "sinks"]
    if sinks:
        out.append(f"the model has learned per-head sink logits ({len(sinks)} parameters such as {sinks[0]}): "
                   "QSinkKVCache passes them to every layer's softmax (SinkQuantCache.attend(sink_logits=...)); "
                   "token sinks may matter less")
    cfg = model.config.get_text_config(decoder=True)
    windows = trained_windows(cfg)
    if windows:
        out.append(f"{len(windows)} of the {cfg.num_hidden_layers} layers keep a trained window of "
                   f"{max(windows.values())} tokens and no sinks (QSinkKVCache's LayerPolicy): the sinks measured "
                   "and recommended here are the full-attention layers'")
    return out
