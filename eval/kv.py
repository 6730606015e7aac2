"""``qsinkkv-eval kv``: where each scheme's error lands, layer by layer, on the model's real
queries, keys and values.

One bf16 forward captures every layer's (q, k, v). For each scheme and layer the stored view
(``schemes.stored_view``) replaces the K/V as at decode time, and against the bf16 cache:

* ``k_err``, ``v_err``: relative error ``||stored - bf16|| / ||bf16||`` of K and V;
  ``sink_v_err``: the same for the values of the first ``sink_tokens`` tokens.
* ``out_err``: relative error of the attention output for the real queries.
* ``kl``: mean KL(bf16 attention || scheme attention) over queries and heads (nats).
* ``sink_mass``: mean attention mass on the first ``sink_tokens`` tokens (queries past them),
  and ``sink_shift``: the scheme's minus the bf16 cache's.

No error propagates between layers here: each layer sees the bf16 model's inputs (``ppl``
measures the compounded effect). A trained window layer attends its window with no sinks (``replay.py``): its
sink figures are 0. Each scheme's ``memory`` is its real cache's bytes at the
run's capacity (``footprint.py``). With ``positions="cache_index"`` the captured q and k are
taken back to pre-RoPE (what that contract stores; ``k_err`` is then on pre-RoPE keys) and
attention rotates them by cache index (``replay.attend``).
"""
from __future__ import annotations

import torch

from . import footprint, replay
from .progress import bar
from .schemes import REFERENCE, schemes_for, store_of, stored_view

METRICS = ("k_err", "v_err", "sink_v_err", "out_err", "kl", "sink_mass", "sink_shift")


def capture(model, ids, sink_tokens: int, recent_tokens: int) -> dict[int, tuple]:
    """Every layer's (q, k, v, learned sink logits or None) of one bf16-cache forward over ``ids``."""
    with replay.replay(store_of(REFERENCE), sink_tokens, recent_tokens, capture=True) as rp:
        with torch.no_grad():
            model.get_decoder()(input_ids=ids, use_cache=False)
    return rp.captured


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run(model, ids, bits: list[int], sink_tokens: int, recent_tokens: int, only: list[str] | None = None,
        captured: dict | None = None, positions: str = "absolute") -> dict:
    from .ppl import QUANTO_ABSOLUTE_ONLY, QUANTO_NO_WINDOW_LAYERS

    S, W = sink_tokens, recent_tokens
    captured = captured or capture(model, ids, S, W)
    rotary = replay.positions_rotary(model, positions)
    todo = [s for b in bits for s in schemes_for(b) if only is None or s.name in only]
    windowed = S + W < int(ids.shape[1])
    hybrid = footprint.Geometry.of(model).window_layers > 0
    skipped = [dict(scheme=s.name, status=f"skipped: {s.requires} is not installed") for s in todo if not s.available()]
    skipped += [dict(scheme=s.name, status=QUANTO_NO_WINDOW_LAYERS)
                for s in todo if s.available() and s.family == "quanto" and hybrid]
    todo = [s for s in todo if not (s.family == "quanto" and hybrid)]
    skipped += [dict(scheme=s.name, status="skipped: QuantizedCache keeps every token (no window)")
                for s in todo if s.available() and s.family == "quanto" and windowed]
    skipped += [dict(scheme=s.name, status=QUANTO_ABSOLUTE_ONLY)
                for s in todo if s.available() and s.family == "quanto" and not windowed and rotary is not None]
    todo = [s for s in todo if s.available() and not (s.family == "quanto" and (windowed or rotary is not None))]
    per_layer = {s.name: {m: [] for m in METRICS} for s in todo}
    ref_sink_mass = []
    for layer in bar(sorted(captured), "kv layers"):
        q, k, v, sink_logits = captured[layer]
        if rotary is not None:  # the contract stores pre-RoPE keys
            q, k = replay.unrotate(rotary, q), replay.unrotate(rotary, k)
        T = k.shape[2]
        Sl, Wl = replay.layer_visible(model.config, layer, S, W)  # a trained window layer: its window, no sinks
        ref_out, ref_p = replay.attend(q, k, v, None, Sl, Wl, want_probs=True, rotary=rotary, sink_logits=sink_logits)
        past = slice(Sl, T)  # queries that could look past the sinks
        ref_mass = ref_p[:, :, past, :Sl].sum(-1).mean().item()
        ref_sink_mass.append(ref_mass)
        kf, vf = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
        for scheme in todo:
            view = stored_view(scheme, k, v, Sl)
            out, p = replay.attend(q, k, v, view, Sl, Wl, want_probs=True, rotary=rotary, sink_logits=sink_logits)
            mass = p[:, :, past, :Sl].sum(-1).mean().item()
            kl = torch.special.xlogy(ref_p, ref_p) - torch.special.xlogy(ref_p, p.clamp_min(1e-30))
            m = per_layer[scheme.name]
            m["k_err"].append(_rel(view.k, kf))
            m["v_err"].append(_rel(view.v, vf))
            m["sink_v_err"].append(_rel(view.v[:, :, :Sl], vf[:, :, :Sl]) if Sl else 0.0)
            m["out_err"].append(_rel(out, ref_out))
            m["kl"].append(kl.sum(-1).mean().item())
            m["sink_mass"].append(mass)
            m["sink_shift"].append(mass - ref_mass)
    overall = []
    T = int(ids.shape[1])
    geo, capacity = footprint.Geometry.of(model, tokens=T), min(S + W, T)
    for scheme in [REFERENCE] + todo:
        if scheme is REFERENCE:
            row = {m: 0.0 for m in METRICS} | dict(sink_mass=sum(ref_sink_mass) / len(ref_sink_mass))
        else:
            row = {m: sum(vals) / len(vals) for m, vals in per_layer[scheme.name].items()}
        overall.append(dict(scheme=scheme.name, bits=scheme.bits, description=scheme.description, **row,
                            memory=footprint.of_scheme(scheme, geo, S, capacity).to_dict()))
    return dict(tokens=T, sink_tokens=S, recent_tokens=W, capacity=capacity, positions=positions, overall=overall,
                skipped=skipped, per_layer=per_layer, ref_sink_mass=ref_sink_mass)
