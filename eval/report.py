"""Markdown tables and PNG plots of the subcommands' results (``results.json`` holds every number)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path


def _f(x, fmt="{:.4f}"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def kv_markdown(r: dict) -> str:
    head = ["scheme", "K rel err", "V rel err", "sink V rel err", "attn out rel err", "attn KL", "sink mass",
            "sink mass shift"]
    rows = [[f"`{o['scheme']}`", _f(o["k_err"]), _f(o["v_err"]), _f(o["sink_v_err"]), _f(o["out_err"]),
             _f(o["kl"], "{:.5f}"), _f(o["sink_mass"], "{:.3f}"), _f(o["sink_shift"], "{:+.4f}")]
            for o in r["overall"]]
    window = "every earlier token" if r["recent_tokens"] >= r["tokens"] else \
        f"{r['sink_tokens']} sinks + {r['recent_tokens']} recent"
    text = (f"Per-layer error on the model's real q/k/v ({r['tokens']} tokens, queries see {window}; "
            f"first {r['sink_tokens']} tokens are the sinks), averaged over layers:\n\n" + _table(head, rows))
    if r["skipped"]:
        text += "\n\n" + "\n".join(f"- `{s['scheme']}`: {s['status']}" for s in r["skipped"])
    return text


def ppl_markdown(r: dict) -> str:
    head = ["scheme", "bits", "perplexity", "vs bf16", "mean KL (nats/token)", "what it stores"]
    rows = []
    for o in r["rows"]:
        if o["status"] != "ok":
            rows.append([f"`{o['scheme']}`", str(o["bits"]), "-", "-", "-", o["status"]])
            continue
        rows.append([f"`{o['scheme']}`", str(o["bits"]), _f(o["ppl"], "{:.3f}"), _f(o["delta_pct"], "{:+.2f}%"),
                     _f(o["kl"], "{:.4f}"), o["description"]])
    window = "the whole text visible" if r["sink_tokens"] + r["recent_tokens"] >= r["tokens"] else \
        f"{r['sink_tokens']} sinks + {r['recent_tokens']} recent visible"
    return f"Perplexity over {r['tokens']} tokens ({window}), each token decoded from its scheme's cache:\n\n" + \
        _table(head, rows)


def stream_markdown(r: dict) -> str:
    head = ["configuration", "perplexity (all)", f"perplexity after the cache fills (position >= {r['capacity']})"]
    rows = [[o["config"], _f(o["ppl"], "{:.2f}"), _f(o["after_fill"], "{:.2f}")] for o in r["rows"]]
    return (f"{r['tokens']} tokens, capacity {r['capacity']} = {r['sink_tokens']} sinks + {r['recent_tokens']} "
            f"recent (the plain window keeps the newest {r['capacity']}):\n\n" + _table(head, rows))


def calibrate_markdown(r: dict) -> str:
    lines = [f"Recommended `sink_tokens`: **{r['recommended_sink_tokens']}** (sink positions: "
             f"{r['sink_positions'] or 'none'}; a sink draws >= 10x a uniform share of the mass, "
             f"{r['uniform_share']:.4f}, averaged over layers and heads, from queries at {r['positions']} or later)."]
    head = ["first k positions", "1", "2", "4", "8", "16"]
    cm = r["cumulative_mass"]
    lines.append("\n" + _table(head, [["mean attention mass"] + [f"{cm[k - 1]:.3f}" for k in (1, 2, 4, 8, 16)]]))
    vr = r["value_norm_ratio"]
    med = statistics.median(x[0] for x in vr)
    lines.append(f"\nValue norm of position 0 / the layer's median value norm: median over layers {med:.2f} "
                 f"(min {min(x[0] for x in vr):.2f}, max {max(x[0] for x in vr):.2f}).")
    hh = r["heavy_hitters"]
    if hh:
        by_pos: dict[int, list] = {}
        for h in hh:
            by_pos.setdefault(h["position"], []).append(h)
        lines.append(f"\n{len(hh)} heads park >= 0.1 of their mass on a later position more than on the sinks "
                     "(a windowed cache will evict it):\n")
        lines.append(_table(["position", "token", "heads (layer.head)", "max mass"], [
            [str(p), f"`{(hs[0]['token'] or '').strip() or repr(hs[0]['token'])}`",
             ", ".join(f"{h['layer']}.{h['head']}" for h in hs[:12]) + (" ..." if len(hs) > 12 else ""),
             f"{max(h['mass'] for h in hs):.3f}"] for p, hs in sorted(by_pos.items())]))
    else:
        lines.append("\nNo head parks its mass on a later position instead of the sinks.")
    lines += [f"\n**Warning:** {w}" for w in r["warnings"]]
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_kv(r: dict, path: Path) -> None:
    plt = _plt()
    bits = sorted({o["bits"] for o in r["overall"] if o["bits"] != 16}, reverse=True)
    fig, axes = plt.subplots(2, len(bits), figsize=(6 * len(bits), 7), squeeze=False)
    for c, b in enumerate(bits):
        for o in r["overall"]:
            if o["bits"] != b:
                continue
            layer = r["per_layer"][o["scheme"]]
            style = "-" if o["scheme"].startswith(("qsinkkv", "group")) else "--"
            axes[0][c].plot(layer["out_err"], style, label=o["scheme"])
            axes[1][c].plot(layer["sink_shift"], style, label=o["scheme"])
        axes[0][c].set(title=f"int{b}: attention-output relative error", xlabel="layer", yscale="log")
        axes[1][c].set(title=f"int{b}: shift of attention mass on the sinks", xlabel="layer")
        axes[0][c].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ppl(r: dict, path: Path) -> None:
    plt = _plt()
    ok = [o for o in r["rows"] if o["status"] == "ok" and o["scheme"] != "bf16"]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(ok) + 1.5))
    ax.barh([o["scheme"] for o in ok], [o["delta_pct"] for o in ok],
            color=["tab:green" if o["scheme"].startswith("qsinkkv") else "tab:gray" for o in ok])
    ax.set_xscale("symlog", linthresh=1)
    ax.invert_yaxis()
    ax.set(xlabel="perplexity vs the bf16 cache (%)", title=f"perplexity increase, {r['tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stream(r: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, c in r["curves"].items():
        ax.plot(c["position"], c["ppl"], label=name)
    ax.axvline(r["capacity"], color="k", lw=0.6, ls=":")
    ax.set(xlabel="position", ylabel=f"perplexity over {r['window']}-token windows", yscale="log",
           title=f"streaming with capacity {r['capacity']} ({r['sink_tokens']} sinks + {r['recent_tokens']} recent)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_calibrate(r: dict, path: Path) -> None:
    plt = _plt()
    import numpy as np

    mass = np.array(r["first_mass"]).mean(1)  # [L, F] over heads
    fig, ax = plt.subplots(figsize=(8, 6))
    im = ax.imshow(mass, aspect="auto", cmap="viridis")
    ax.set(xlabel="position", ylabel="layer", title="mean attention mass on the first positions (over heads)")
    fig.colorbar(im)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


MARKDOWN = dict(kv=kv_markdown, ppl=ppl_markdown, stream=stream_markdown, calibrate=calibrate_markdown)
PLOTS = dict(kv=plot_kv, ppl=plot_ppl, stream=plot_stream, calibrate=plot_calibrate)
TITLES = dict(kv="Per-layer error (kv)", ppl="Perplexity (ppl)", stream="Streaming (stream)",
              calibrate="Sinks (calibrate)")
